"""`scd-serve plan`: payload per request and projected TTFT per method for real model shapes.

A projection, not a measurement: bytes and FLOPs (costs.py) over the link bandwidth and the
compute/memory rates given (or `--measure`d here), with rank ratios from a codebook's
manifest, so a plan fitted on the demo pair scales to Mistral-7B-sized layers.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from scd_serve.planner.costs import METHODS, MethodCost, RankPlan, method_cost
from scd_serve.planner.ranks import rank_plan_from_codebook
from scd_serve.planner.shapes import ModelShape, available, load_shape
from scd_serve.planner.units import fmt_bandwidth, fmt_bytes, parse_bandwidth
from scd_serve.errors import ConfigError

FORMULA = """\
projection (per request, T prompt tokens, B link bandwidth):
  prefill(T)  = prefill_FLOPs(T) / F                    F = prefill TFLOP/s
  wire        = payload / B
  rebuild     = rebuild_FLOPs / F_r + rebuild_bytes / M  F_r = rebuild TFLOP/s, M = memory GB/s
  first step  = max(2 * params / F, (weights + KV) bytes / M)   one decode step, last prompt token
  oracle TTFT = prefill(T)                              (consumer prefills itself, no transfer)
  warm TTFT   = max(wire, rebuild) + first step          (codes cached at the producer; layer-wise
                                                          streaming overlaps wire and rebuild)
  cold TTFT   = prefill(T-1) + encode + warm TTFT         (producer prefill not overlapped: conservative)"""


@dataclass(frozen=True)
class Rates:
    prefill_tflops: float
    rebuild_tflops: float
    mem_gbps: float
    source: str


@dataclass
class Projection:
    method: str
    payload_bytes: float
    wire_s: float
    rebuild_s: float
    first_step_s: float
    warm_ttft_s: float
    cold_ttft_s: float
    speedup_vs_oracle_warm: float


def project(shape: ModelShape, tokens: int, bw: float, plan: RankPlan, rates: Rates, methods=METHODS):
    f, fr, m = rates.prefill_tflops * 1e12, rates.rebuild_tflops * 1e12, rates.mem_gbps * 1e9
    weights = shape.num_params * 2  # 16-bit
    kv_all = shape.num_layers * tokens * 2 * shape.kv_width * 2
    first = max(2.0 * shape.num_params / f, (weights + kv_all) / m)
    oracle = shape.prefill_flops(tokens) / f
    producer = shape.prefill_flops(tokens - 1) / f
    rows = []
    for name in methods:
        c: MethodCost = method_cost(name, shape, tokens, plan)
        if name == "oracle":
            rows.append(Projection(name, 0.0, 0.0, 0.0, 0.0, oracle, oracle, 1.0))
            continue
        wire = c.payload_bytes / bw
        rebuild = c.rebuild_flops / fr + c.rebuild_bytes / m
        encode = c.encode_flops / f + c.encode_bytes / m
        warm = max(wire, rebuild) + first
        rows.append(Projection(name, c.payload_bytes, wire, rebuild, first, warm, producer + encode + warm, oracle / warm))
    return rows


def crossover(shape: ModelShape, tokens: int, plan: RankPlan, rates: Rates, methods=METHODS) -> dict:
    """Per transfer method, the link bandwidth (bytes/s) above which its warm TTFT beats the
    consumer's own prefill (the oracle): payload / (oracle - first step), where the rebuild fits
    in that time; None where it does not (no link is fast enough). A cold transfer adds the
    producer's prefill, as long as the oracle's for models of one shape: it never beats it."""
    rows = project(shape, tokens, 1.0, plan, rates, ["oracle", *(m for m in methods if m != "oracle")])
    oracle = rows[0].warm_ttft_s
    out = {}
    for r in rows[1:]:
        room = oracle - r.first_step_s  # what wire (and, overlapped, the rebuild) may take
        out[r.method] = r.payload_bytes / room if room > 0 and r.rebuild_s < room else None
    return out


def measure_rates() -> Rates:
    """Time a float32 matmul and a large copy on this machine (seconds; noisy on shared CPUs)."""
    import time

    import torch

    def per_second(fn, work: float) -> float:  # one warm-up, then five timed calls
        fn()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        return 5 * work / (time.perf_counter() - t0)

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    tflops = per_second(lambda: torch.mm(a, b), 2 * 1024**3) / 1e12
    x = torch.empty(32 * 2**20)  # 128 MiB
    y = torch.empty_like(x)
    gbps = per_second(lambda: y.copy_(x), 2 * x.numel() * 4) / 1e9  # read + write
    return Rates(tflops, tflops, gbps, "measured on this machine (float32 matmul, memory copy)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-config", required=True, help=f"shipped name ({', '.join(available())}), config.json or model dir")
    p.add_argument("--bandwidth", required=True, nargs="+", help="link bandwidth(s), e.g. 10gbit 100Gbps 1500MB/s")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024])
    p.add_argument("--codebook", help="codebook directory: rank ratios from its manifest (else documented defaults)")
    p.add_argument("--prefill-tflops", type=float, default=150.0, help="effective prefill TFLOP/s (default: A100-class 150)")
    p.add_argument("--rebuild-tflops", type=float, help="effective TFLOP/s of rebuild matmuls (default: = prefill)")
    p.add_argument("--rebuild-gbps", type=float, default=1500.0, help="memory bandwidth GB/s for rebuild/decode (default 1500)")
    p.add_argument("--measure", action="store_true", help="use TFLOP/s and GB/s measured on this machine instead")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--json", help="also write the projection as JSON here")


def run(args: argparse.Namespace) -> int:
    shape = load_shape(args.model_config)
    if any(t < 2 for t in args.prompt_tokens):
        raise ConfigError("--prompt-tokens must be at least 2", field="prompt_tokens")
    bws = [parse_bandwidth(b) for b in args.bandwidth]
    plan = rank_plan_from_codebook(Path(args.codebook)) if args.codebook else RankPlan()
    if args.measure:
        rates = measure_rates()
    else:
        for name in ("prefill_tflops", "rebuild_gbps"):
            if getattr(args, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive", field=name)
        rates = Rates(args.prefill_tflops, args.rebuild_tflops or args.prefill_tflops, args.rebuild_gbps, "given")
    out = sys.stdout
    print(f"model {shape.name}: {shape.num_layers} layers, hidden {shape.hidden_size}, kv width {shape.kv_width}, "
          f"{shape.num_params / 1e9:.2f}B params", file=out)
    given = Path(args.model_config)
    print(f"shape: {'config ' + str(given) if given.exists() else 'shipped public config ' + args.model_config} "
          "(architecture numbers only; no weights)", file=out)
    print(f"ranks: {plan.source}", file=out)
    if plan.caveat:
        print(f"  caveat: {plan.caveat}", file=out)
    print(f"  r_K/d={plan.k_ratio:.3f} r_V/d={plan.v_ratio:.3f} patch layers {plan.num_patch(shape.num_layers)}/"
          f"{shape.num_layers} r_H/hidden={plan.h_ratio:.3f}"
          + (f"; the consumer runs {int(round(plan.run_fraction * shape.num_layers))} layers itself from a "
             f"residual code of r/hidden={plan.run_ratio:.3f}" if plan.run_fraction else "")
          + (f"; reuse-only plan r_K/d={plan.reuse_k_ratio:.3f} r_V/d={plan.reuse_v_ratio:.3f}"
             if plan.reuse_k_ratio is not None else ""), file=out)
    print(f"rates ({rates.source}): prefill {rates.prefill_tflops:.3g} TFLOP/s, rebuild {rates.rebuild_tflops:.3g} "
          f"TFLOP/s, memory {rates.mem_gbps:.4g} GB/s", file=out)
    print(FORMULA, file=out)
    result = []
    for tokens in args.prompt_tokens:
        for bw in bws:
            rows = project(shape, tokens, bw, plan, rates, args.methods)
            print(f"\nT={tokens} tokens, link {fmt_bandwidth(bw)}", file=out)
            print(f"  {'method':<11}{'payload':>11}{'wire ms':>10}{'rebuild ms':>11}{'first ms':>9}"
                  f"{'warm TTFT':>11}{'cold TTFT':>11}{'oracle/warm':>12}", file=out)
            for r in rows:
                print(f"  {r.method:<11}{fmt_bytes(r.payload_bytes):>11}{r.wire_s * 1e3:>10.2f}{r.rebuild_s * 1e3:>11.2f}"
                      f"{r.first_step_s * 1e3:>9.2f}{r.warm_ttft_s * 1e3:>11.2f}{r.cold_ttft_s * 1e3:>11.2f}"
                      f"{r.speedup_vs_oracle_warm:>11.2f}x", file=out)
            result.append({"prompt_tokens": tokens, "bandwidth_bytes_per_s": bw, "rows": [asdict(r) for r in rows]})
    crossovers = {}
    print("\nwhere a transfer pays off: the link bandwidth above which its warm TTFT beats the consumer's own "
          "prefill\n(payload / (oracle TTFT - first step); 'never': its rebuild alone takes longer; cold "
          "transfers never do)", file=out)
    for tokens in args.prompt_tokens:
        crossovers[tokens] = crossover(shape, tokens, plan, rates, args.methods)
        print(f"  T={tokens}: " + ", ".join(f"{m} {fmt_bandwidth(b) if b else 'never'}"
                                            for m, b in crossovers[tokens].items()), file=out)
    if args.json:
        doc = {"model": asdict(shape), "ranks": asdict(plan), "rates": asdict(rates), "formula": FORMULA, "results": result,
               "crossover_bytes_per_s": crossovers}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0
