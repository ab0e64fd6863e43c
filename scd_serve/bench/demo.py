"""`scd-serve demo`: what SCD buys, in one command.

Starts a cluster of the context pair (gateway, prefill and decode worker: real processes, as
`scd-serve up --pair context` does) with the prefill worker behind a shaped link: its own
network namespace and `tc tbf` on the veth it talks through (netns.HostLink), or, where
namespaces cannot be made, the userspace token-bucket proxy (said on screen). Then a handful
of held-out prompts go through each method over the gateway's OpenAI API, one method after
another per prompt, and one table shows for each: the answer (right or not, the expected one
and the oracle's beside it), the client's time to first token, the bytes the transfer put on
the wire and the decode worker's time to rebuild them, all as the responses report them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from pathlib import Path

import httpx

from scd_serve.bench import procs
from scd_serve.bench.demo_table import render, summarize, write_png
from scd_serve.bench.loadgen import stream_completion
from scd_serve.bench.netns import HostLink
from scd_serve.bench.ttft import open_link
from scd_serve.config.control import SECRET_ENV
from scd_serve.errors import ConfigError, DeadlineExceeded, Unavailable
from scd_serve.planner.units import fmt_bandwidth, parse_bandwidth
from scd_serve.quality.metrics import exact_match

METHODS = ("local", "raw", "scd", "scd-int8", "auto")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", default="100mbit", help="the link's rate, e.g. 10mbit, 1gbit (tc's units)")
    p.add_argument("--prompts", type=int, default=6, help="held-out prompts to send (the file's first ones)")
    p.add_argument("--methods", nargs="+", default=list(METHODS),
                   help="in the order each prompt goes through them; `local` is the oracle (the consumer's "
                        "own prefill); `auto` last, so it may find the prompt's codes cached")
    p.add_argument("--pair-dir", default="models/context-pair",
                   help="producer/, consumer/, codebook/ and eval/heldout.jsonl of the pair")
    p.add_argument("--out", default="out/demo", help="demo.json, demo.png and the workers' logs go here")
    p.add_argument("--no-netns", action="store_true", help="shape with the userspace proxy, not a namespace")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds the cluster may take to start")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")


def load_prompts(path: Path, n: int) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"{path}: no held-out prompts there; pass --pair-dir DIR (DIR/eval/heldout.jsonl)")
    rows = []
    with path.open() as f:
        for line in f:
            if line.strip() and len(rows) < n:
                row = json.loads(line)
                rows.append({"id": row["id"], "prompt": row["prompt"], "answer": row["answer"]})
    return rows


class Cluster:
    """gateway + prefill (behind the link) + decode, each `python -m scd_serve.cli ROLE`, logs in `logs`."""

    def __init__(self, pair: Path, link, logs: Path):
        self.procs: list = []
        self.logs = logs
        env = {SECRET_ENV: secrets.token_hex(32), "SCD_WORKER_TOKEN": secrets.token_hex(32)}
        cli = [sys.executable, "-m", "scd_serve.cli"]
        gw_port, control_port, decode_port, prefill_port = (procs.free_port() for _ in range(4))
        control = f"tcp://127.0.0.1:{control_port}"
        self.url, self.decode_url = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{decode_port}"
        book = ["--codebook", str(pair / "codebook")]
        self._spawn("gateway", [*cli, "gateway", "--port", str(gw_port), "--control-bind", control], env, logs)
        self._spawn("prefill", [*link.exec_prefix("producer"), *cli, "prefill", "--model", str(pair / "producer"),
                                *book, "--host", link.producer_bind(), "--port", str(prefill_port)], env, logs)
        # every method meets each prompt afresh: no prefix cache holds it from the method before
        self._spawn("decode", [*cli, "decode", "--model", str(pair / "consumer"), *book, "--port", str(decode_port),
                               "--prefill", link.producer_addr(prefill_port), "--control-url", control,
                               "--no-enable-prefix-caching"], env, logs)

    def _spawn(self, name: str, cmd: list[str], env: dict, logs: Path) -> None:
        proc = procs.spawn(cmd, logs / f"{name}.log", env)
        proc.name = name
        self.procs.append(proc)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the decode worker has its prefill peer (not serving on its local fallback) and the
        gateway routes to it."""
        deadline, logs = time.monotonic() + timeout_s, self.logs
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise Unavailable(f"the {p.name} worker exited with code {p.returncode} while starting"
                                      f"{procs.log_tail(logs / f'{p.name}.log', 600)}")
            if _ready(f"{self.decode_url}/ready", lambda body: "prefill" not in body) and _ready(f"{self.url}/ready"):
                return
            time.sleep(0.3)
        raise DeadlineExceeded(f"the cluster did not start within --start-timeout (logs in {logs})")

    def stop(self) -> None:
        for p in sorted(self.procs, key=lambda p: ("gateway", "decode", "prefill").index(p.name)):  # front first
            procs.stop(p)


