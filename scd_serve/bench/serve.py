"""`scd-serve bench serve`: the same open-loop load against the engine and a sequential baseline.

The targets run one after the other (never both at once on the shared CPU): `scd-serve
decode` (continuous batching) and baseline.py (one transformers `generate` at a time).
Per request rate: TTFT / inter-token / end-to-end percentiles, throughput and goodput under
the SLO, then tokens/s at a fixed number of concurrent streams. The default rates are
multiples of the baseline's capacity (1 / its single-request latency).

--mixed: seeded requests of mixed prompt and output lengths, --concurrency at a time,
against the engine, static batches of generate (each waits for its longest) and
sequential generate; tokens/s of each and the two ratios.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

from scd_serve.bench import procs
from scd_serve.bench.loadgen import closed_loop, open_loop
from scd_serve.bench.report import machine
from scd_serve.bench.stats import Slo, summarize
from scd_serve.errors import ConfigError, TransferFailed

CAPACITY_MULTIPLES = (0.5, 1.0, 2.0, 4.0)


def make_body_factory(prompt_tokens: int | tuple[int, int], max_tokens: int | tuple[int, int], vocab: int,
                      method: str | None, seed: int):
    """Request i's body, the same for every target; a (lo, hi) length is drawn per request."""
    def body(i: int) -> dict:
        rng = random.Random(seed * 100003 + i)
        n = prompt_tokens if isinstance(prompt_tokens, int) else rng.randint(*prompt_tokens)
        m = max_tokens if isinstance(max_tokens, int) else rng.randint(*max_tokens)
        b = {"prompt": [rng.randrange(3, min(vocab, 30000)) for _ in range(n)],
             "max_tokens": m, "temperature": 0.0, "ignore_eos": True,
             "stream_options": {"include_usage": True}}  # same length everywhere; count tokens from usage
        if method:
            b["scd_method"] = method
        return b
    return body


def requests_for(rate: float, args) -> int:
    """About --duration-s of arrivals at `rate`, between --min-requests and --requests."""
    return max(min(args.min_requests, args.requests), min(args.requests, round(rate * args.duration_s)))


def start_target(name: str, args, logs: Path):
    port = procs.free_port()
    if name == "engine":
        cmd = [sys.executable, "-m", "scd_serve.cli", "decode", "--model", args.consumer, "--host", "127.0.0.1",
               "--port", str(port), "--method", args.method, "--request-timeout-s", str(args.request_timeout),
               "--device", args.device, "--dtype", args.dtype, *args.engine_args]
        if args.method == "local" and not any(a.startswith("--codebook") for a in args.engine_args):
            cmd += ["--codebook", ""]  # no transfer: the engine alone
    else:
        cmd = [sys.executable, "-m", "scd_serve.bench.baseline", "--model", args.consumer, "--port", str(port),
               "--threads", "1", "--batch", str(args.concurrency if name == "static" else 1),
               "--device", args.device, "--dtype", args.dtype]
    log = logs / f"{name}.log"
    proc = procs.spawn(cmd, log)
    url = f"http://127.0.0.1:{port}"
    procs.wait_http(url + "/ready", proc, args.start_timeout, log)
    return proc, url


def bench_target(name: str, url: str, args, rates: list[float] | None, slo: Slo, vocab: int) -> dict:
    method = args.method if name == "engine" else None
    body = make_body_factory(args.prompt_tokens, args.max_tokens, vocab, method, args.seed)
    # warm-up + single-request latency (used to pick rates when none are given)
    asyncio.run(closed_loop(url, 1, 1, body, timeout_s=args.request_timeout))
    single, wall = asyncio.run(closed_loop(url, 1, 2, body, timeout_s=args.request_timeout))
    single_sum = summarize(single, wall, slo)
    out = {"single_request": single_sum, "rates": []}
    for rate in rates or []:
        n = requests_for(rate, args)
        res, wall = asyncio.run(open_loop(url, rate, n, body, seed=args.seed, timeout_s=args.request_timeout))
        out["rates"].append({"rate_rps": rate, **summarize(res, wall, slo)})
        print(f"  {name}: {rate:.3g} req/s -> {out['rates'][-1]['throughput_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    res, wall = asyncio.run(closed_loop(url, args.concurrency, args.concurrency * args.streams_rounds, body,
                                        timeout_s=args.request_timeout))
    out["concurrent"] = {"streams": args.concurrency, **summarize(res, wall, slo)}
    if out["concurrent"]["completed"] == 0:
        raise TransferFailed(f"{name} ({url}) completed no request: {out['concurrent']['errors']}")
    print(f"  {name}: {args.concurrency} streams -> {out['concurrent']['throughput_tokens_per_s']:.1f} tok/s",
          file=sys.stderr)
    return out


