"""The transfer plan: per layer, Reuse with ranks (r_k, r_v) or Patch with rank r_h.

Fixed offline by calibration and stored in the codebook manifest; serving only looks it up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

REUSE, PATCH = "reuse", "patch"


@dataclass(frozen=True)
class LayerPlan:
    mode: str = REUSE
    r_k: int = 0
    r_v: int = 0
    r_h: int = 0

    def __post_init__(self):
        if self.mode not in (REUSE, PATCH):
            raise ValueError(f"layer mode must be '{REUSE}' or '{PATCH}', not {self.mode!r}")
        ranks = (self.r_k, self.r_v) if self.mode == REUSE else (self.r_h,)
        if min(ranks) < 1:
            raise ValueError(f"{self.mode} layer needs positive ranks, got {self}")

    @property
    def code_width(self) -> int:
        """Numbers per token this layer ships."""
        return self.r_k + self.r_v if self.mode == REUSE else self.r_h

    def to_json(self) -> dict[str, Any]:
        if self.mode == REUSE:
            return {"mode": REUSE, "r_k": self.r_k, "r_v": self.r_v}
        return {"mode": PATCH, "r_h": self.r_h}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayerPlan:
        return cls(mode=d["mode"], r_k=int(d.get("r_k", 0)), r_v=int(d.get("r_v", 0)), r_h=int(d.get("r_h", 0)))


@dataclass(frozen=True)
class Plan:
    layers: tuple[LayerPlan, ...]

    @property
    def patch_layers(self) -> tuple[int, ...]:
        return tuple(i for i, lp in enumerate(self.layers) if lp.mode == PATCH)

    def code_width(self) -> int:
        """Numbers per token over all layers (multiply by bytes per number for the payload)."""
        return sum(lp.code_width for lp in self.layers)

    def with_layer(self, layer: int, lp: LayerPlan) -> Plan:
        layers = list(self.layers)
        layers[layer] = lp
        return replace(self, layers=tuple(layers))

    def to_json(self) -> list[dict[str, Any]]:
        return [lp.to_json() for lp in self.layers]

    @classmethod
    def from_json(cls, rows: list[dict[str, Any]]) -> Plan:
        return cls(tuple(LayerPlan.from_json(r) for r in rows))
