"""`scd-serve bench structured`: decode throughput with half the streams grammar-constrained.

One `scd-serve decode` (local prefill, no transfer) and --streams closed-loop streaming clients.
Round `free`: every request unconstrained (ignore_eos, --max-tokens each). Round `half`: the
same, but every other stream sends `response_format` json_schema (LOAD: an array of objects
with enums, bounded strings and integers, longer than max_tokens, so both kinds run the same
lengths). Throughput is the tokens streamed within a --round-s window per second; free and
half rounds alternate twice. Before them, each of SCHEMAS is answered twice with room, and
the replies are parsed and checked against their schemas.
The default model is the context pair's consumer: a byte-level BPE vocabulary (the demo pair's
word-level one has no `{`, so it cannot write JSON; the server says so with a 400).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from contextlib import suppress
from pathlib import Path

import httpx

from scd_serve.bench import procs
from scd_serve.bench.loadgen import stream_completion
from scd_serve.bench.report import machine
from scd_serve.errors import TransferFailed
from scd_serve.extras import extra

NAME = {"type": "string", "maxLength": 16}  # bounded: the small model's strings and numbers run on otherwise
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                      "tags": {"type": "array", "items": NAME, "maxItems": 4}},
     "required": ["name", "age", "tags"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "failed", "pending"]},
                                      "items": {"type": "array", "maxItems": 4, "items": {
                                          "type": "object", "properties": {
                                              "id": {"type": "integer", "minimum": 0, "maximum": 999}, "label": NAME},
                                          "required": ["id", "label"]}}}, "required": ["status", "items"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"first": NAME, "last": NAME},
                                               "required": ["first", "last"]},
                                      "score": {"type": "integer", "minimum": 0, "maximum": 100},
                                      "admin": {"type": "boolean"}},
     "required": ["user", "score", "admin"]},
]


# The load's constrained rows: longer than any --max-tokens, so that they run max_tokens as the free
# rows do, and both kinds start new requests (prefills) equally often: only the grammar differs.
LOAD = {"type": "array", "minItems": 256, "items": SCHEMAS[1]["properties"]["items"]["items"]}


def body(i: int, schema: dict | None, args, max_tokens: int | None = None) -> dict:
    rng = random.Random(args.seed * 100003 + i)
    b = {"prompt": [rng.randrange(3, 8000) for _ in range(args.prompt_tokens)],
         "max_tokens": max_tokens or args.max_tokens, "temperature": 0.0}
    if schema is not None:
        return b | {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    return b | {"ignore_eos": True}


async def one_round(url: str, args, half: bool) -> dict:
    """--streams closed-loop clients for --round-s: tokens streamed within the window per second
    (a window, not "until the last reply": constrained replies end sooner, and a tail of free
    ones alone would be measured otherwise)."""
    counted = requests = errors = 0
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        t0 = time.perf_counter()
        end = t0 + args.round_s

        async def stream(s: int) -> None:
            nonlocal counted, requests, errors
            k = 0
            while time.perf_counter() < end:
                res = await stream_completion(client, url, body(s * 1000 + k, LOAD if half and s % 2 else None, args),
                                              args.request_timeout)
                k, requests, errors = k + 1, requests + 1, errors + (res.error is not None)
                counted += sum(1 for t in res.token_times if t <= end)

        await asyncio.gather(*(stream(s) for s in range(args.streams)))
    return {"tokens_in_window": counted, "window_s": args.round_s, "tokens_per_s": round(counted / args.round_s, 1),
            "requests": requests, "errors": errors}


async def check_replies(url: str, args) -> dict:
    """Each schema, twice, unstreamed, with room (512 tokens): does the reply parse and validate?"""
    with extra("bench", "bench structured's check of the constrained replies"):
        import jsonschema

    valid, finishes = 0, []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout)) as client:
        for i in range(2 * len(SCHEMAS)):
            b = body(10**6 + i, SCHEMAS[i % len(SCHEMAS)], args, max_tokens=512)
            out = (await client.post(f"{url}/v1/completions", json=b)).json()
            finishes.append(out["choices"][0]["finish_reason"])
            with suppress(ValueError, jsonschema.ValidationError):  # max_tokens ran out mid-JSON (finish_reason length)
                schema = b["response_format"]["json_schema"]["schema"]
                jsonschema.validate(json.loads(out["choices"][0]["text"]), schema)
                valid += 1
    return {"requests": len(finishes), "valid": valid, "finish_reasons": finishes}


def run_structured(args) -> dict:
    logs = Path(args.json).with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    port = procs.free_port()
    cmd = [sys.executable, "-m", "scd_serve.cli", "decode", "--model", args.consumer, "--host", "127.0.0.1",
           "--port", str(port), "--method", "local", "--codebook", "", "--max-num-seqs", str(args.streams),
           "--json-whitespace", str(args.json_whitespace),
           "--request-timeout-s", str(args.request_timeout), "--device", args.device, "--dtype", args.dtype]
    proc = procs.spawn(cmd, logs / "decode.log")
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_http(url + "/ready", proc, args.start_timeout, logs / "decode.log")
        checked = asyncio.run(check_replies(url, args))  # also the warm-up: every schema compiled once
        rounds = {}
        for name in ("free", "half", "free-again", "half-again"):
            rounds[name] = asyncio.run(one_round(url, args, half=name.startswith("half")))
            print(f"  {name}: {rounds[name]['tokens_per_s']} tokens/s", file=sys.stderr)
    finally:
        procs.stop(proc)
    if any(r["errors"] for r in rounds.values()):
        raise TransferFailed(f"requests failed: {json.dumps(rounds)}; see {logs}")
    free = (rounds["free"]["tokens_per_s"] + rounds["free-again"]["tokens_per_s"]) / 2  # interleaved: drift cancels
    half = (rounds["half"]["tokens_per_s"] + rounds["half-again"]["tokens_per_s"]) / 2
    return {"bench": "structured", "machine": machine(), "consumer": args.consumer, "streams": args.streams,
            "round_s": args.round_s, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
            "json_whitespace": args.json_whitespace, "rounds": rounds, "checked": checked,
            "free_tokens_per_s": round(free, 1), "half_tokens_per_s": round(half, 1),
            "half_over_free": round(half / free, 3)}