def run_mixed(args, vocab: int, logs: Path, slo: Slo) -> dict:
    """The three targets, one after the other, on the same seeded mixed requests."""
    results = {}
    for name in args.mixed_targets:
        body = make_body_factory(tuple(args.prompt_range), tuple(args.output_range), vocab,
                                 args.method if name == "engine" else None, args.seed)
        proc = None
        try:
            proc, url = start_target(name, args, logs)
            warm = make_body_factory(16, 2, vocab, args.method if name == "engine" else None, args.seed + 1)
            asyncio.run(closed_loop(url, 1, 1, warm, timeout_s=args.request_timeout))
            res, wall = asyncio.run(closed_loop(url, args.concurrency, args.mixed_requests, body,
                                                timeout_s=args.request_timeout))
            results[name] = summarize(res, wall, slo)
            if results[name]["completed"] < args.mixed_requests:
                raise TransferFailed(f"{name} completed {results[name]['completed']} of {args.mixed_requests}: "
                                     f"{results[name]['errors']}")
            print(f"  {name}: {results[name]['throughput_tokens_per_s']:.2f} tok/s in {wall:.0f} s", file=sys.stderr)
        finally:
            procs.stop(proc)
    tps = {name: r["throughput_tokens_per_s"] for name, r in results.items()}

    def ratio(a: str, b: str) -> float | None:
        return tps[a] / tps[b] if tps.get(a) and tps.get(b) else None

    return {"benchmark": "serve-mixed", "machine": machine(), "consumer": args.consumer, "method": args.method,
            "device": args.device, "dtype": args.dtype,
            "requests": args.mixed_requests, "prompt_range": args.prompt_range, "output_range": args.output_range,
            "concurrent_streams": args.concurrency, "targets": results, "tokens_per_s": tps,
            "engine_over_static": ratio("engine", "static"), "engine_over_sequential": ratio("engine", "baseline")}


def run_serve(args) -> dict:
    cfg = Path(args.consumer) / "config.json"
    if not cfg.exists():
        raise ConfigError(f"model directory {args.consumer} has no config.json", field="consumer")
    import json

    vocab = int(json.loads(cfg.read_text())["vocab_size"])
    logs = Path(args.json).resolve().parent / "bench-serve-logs"
    logs.mkdir(parents=True, exist_ok=True)
    slo = Slo(args.slo_ttft, args.slo_itl)
    if args.mixed:
        return run_mixed(args, vocab, logs, slo)
    results: dict = {}
    rates = [float(r) for r in args.rates] if args.rates else None
    for name in ("baseline", "engine"):  # the baseline first: its latency sets the default rates
        proc = None
        try:
            proc, url = start_target(name, args, logs)
            if rates is None:
                probe = make_body_factory(args.prompt_tokens, args.max_tokens, vocab, None, args.seed)
                one, wall = asyncio.run(closed_loop(url, 1, 2, probe, timeout_s=args.request_timeout))
                e2e = summarize(one, wall, slo)["e2e_s"]["p50"] or 1.0
                rates = [round(m / e2e, 3) for m in CAPACITY_MULTIPLES]
            results[name] = bench_target(name, url, args, rates, slo, vocab)
        finally:
            procs.stop(proc)
    eng = results["engine"]["concurrent"]["throughput_tokens_per_s"]
    base = results["baseline"]["concurrent"]["throughput_tokens_per_s"]
    ratio = eng / base if base else None
    return {"benchmark": "serve", "machine": machine(), "consumer": args.consumer, "method": args.method,
            "device": args.device, "dtype": args.dtype,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "requests_per_rate": {str(r): requests_for(r, args) for r in rates},
            "slo": {"ttft_s": slo.ttft_s, "mean_itl_s": slo.itl_s}, "rates_rps": rates, "targets": results,
            "concurrent_streams": args.concurrency, "batching_speedup_tokens_per_s": ratio,
            "target_4x_met": ratio is not None and ratio >= 4.0}
