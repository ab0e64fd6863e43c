"""`scd-serve bench {ttft,chat,peer,serve,structured}`: the measured benchmarks (the planner is `scd-serve plan`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scd_serve.config.methods import AUTO, TRANSFER_METHODS
from scd_serve.config.model import DTYPE_NAMES
from scd_serve.errors import ConfigError

DEMO = "models/demo-pair"
# "oracle": the consumer's own prefill, timed as a method; identity is a test codec, not benched
ALL_METHODS = ("oracle", *(m for m in TRANSFER_METHODS if m != "identity"), AUTO)


def _common(p, *, seed: bool = True, start_timeout: float = 300.0, request_timeout: float | None = 300.0) -> None:
    """What the benchmarks share: --json, --seed, their start and request deadlines."""
    p.add_argument("--json", required=True, help="write the results here")
    if seed:
        p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=start_timeout)
    if request_timeout is not None:
        p.add_argument("--request-timeout", type=float, default=request_timeout)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    t = sub.add_parser("ttft", help="TTFT per method over a shaped link (netns + veth + tc tbf)")
    _common(t, request_timeout=None)
    t.add_argument("--plot", help="PNG: TTFT vs bandwidth; the Pareto plot goes next to it (*.pareto.png)")
    t.add_argument("--bandwidths", nargs="+", help="link rates, e.g. 100mbit 1gbit (default: chosen from the "
                                                   "oracle's measured TTFT so raw KV goes from negligible to dominant)")
    t.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    t.add_argument("--ref-tokens", type=int, default=1024, help="prompt length the sweep and targets refer to")
    t.add_argument("--methods", nargs="+", default=list(ALL_METHODS), choices=ALL_METHODS)
    t.add_argument("--modes", nargs="+", default=["warm", "cold"], choices=["warm", "cold"])
    t.add_argument("--reps", type=int, default=3, help="timed requests per (method, length, mode); medians reported")
    t.add_argument("--producer", default=f"{DEMO}/producer")
    t.add_argument("--consumer", default=f"{DEMO}/consumer")
    t.add_argument("--codebook", default=f"{DEMO}/codebook", help="'' for codebook-free methods only")
    t.add_argument("--quality", help="JSON of `scd-serve eval --table --json` (F1 per method) for the Pareto plot")
    t.add_argument("--resend-chunk-bytes", type=int, default=0,
                   help="prefill worker's chunk_bytes for cached (warm) codes: 0 = the worker's default "
                        "(first and last layer alone, the layers between packed up to 32 KiB per message), "
                        "1 = one layer per chunk")
    t.add_argument("--worker", action="store_true",
                   help="also time the real decode worker (`scd-serve decode`, HTTP, max_tokens=1) at every rate, "
                        "warm, reference length, per method and its own local prefill; `auto` (the worker picks "
                        "per request) is timed only here, in rounds with the fixed methods")
    t.add_argument("--quality-budget", type=float, default=None,
                   help="the decode worker's --quality-budget for auto (default: the codebook's KL budget)")
    t.add_argument("--rate-change", nargs="+", metavar="RATE",
                   help="instead of the sweep: the decode worker alone, --phase-requests auto requests at each "
                        "rate in turn (the link re-shaped between two requests), then the allowed fixed methods "
                        "at that rate; prints the sequence of auto's choices")
    t.add_argument("--phase-requests", type=int, default=15, help="auto requests per rate of --rate-change")
    t.add_argument("--auto-stale-s", type=float, default=None,
                   help="the decode worker's --auto-stale-s (default: its own, 30 s)")
    t.add_argument("--no-netns", action="store_true", help="use the userspace token-bucket proxy")
    t.add_argument("--quick", action="store_true", help="tiny setting: one length, one rep, two bandwidths")
    t.add_argument("--point-timeout", type=float, default=1800.0)

    c = sub.add_parser("chat", help="multi-turn chats over a shared system prompt, and agent chains with --expert: "
                                     "TTFT, bytes and cached share per turn, the decode workers' prefix cache on and off")
    _common(c)
    c.add_argument("--bandwidth", default="100mbit", help="the link's rate between prefill and decode")
    c.add_argument("--methods", nargs="+", default=["scd", "local"], help="scd_method of the requests")
    c.add_argument("--chats", type=int, default=3, help="conversations per method and cache setting")
    c.add_argument("--turns", type=int, default=4)
    c.add_argument("--system-tokens", type=int, default=1024, help="the system prompt every chat starts with")
    c.add_argument("--turn-tokens", type=int, default=48, help="each user message")
    c.add_argument("--max-tokens", type=int, default=16, help="each answer (greedy)")
    c.add_argument("--producer", default=f"{DEMO}/producer")
    c.add_argument("--consumer", default=f"{DEMO}/consumer")
    c.add_argument("--codebook", default=f"{DEMO}/codebook")
    c.add_argument("--expert", metavar="NAME=DIR[:CODEBOOK]",
                   help="another consumer of the producer (a model or a LoRA adapter directory, its codebook for "
                        "codebook methods): agent chains alternate it with --consumer, each reading the other's answers")
    c.add_argument("--resend-chunk-bytes", type=int, default=0, help=argparse.SUPPRESS)
    c.add_argument("--no-netns", action="store_true", help="use the userspace token-bucket proxy")

    g = sub.add_parser("structured", help="tokens/s with half the streams grammar-constrained (json_schema) "
                                          "vs none, on one decode worker")
    _common(g, request_timeout=600.0)
    g.add_argument("--consumer", default="models/context-pair/consumer",
                   help="a model whose vocabulary can write JSON (the demo pair's word-level one cannot)")
    g.add_argument("--streams", type=int, default=16)
    g.add_argument("--round-s", type=float, default=30.0, help="seconds each round's tokens are counted over")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--prompt-tokens", type=int, default=32)
    g.add_argument("--json-whitespace", type=int, default=2,
                   help="the worker's --json-whitespace (the small pair pads JSON with the most it may)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)

    v = sub.add_parser("peer", help="vLLM, the decode worker alone and the P/D pair on the same model, dtype, cores "
                                    "and requests: throughput, time per token and TTFT, with ratios")
    _common(v, seed=False, start_timeout=900.0, request_timeout=600.0)
    v.add_argument("--model", default="out/shaped/consumer", help="a model directory both engines load")
    v.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    v.add_argument("--targets", nargs="+", default=["vllm", "scd", "pd"], choices=["vllm", "scd", "pd"],
                   help="vllm; scd: the decode worker, local prefill; pd: a prefill worker + a decode worker, raw K/V")
    v.add_argument("--vllm-python", default="", help="the python of vLLM's own venv (default $SCD_VLLM_PYTHON)")
    v.add_argument("--threads", type=int, default=2, help="each server's threads (OMP_NUM_THREADS)")
    v.add_argument("--streams", type=int, nargs="+", default=[8, 16], help="streams at once, one round each")
    v.add_argument("--stream-prompt-tokens", type=int, default=256)
    v.add_argument("--stream-max-tokens", type=int, default=48)
    v.add_argument("--ttft-tokens", type=int, nargs="+", default=[1024, 4096], help="prompt lengths timed to the first token")
    v.add_argument("--ttft-requests", type=int, default=5, help="requests per length, one after another")
    v.add_argument("--scd-arg", dest="scd_args", action="append", default=[],
                   help="another flag for the decode worker (repeatable), e.g. --scd-arg=--max-num-batched-tokens=2048")

    s = sub.add_parser("serve", help="open-loop Poisson load: engine (continuous batching) vs sequential generate")
    _common(s)
    s.add_argument("--consumer", default=f"{DEMO}/consumer")
    s.add_argument("--method", default="local", help="scd_method of every request ('local' = no transfer)")
    s.add_argument("--device", default="cpu", help="every target's device: cpu or cuda[:N]")
    s.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="every target's weights and KV dtype")
    s.add_argument("--engine-arg", dest="engine_args", action="append", default=[],
                   help="extra argument for `scd-serve decode` (repeatable), e.g. --engine-arg=--prefill=H:P")
    s.add_argument("--rates", nargs="+", help="request rates (req/s); default: 0.5, 1, 2, 4 x baseline capacity")
    s.add_argument("--requests", type=int, default=24, help="most requests per rate")
    s.add_argument("--min-requests", type=int, default=6, help="fewest requests per rate")
    s.add_argument("--duration-s", type=float, default=20.0, help="arrivals span about this long per rate")
    s.add_argument("--prompt-tokens", type=int, default=64)
    s.add_argument("--max-tokens", type=int, default=32)
    s.add_argument("--concurrency", type=int, default=16, help="streams for the tokens/s comparison")
    s.add_argument("--streams-rounds", type=int, default=1, help="requests per stream in that comparison")
    s.add_argument("--slo-ttft", type=float, default=2.0, help="SLO: TTFT bound (s)")
    s.add_argument("--slo-itl", type=float, default=0.25, help="SLO: mean inter-token latency bound (s)")
    s.add_argument("--mixed", action="store_true",
                   help="the hot path's workload: mixed lengths, engine vs static-batch and sequential generate")
    s.add_argument("--mixed-requests", type=int, default=64)
    s.add_argument("--mixed-targets", nargs="+", default=["baseline", "static", "engine"],
                   choices=["baseline", "static", "engine"], help="with --mixed: which targets to run, in order")
    s.add_argument("--prompt-range", type=int, nargs=2, default=[128, 1024], metavar=("LO", "HI"))
    s.add_argument("--output-range", type=int, nargs=2, default=[16, 256], metavar=("LO", "HI"))
    s.add_argument("--quick", action="store_true", help="tiny setting: one rate, few requests, 2 streams")


def run(args: argparse.Namespace) -> int:
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.bench == "ttft":
        doc = _ttft(args)
    elif args.bench == "chat":
        from scd_serve.bench.chat import print_table, run_chat

        doc = run_chat(args)
        print_table(doc)
    elif args.bench == "peer":
        from scd_serve.bench.peer import print_table, run_peer

        doc = run_peer(args)
        print_table(doc)
    elif args.bench == "structured":
        from scd_serve.bench.structured import run_structured

        for name in ("streams", "max_tokens", "prompt_tokens", "round_s"):
            if getattr(args, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0", field=name)
        doc = run_structured(args)
        print(f"bench structured: {doc['streams']} streams, tokens/s unconstrained {doc['free_tokens_per_s']}, "
              f"half constrained {doc['half_tokens_per_s']}: {doc['half_over_free']:.0%} of unconstrained; "
              f"constrained replies valid {doc['checked']['valid']}/{doc['checked']['requests']}")
    else:
        if args.quick:
            args.rates = args.rates or ["1"]
            args.requests, args.concurrency, args.streams_rounds = 3, 2, 1
            args.max_tokens, args.prompt_tokens = min(args.max_tokens, 4), min(args.prompt_tokens, 16)
            args.mixed_requests, args.prompt_range, args.output_range = 4, [8, 24], [2, 6]
        for name in ("requests", "prompt_tokens", "max_tokens", "concurrency", "streams_rounds", "mixed_requests"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1", field=name)
        for name in ("prompt_range", "output_range"):
            lo, hi = getattr(args, name)
            if not 1 <= lo <= hi:
                raise ConfigError(f"--{name.replace('_', '-')} needs 1 <= LO <= HI, got {lo} {hi}", field=name)
        from scd_serve.bench.serve import run_serve

        doc = run_serve(args)
        if args.mixed:
            print(f"bench serve --mixed: {doc['concurrent_streams']} streams, tokens/s {doc['tokens_per_s']}; "
                  f"engine/static {doc['engine_over_static']}, engine/sequential {doc['engine_over_sequential']}")
        else:
            print(f"bench serve: {doc['concurrent_streams']} streams, engine/sequential tokens/s = "
                  f"{doc['batching_speedup_tokens_per_s']}")
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


def _ttft(args) -> dict:
    from scd_serve.bench import plot
    from scd_serve.bench.report import check_targets, f1_by_method
    from scd_serve.bench.ttft import run_ttft

    if args.quick:
        args.prompt_tokens, args.reps = [min(args.prompt_tokens)], 1
        args.modes = ["warm"]
        if not args.bandwidths:
            args.bandwidths = ["1gbit", "100mbit"]
    if any(t < 2 for t in args.prompt_tokens) or args.reps < 1:
        raise ConfigError("--prompt-tokens must be >= 2 and --reps >= 1", field="prompt_tokens")
    if not args.codebook or not Path(args.codebook).exists():
        needs = [m for m in args.methods if m in ("reuse", "scd", "scd-int8")]
        if needs and not args.rate_change:
            print(f"bench ttft: no codebook at {args.codebook!r}; skipping {needs}", file=sys.stderr)
            args.methods = [m for m in args.methods if m not in needs]
        args.codebook = None
    if args.rate_change:
        return _rate_change(args)
    if "auto" in args.methods and not args.worker:
        print("bench ttft: auto is a choice of the decode worker: timed only with --worker", file=sys.stderr)
    ref = args.ref_tokens if args.ref_tokens in args.prompt_tokens else max(args.prompt_tokens)
    doc = run_ttft(args)
    f1 = f1_by_method(Path(args.quality)) if args.quality else None
    doc["quality"] = {"source": args.quality, "f1": f1}
    doc["targets"] = check_targets(doc, f1, ref)
    if args.plot:
        png = Path(args.plot)
        doc["plots"] = [str(plot.ttft_vs_bandwidth(doc, png, ref))]
        if f1:
            doc["plots"].append(str(plot.pareto(doc, f1, png.with_suffix(".pareto.png"), ref)))
    _print_table(doc, ref)
    return doc


def _rate_change(args) -> dict:
    from scd_serve.bench.ttft import run_rate_change

    if args.phase_requests < 1:
        raise ConfigError("--phase-requests must be >= 1", field="phase_requests")
    if args.ref_tokens < 2:
        raise ConfigError("--ref-tokens must be >= 2", field="ref_tokens")
    if args.quick:
        args.ref_tokens = min(args.prompt_tokens)
    doc = run_rate_change(args)
    print(f"link: {doc['link']['kind']}; prompt {doc['prompt_tokens']} tokens; auto within quality budget "
          f"{doc['allowed']['budget']:g}: {', '.join(doc['allowed']['methods'])}")
    print(f"{'#':>3} {'bandwidth':>10} {'method':<10}{'reason':<9}{'TTFT ms':>9}{'predicted':>10}")
    for s in doc["sequence"]:
        pred = f"{s['predicted_s'] * 1e3:.1f}" if s.get("predicted_s") is not None else "-"
        print(f"{s['index']:>3} {s['bandwidth']:>10} {s['method'] or '-':<10}{s['reason'] or '-':<9}"
              f"{s['ttft_s'] * 1e3:>9.1f}{pred:>10}")
    for ph in doc["phases"]:
        fixed = ", ".join(f"{m} {t * 1e3:.1f}" for m, t in ph["fixed_ttft_s"].items())
        print(f"{ph['bandwidth']}: fixed methods (ms, median of {doc['reps']}): {fixed}; within 10% of the best: "
              f"{', '.join(ph['good_enough'])}; auto first picked one at request {ph['first_good_request']} of the "
              f"phase, then {ph['share_good_from_then']:.0%} of the time" if ph["first_good_request"] else
              f"{ph['bandwidth']}: fixed {fixed}; auto never picked one of {ph['good_enough']}")
    err = doc["prediction_error"]
    if err["median"] is not None:
        print(f"prediction error (|predicted - client TTFT| / client TTFT): median {err['median']:.1%} over "
              f"{err['num']} predictions; worker's histogram: {doc['server_prediction_error']}")
    return doc


def _print_table(doc: dict, tokens: int) -> None:
    print(f"link: {doc['link']['kind']}; prompt {tokens} tokens; medians of {doc['reps']} (ms)")
    print(f"{'bandwidth':>10} {'method':<11}{'mode':<6}{'TTFT':>9}{'pf+enc':>9}{'wire':>8}"
          f"{'rebuild':>9}{'first':>7}{'payload':>11}{'bound':>8}{'ratio':>7}{'floor':>7}")
    for p in doc["sweep"]:
        for r in p["rows"]:
            if r["prompt_tokens"] != tokens:
                continue
            ms = lambda k: f"{r[k] * 1e3:.1f}" if r.get(k) is not None else "-"  # noqa: E731
            ratio = f"{r['ratio_to_lower_bound']:.2f}" if r.get("ratio_to_lower_bound") else "-"
            floor = f"{r['ratio_to_pipelined_floor']:.2f}" if r.get("ratio_to_pipelined_floor") else "-"
            print(f"{p['bandwidth']:>10} {r['method']:<11}{r['mode']:<6}{ms('ttft_s'):>9}{ms('producer_s'):>9}"
                  f"{ms('wire_s'):>8}{ms('rebuild_s'):>9}{ms('first_step_s'):>7}"
                  f"{r['payload_bytes'] / 1e6:>10.3f}M{ms('lower_bound_s'):>8}{ratio:>7}{floor:>7}")
    for p in doc["sweep"]:
        if p.get("worker_rows"):
            cells = ", ".join(f"{r['method']} {r['ttft_s'] * 1e3:.1f}" for r in p["worker_rows"])
            auto = next((r for r in p["worker_rows"] if r["method"] == "auto"), None)
            picked = f"; auto picked {' '.join(auto['chosen'])}" if auto else ""
            print(f"{p['bandwidth']:>10} decode worker (ms): {cells}{picked}")
    print(json.dumps(doc["targets"], indent=1))
