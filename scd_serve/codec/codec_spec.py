"""The few model facts a codec needs, read from a runtime, a ModelSpec, an HF config or a dict.

The producer builds its half of a codec from specs alone (no consumer weights), so for
whichever side has no runtime at hand the codec rotates with `model.rope.Rotary` built
from the spec's rope_theta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scd_serve.errors import CodebookError
from scd_serve.model.rope import Rotary


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


def rotate(spec: CodecSpec, k: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Apply (or undo) this spec's default RoPE with the runtime's own rotary code.
    k: [T, kvh, hd]; positions: [T] -> [T, kvh, hd]."""
    half = torch.arange(0, spec.head_dim, 2, dtype=torch.float32) / spec.head_dim
    rotary = Rotary(1.0 / spec.rope_theta**half, 1.0, k.device, torch.float32)
    x = k.float()
    return (rotary.unrotate(x, positions) if inverse else rotary.rotate(x, positions)).to(k.dtype)


def rotate_with(model: Any, spec: CodecSpec, k: torch.Tensor, positions: torch.Tensor,
                inverse: bool = False) -> torch.Tensor:
    """Use the runtime's own rotary when it offers one (it knows its rope scaling), else ours."""
    method = getattr(model, "unrotate_keys" if inverse else "rotate_keys", None)
    if callable(method):
        return method(k, positions)
    return rotate(spec, k, positions, inverse)
