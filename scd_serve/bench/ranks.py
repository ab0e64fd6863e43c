"""Rank ratios from a codebook manifest, to scale a fitted plan to other model shapes."""

from __future__ import annotations

import json
from pathlib import Path

from scd_serve.bench.costs import RankPlan
from scd_serve.errors import CodebookError


def rank_plan_from_codebook(path: Path) -> RankPlan:
    manifest = path / "manifest.json" if path.is_dir() else path
    if not manifest.exists():
        raise CodebookError(f"no manifest.json in codebook {path}; run `scd-serve calibrate` or omit --codebook")
    try:
        doc = json.loads(manifest.read_text())
    except ValueError as exc:
        raise CodebookError(f"codebook manifest {manifest} is not JSON: {exc}") from exc
    return _from_manifest(doc, str(manifest))


def _from_manifest(doc: dict, where: str) -> RankPlan:
    raise CodebookError(f"codebook manifest {where}: format not understood yet")
