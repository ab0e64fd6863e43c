"""One batched decode step of the engine's runtime, timed (and profiled by op with --profile):
B sequences of L cached random tokens, the model loaded and packed as a worker loads it (issue 43:
how much of a step the linears take, and what the rest is):

    .venv/bin/python scripts/decode_step.py --model out/shaped/consumer --batch 8 --cached 300 --threads 2

--attention both: rounds of the step with the CPU's C++ kernels (model/cpu_kernel.py: attention, norms, rotary, SiLU)
and with the torch path, alternated in one process (a ratio measured side by side).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from scd_serve.bench.stats import alternated
from scd_serve.model import cpu_kernel
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
    p.add_argument("--attention", choices=["kernel", "torch", "both"], default="kernel",
                   help="kernel: the CPU's C++ kernels (built here if need be); both: alternated rounds")
    args = p.parse_args()
    if args.attention != "torch":
        cpu_kernel.use(True)
    torch.set_num_threads(args.threads)
    rt = ModelRuntime.load(args.model, device="cpu", dtype=getattr(torch, args.dtype))
    rt.pack_linears()
    block_size, gen = 16, torch.Generator().manual_seed(0)
    per_seq = -(-(args.cached + 3 * args.steps + 16) // block_size)  # room for --attention both's rounds
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
        def on(kernel: bool) -> Callable[[], None]:
            def run() -> None:
                rt.paged_kernel = kernel
                step()
            return run

        paths = {"C++ kernels": on(True), "torch path": on(False)}
        if args.attention != "both":
            paths = {name: fn for name, fn in paths.items() if (name == "torch path") == (args.attention == "torch")}
        rounds = 3 if args.attention == "both" else 1
        # the first step of a round on its path is not timed
        times = alternated(paths, rounds, calls=(args.steps - 4 - (5 if args.profile else 0)) // rounds, warm=1)
        for name, ts in times.items():
            print(f"batch {args.batch}, {args.cached}+ cached, {args.threads} threads, {args.dtype}, "
                  f"{name}: step median {1e3 * statistics.median(ts):.1f} ms (min {1e3 * min(ts):.1f}, {len(ts)} steps)")
        rt.paged_kernel = args.attention != "torch"
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
