"""Time to the first token of the engine itself, in process: the model loaded as a worker loads
it (model/threads.py), `Engine.generate` of one prompt at a time (its chunks, the first token
sampled from the prefill), no HTTP. Set against `scd-serve bench peer --targets scd` it says what
the serving path around the engine adds (issue 43):

    OMP_NUM_THREADS=2 .venv/bin/python scripts/engine_ttft.py --model out/shaped/consumer
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

from scd_serve.config.engine import EngineConfig
from scd_serve.engine.engine import Engine
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.model.threads import load_for_serving


async def first_tokens(engine: Engine, vocab: int, tokens: int, runs: int) -> list[float]:
    out = []
    for i in range(runs + 1):  # the first is a warm-up
        rng = random.Random(i)
        prompt = [rng.randrange(vocab) for _ in range(tokens)]
        start = time.perf_counter()
        async for _ in engine.generate(GenerationRequest(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=1))):
            break
        out.append(time.perf_counter() - start)
    return out[1:]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="prompt tokens per engine step")
    args = p.parse_args()
    rt = load_for_serving(args.model, "cpu", args.dtype)
    blocks = 2 * (-(-(args.tokens + 16) // 16))
    engine = Engine(rt, EngineConfig(max_model_len=args.tokens + 16, num_blocks=blocks, max_num_seqs=1,
                                     max_prefill_tokens=args.max_num_batched_tokens, prefix_caching=False))
    engine.start()
    try:
        times = await first_tokens(engine, rt.spec.vocab_size, args.tokens, args.runs)
    finally:
        await engine.stop(1.0)
    print(f"engine: {args.tokens} tokens, {args.dtype}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
          f"TTFT median {statistics.median(times):.3f} s of {[round(t, 3) for t in times]}")


if __name__ == "__main__":
    asyncio.run(main())
