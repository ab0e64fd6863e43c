"""Rank ratios from a codebook manifest, to scale a fitted plan to other model shapes."""

from __future__ import annotations

import json
from pathlib import Path

from scd_serve.planner.costs import RankPlan
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


def _ratios(plan: list[dict], kv_width: int, hidden: int) -> tuple[float, float, float, float]:
    """(mean r_k/d, mean r_v/d over reuse layers, patch share, mean r_h/hidden over patch layers);
    a run's layers are none of these (_run gives theirs)."""
    reuse = [lp for lp in plan if lp.get("mode") == "reuse"]
    patch = [lp for lp in plan if lp.get("mode") == "patch"]
    k = sum(lp["r_k"] for lp in reuse) / (len(reuse) * kv_width) if reuse else 0.0
    v = sum(lp["r_v"] for lp in reuse) / (len(reuse) * kv_width) if reuse else 0.0
    h = sum(lp["r_h"] for lp in patch) / (len(patch) * hidden) if patch else 0.0
    return k, v, len(patch) / len(plan), h


def _run(plan: list[dict], hidden: int) -> dict[str, float]:
    """A run's share of the layers and its residual code's rank / hidden (none: {})."""
    run = [lp for lp in plan if lp.get("mode") == "run"]
    return {"run_fraction": len(run) / len(plan), "run_ratio": max(lp["r_h"] for lp in run) / hidden} if run else {}


def _from_manifest(doc: dict, where: str) -> RankPlan:
    """Ratios of the codebook's `scd` plan (and `reuse` plan, when it has its own ranks)."""
    try:
        spec = doc["consumer"]
        kv_width, hidden = int(spec["num_kv_heads"]) * int(spec["head_dim"]), int(spec["hidden_size"])
        plans = doc["plans"]
        scd = plans.get("scd") or plans.get("scd-int8")
        if not scd:
            raise KeyError("plans.scd")
        k, v, patch, h = _ratios(scd, kv_width, hidden)
        rk, rv = (_ratios(plans["reuse"], kv_width, hidden)[:2]) if plans.get("reuse") else (k, v)
        droid = doc.get("droidspeak_layers")
        layers = int(spec["num_layers"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise CodebookError(f"codebook manifest {where} lacks plan or spec fields ({exc})") from exc
    prior = doc.get("prior")
    kind = "none" if not prior else prior.get("kind", "dense")
    caveat = ""
    if kind == "dense":
        caveat = ("its ranks are low partly because a dense token prior (a table of taps x vocab rows per layer) "
                  "did the work; at a real vocabulary that table does not fit, so these ratios understate the "
                  "codes a real pair needs: recalibrate with --prior features")
    elif kind == "features" and prior.get("states"):
        caveat = ("rebuild counts the decoders alone: the token prior's rows of each token come from the decode "
                  "worker's vocabulary table (--prior-table, made at its start); without that table a prompt's "
                  "unseen tokens add about the FLOPs of a prefill's projections")
    data = (doc.get("calibration") or {}).get("data", {}).get("source", "the built-in calibration split")
    return RankPlan(k_ratio=k, v_ratio=v, patch_fraction=patch, h_ratio=h, reuse_k_ratio=rk, reuse_v_ratio=rv,
                    **_run(scd, hidden),
                    droidspeak_fraction=(len(droid) / layers) if droid else RankPlan.droidspeak_fraction,
                    source=f"codebook {where} (ratios of its scd/reuse plans; fitted on a {layers}-layer, hidden "
                           f"{hidden} consumer, calibration data: {data}; token prior: {kind})", caveat=caveat)
