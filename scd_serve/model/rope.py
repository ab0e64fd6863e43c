"""Rotary position embedding with one model's own parameters (theta, scaling).

Keys are pre-RoPE at every boundary of the runtime (prefill output, codec, recompute) and
rotated here with THIS model's tables: a producer and a consumer each apply their own.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from scd_serve.errors import ModelLoadError
from scd_serve.model.spec import ModelSpec


def inv_freq_and_scaling(spec: ModelSpec, cfg: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim/2] float32 and the attention scaling applied to cos/sin."""
    if spec.rope_type == "default":
        dim = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    # Scaled variants (linear, llama3, yarn): reuse transformers' reference formulas.
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    try:
        hf_cfg = AutoConfig.for_model(**cfg)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[spec.rope_type](hf_cfg, None)
    except Exception as exc:  # transformers raises many kinds on a bad rope config
        raise ModelLoadError(f"config.json: cannot build rope type {spec.rope_type!r}: {exc}") from None
    return inv_freq.float().cpu(), float(scaling)


KEPT_TABLES = 4  # requests whose tables rotate/unrotate keep (a few transfers at once)


class Rotary:
    """cos/sin computed per call from positions, as transformers does (no table to size).

    rotate/unrotate, which codecs and rebuilds call once per layer with one request's positions,
    keep the last few requests' tables: computing them again for every layer was about half of
    a raw transfer's work per layer (1k tokens, one thread: the producer's encode 0.38 -> 0.21 ms,
    the decode side's 0.31 -> 0.14; scripts/codec_layer_costs.py)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, device, dtype):
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)  # [hd/2]
        self.scaling = scaling
        self.dtype = dtype
        self._kept: dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()  # transfers rotate from their own threads

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [...] long -> cos/sin [..., 1, hd] (broadcast over heads), rounded to
        # the compute dtype exactly where transformers rounds them
        freqs = positions.to(self.inv_freq.device).float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(self.dtype)
        sin = (emb.sin() * self.scaling).to(self.dtype)
        return cos.unsqueeze(-2), sin.unsqueeze(-2)

    def kept_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tables(positions), the same tensors again for the same positions (bit for bit what
        tables computes: it computed them)."""
        flat = positions.reshape(-1)
        if not flat.numel():
            return self.tables(positions)
        key = (tuple(positions.shape), str(positions.device), int(flat[0]), int(flat[-1]))
        with self._lock:
            hit = self._kept.get(key)
        if hit is not None and torch.equal(hit[0], positions):
            return hit[1]
        tables = self.tables(positions)
        with self._lock:
            self._kept.pop(key, None)
            while len(self._kept) >= KEPT_TABLES:
                self._kept.pop(next(iter(self._kept)))
            self._kept[key] = (positions.clone(), tables)
        return tables

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [..., T, heads, hd], positions: [..., T]
        return apply(x, *self.kept_tables(positions))

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # inverse of rotate: R(p)^T / scaling^2 (cos^2 + sin^2 = scaling^2)
        cos, sin = self.kept_tables(positions)
        out = x * cos - rotate_half(x) * sin
        return out if self.scaling == 1.0 else out / (self.scaling**2)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [..., T, heads, hd]; cos, sin: [..., T, 1, hd] from Rotary.tables (computed once per forward)
    return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

