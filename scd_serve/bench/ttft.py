"""`scd-serve bench ttft`: TTFT per method through the real gRPC path over a shaped link.

A prefill worker runs in the producer namespace and the probe (transfer_probe.py, the
decode side) in the consumer namespace, joined by a veth whose `tc tbf` is set to each rate
of the sweep in turn; without namespaces they talk through the labelled userspace proxy.
The default sweep spans rates at which raw KV's wire time goes from negligible to dominant
against the oracle's measured TTFT (RAW_SHARES). `auto` is timed only on the real decode
worker (--worker), in rounds with the fixed methods; `--rate-change R1 R2 ...` re-shapes the
link between runs of `auto` requests and prints its choices (run_rate_change).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

from scd_serve.config.methods import AUTO, LOCAL
from scd_serve.bench import procs
from scd_serve.bench.loadgen import random_prompt
from scd_serve.bench.netns import NetnsLink
from scd_serve.bench.report import summarize_rows
from scd_serve.bench.stats import median
from scd_serve.bench.tbproxy import ProxyLink
from scd_serve.planner.shapes import load_shape
from scd_serve.planner.units import fmt_bandwidth, parse_bandwidth
from scd_serve.errors import ConfigError, DeadlineExceeded, TransferFailed, Unavailable

RAW_SHARES = (0.05, 0.25, 0.5, 1.0, 2.0, 4.0)  # raw wire time / oracle TTFT at the reference length
CEILING_SHARE = 0.6  # a tbf rate above this share of the unshaped throughput is not what limits the wire
SETTLE = "settle"  # an uncounted request after the local prefill in each round of worker_rounds
WITHIN = 1.10  # `auto` counts as following the link when within 10% of the best method allowed there


class ProbeProcess:
    """The decode-side probe: one JSON command in, one JSON answer out, with a deadline."""

    def __init__(self, cmd: list[str], log: Path, deadline_s: float):
        env_cmd = ["env", "OMP_NUM_THREADS=1", "TOKENIZERS_PARALLELISM=false", "nice", "-n", "5", *cmd]
        self.proc = subprocess.Popen(env_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "ab"), text=True, start_new_session=True)
        self.log = log
        self.hello = self._read(deadline_s)

    def ask(self, cmd: dict, deadline_s: float) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        answer = self._read(deadline_s)
        if "error" in answer:
            raise TransferFailed(f"probe failed: {answer['error']}")
        return answer

    def _read(self, deadline_s: float) -> dict:
        import select

        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise TransferFailed(f"probe exited with {self.proc.returncode}{procs.log_tail(self.log)}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.strip().startswith("{"):
                    return json.loads(line)
        raise DeadlineExceeded(f"probe gave no answer within {deadline_s:.0f}s{procs.log_tail(self.log)}")

    def close(self) -> None:
        with suppress(OSError, subprocess.TimeoutExpired, ValueError):
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(5)
        procs.stop(self.proc)


def open_link(force_fallback: bool = False, kind=NetnsLink, warn: bool = True):
    """An entered link (`kind`, kernel namespaces, when possible; else the labelled userspace
    fallback, ProxyLink, whose .reason says why); the caller must call .down()."""
    reason = "--no-netns given" if force_fallback else kind.available()
    if reason is None:
        try:
            return kind().up()
        except Unavailable as exc:
            reason = exc.message
    if warn:
        print(f"bench: network namespaces unavailable ({reason}); using the in-process "
              f"userspace token-bucket proxy instead - results are labelled as such", file=sys.stderr)
    return ProxyLink(reason).up()


def choose_sweep(oracle_s: float, raw_bytes: float, shares=RAW_SHARES) -> list[float]:
    """Bandwidths (bytes/s) at which raw transfer takes each share of the oracle's TTFT."""
    return sorted((raw_bytes / (share * oracle_s) for share in shares), reverse=True)


def allowed_methods(args) -> dict:
    """What the worker's `auto` may pick here: the budget in force and the methods within it
    (calibrated top-1 or KL, as decode/chooser.py rules; raw/identity where producer and
    consumer are one model; local always)."""
    from scd_serve.config.decode import ChooserConfig
    from scd_serve.codec.figures import QualityFigures
    from scd_serve.decode.chooser import LOSSLESS, Chooser

    cal = QualityFigures.load(args.codebook)
    budget = args.quality_budget if args.quality_budget is not None else (cal.budget or 0.0)
    rule = Chooser(ChooserConfig(), budget, 1.0, min_top1=cal.min_top1, strict_kl=args.quality_budget is not None)
    kl, top1 = dict(cal.kl), dict(cal.top1)
    if Path(args.producer).resolve() == Path(args.consumer).resolve():
        kl.update({m: 0.0 for m in LOSSLESS})
        top1.update({m: 1.0 for m in LOSSLESS})
    return {"budget": budget, "min_top1": cal.min_top1, "kl": kl, "top1": top1,
            "methods": sorted(m for m, v in kl.items() if rule.within(v, top1.get(m))) + [LOCAL]}


