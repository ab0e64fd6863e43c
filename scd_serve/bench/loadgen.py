"""Load over the OpenAI completions API with streaming: open-loop Poisson and fixed concurrency.

Open loop: arrival times are drawn up front and each request is sent at its time whether or
not earlier ones finished, so a slow server builds a queue instead of slowing the client
(the coordinated-omission trap). Every token event is timestamped on arrival.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

import httpx

from scd_serve.bench.stats import RequestResult


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, timeout_s: float,
                            meta: dict | None = None) -> RequestResult:
    """POST `body` (stream=True) to `url`/v1/completions and time every streamed token. `meta`,
    when given, receives the response's x-scd-* headers, its `scd` field (the method that served)
    and the text of its choices."""
    res = RequestResult(sent=time.perf_counter())
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
                if meta is not None:
                    meta["headers"] = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-scd-")}
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
                        res.error = str(event["error"].get("code") or event["error"].get("type") or event["error"])
                        return res
                    now = time.perf_counter()
                    if meta is not None:
                        _note(meta, event)
                    usage = event.get("usage") or {}
                    if usage.get("completion_tokens") is not None:
                        res.reported_tokens = int(usage["completion_tokens"])
                    n = _tokens_in(event)
                    if n:
                        res.first_token = res.first_token or now
                        res.token_times.extend([now] * n)
                        res.num_tokens += n
        res.done = time.perf_counter()
        if res.first_token is None and res.reported_tokens:
            # every token's text was held back to the end (bytes of a character not yet whole,
            # as random weights produce): the client saw its first token with the last event
            res.first_token = res.done
    except TimeoutError:
        res.error = f"client deadline of {timeout_s:.0f}s exceeded"
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


def _note(meta: dict, event: dict) -> None:
    """What a stream's event adds to `meta`: the `scd` field, the text, the token ids (from
    logprobs with return_tokens_as_token_ids) and the usage."""
    meta["scd"] = event.get("scd", meta.get("scd"))
    for c in event.get("choices") or []:
        meta["text"] = meta.get("text", "") + (c.get("text") or "")
        tokens = (c.get("logprobs") or {}).get("tokens") or []
        meta.setdefault("token_ids", []).extend(int(t.split(":", 1)[1]) for t in tokens if t.startswith("token_id:"))
    if event.get("usage"):
        meta["usage"] = event["usage"]


def random_prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    """n seeded token ids in 3..min(vocab, 30000): the same prompt for the same seed everywhere."""
    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab_size, 30000)) for _ in range(n)]


def _tokens_in(event: dict) -> int:
    """Tokens carried by one SSE event: one per choice with text, except a bare finishing event."""
    return sum(1 for c in event.get("choices") or []
               if c.get("text") or (c.get("text") is not None and c.get("finish_reason") is None))


def poisson_arrivals(rate: float, num: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(num)))


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


# ---- `python -m scd_serve.bench.loadgen`: a client that runs where the decode worker is --------------
# (`bench ttft` starts it in the consumer's network namespace and asks it JSON lines on stdin)

async def timed_requests(client: httpx.AsyncClient, url: str, body: dict, count: int, timeout_s: float) -> list[dict]:
    """`count` streamed requests one after another; -> per request: TTFT, the method that served
    and why, and the server's predicted TTFT."""
    out = []
    for i in range(count):
        meta: dict = {}
        res = await stream_completion(client, url, body, timeout_s, meta)
        if not res.ok:
            raise RuntimeError(f"request {i}: {res.error or 'no token'}")
        scd = meta.get("scd") or {}
        predicted = scd.get("predicted_ttft_ms")
        out.append({"ttft_s": res.ttft, "method": scd.get("method"), "reason": scd.get("reason"),
                    "detail": scd.get("detail", ""), "predicted_s": None if predicted is None else predicted / 1e3,
                    "header_method": meta.get("headers", {}).get("x-scd-method")})
    return out


