"""A bounded soak of one in-process prefill + decode pair, and the stack it runs against.

`LocalStack` wires the real pieces in one event loop (a PrefillServicer on 127.0.0.1:0, the
decode side, an Engine, the app through an in-process ASGI client or uvicorn for real
streaming and disconnects); fault wrappers are passed in. `leaks()` names whatever is still
held (KV blocks, transfers, unfinished sequences); an empty dict is the clean state. The soak
itself: `python -m scd_serve.testing.soak --minutes 10` (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable

import httpx

from scd_serve.extras import extra

DEFAULT_ENGINE = dict(num_blocks=128, block_size=8, max_model_len=256, max_num_seqs=16, max_concurrent=32,
                      request_timeout_s=30.0, queue_timeout_s=10.0, stall_timeout_s=2.0)
DEFAULT_API = dict(max_model_len=256, max_tokens_cap=64, request_timeout_s=30.0)


class LocalStack:
    def __init__(self, rt: Any, *, methods=("identity",), api: dict | None = None, engine: dict | None = None,
                 prefill: dict | None = None, decode: dict | None = None, transport: Any = None,
                 producer_wrap: Callable | None = None, servicer_wrap: Callable | None = None,
                 runtime_wrap: Callable | None = None, max_concurrent_rpcs: int | None = None,
                 health_loop: bool = True):
        from scd_serve.config.transport import TransportConfig

        self.rt = rt
        self.methods = tuple(methods)
        self.api_opts = DEFAULT_API | (api or {})
        self.engine_opts = DEFAULT_ENGINE | (engine or {})
        self.prefill_opts = prefill or {}
        self.decode_opts = decode or {}
        self.transport = transport or TransportConfig(rpc_timeout_s=2.0, prefill_timeout_s=10.0)
        self.producer_wrap, self.servicer_wrap, self.runtime_wrap = producer_wrap, servicer_wrap, runtime_wrap
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.health_loop = health_loop  # False: handshake once, no periodic checks (tests of other things)
        self.prefill = self.servicer = self.served = None
        self.prefill_port = 0
        self.http_server = None
        self.http_task: asyncio.Task | None = None

    # ---- prefill side ----------------------------------------------------------------------
    async def start_prefill(self, port: int = 0) -> str:
        from scd_serve import codec as codec_registry
        from scd_serve.config.prefill import PrefillConfig
        from scd_serve.prefill.worker import PrefillWorker

        config = PrefillConfig(model="unused", codebook="", port=port, transport=self.transport, **self.prefill_opts)
        producer = self.producer_wrap(self.rt) if self.producer_wrap else self.rt
        codecs = {m: codec_registry.build(m, producer=self.rt) for m in self.methods}
        self.prefill = PrefillWorker(producer, codecs, config, servicer_wrap=self.servicer_wrap,
                                     max_concurrent_rpcs=self.max_concurrent_rpcs)
        self.servicer, self.served = self.prefill.servicer, self.prefill.served
        address = await self.prefill.start()
        self.prefill_port = self.prefill.port
        return address

    async def stop_prefill(self) -> None:
        if self.prefill is not None:
            await self.prefill.stop()
            self.prefill = None

    # ---- decode side -----------------------------------------------------------------------
    async def start(self, prefill_addresses: tuple[str, ...] | None = None) -> LocalStack:
        with extra("bench", "LocalStack"):
            from asgi_lifespan import LifespanManager

        from scd_serve.config.api import ApiConfig
        from scd_serve.config.decode import DecodeConfig
        from scd_serve.config.engine import EngineConfig
        from scd_serve.decode.worker import DecodeWorker

        if prefill_addresses is None:
            prefill_addresses = (await self.start_prefill(),)
        engine_config = EngineConfig(**self.engine_opts)
        fallback = "local" if engine_config.fallback_to_local else "none"
        dconf = DecodeConfig(model="unused", codebook="", prefill=tuple(prefill_addresses), method=self.methods[0],
                             transport=self.transport, **({"fallback": fallback} | self.decode_opts))
        api = ApiConfig(**({"model_name": "tiny"} | self.api_opts))
        self.decode = await DecodeWorker(self.rt, dconf, engine_config, api,
                                         runtime_wrap=self.runtime_wrap).start(health_loop=self.health_loop)
        self.peers, self.fill, self.engine = self.decode.peers, self.decode.fill, self.decode.engine
        self.backend, self.app = self.decode.backend, self.decode.app
        self.lifespan = LifespanManager(self.app)
        await self.lifespan.__aenter__()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.lifespan.app, raise_app_exceptions=False),
                                        base_url="http://test", timeout=30.0)
        return self

    async def serve_http(self) -> str:
        """Also serve the app with uvicorn on 127.0.0.1:0 (same loop); returns its base URL."""
        import uvicorn

        from scd_serve.control.lifecycle import start_http

        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                timeout_keep_alive=self.api_opts.get("timeout_keep_alive_s", 5))
        self.http_server = uvicorn.Server(config)
        self.http_task, port = await start_http(self.http_server)
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.http_server is not None:
            self.http_server.should_exit = True
            await asyncio.wait_for(self.http_task, 5)
        await self.client.aclose()
        await self.lifespan.__aexit__(None, None, None)
        await self.decode.stop(grace_s=1.0)
        await self.stop_prefill()

    # ---- clean state -----------------------------------------------------------------------
    def leaks(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        bm = self.engine.block_manager
        if bm.num_free != bm.num_blocks:
            out["kv_blocks_in_use"] = bm.num_blocks - bm.num_free
        if self.fill.num_inflight:
            out["decode_transfers"] = self.fill.num_inflight
        if self.servicer is not None and self.servicer.transfers:
            out["prefill_transfers"] = sorted(self.servicer.transfers)
        if self.engine.scheduler.has_unfinished():
            out["scheduler_unfinished"] = self.engine.stats()
        if self.engine.stats()["num_requests"]:
            out["engine_requests"] = self.engine.stats()["num_requests"]
        return out

    async def wait_clean(self, timeout: float = 2.0) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while (left := self.leaks()) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return left


def completion(prompt: str, max_tokens: int = 8, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra


# ---- the soak driver -------------------------------------------------------------------------
async def _one(http: httpx.AsyncClient, kind: str, rng: random.Random, method: str) -> int | str:
    prompt = "soak " + "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(4, 40)))
    if kind == "invalid":
        bad = rng.choice([{"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"max_tokens": "ten"}])
        return (await http.post("/v1/completions", json=completion(prompt) | bad)).status_code
    body = completion(prompt, rng.randint(4, 24), stream=True, scd_method=method)
    if kind == "normal":
        async with http.stream("POST", "/v1/completions", json=body) as r:
            text = "".join([line async for line in r.aiter_lines()])
            return r.status_code if "[DONE]" in text and '"error"' not in text else "stream_error"
    # cancelled: the client walks away mid-stream; timed_out: its read timeout fires first
    timeout = httpx.Timeout(30.0, read=0.002) if kind == "timed_out" else None
    with suppress(httpx.TimeoutException):
        async with http.stream("POST", "/v1/completions", json=body, **({"timeout": timeout} if timeout else {})) as r:
            async for _ in r.aiter_lines():
                if kind == "cancelled":
                    break
    return kind


async def soak(stack: LocalStack, minutes: float, concurrency: int, max_requests: int, seed: int = 0) -> dict:
    with extra("bench", "the soak's memory samples"):
        import psutil
    base = await stack.serve_http()
    rng, proc = random.Random(seed), psutil.Process()
    kinds = ["normal"] * 60 + ["cancelled"] * 15 + ["invalid"] * 15 + ["timed_out"] * 10
    counts: dict[str, int] = {}
    rss: list[tuple[float, float]] = []
    rss_at: dict[int, float] = {}  # request count -> RSS MiB (at 200 and at the end)
    start, n, stop_at = time.monotonic(), 0, time.monotonic() + minutes * 60

    async def worker() -> None:
        nonlocal n
        async with httpx.AsyncClient(base_url=base, timeout=30.0) as http:
            while time.monotonic() < stop_at and n < max_requests:
                n += 1
                if n == 200:
                    rss_at[200] = proc.memory_info().rss / 2**20
                kind = rng.choice(kinds)
                method = rng.choice(stack.methods + ("local",))
                key = f"{kind}:{await _one(http, kind, rng, method)}"
                counts[key] = counts.get(key, 0) + 1

    async def sampler() -> None:
        while time.monotonic() < stop_at and n < max_requests:
            rss.append((time.monotonic() - start, proc.memory_info().rss / 2**20))
            await asyncio.sleep(1.0)

    await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    rss_at[n] = proc.memory_info().rss / 2**20
    leaks = await stack.wait_clean(2.0)
    unexpected_5xx = sum(v for k, v in counts.items() if k.split(":")[1].startswith("5") or k.endswith("stream_error"))
    return {"requests": n, "seconds": round(time.monotonic() - start, 1), "counts": counts, "leaks": leaks,
            "unexpected_5xx": unexpected_5xx, "rss_at_request_mb": {k: round(v, 1) for k, v in rss_at.items()},
            "rss_mb": [(round(t, 1), round(m, 1)) for t, m in rss]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-requests", type=int, default=10**9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write the JSON report here too")


def rss_growth(rss: list, t0: float, t1: float) -> float | None:
    """Relative RSS growth between the first samples at or after t0 and t1 seconds."""
    a = next((m for t, m in rss if t >= t0), None)
    b = next((m for t, m in reversed(rss) if t <= t1), None)
    return None if a is None or b is None else (b - a) / a


async def _main(args) -> dict:
    from scd_serve.model.runtime import ModelRuntime
    from scd_serve.model.tiny import save_tiny_model

    with tempfile.TemporaryDirectory() as d:
        save_tiny_model(d, "llama", seed=0)
        stack = await LocalStack(ModelRuntime.load(d)).start()  # production health period (1 s)
        try:
            report = await soak(stack, args.minutes, args.concurrency, args.max_requests, args.seed)
        finally:
            await stack.stop()
    secs = args.minutes * 60
    report["rss_growth_min2_to_end"] = rss_growth(report["rss_mb"], min(120.0, secs * 0.2), secs)
    return report


def run(args) -> int:
    report = asyncio.run(_main(args))
    if args.out:
        Path(args.out).write_text(json.dumps(report))
    print(json.dumps({k: v for k, v in report.items() if k != "rss_mb"}, indent=1))
    return 0 if not report["leaks"] and report["unexpected_5xx"] == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m scd_serve.testing.soak", description=__doc__.splitlines()[0])
    add_arguments(parser)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(run(parser.parse_args()))
