"""Rounds of `scd-serve bench peer`'s stream load against a server already running, with the
client's own CPU time per round (issue 43: what a served load costs beyond the engine's, and how
a first round after start differs from the next ones, which `bench peer` runs once each):

    .venv/bin/python scripts/served_rounds.py http://127.0.0.1:PORT --streams 16 --rounds 4

The server serves its model as "m" (bench peer starts them so: `--served-model-name m`).

Each round sends N concurrent streaming completions (random token prompts, distinct per round,
greedy, ignore_eos, logprobs 0, as bench peer sends them) after one short warm-up request.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

import httpx

from scd_serve.bench.loadgen import stream_completion
from scd_serve.bench.peer import body


def cpu_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--vocab", type=int, default=151936, help="prompt token ids are drawn below this")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    if args.streams < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--streams, --rounds and --max-tokens must be >= 1")
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        await stream_completion(client, args.url, body(args.vocab, 32, 99, 4), args.timeout)
        for r in range(args.rounds):
            bodies = [body(args.vocab, args.prompt_tokens, 7919 * r + 1000 * args.streams + i, args.max_tokens)
                      for i in range(args.streams)]
            cpu, start = cpu_seconds(), time.perf_counter()
            results = await asyncio.gather(*(stream_completion(client, args.url, b, args.timeout) for b in bodies))
            wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            ok = sum(res.ok and res.tokens == args.max_tokens for res in results)
            print(f"round {r}: {args.streams} streams, {args.streams * args.max_tokens / wall:.1f} tok/s "
                  f"(wall {wall:.2f} s), client CPU {cpu:.2f} s, {ok} of {args.streams} complete", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
