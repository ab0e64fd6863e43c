"""The few model facts a codec needs, read from a runtime, a ModelSpec, an HF config or a dict.

The producer builds its half of a codec from specs alone (no consumer weights), so the codec
carries its own rotary math for whichever side has no runtime at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scd_serve.errors import CodebookError


@dataclass(frozen=True)
class CodecSpec:
    """Shapes and rotary parameters of one model, as the codec sees it."""

    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    fingerprint: str | None = None

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers, "hidden_size": self.hidden_size,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rope_theta": self.rope_theta, "fingerprint": self.fingerprint,
        }


def _pick(obj: Any, *names: str) -> Any:
    for name in names:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if value is not None:
            return value
    return None


def spec_of(model: Any) -> CodecSpec:
    """Normalise a ModelRuntime / ModelSpec / transformers config / dict / CodecSpec."""
    if isinstance(model, CodecSpec):
        return model
    fingerprint = _pick(model, "fingerprint")
    src = _pick(model, "spec") or _pick(model, "config") or model
    if isinstance(src, CodecSpec):
        return src
    num_layers = _pick(src, "num_layers", "num_hidden_layers")
    hidden = _pick(src, "hidden_size")
    heads = _pick(src, "num_heads", "num_attention_heads")
    kv_heads = _pick(src, "num_kv_heads", "num_key_value_heads") or heads
    head_dim = _pick(src, "head_dim") or (hidden // heads if hidden and heads else None)
    theta = _pick(src, "rope_theta")
    if theta is None:
        params = _pick(src, "rope_parameters") or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
    missing = [n for n, v in [("num_layers", num_layers), ("hidden_size", hidden),
                              ("num_kv_heads", kv_heads), ("head_dim", head_dim),
                              ("rope_theta", theta)] if v is None]
    if missing:
        raise CodebookError(f"cannot read model spec fields {missing} from {type(model).__name__}")
    fingerprint = fingerprint or _pick(src, "fingerprint")
    return CodecSpec(int(num_layers), int(hidden), int(kv_heads), int(head_dim), float(theta),
                     fingerprint if isinstance(fingerprint, str) else None)


def _cos_sin(spec: CodecSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Llama convention: inv_freq over even dims, duplicated halves (rotate_half layout).
    half = torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** half)
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rotate(spec: CodecSpec, k: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Apply (or undo) this spec's RoPE. k: [T, kvh, hd]; positions: [T] -> [T, kvh, hd]."""
    cos, sin = _cos_sin(spec, positions)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over kv heads
    if inverse:
        sin = -sin
    x = k.to(torch.float64)
    return (x * cos + _rotate_half(x) * sin).to(k.dtype)


def rotate_with(model: Any, spec: CodecSpec, k: torch.Tensor, positions: torch.Tensor,
                inverse: bool = False) -> torch.Tensor:
    """Use the runtime's own rotary when it offers one (it knows its rope scaling), else ours."""
    method = getattr(model, "unrotate_keys" if inverse else "rotate_keys", None)
    if callable(method):
        return method(k, positions)
    return rotate(spec, k, positions, inverse)
