"""The engine's own throughput under `scd-serve bench peer`'s stream load, in process: N
concurrent requests (256-token random prompts, 48 tokens out, greedy, logprobs 0, as the bench
sends them), the model loaded as a worker loads it, no HTTP. Each engine step timed by what it
held (prefill chunks beside decodes, or decodes alone). Set against `bench peer --targets scd`
it says what serving adds to the engine (issue 43):

    OMP_NUM_THREADS=2 .venv/bin/python scripts/engine_streams.py --model out/shaped/consumer --streams 8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from scd_serve.config.engine import EngineConfig
from scd_serve.engine.engine import Engine
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.model.threads import load_for_serving


async def stream(engine: Engine, vocab: int, tokens: int, max_tokens: int, seed: int) -> list[float]:
    """-> the time of each token since the request was sent"""
    rng = random.Random(seed)
    req = GenerationRequest(f"r{seed}", [rng.randrange(vocab) for _ in range(tokens)],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    start, times = time.perf_counter(), []
    async for _ in engine.generate(req):
        times.append(time.perf_counter() - start)
    return times


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="prompt tokens per engine step")
    p.add_argument("--prefill-attention", choices=("kernel", "torch"), default="kernel",
                   help="torch: prefill chunks attend through the torch path, the other CPU kernels kept")
    args = p.parse_args()
    if args.prefill_attention == "torch":
        from scd_serve.model import cpu_kernel

        cpu_kernel.prefill_ops = lambda device, dtype: None
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2: time per output token needs two tokens")
    rt = load_for_serving(args.model, "cpu", args.dtype)
    engine = Engine(rt, EngineConfig(max_model_len=args.prompt_tokens + args.max_tokens + 16, num_blocks=4096,
                                     max_num_seqs=max(32, args.streams), max_prefill_tokens=args.max_num_batched_tokens,
                                     prefix_caching=False))
    steps: list[tuple[float, bool]] = []  # (seconds, whether it held prompt tokens)
    run = engine.runner.run

    def timed(batch):
        start = time.perf_counter()
        out = run(batch)
        steps.append((time.perf_counter() - start, bool(batch.prefills)))
        return out

    engine.runner.run = timed
    engine.start()
    try:
        await stream(engine, rt.spec.vocab_size, 32, 4, 0)  # warm-up
        for rnd in range(args.rounds):
            steps.clear()
            start = time.perf_counter()
            runs = await asyncio.gather(*(stream(engine, rt.spec.vocab_size, args.prompt_tokens, args.max_tokens,
                                                 1000 * (rnd + 1) + i) for i in range(args.streams)))
            wall = time.perf_counter() - start
            tpot = statistics.median(statistics.median(b - a for a, b in zip(r, r[1:])) for r in runs)
            mixed = [s for s, p in steps if p]
            decode = [s for s, p in steps if not p]
            print(f"round {rnd}: {args.streams} streams, wall {wall:.2f} s, {args.streams * args.max_tokens / wall:.1f} "
                  f"tok/s, TPOT p50 {tpot * 1e3:.1f} ms; {len(mixed)} steps with prompt chunks {sum(mixed):.2f} s, "
                  f"{len(decode)} decode steps {sum(decode):.2f} s (median {statistics.median(decode) * 1e3:.1f} ms)",
                  flush=True)
    finally:
        await engine.stop(1.0)


if __name__ == "__main__":
    asyncio.run(main())
