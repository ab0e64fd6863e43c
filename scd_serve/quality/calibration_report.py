"""What `scd-serve calibrate` prints when the codebook is written: the verdict against the
budget, what the decode worker's rebuild costs, what was weighed, and each method's figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scd_serve.config.codec import CalibrateConfig


def print_report(result: Any, cfg: CalibrateConfig, out: Path) -> None:
    """result: quality/calibrate.py's CalibrationResult; out: the codebook's directory."""
    book = result.codebook
    chosen = book.plan("scd")
    stats = book.manifest["calibration"]
    scd = stats["methods"]["scd"]
    where = "held-out report prompts" if stats["report"]["held_out"] else "probe prompts"
    verdict = "meets" if stats["meets_budget"] else (
        f"does NOT meet: KL {scd['kl'] / cfg.kl_budget:.1f}x the budget, top-1 {cfg.min_top1 - scd['top1']:+.3f} short"
        if scd["top1"] < cfg.min_top1 else f"does NOT meet: KL {scd['kl'] / cfg.kl_budget:.1f}x the budget")
    print(f"scd on {stats['report']['prompts']} {where}: KL {scd['kl']:.4f}, top-1 {scd['top1']:.3f} at "
          f"{scd['payload_ratio']:.3f} of raw: {verdict} (KL <= {cfg.kl_budget}, top-1 >= {cfg.min_top1})")
    chosen_layers = len(chosen.layers)
    computed = len(chosen.patch_layers) + (chosen_layers - chosen.run_layer if chosen.run_layer is not None else 0)
    r = stats["replay"]
    print(f"rebuild: {r['rebuild']:.2f} of the consumer's own prefill, {cfg.rebuild_cost} on the probe prompts ("
          f"{'within' if r['rebuild_within'] else 'OVER, the cheapest plan there is:'} --max-rebuild "
          f"{cfg.max_rebuild}); the consumer computes {computed} of its {chosen_layers} layers' K/V itself from "
          f"codes (patches and a run), the first {r['head']} and the last {r['tokens']} prompt tokens in full; "
          f"{sum(not lp.streams for lp in chosen.layers)} layers ship nothing", flush=True)
    print(f"codebook: {out} (search on the probe: {'within' if stats['feasible'] else 'OVER'} the budget, KL "
          f"{cfg.kl_budget} and top-1 {cfg.min_top1}); patch layers {list(chosen.patch_layers)}; run from {chosen.run_layer}; droidspeak layers {book.droidspeak_layers}; "
          f"{stats['seconds']} s")
    tried = "; ".join(f"replay {o['replay']} head {o['head']} run {o['run']}"
                      f"{' (closest plan)' if o.get('closest') else ''}: KL {o['kl']:.4f} top-1 {o['top1']:.3f} "
                      + ("not timed" if "cost" not in o else f"rebuild {o['cost']:.2f}"
                         + (", over" if o["cost"] > cfg.max_rebuild else "")) for o in r["options"])
    print(f"head and replay: the consumer computes the prompt's first {r['head']} and last {r['tokens']} "
          f"tokens itself ({tried}; on the probe, before distillation)")
    if stats["run"].get("kl"):
        measured = ", ".join(f"{layer}: {kl:.4f}" for layer, kl in stats["run"]["kl"].items())
        print(f"runs measured (probe KL by first layer): {measured}; without a run {stats['run']['kl_without']:.4f}")
    if "distill" in stats:
        d = stats["distill"]
        print(f"distilled the scd plan: held-out KL {d['held_out_kl_before']:.4f} -> {d['held_out_kl_after']:.4f} "
              f"(step {d['step_kept']} of {cfg.distill_steps} kept; {d['seconds']} s)")
    size = stats["size"]
    if "fraction_of_consumer" in size:
        print(f"codebook tensors {size['codebook_tensor_bytes']:,} bytes = {size['fraction_of_consumer']:.1%} of the "
              f"consumer's weights ({size['consumer_weight_bytes']:,} bytes)")
    print(f"{'method':<12}{'KL':>10}{'top-1':>8}{'payload/raw':>13}   ({where})")
    for name, m in result.methods.items():
        print(f"{name:<12}{m['kl']:>10.4f}{m['top1']:>8.3f}{m['payload_ratio']:>13.3f}")
