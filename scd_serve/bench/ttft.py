"""`scd-serve bench ttft`: TTFT per method through the real gRPC path over a shaped link.

A prefill worker (`scd-serve prefill`) runs in the producer namespace and the probe
(probe.py, the decode side) in the consumer namespace; the veth between them carries a
`tc tbf` token bucket set to each bandwidth of the sweep in turn. Without namespaces the
same processes talk through the userspace token-bucket proxy, labelled as such.

The default sweep is chosen from measurements on this machine: the oracle's TTFT at the
reference prompt length and the raw-KV payload give the bandwidth at which raw transfer
takes a given share of the oracle's time; the sweep spans shares from negligible to
dominant (RAW_SHARES).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from scd_serve.bench import procs
from scd_serve.bench.link import open_link
from scd_serve.bench.report import summarize_rows
from scd_serve.bench.units import fmt_bandwidth, parse_bandwidth
from scd_serve.errors import ConfigError, DeadlineExceeded, TransferFailed

RAW_SHARES = (0.05, 0.25, 0.5, 1.0, 2.0, 4.0)  # raw wire time / oracle TTFT at the reference length
CEILING_SHARE = 0.6  # a tbf rate above this share of the unshaped throughput is not what limits the wire
TRANSFER_METHODS = ("raw", "quant4", "quant2", "droidspeak", "reuse", "scd", "scd-int8")


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
                raise TransferFailed(f"probe exited with {self.proc.returncode}{procs._tail(self.log)}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.strip().startswith("{"):
                    return json.loads(line)
        raise DeadlineExceeded(f"probe gave no answer within {deadline_s:.0f}s{procs._tail(self.log)}")

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(5)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        procs.stop(self.proc)


def raw_payload_bytes(consumer_dir: str, tokens: int) -> float:
    """16-bit K and V of every layer for T-1 tokens: what `raw` ships."""
    from scd_serve.bench.shapes import load_shape

    s = load_shape(consumer_dir)
    return s.num_layers * (tokens - 1) * 2 * s.kv_width * 2


def choose_sweep(oracle_s: float, raw_bytes: float, shares=RAW_SHARES) -> list[float]:
    """Bandwidths (bytes/s) at which raw transfer takes each share of the oracle's TTFT."""
    return sorted((raw_bytes / (share * oracle_s) for share in shares), reverse=True)


def start_worker(args, link, address: str, logs: Path) -> tuple[subprocess.Popen, str]:
    """The real `scd-serve decode` beside the probe, listening -> (process, URL); the probe
    then waits for /ready (peers handshaken)."""
    port = procs.free_port()
    cmd = [*link.exec_prefix("consumer"), sys.executable, "-m", "scd_serve.cli", "decode", "--model", args.consumer,
           "--codebook", args.codebook or "", "--host", "127.0.0.1", "--port", str(port), "--prefill", address,
           "--fallback", "none"]  # a failed transfer is an error here, never a silent local prefill
    proc = procs.spawn(cmd, logs / "decode.log")
    procs.wait_tcp("127.0.0.1", port, proc, args.start_timeout, link.exec_prefix("consumer"), logs / "decode.log")
    return proc, f"http://127.0.0.1:{port}"


def run_ttft(args) -> dict:
    out_dir = Path(args.json).resolve().parent
    logs = out_dir / "bench-ttft-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for d in (args.producer, args.consumer):
        if not (Path(d) / "config.json").exists():
            raise ConfigError(f"model directory {d} has no config.json; run `scd-serve make-demo-pair` or pass "
                              f"--producer/--consumer", field="model")
    methods = [m for m in args.methods if m != "oracle"]
    link = open_link(force_fallback=args.no_netns)
    server = probe = worker_proc = None
    try:
        port = procs.free_port()
        server_cmd = [*link.exec_prefix("producer"), sys.executable, "-m", "scd_serve.bench.prefill_worker",
                      "--chunk-bytes", str(args.resend_chunk_bytes), "--model", args.producer, "--host", link.producer_bind(), "--port", str(port),
                      "--codebook", args.codebook or ""]
        server = procs.spawn(server_cmd, logs / "prefill.log")
        procs.wait_tcp(link.producer_bind(), port, server, args.start_timeout, link.exec_prefix("producer"),
                       logs / "prefill.log")
        address = link.producer_addr(port)
        probe_cmd = [*link.exec_prefix("consumer"), sys.executable, "-m", "scd_serve.bench.probe",
                     "--consumer", args.consumer]
        if args.codebook:
            probe_cmd += ["--codebook", args.codebook]
        probe = ProbeProcess(probe_cmd, logs / "probe.log", args.start_timeout)
        base = {"prefill": address, "reps": args.reps, "seed": args.seed}
        # unshaped calibration: the oracle (local prefill) and the producer's prefill alone (identity, cold)
        link.set_rate(None)
        calib = probe.ask({**base, "prompt_tokens": args.prompt_tokens, "methods": ["oracle", "identity"],
                           "modes": ["cold"]}, args.point_timeout)["rows"]
        ref = args.ref_tokens if args.ref_tokens in args.prompt_tokens else max(args.prompt_tokens)
        oracle_ref = _median([s["ttft_s"] for r in calib if r["method"] == "oracle" and r["prompt_tokens"] == ref
                              for s in r["samples"]])
        ceiling = link.measure_throughput(32 << 20)  # unshaped: what the veth + CPU carry at most
        notes = []
        if args.bandwidths:
            sweep = [parse_bandwidth(b) for b in args.bandwidths]
        else:
            sweep = choose_sweep(oracle_ref, raw_payload_bytes(args.consumer, ref))
        if ceiling and any(bw > CEILING_SHARE * ceiling for bw in sweep):
            notes.append(f"rates above {CEILING_SHARE:.0%} of the unshaped link ({fmt_bandwidth(ceiling)}) are "
                         f"CPU-bound, not shaped: " + ", ".join(fmt_bandwidth(b) for b in sweep if b > CEILING_SHARE * ceiling)
                         + (" (replaced by one point at that share)" if not args.bandwidths else " (kept: given explicitly)"))
            if not args.bandwidths:
                sweep = [CEILING_SHARE * ceiling] + [b for b in sweep if b <= CEILING_SHARE * ceiling]
        for note in notes:
            print(f"bench ttft: {note}", file=sys.stderr)
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
        if args.worker:  # after the probe's points, so that an idle worker never shares the CPU with them
            worker_proc, worker = start_worker(args, link, address, logs)
            for point in points:
                link.set_rate(point["bandwidth_bytes_per_s"])
                point["worker_rows"] = probe.ask({**base, "worker": worker, "prompt_tokens": [ref],
                                                  "methods": [*methods, "local"], "ready_timeout_s": args.start_timeout},
                                                 args.point_timeout)["rows"]
                print(f"  {point['bandwidth']}: decode worker done", file=sys.stderr)
        link_info = {**link.describe(), "unshaped_tcp_bytes_per_s": ceiling, "notes": notes}
    finally:
        if probe:
            probe.close()
        procs.stop(worker_proc)
        procs.stop(server)
        link.down()
    return summarize_rows(calib, points, link_info, ref, args)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    if not xs:
        raise TransferFailed("no oracle samples at the reference prompt length")
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