def _ready(url: str, ok=lambda body: True) -> bool:
    try:
        r = httpx.get(url, timeout=2.0)
        return r.status_code == 200 and ok(r.json())
    except (httpx.HTTPError, ValueError):
        return False


async def ask(client: httpx.AsyncClient, url: str, p: dict, method: str, max_tokens: int, timeout_s: float) -> dict:
    """One streamed request -> what the table shows of it, as the response said it."""
    meta: dict = {}
    body = {"prompt": p["prompt"], "max_tokens": max_tokens, "temperature": 0.0, "scd_method": method}
    res = await stream_completion(client, url, body, timeout_s, meta)
    if res.error:
        raise Unavailable(f"{p['id']} with {method}: {res.error}")
    scd, text = meta.get("scd") or {}, meta.get("text", "")
    moved = scd.get("transfer") or {}
    return {"method": method, "text": text, "right": bool(exact_match(text, p["answer"])), "ttft_s": res.ttft,
            "served": scd.get("method"), "reason": scd.get("reason"), "detail": scd.get("detail", ""),
            "header": meta.get("headers", {}).get("x-scd-method"), "wire_bytes": moved.get("payload_bytes", 0),
            "raw_kv_bytes": moved.get("raw_kv_bytes"), "rebuild_ms": moved.get("rebuild_ms"),
            "cache_hit": bool(moved.get("cache_hit"))}


async def ask_all(url: str, prompts: list[dict], methods: list[str], timeout_s: float) -> list[dict]:
    """Every prompt through every method, one request at a time; -> one row per request. The first
    prompt warms each method up (first-call costs) and is not counted."""
    rows = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        for i, p in enumerate(prompts, start=-1):
            answer = await client.post(f"{url}/tokenize", json={"prompt": p["answer"], "add_special_tokens": False})
            answer.raise_for_status()
            p["prompt_tokens"] = (await client.post(f"{url}/tokenize", json={"prompt": p["prompt"]})).json()["count"]
            for method in methods:  # as many tokens as the expected answer (what eval's exact match reads)
                row = await ask(client, url, p, method, answer.json()["count"], timeout_s)
                if i >= 0:
                    rows.append({"prompt": i, **row})
            print(f"  {f'prompt {i + 1} of {len(prompts) - 1}' if i >= 0 else 'warm-up'} ({p['prompt_tokens']} "
                  f"tokens) done", file=sys.stderr, flush=True)
    return rows


def run(args) -> int:
    t0 = time.monotonic()
    pair, out = Path(args.pair_dir), Path(args.out)
    for side in ("producer", "consumer", "codebook"):
        if not (pair / side).is_dir():
            raise ConfigError(f"{pair / side}: missing; the demo needs the context pair (models/context-pair) "
                              f"or --pair-dir DIR with producer/, consumer/ and codebook/")
    if args.prompts < 1:
        raise ConfigError(f"--prompts must be >= 1, got {args.prompts}")
    prompts = load_prompts(pair / "eval" / "heldout.jsonl", args.prompts + 1)
    if len(prompts) < 2:
        raise ConfigError(f"{pair / 'eval' / 'heldout.jsonl'} holds fewer than 2 prompts")
    prompts = prompts[-1:] + prompts[:-1]  # the warm-up first: the one after those shown
    rate = parse_bandwidth(args.rate)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    link = open_link(args.no_netns, HostLink, warn=False)  # only the producer in a namespace
    why_not = getattr(link, "reason", None)
    cluster = None
    try:
        link.set_rate(rate)
        measured = link.measure_throughput(max(1 << 20, min(8 << 20, int(rate * 0.3))))
        shaping = (f"tc tbf on a veth, the prefill worker in its own network namespace"
                   + (f" (TCP measured {fmt_bandwidth(measured)})" if measured else "")) if why_not is None else \
            f"EMULATED by a userspace token-bucket proxy in this process ({why_not}), not the kernel's shaping"
        print(f"scd-serve demo: starting the cluster of {pair} behind a {fmt_bandwidth(rate)} link ...",
              file=sys.stderr, flush=True)
        cluster = Cluster(pair, link, logs)
        cluster.wait_ready(args.start_timeout)
        t_up = time.monotonic()
        rows = asyncio.run(ask_all(cluster.url, prompts, args.methods, args.request_timeout))
        prompts = prompts[1:]
    finally:
        if cluster is not None:
            cluster.stop()
        link.down()
    doc = {"pair": str(pair), "rate_bytes_per_s": rate, "rate": fmt_bandwidth(rate), "link": link.describe(),
           "shaping": shaping, "measured_bytes_per_s": measured, "prompts": prompts, "methods": args.methods,
           "rows": rows, "summary": summarize(rows, args.methods, len(prompts)),
           "start_s": t_up - t0}
    for p in doc["prompts"]:
        p.pop("prompt")  # the table needs ids, lengths and answers; the file has the text
    png = write_png(doc, out / "demo.png")
    doc["wall_s"] = time.monotonic() - t0
    (out / "demo.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(render(doc, png), flush=True)
    return 0

