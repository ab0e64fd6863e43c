"""Load over the OpenAI completions API with streaming: open-loop Poisson and fixed concurrency.

Open loop: arrival times are drawn up front (exponential gaps at `rate` req/s) and each
request is sent at its time whether or not earlier ones finished, so a slow server builds
a queue instead of slowing the client down (the coordinated-omission trap).
Every token event of the SSE stream is timestamped on arrival.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Callable

import httpx

from scd_serve.bench.stats import RequestResult


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, timeout_s: float) -> RequestResult:
    """POST `body` (stream=True) to `url`/v1/completions and time every streamed token."""
    res = RequestResult(sent=time.perf_counter())
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:200]
                    res.error = f"HTTP {resp.status_code}: {text}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        res.error = str(event["error"].get("type") or event["error"])
                        return res
                    now = time.perf_counter()
                    usage = event.get("usage") or {}
                    if usage.get("completion_tokens") is not None:
                        res.reported_tokens = int(usage["completion_tokens"])
                    n = _tokens_in(event)
                    if n:
                        res.first_token = res.first_token or now
                        res.token_times.extend([now] * n)
                        res.num_tokens += n
        res.done = time.perf_counter()
    except TimeoutError:
        res.error = f"client deadline of {timeout_s:.0f}s exceeded"
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


def _tokens_in(event: dict) -> int:
    """Tokens carried by one SSE event: one per choice with text, except a bare finishing event."""
    n = 0
    for choice in event.get("choices") or []:
        if choice.get("text") or (choice.get("text") is not None and choice.get("finish_reason") is None):
            n += 1
    return n


def poisson_arrivals(rate: float, num: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def open_loop(url: str, rate: float, num_requests: int, make_body: Callable[[int], dict], *,
                    seed: int = 0, timeout_s: float = 120.0) -> tuple[list[RequestResult], float]:
    """Send `num_requests` at Poisson times; -> (results, wall seconds from first send to last finish)."""
    arrivals = poisson_arrivals(rate, num_requests, seed)
    limits = httpx.Limits(max_connections=num_requests + 4, max_keepalive_connections=num_requests + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(i: int, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await stream_completion(client, url, make_body(i), timeout_s)

        results = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    return list(results), time.perf_counter() - t0


async def closed_loop(url: str, concurrency: int, num_requests: int, make_body: Callable[[int], dict], *,
                      timeout_s: float = 120.0) -> tuple[list[RequestResult], float]:
    """Keep `concurrency` streams in flight until `num_requests` are done."""
    queue = list(range(num_requests))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                i = queue.pop()
                results.append(await stream_completion(client, url, make_body(i), timeout_s))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0
