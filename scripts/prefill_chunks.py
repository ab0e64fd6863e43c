"""The engine's prefill chunks (`ModelRuntime.extend`, as its steps run them) with the prompt
attention in the CPU's C++ kernel (model/cpu_kernel.prefill) and through the torch path (SDPA,
or bfloat16 matmul blocks), the other CPU kernels on in both; the two alternated in rounds in one
process, medians (issue 43):

    .venv/bin/python scripts/prefill_chunks.py --model out/shaped/consumer --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics

import torch

from scd_serve.bench.stats import alternated
from scd_serve.model import cpu_kernel
from scd_serve.model.runtime import ModelRuntime

# (tokens already cached, tokens in the chunk) per sequence of one step
CASES = {"1 x 1024": [(0, 1024)], "2 x 256": [(0, 256), (0, 256)], "512 after 512": [(512, 512)],
         "8 + 256 + 248": [(248, 8), (0, 256), (0, 248)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rt = ModelRuntime.load(args.model, dtype=args.dtype)
    rt.pack_linears()
    cpu_kernel.use(True)
    kernel_ops, gen = cpu_kernel.prefill_ops, torch.Generator().manual_seed(0)
    for name, items in CASES.items():
        pool, work = rt.new_kv_pool(100 * len(items), 16), []
        for i, (cached, n) in enumerate(items):
            blocks = list(range(100 * i, 100 * (i + 1)))
            if cached:
                rt.extend(pool, [(blocks, 0, torch.randint(100, 30000, (cached,), generator=gen))], "none")
            work.append((blocks, cached, torch.randint(100, 30000, (n,), generator=gen)))

        def run(ops):
            cpu_kernel.prefill_ops = ops
            rt.extend(pool, work, "last")
        times = alternated({"kernel": lambda: run(kernel_ops), "torch": lambda: run(lambda device, dtype: None)},
                           rounds=args.rounds, calls=2, warm=1)
        k, t = statistics.median(times["kernel"]), statistics.median(times["torch"])
        print(f"{args.dtype} {name}: C++ attention {k * 1e3:.0f} ms, torch path {t * 1e3:.0f} ms, ratio {k / t:.3f}",
              flush=True)
    cpu_kernel.prefill_ops = kernel_ops


if __name__ == "__main__":
    main()