async def chat(client: httpx.AsyncClient, urls: list[str], system: list[int], turns: list[list[int]], body: dict,
               timeout_s: float) -> list[dict]:
    """One conversation: turn k sends the system prompt, every earlier message and answer, and
    message k, as token ids (what a chat client resends each turn), to urls[k] (one worker for a
    chat; experts taking turns for an agent chain, each reading the others' answers). -> per turn:
    TTFT, prompt tokens, those the prefix cache held, the bytes its transfer carried, the method
    that served, and the answer's token ids."""
    history, out = list(system), []
    for k, (url, message) in enumerate(zip(urls, turns, strict=True)):
        prompt, meta = history + message, {}
        before = await transfer_bytes(client, url)
        res = await stream_completion(client, url, {**body, "prompt": prompt, "logprobs": 0,
                                                    "return_tokens_as_token_ids": True,
                                                    "stream_options": {"include_usage": True}}, timeout_s, meta)
        if not res.ok:
            raise RuntimeError(f"turn {k}: {res.error or 'no token'}")
        usage, scd = meta.get("usage") or {}, meta.get("scd") or {}
        out.append({"turn": k, "ttft_s": res.ttft, "prompt_tokens": len(prompt),
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    "payload_bytes": await transfer_bytes(client, url) - before, "method": scd.get("method"),
                    "answer": meta.get("token_ids", [])})
        history = prompt + meta.get("token_ids", [])
    return out


async def transfer_bytes(client: httpx.AsyncClient, url: str) -> float:
    """The decode worker's scd_transfer_bytes_total, all methods: the code bytes its fills received."""
    r = await client.get(f"{url}/metrics", timeout=30.0)
    r.raise_for_status()
    return sum(float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
               if line.startswith("scd_transfer_bytes_total{"))


async def _answer(client: httpx.AsyncClient, cmd: dict) -> dict:
    url, timeout = cmd["url"], float(cmd.get("timeout_s", 120.0))
    if cmd["cmd"] == "ready":
        await wait_ready(client, url, timeout)
        return {"ready": True}
    if cmd["cmd"] == "metrics":
        r = await client.get(f"{url}/metrics", timeout=timeout)
        r.raise_for_status()
        return {"text": r.text}
    if cmd["cmd"] == "requests":
        return {"samples": await timed_requests(client, url, cmd["body"], int(cmd["count"]), timeout)}
    if cmd["cmd"] == "chat":
        urls = cmd.get("urls") or [url] * len(cmd["turns"])
        return {"turns": await chat(client, urls, cmd["system"], cmd["turns"], cmd["body"], timeout)}
    if cmd["cmd"] == "rounds":  # one request per body in turn, `rounds` times: a load swing hits them alike
        samples: dict[str, list] = {name: [] for name in cmd["bodies"]}
        for _ in range(int(cmd["rounds"])):
            for name, body in cmd["bodies"].items():
                samples[name] += await timed_requests(client, url, body, 1, timeout)
        return {"samples": samples}
    raise ValueError(f"unknown command {cmd['cmd']!r}")


async def wait_ready(client: httpx.AsyncClient, url: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with suppress(httpx.HTTPError):  # not listening yet
            if (await client.get(f"{url}/ready", timeout=2.0)).status_code == 200:
                return
        await asyncio.sleep(0.3)
    raise RuntimeError(f"decode worker at {url} not ready within {deadline_s:.0f}s")


async def answer_commands(hello: dict, answer: Callable[[dict], Awaitable[dict]]) -> None:
    """Print `hello`, then answer each JSON command on stdin with one JSON line on stdout,
    until EOF or {"cmd": "quit"}. A failed command is answered {"error": ...}."""
    import sys

    loop = asyncio.get_running_loop()
    print(json.dumps(hello), flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            reply = await answer(cmd)
        except Exception as exc:  # reported to the driver, which decides what to do
            reply = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(json.dumps(reply), flush=True)


async def _serve_commands() -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        await answer_commands({"ready": True}, lambda cmd: _answer(client, cmd))


if __name__ == "__main__":
    asyncio.run(_serve_commands())
