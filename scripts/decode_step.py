"""One batched decode step of the engine's runtime, timed (and profiled by op with --profile):
B sequences of L cached random tokens, the model loaded and packed as a worker loads it (issue 43:
how much of a step the linears take, and what the rest is):

    .venv/bin/python scripts/decode_step.py --model out/shaped/consumer --batch 8 --cached 300 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scd_serve.model.runtime import ModelRuntime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cached", type=int, default=300, help="tokens each sequence holds before the step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=23, help="steps in all: 3 warm-up, 5 profiled (--profile), the rest timed")
    p.add_argument("--profile", action="store_true", help="then 5 steps under torch.profiler, by op")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rt = ModelRuntime.load(args.model, device="cpu", dtype=getattr(torch, args.dtype))
    rt.pack_linears()
    block_size, gen = 16, torch.Generator().manual_seed(0)
    per_seq = -(-(args.cached + args.steps + 16) // block_size)
    pool = rt.new_kv_pool(per_seq * args.batch, block_size)
    items = []
    with torch.no_grad():
        for b in range(args.batch):
            blocks = list(range(b * per_seq, (b + 1) * per_seq))
            rt.extend(pool, [(blocks, 0, torch.randint(0, rt.spec.vocab_size, (args.cached,), generator=gen))],
                      logits="none")
            items.append([blocks, args.cached, 5])

        def step() -> None:
            rt.decode_step(pool, [tuple(item) for item in items])
            for item in items:
                item[1] += 1

        for _ in range(3):
            step()
        times = []
        for _ in range(args.steps - 3 - (5 if args.profile else 0)):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        print(f"batch {args.batch}, {args.cached}+ cached, {args.threads} threads, {args.dtype}: step median "
              f"{1e3 * statistics.median(times):.1f} ms (min {1e3 * min(times):.1f}, {len(times)} steps)")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
