"""Calibration settings for `scd-serve calibrate` (the SCD codebook fit)."""

from __future__ import annotations

from dataclasses import dataclass

from scd_serve.errors import ConfigError


PRIOR_KINDS = ("features", "dense", "none")
REBUILD_COSTS = ("timed", "counted")  # how calibration weighs a rebuild against --max-rebuild


@dataclass(frozen=True)
class CalibrateConfig:
    # Expected KL(consumer with the codec || oracle) per answer token, nats, on the probe prompts.
    kl_budget: float
    # The agreement target: share of next tokens equal to the consumer's own (what `auto` reads).
    min_top1: float = 0.95
    # Prompts whose paired states fit the codes; prompts whose KL steers the plan; prompts of other
    # documents on which the codebook's figures are measured (all three disjoint: calibration_data.py).
    num_prompts: int = 192
    num_probe_prompts: int = 24
    num_report_prompts: int = 24
    # Of those, how many the per-stream profile uses (it only predicts; plans are measured on all).
    num_profile_prompts: int = 16
    # Prompt tokens the consumer runs itself in the probe, scored with the answer (1: the serving
    # handoff, the units of the eval harness's KL and of the budget).
    probe_tail: int = 1
    # Token rows per layer used for the joint SVDs and ridge fits (sampled over the prompts).
    max_rows: int = 8192
    # Most patch layers tried (None: half the layers).
    max_patches: int | None = None
    # Most code numbers per token as a fraction of raw K/V's (None: no cap). The plan ships the
    # fewest numbers within the KL budget; where no plan under the cap meets it, the least KL
    # under the cap (a link's bytes fixed first, quality second). scd-int8 ships about half.
    max_payload: float | None = None
    # Adam steps and hidden width of each patch aligner MLP (0 steps: linear aligner only).
    aligner_steps: int = 300
    aligner_width: int = 128
    # Two models with a feature prior: each Reuse stream's refiner (codec/refiner.py), an MLP over its
    # code and the prompt's token features, trained this many epochs over the fit rows (0: none); its
    # width at most refiner_width, less on a small consumer (calibration/fit.py refiner_width)
    refiner_epochs: int = 40
    refiner_width: int = 256
    # Layers a run of the consumer's own upper layers may start from (plan.py; empty: none; None:
    # every layer whose run costs at most max_rebuild of a prefill).
    run_layers: tuple[int, ...] | None = None
    # The most a rebuild may cost the decode worker, as a share of its own prefill of the prompt
    # (a run from L computes (layers - L) / layers of it, a replay of R tokens R / T, a head of S
    # tokens S / T, and the codes' decode comes on top; 0: the plan alone, no run, replay or head).
    # "timed" (quality/rebuild_cost.py: each option on num_timing_prompts probe prompts spread over
    # their lengths) or "counted"
    # (the shares above alone: the same choice on every machine, but blind to the codes' decode).
    max_rebuild: float = 0.5
    rebuild_cost: str = "timed"
    num_timing_prompts: int = 8
    # Token prior: "features" (codec/features.py, size independent of the vocabulary), "dense"
    # (codec/prior.py: tables of taps * (vocab + 1) rows) or "none"; taps: recent prompt tokens it
    # reads; width, rank: the feature prior's random features and shared basis; ridge: see `ridge`.
    prior: str = "features"
    prior_taps: int = 3
    prior_width: int = 512
    # feature prior: columns of each token's own K/V at every layer, standing alone (0: none)
    prior_states: int = 512
    prior_state_layers: int = 0  # the token states' first layers (0: all); a cold prompt pays for these
    prior_frequent: int = 0  # feature prior: most frequent fit tokens with one-hot columns
    prior_rank: int = 64
    prior_ridge: float | None = None
    # Distillation (calibration/distill.py): Adam steps tuning the scd plan's decoders and aligners on the
    # consumer's next-token KL (0: closed form only), learning rate, prompts per step.
    distill_steps: int = 300
    # Replayed tails tried on the scd plan (calibration/probes.py): prompt tokens before the handoff's
    # end the consumer computes itself rather than rebuilds (0 alone: never).
    replay: tuple[int, ...] = (0, 16, 32, 64)
    # Heads tried with them (codec/rebuild.py): the prompt's first tokens the consumer computes
    # itself, which every later row attends to (0 alone: never).
    head: tuple[int, ...] = (0, 16, 32, 64)
    distill_lr: float = 1e-4
    distill_batch: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.kl_budget < 100:
            raise ConfigError(f"kl_budget must be in (0, 100) nats, got {self.kl_budget}")
        if not 0 < self.min_top1 <= 1:
            raise ConfigError(f"min_top1 must be in (0, 1] (a share of next tokens), got {self.min_top1}")
        for name in ("num_prompts", "num_probe_prompts", "num_report_prompts", "max_rows", "aligner_width", "probe_tail",
                     "num_profile_prompts", "num_timing_prompts", "refiner_width"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.prior_taps <= 8:
            raise ConfigError(f"prior_taps must be in [0, 8], got {self.prior_taps}")
        if self.prior not in PRIOR_KINDS:
            raise ConfigError(f"prior must be one of {', '.join(PRIOR_KINDS)}, got {self.prior!r}")
        if min(self.prior_width, self.prior_states, self.prior_state_layers, self.prior_frequent) < 0 \
                or self.prior_rank < 1:
            raise ConfigError(f"prior_width, prior_states, prior_state_layers and prior_frequent must be >= 0 and "
                              f"prior_rank >= 1, got {self.prior_width}, {self.prior_states}, "
                              f"{self.prior_state_layers}, {self.prior_frequent} and {self.prior_rank}")
        if self.prior_ridge is not None and self.prior_ridge <= 0:
            raise ConfigError(f"prior_ridge must be > 0, got {self.prior_ridge}")
        if self.aligner_steps < 0 or self.distill_steps < 0:
            raise ConfigError(f"aligner_steps and distill_steps must be >= 0, got {self.aligner_steps} and "
                              f"{self.distill_steps}")
        if self.refiner_epochs < 0:
            raise ConfigError(f"refiner_epochs must be >= 0 (0: no refiners), got {self.refiner_epochs}")
        if not 0 < self.distill_lr < 1 or self.distill_batch < 1:
            raise ConfigError(f"distill_lr must be in (0, 1) and distill_batch >= 1, got {self.distill_lr} and "
                              f"{self.distill_batch}")
        if self.max_payload is not None and not 0 < self.max_payload <= 1:
            raise ConfigError(f"max_payload must be in (0, 1] (a fraction of raw K/V), got {self.max_payload}")
        if not 0 <= self.max_rebuild < 1:
            raise ConfigError(f"max_rebuild must be in [0, 1) (a share of the consumer's prefill), got {self.max_rebuild}")
        if self.rebuild_cost not in REBUILD_COSTS:
            raise ConfigError(f"rebuild_cost must be one of {', '.join(REBUILD_COSTS)}, got {self.rebuild_cost!r}")
        for name in ("replay", "head"):
            counts = getattr(self, name)
            if not counts or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in counts):
                raise ConfigError(f"{name} must list non-negative token counts, got {counts!r}")
        if self.max_patches is not None and self.max_patches < 0:
            raise ConfigError(f"max_patches must be >= 0, got {self.max_patches}")

    def run_candidates(self, num_layers: int) -> tuple[int, ...]:
        """The layers a run may start from: those given, or (None) every L >= 1 whose run,
        (num_layers - L) / num_layers of a prefill, fits max_rebuild."""
        if self.run_layers is not None:
            return tuple(self.run_layers)
        return tuple(L for L in range(1, num_layers) if (num_layers - L) / num_layers <= self.max_rebuild)

    def state_columns(self, num_layers: int, kv_width: int) -> int:
        """Token-state columns of a feature prior for the consumer: its K and V at every layer (or
        the first prior_state_layers), projected down to prior_states where it has more."""
        return min(self.prior_states, min(self.prior_state_layers or num_layers, num_layers) * 2 * kv_width)

    @property
    def uses_prior(self) -> bool:
        return self.prior != "none" and self.prior_taps > 0

    @property
    def ridge(self) -> float | None:
        """Dense: in token counts (default 0.1); features: relative to the mean feature variance
        (None: the ridge of least generalized cross-validation error)."""
        if self.prior_ridge is not None:
            return self.prior_ridge
        return 0.1 if self.prior == "dense" else None
