"""`scd-serve up`: start gateway, prefill and decode workers as separate processes.

The gateway starts first (it hosts the control-plane registry); workers listen on free
ports and join it, and the URL is printed once the gateway reports them ready. A crashed
worker is restarted; Ctrl-C (or SIGTERM) stops gateway, decode, prefill in that order, each
with SIGTERM and a grace period, then SIGKILL. Unless the environment has them, the cluster
gets a random cluster secret and worker token, passed in the children's environment (never
on a command line, which any local user can read).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from scd_serve.config.control import SECRET_ENV
from scd_serve.config.expert import parse_experts
from scd_serve.config.model import DTYPE_CHOICES
from scd_serve.control.preflight import check_port
from scd_serve.errors import ConfigError, ScdError, Unavailable

PAIRS = {"demo": "models/demo-pair", "context": "models/context-pair"}  # --pair NAME -> its directory
STOP_GRACE_S = 15.0
MAX_RESTARTS = 5  # per worker, over the life of the cluster
_stop = threading.Event()  # set by SIGINT/SIGTERM
CHILD_ERROR = re.compile(r"^scd-serve [a-z-]+: error: (.*)$")  # what cli.main prints before exit 2


def _check_stop() -> None:
    if _stop.is_set():
        raise KeyboardInterrupt


def _on_signal(*_) -> None:
    """SIGINT/SIGTERM: set _stop from another thread. The handler runs in the main thread, which
    may be inside _stop.wait() holding the event's lock: setting it here would wait for that
    lock forever (up then ignores every Ctrl-C)."""
    threading.Thread(target=_stop.set, name="up-stop", daemon=True).start()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port (0 = any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    parser.add_argument("--pair", default="demo", choices=list(PAIRS),
                        help="embedded pair whose producer/, consumer/ and codebook/ are the defaults of the "
                             "next three flags (demo: models/demo-pair; context: models/context-pair)")
    parser.add_argument("--producer", default=None, help="producer model (prefill workers; default: the pair's)")
    parser.add_argument("--consumer", default=None, help="consumer model (decode workers; default: the pair's)")
    parser.add_argument("--codebook", default=None,
                        help="SCD codebook directory (default: the pair's; none there: codebook-free methods)")
    parser.add_argument("--expert", dest="experts", action="append", default=[], metavar="NAME=DIR[:CODEBOOK]",
                        help="a further consumer of the same producer (a fine-tuned expert: a model or a LoRA adapter "
                             "directory), served under NAME by --decode-workers decode workers of its own and fed by "
                             "the same prefill workers (its codebook from `scd-serve calibrate`; none: codebook-free "
                             "methods); repeatable. The gateway routes each request by its `model`")
    parser.add_argument("--method", default=None, help="default transfer method (default: auto when a codebook loads, else raw)")
    parser.add_argument("--prefill-workers", type=int, default=1)
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="weights and KV dtype of every worker (auto: bfloat16 on CUDA, float32 on the CPU)")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="longest prompt + completion of the decode workers, longest prompt of the prefill "
                             "workers (0 = their defaults)")
    parser.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                        help="name(s) clients may put in `model` (default: the consumer directory's name)")
    parser.add_argument("--api-key", default="",
                        help="bearer token clients must send, to the gateway and the decode workers (passed to "
                             "them in $SCD_API_KEY, not on their command lines; default: $SCD_API_KEY)")
    parser.add_argument("--max-num-seqs", type=int, default=0,
                        help="sequences each decode worker decodes at once (0 = its default)")
    parser.add_argument("--chat-template", default="",
                        help="a Jinja chat template (a file, or the template itself) for the decode workers")
    parser.add_argument("--seed", type=int, default=None,
                        help="the decode workers' --seed: seeds of requests that send none, in arrival order")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0, help="how long to wait for workers")
    parser.add_argument("--insecure", action="store_true",
                        help="let the gateway listen beyond loopback without an API key ($SCD_API_KEY)")


class Child:
    """One worker process; its output (logs included) is echoed with a prefix and scanned for its
    URL line and for the one-line error it exits with (reported as up's own)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]):
        self.name, self.argv, self.env = name, argv, env
        self.lines: deque[str] = deque(maxlen=200)  # the startup lines wait_line reads; not the whole log
        self.error: str | None = None  # "scd-serve ROLE: error: ..." as the child printed it
        self.restarts = 0
        self.start()

    def start(self) -> None:
        self.error = None
        self.proc = subprocess.Popen([sys.executable, "-m", "scd_serve.cli", *self.argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True, env=self.env)
        self._reader = threading.Thread(target=self._echo, args=(self.proc,), daemon=True)
        self._reader.start()

    def _echo(self, proc) -> None:
        for line in proc.stdout:
            line = line.rstrip()
            if m := CHILD_ERROR.match(line):
                self.error = m.group(1)  # up says it once, as its own error
                continue
            self.lines.append(line)
            print(f"[{self.name}] {line}", flush=True)

    def exited(self) -> ScdError:
        """The error for a child gone while starting: its own one line when it printed one."""
        code = self.proc.returncode
        self._reader.join(2.0)  # the process is gone: the reader ends once it has its last lines
        if self.error is not None:  # exit 2: its configuration, which up's own exit 2 reports
            return (ConfigError if code == 2 else Unavailable)(f"{self.name}: {self.error}")
        return Unavailable(f"{self.name} exited with code {code} while starting (its log is above)")

    def wait_line(self, pattern: str, deadline: float) -> re.Match:
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                raise self.exited()
            _check_stop()
            time.sleep(0.05)
        raise Unavailable(f"{self.name} did not start in time")


def stop_all(tiers: list[list[Child]]) -> None:
    """SIGTERM tier by tier (each tier in parallel), SIGKILL what outlives the grace period."""
    for tier in tiers:
        for child in tier:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in tier:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.proc.pid, signal.SIGKILL)  # its own session: only its processes
                child.proc.wait(5)


def _get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


def wait_ready(base: str, num_decode: int, children: list[Child], deadline: float) -> None:
    while time.monotonic() < deadline:
        status, body = _get_json(f"{base}/ready")
        if status == 200 and body.get("decode_workers", 0) >= num_decode:
            return
        if dead := [c for c in children if c.proc.poll() is not None]:
            raise dead[0].exited()
        _check_stop()
        time.sleep(0.2)
    raise Unavailable(f"workers not ready within the timeout; last /ready status {status}")


def resolve_pair(args) -> None:
    """Fill --producer/--consumer/--codebook left unset from --pair's directory (a codebook that
    does not fit the models given: the worker's one-line error says so, and up exits 2)."""
    root = PAIRS[args.pair]
    for name in ("producer", "consumer", "codebook"):
        if getattr(args, name) is None:
            setattr(args, name, f"{root}/{name}")


def check_models(args) -> None:
    for flag, path in (("--producer", args.producer), ("--consumer", args.consumer)):
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{flag} {path}: no model there; build the embedded pair with "
                              f"`scd-serve make-demo-pair --recipe {args.pair}` or pass model directories")


