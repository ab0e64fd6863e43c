"""A codebook's quality figures, in one place: what `calibrate` and `measure` write into the
manifest's calibration block, and what `auto` (and anyone) reads back from it.

    calibration.methods      {method: {kl, top1, payload_ratio, replay_tokens, head_tokens[, probe_kl]}}
    calibration.report       {prompts, positions, held_out[, source]}: where they were measured
    calibration.min_top1     the agreement target; kl_budget the KL one
    calibration.meets_budget scd within both
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MIN_TOP1 = 0.95  # the agreement floor of a codebook with top-1 figures but no target of its own


def record(manifest: dict[str, Any], methods: dict[str, dict[str, float]], report: dict[str, Any],
           min_top1: float) -> dict[str, Any]:
    """Write the figures measured on `report`'s prompts into the manifest's calibration block,
    with the verdict against its budget. -> the block."""
    cal = manifest.setdefault("calibration", {})
    cal["methods"], cal["report"], cal["min_top1"] = methods, report, min_top1
    budget, scd = cal.get("kl_budget"), methods.get("scd", {})
    cal["meets_budget"] = bool(scd) and (budget is None or scd["kl"] <= budget) and scd["top1"] >= min_top1
    return cal


@dataclass(frozen=True)
class QualityFigures:
    """What a codebook's manifest says about each method for the pair it was calibrated on."""

    kl: dict[str, float] = field(default_factory=dict)
    top1: dict[str, float] = field(default_factory=dict)  # share of next tokens equal to the consumer's own
    payload_ratio: dict[str, float] = field(default_factory=dict)
    producer: str = ""  # the producer fingerprint it was calibrated for
    budget: float | None = None  # the KL budget it was calibrated to meet
    min_top1: float | None = None  # the agreement target it was calibrated for (codebooks with top-1 figures)

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> QualityFigures:
        cal = manifest.get("calibration", {})
        methods = {m: v for m, v in cal.get("methods", {}).items() if isinstance(v, dict)}
        top1 = {m: float(v["top1"]) for m, v in methods.items() if "top1" in v}
        return cls(kl={m: float(v["kl"]) for m, v in methods.items() if "kl" in v}, top1=top1,
                   payload_ratio={m: float(v["payload_ratio"]) for m, v in methods.items() if "payload_ratio" in v},
                   producer=manifest.get("producer", {}).get("fingerprint", ""), budget=cal.get("kl_budget"),
                   min_top1=cal.get("min_top1", DEFAULT_MIN_TOP1) if top1 else None)

    @classmethod
    def load(cls, codebook: str | None) -> QualityFigures:
        """From DIR/manifest.json; empty without a codebook (lossless methods only)."""
        if not codebook or not (Path(codebook) / "manifest.json").is_file():
            return cls()
        return cls.of(json.loads((Path(codebook) / "manifest.json").read_text()))
