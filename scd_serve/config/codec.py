"""Calibration settings for `scd-serve calibrate` (the SCD codebook fit)."""

from __future__ import annotations

from dataclasses import dataclass

from scd_serve.errors import ConfigError


@dataclass(frozen=True)
class CalibrateConfig:
    # Expected KL(consumer with the codec || oracle) per answer token, nats, on the probe prompts.
    kl_budget: float
    # Prompts whose paired states fit the codes; prompts whose KL steers the plan (disjoint).
    num_prompts: int = 192
    num_probe_prompts: int = 32
    # Of those, how many the per-stream profile uses (it only predicts; plans are measured on all).
    num_profile_prompts: int = 16
    # Prompt tokens the consumer runs itself in the probe, scored with the answer. 1 is the
    # serving handoff and the eval harness's KL (answer tokens only), the budget's units.
    probe_tail: int = 1
    # Token rows per layer used for the joint SVDs and ridge fits (sampled over the prompts).
    max_rows: int = 8192
    # Most patch layers tried (None: half the layers).
    max_patches: int | None = None
    # Adam steps and hidden width of each patch aligner MLP (0 steps: linear aligner only).
    aligner_steps: int = 300
    aligner_width: int = 128
    # Token prior (codec/prior.py): how many recent prompt tokens it reads (0: none), and its
    # ridge in token counts.
    prior_taps: int = 3
    prior_ridge: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.kl_budget < 100:
            raise ConfigError(f"kl_budget must be in (0, 100) nats, got {self.kl_budget}")
        for name in ("num_prompts", "num_probe_prompts", "max_rows", "aligner_width", "probe_tail",
                     "num_profile_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.prior_taps <= 8:
            raise ConfigError(f"prior_taps must be in [0, 8], got {self.prior_taps}")
        if self.prior_ridge <= 0:
            raise ConfigError(f"prior_ridge must be > 0, got {self.prior_ridge}")
        if self.aligner_steps < 0:
            raise ConfigError(f"aligner_steps must be >= 0, got {self.aligner_steps}")
        if self.max_patches is not None and self.max_patches < 0:
            raise ConfigError(f"max_patches must be >= 0, got {self.max_patches}")