def log_dir(args) -> Path:
    logs = Path(args.json).resolve().parent / "bench-ttft-logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def start_client(link, logs: Path, deadline_s: float) -> ProbeProcess:
    """An HTTP client in the decode worker's namespace (bench/loadgen.py's command loop)."""
    return ProbeProcess([*link.exec_prefix("consumer"), sys.executable, "-m", "scd_serve.bench.loadgen"],
                        logs / "client.log", deadline_s)


def auto_body(args, n: int, method: str = AUTO) -> dict:
    # the probe's prompt (Probe.prompt), so `auto` and the fixed methods are warm on the same codes
    return {"prompt": random_prompt(load_shape(args.consumer).vocab_size, n, args.seed), "max_tokens": 1,
            "temperature": 0.0, "ignore_eos": True, "scd_method": method}


def start_prefill(args, link, logs: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`scd-serve prefill` in the producer's namespace, listening -> (process, the address the
    consumer side dials). --insecure: the namespace's address is not loopback, and has no token.
    extra: more of its flags (an expert's codebook)."""
    port = procs.free_port()
    cmd = [*link.exec_prefix("producer"), sys.executable, "-m", "scd_serve.cli", "prefill", "--model", args.producer,
           "--host", link.producer_bind(), "--port", str(port), "--codebook", args.codebook or "", "--insecure", *extra]
    if args.resend_chunk_bytes > 0:  # else the worker's default
        cmd += ["--chunk-bytes", str(args.resend_chunk_bytes)]
    proc = procs.spawn(cmd, logs / "prefill.log")
    procs.wait_tcp(link.producer_bind(), port, proc, args.start_timeout, link.exec_prefix("producer"),
                   logs / "prefill.log")
    return proc, link.producer_addr(port)


def start_worker(args, link, address: str, logs: Path, extra: tuple[str, ...] = ("--no-enable-prefix-caching",),
                 name: str = "decode", model: str | None = None,
                 codebook: str | None = None) -> tuple[subprocess.Popen, str]:
    """The real `scd-serve decode` beside the probe, listening -> (process, URL); the probe
    then waits for /ready (peers handshaken). Its default method is auto (a codebook) or raw.
    extra: more of its flags (by default no prefix cache: a method's TTFT is timed on a prompt
    the worker must fill again each time, `warm` meaning the producer's code cache); name: its log's;
    model, codebook: another consumer's (an expert of the same producer) instead of args'."""
    port = procs.free_port()
    if model is None:
        model, codebook = args.consumer, args.codebook
    cmd = [*link.exec_prefix("consumer"), sys.executable, "-m", "scd_serve.cli", "decode", "--model", model,
           "--codebook", codebook or "", "--host", "127.0.0.1", "--port", str(port), "--prefill", address,
           "--fallback", "none", *extra]  # a failed transfer is an error here, never a silent local prefill
    if getattr(args, "quality_budget", None) is not None:
        cmd += ["--quality-budget", str(args.quality_budget)]
    if getattr(args, "auto_stale_s", None) is not None:
        cmd += ["--auto-stale-s", str(args.auto_stale_s)]
    log = logs / f"{name}.log"
    proc = procs.spawn(cmd, log)
    procs.wait_tcp("127.0.0.1", port, proc, args.start_timeout, link.exec_prefix("consumer"), log)
    return proc, f"http://127.0.0.1:{port}"


def run_ttft(args) -> dict:
    logs = log_dir(args)
    for d in (args.producer, args.consumer):
        if not (Path(d) / "config.json").exists():
            raise ConfigError(f"model directory {d} has no config.json; run `scd-serve make-demo-pair` or pass "
                              f"--producer/--consumer", field="model")
    methods = [m for m in args.methods if m not in ("oracle", AUTO)]
    with_auto = AUTO in args.methods and args.worker
    link = open_link(force_fallback=args.no_netns)
    server = probe = worker_proc = client = None
    try:
        server, address = start_prefill(args, link, logs)
        book = ["--codebook", args.codebook] if args.codebook else []
        probe = ProbeProcess([*link.exec_prefix("consumer"), sys.executable, "-m",
                              "scd_serve.bench.transfer_probe", "--consumer", args.consumer, *book],
                             logs / "probe.log", args.start_timeout)
        base = {"prefill": address, "reps": args.reps, "seed": args.seed}
        # unshaped calibration: the oracle (local prefill) and the producer's prefill alone (identity, cold)
        link.set_rate(None)
        calib = probe.ask({**base, "prompt_tokens": args.prompt_tokens, "methods": ["oracle", "identity"],
                           "modes": ["cold"]}, args.point_timeout)["rows"]
        ref = args.ref_tokens if args.ref_tokens in args.prompt_tokens else max(args.prompt_tokens)
        oracle_ref = _median([s["ttft_s"] for r in calib if r["method"] == "oracle" and r["prompt_tokens"] == ref
                              for s in r["samples"]])
        ceiling = link.measure_throughput(32 << 20)  # unshaped: what the veth + CPU carry at most
        shape = load_shape(args.consumer)  # raw ships 16-bit K and V of every layer for T-1 tokens
        sweep = ([parse_bandwidth(b) for b in args.bandwidths] if args.bandwidths
                 else choose_sweep(oracle_ref, shape.num_layers * (ref - 1) * 2 * shape.kv_width * 2))
        notes = []
        if ceiling and any(bw > CEILING_SHARE * ceiling for bw in sweep):
            notes.append(f"rates above {CEILING_SHARE:.0%} of the unshaped link ({fmt_bandwidth(ceiling)}) are "
                         f"CPU-bound, not shaped: " + ", ".join(fmt_bandwidth(b) for b in sweep if b > CEILING_SHARE * ceiling)
                         + (" (replaced by one point at that share)" if not args.bandwidths else " (kept: given explicitly)"))
            print(f"bench ttft: {notes[0]}", file=sys.stderr)
            if not args.bandwidths:
                sweep = [CEILING_SHARE * ceiling] + [b for b in sweep if b <= CEILING_SHARE * ceiling]
        print(f"bench ttft: link {link.kind}; oracle TTFT at {ref} tokens {oracle_ref * 1e3:.1f} ms; sweep "
              f"{', '.join(fmt_bandwidth(b) for b in sweep)}", file=sys.stderr)
        points = []
        for bw in sweep:
            link.set_rate(bw)
            measured = link.measure_throughput(max(1 << 20, min(16 << 20, int(bw * 0.5))))
            t0 = time.monotonic()
            rows = probe.ask({**base, "prompt_tokens": args.prompt_tokens, "methods": methods,
                              "modes": args.modes}, args.point_timeout)["rows"]
            points.append({"bandwidth_bytes_per_s": bw, "bandwidth": fmt_bandwidth(bw), "rows": rows,
                           "measured_tcp_bytes_per_s": measured, "elapsed_s": time.monotonic() - t0})
            print(f"  {fmt_bandwidth(bw)} done in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        auto = None
        if args.worker:  # after the probe's points, so that an idle worker never shares the CPU with them
            worker_proc, worker = start_worker(args, link, address, logs)
            if with_auto:
                client = start_client(link, logs, args.start_timeout)
                client.ask({"cmd": "ready", "url": worker, "timeout_s": args.start_timeout}, args.start_timeout + 10)
            for point in points:
                link.set_rate(point["bandwidth_bytes_per_s"])
                if with_auto:  # in rounds, auto first in each: see worker_rounds
                    point["worker_rows"] = worker_rounds(client, worker, args, ref, [AUTO, *methods, LOCAL])
                else:
                    point["worker_rows"] = probe.ask(
                        {**base, "worker": worker, "prompt_tokens": [ref], "methods": [*methods, LOCAL],
                         "ready_timeout_s": args.start_timeout}, args.point_timeout)["rows"]
                print(f"  {point['bandwidth']}: decode worker done", file=sys.stderr)
            if with_auto:
                auto = {**allowed_methods(args), "server_prediction_error": prediction_error_histogram(
                    client.ask({"cmd": "metrics", "url": worker}, 60)["text"])}
        link_info = {**link.describe(), "unshaped_tcp_bytes_per_s": ceiling, "notes": notes}
    finally:
        for helper in (client, probe):
            if helper:
                helper.close()
        procs.stop(worker_proc)
        procs.stop(server)
        link.down()
    doc = summarize_rows(calib, points, link_info, ref, args)
    if auto is not None:
        doc["auto"] = auto
    return doc


def worker_rounds(client: ProbeProcess, worker: str, args, n: int, methods: list[str]) -> list[dict]:
    """The decode worker's warm TTFT per method (auto included) at the current rate, in rounds of
    one request per method, so a load swing hits them alike; the first round (cache fill,
    first-call costs) is not counted. `auto` learns from the fixed methods' transfers too."""
    bodies = {m: auto_body(args, n, m) for m in methods}
    if LOCAL in methods and methods[-1] == LOCAL and len(methods) > 1:
        # the request right after a local prefill is slower (scd-int8 at 100 Mbit, load average 4.7:
        # median 94 ms right after local vs 68 ms right after another scd-int8, 8 rounds; not after
        # 150 ms of idle alone): one uncounted request takes that slot, so no counted one follows local
        bodies[SETTLE] = auto_body(args, n, methods[-2])
    got = client.ask({"cmd": "rounds", "url": worker, "bodies": bodies, "rounds": args.reps + 1},
                     args.point_timeout)["samples"]
    return [{"method": m, "prompt_tokens": n, "mode": "warm", "samples": got[m][1:], "uncounted": got[m][:1]}
            for m in methods]


def prediction_error_histogram(metrics_text: str) -> dict:
    """The worker's scd_auto_prediction_error_ratio over all methods: count, and the share of
    predictions within each bucket bound (the share within 0.25 is exact: 0.25 is a bound)."""
    buckets: dict[float, float] = {}
    count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("scd_auto_prediction_error_ratio_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            if le != "+Inf":
                buckets[float(le)] = buckets.get(float(le), 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("scd_auto_prediction_error_ratio_count"):
            count += float(line.rsplit(" ", 1)[1])
    return {"count": int(count), "share_within": {f"{b:g}": (v / count if count else None)
                                                  for b, v in sorted(buckets.items())}}


def run_rate_change(args) -> dict:
    """The worker alone: per rate of args.rate_change, args.phase_requests `auto` requests on one
    warm prompt, then each allowed fixed method (args.reps, after an uncounted one) as the yardstick."""
    logs = log_dir(args)
    allowed = allowed_methods(args)
    ref = args.ref_tokens
    link = open_link(force_fallback=args.no_netns)
    server = worker_proc = client = None
    sequence, phases = [], []
    try:
        server, address = start_prefill(args, link, logs)
        worker_proc, worker = start_worker(args, link, address, logs)
        client = start_client(link, logs, args.start_timeout)
        client.ask({"cmd": "ready", "url": worker, "timeout_s": args.start_timeout}, args.start_timeout + 10)
        for phase, rate in enumerate(parse_bandwidth(r) for r in args.rate_change):
            link.set_rate(rate)
            got = client.ask({"cmd": "requests", "url": worker, "body": auto_body(args, ref),
                              "count": args.phase_requests}, args.point_timeout)["samples"]
            for s in got:
                sequence.append({"index": len(sequence), "phase": phase, "bandwidth": fmt_bandwidth(rate), **s})
            fixed = {}
            for m in allowed["methods"]:
                xs = client.ask({"cmd": "requests", "url": worker, "body": auto_body(args, ref, m),
                                 "count": args.reps + 1}, args.point_timeout)["samples"][1:]
                fixed[m] = _median([x["ttft_s"] for x in xs])
            phases.append(judge_phase(phase, fmt_bandwidth(rate), got, fixed))
            print(f"  {fmt_bandwidth(rate)}: {len(got)} auto requests, best fixed {phases[-1]['best']}",
                  file=sys.stderr)
        histogram = prediction_error_histogram(client.ask({"cmd": "metrics", "url": worker}, 60)["text"])
    finally:
        if client:
            client.close()
        procs.stop(worker_proc)
        procs.stop(server)
        link.down()
    from scd_serve.bench.report import machine, prediction_errors

    return {"benchmark": "ttft-rate-change", "machine": machine(), "link": link.describe(), "prompt_tokens": ref,
            "allowed": allowed, "phase_requests": args.phase_requests, "reps": args.reps, "phases": phases,
            "sequence": sequence, "prediction_error": prediction_errors(sequence),
            "server_prediction_error": histogram,
            "models": {"producer": args.producer, "consumer": args.consumer, "codebook": args.codebook}}


def judge_phase(phase: int, bandwidth: str, samples: list[dict], fixed: dict[str, float]) -> dict:
    """Which methods were good enough at this rate (within WITHIN of the best fixed one), and
    after how many requests `auto` first picked one of them."""
    best = min(fixed, key=fixed.get)
    good = sorted(m for m, t in fixed.items() if t <= WITHIN * fixed[best])
    first = next((i + 1 for i, s in enumerate(samples) if s["method"] in good), None)
    after = samples[first - 1:] if first else []
    return {"phase": phase, "bandwidth": bandwidth, "fixed_ttft_s": fixed, "best": best, "good_enough": good,
            "auto_methods": [s["method"] for s in samples], "first_good_request": first,
            "share_good_from_then": (sum(s["method"] in good for s in after) / len(after)) if after else None,
            "auto_median_ttft_s": _median([s["ttft_s"] for s in samples[len(samples) // 2:]])}


def _median(xs: list[float]) -> float:
    if not xs:
        raise TransferFailed("no oracle samples at the reference prompt length")
    return median(xs)
