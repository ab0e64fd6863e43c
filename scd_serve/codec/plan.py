"""The transfer plan: per layer, Reuse with ranks (r_k, r_v), Patch with rank r_h, Run, or Own.

A Reuse stream of rank 0 (our addition) ships nothing: the consumer's mean and token prior of
that stream stand alone. Calibration chooses it where the codes measure no better (a fine-tune
can move a layer so far that the producer's states predict nothing the prior does not).

Own (our addition, layer 0 only): the layer's input is the token's embedding alone, so the
consumer computes its K/V from its own weights and the prompt's token ids: exact, nothing shipped,
a projection's cost.

Run (our addition): the first run layer ships a rank-r_h code of the producer's residual stream
entering it; the consumer maps it to its own residual and computes that layer and every layer
above over the prompt itself (r_h = 0 above: nothing shipped). What the upper layers compute
from context is then the consumer's own computation, at (N - L) / N of a prefill's work.
Fixed offline by calibration and stored in the codebook manifest; serving only looks it up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

REUSE, PATCH, RUN, OWN = "reuse", "patch", "run", "own"


@dataclass(frozen=True)
class LayerPlan:
    mode: str = REUSE
    r_k: int = 0
    r_v: int = 0
    r_h: int = 0

    def __post_init__(self):
        if self.mode not in (REUSE, PATCH, RUN, OWN):
            raise ValueError(f"layer mode must be '{REUSE}', '{PATCH}', '{RUN}' or '{OWN}', not {self.mode!r}")
        if self.mode == OWN:
            if self.r_k or self.r_v or self.r_h:
                raise ValueError(f"an '{OWN}' layer ships nothing, got {self}")
            return
        ranks = (self.r_k, self.r_v) if self.mode == REUSE else (self.r_h,)
        if min(ranks) < (0 if self.mode in (RUN, REUSE) else 1):
            raise ValueError(f"{self.mode} layer needs {'non-negative' if self.mode == REUSE else 'positive'} "
                             f"ranks, got {self}")

    @property
    def streams(self) -> tuple[tuple[str, int], ...]:
        """(stream, rank) of each code the layer ships: k, v (Reuse), h (Patch: H_in), r (the
        run's first layer: the residual); none above a run's first layer, nor for an own layer."""
        if self.mode == OWN:
            return ()
        if self.mode == REUSE:  # a rank-0 stream ships nothing: the consumer's token prior alone
            return tuple((s, r) for s, r in (("k", self.r_k), ("v", self.r_v)) if r)
        return ((("h" if self.mode == PATCH else "r"), self.r_h),) if self.r_h else ()

    @property
    def decoded(self) -> tuple[tuple[str, int], ...]:
        """(stream, rank) of each stream the consumer rebuilds from the codebook: both of a Reuse
        layer, rank 0 included (its mean and token prior), else the streams shipped."""
        return (("k", self.r_k), ("v", self.r_v)) if self.mode == REUSE else self.streams

    @property
    def code_width(self) -> int:
        """Numbers per token this layer ships."""
        return sum(r for _, r in self.streams)

    def to_json(self) -> dict[str, Any]:
        if self.mode == OWN:
            return {"mode": OWN}
        if self.mode == REUSE:
            return {"mode": REUSE, "r_k": self.r_k, "r_v": self.r_v}
        return {"mode": self.mode, "r_h": self.r_h}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayerPlan:
        return cls(mode=d["mode"], r_k=int(d.get("r_k", 0)), r_v=int(d.get("r_v", 0)), r_h=int(d.get("r_h", 0)))


@dataclass(frozen=True)
class Plan:
    layers: tuple[LayerPlan, ...]

    def __post_init__(self):
        if any(lp.mode == OWN for lp in self.layers[1:]):
            raise ValueError(f"only layer 0 can be '{OWN}' (its input is the token alone), got "
                             f"{[lp.to_json() for lp in self.layers]}")
        start = self.run_layer
        if start is not None and (not self.layers[start].r_h or any(
                lp.mode != RUN or lp.r_h for lp in self.layers[start + 1:])):
            raise ValueError(f"a run ships a code at its first layer ({start}) and runs every layer above "
                             f"(mode '{RUN}', r_h 0): got {[lp.to_json() for lp in self.layers[start:]]}")

    @property
    def run_layer(self) -> int | None:
        """The layer from which the consumer runs its own layers (None: no run)."""
        return next((i for i, lp in enumerate(self.layers) if lp.mode == RUN), None)

    @classmethod
    def with_run(cls, below: Plan, layer: int, rank: int) -> Plan:
        """`below`'s layers under `layer`, then a run from `layer` on a rank-`rank` residual code."""
        above = (LayerPlan(RUN, r_h=0),) * (len(below.layers) - layer - 1)
        return cls(below.layers[:layer] + (LayerPlan(RUN, r_h=rank),) + above)

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