def cluster_env(base: dict[str, str], api_key: str = "") -> dict[str, str]:
    """The children's environment: `base` plus a fresh cluster secret and worker token where unset,
    and the API key (every child reads $SCD_API_KEY; an argv is visible to every local user)."""
    env = dict(base) | ({"SCD_API_KEY": api_key} if api_key else {})
    for name in (SECRET_ENV, "SCD_WORKER_TOKEN"):
        if not env.get(name, "").strip():
            env[name] = secrets.token_hex(32)
    return env


def decode_flags(args, names: list[str]) -> list[str]:
    """The decode workers' own flags, from up's, serving `names` (the API key goes by the
    environment instead)."""
    flags = ["--method", args.method] if args.method else []
    if names:
        flags += ["--served-model-name", *names]
    for flag, value in (("--max-num-seqs", args.max_num_seqs or None), ("--chat-template", args.chat_template),
                        ("--seed", args.seed)):
        flags += [flag, str(value)] if value not in (None, "") else []
    return flags


def run(args) -> int:
    resolve_pair(args)
    check_models(args)
    check_port(args.host, args.port)
    if args.prefill_workers < 1 or args.decode_workers < 1:
        raise ConfigError("--prefill-workers and --decode-workers must be >= 1")
    experts = parse_experts(args.experts, set(args.served_model_name or [Path(args.consumer).name]))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    deadline = time.monotonic() + args.ready_timeout_s
    env = cluster_env(os.environ, args.api_key)
    insecure = ["--insecure"] if args.insecure else []
    gateway = Child("gateway", ["gateway", "--host", args.host, "--port", str(args.port),
                                "--control-bind", "tcp://127.0.0.1:0", *insecure], env)
    children, prefill, decode = [gateway], [], []
    try:
        m = gateway.wait_line(r"gateway serving (http://\S+), control plane (tcp://\S+)", deadline)
        url, control = m.group(1), m.group(2)
        common = ["--host", "127.0.0.1", "--port", "0", "--control-url", control, "--device", args.device,
                  "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
        books = [arg for _, _, book in experts if book for arg in ("--expert-codebook", book)]
        for i in range(args.prefill_workers):
            prefill.append(Child(f"prefill-{i}", ["prefill", "--model", args.producer, *common,
                                                  "--codebook", args.codebook, *books], env))
        for i in range(args.decode_workers):
            decode.append(Child(f"decode-{i}", ["decode", "--model", args.consumer, *common,
                                                "--codebook", args.codebook, *decode_flags(args, args.served_model_name)],
                                env))
        for name, model, book in experts:
            for i in range(args.decode_workers):
                decode.append(Child(f"decode-{name}-{i}", ["decode", "--model", model, *common, "--codebook", book,
                                                           *decode_flags(args, [name])], env))
        children += prefill + decode
        wait_ready(url, len(decode), children, deadline)
        print(f"scd-serve is up: {url}/v1 (OpenAI API; try `curl {url}/v1/models`). Ctrl-C stops it.", flush=True)
        while not _stop.is_set():
            if gateway.proc.poll() is not None:
                print(f"scd-serve up: the gateway exited with code {gateway.proc.returncode}; stopping",
                      file=sys.stderr)
                return 1
            for child in prefill + decode:  # a crashed worker is restarted, like a supervisor would
                if child.proc.poll() is not None:
                    if child.restarts >= MAX_RESTARTS:
                        print(f"scd-serve up: {child.name} keeps exiting; stopping", file=sys.stderr)
                        return 1
                    child.restarts += 1
                    why = f" ({child.error})" if child.error else ""
                    print(f"scd-serve up: {child.name} exited with code {child.proc.returncode}{why}; restarting "
                          f"({child.restarts}/{MAX_RESTARTS})", file=sys.stderr, flush=True)
                    child.start()
            _stop.wait(0.5)
        return 0
    finally:
        stop_all([[gateway], decode, prefill])  # front door first, producers last
