"""A decode step's attention alone: the torch path (paged.attend_gathered) against the CPU's C++
kernel (model/cpu_kernel.py, built here if need be), alternated, medians of each:

    .venv/bin/python scripts/decode_attention.py --batch 8 --keys 310 --heads 14 --kv-heads 2 --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from scd_serve.bench.stats import alternated
from scd_serve.model import cpu_kernel
from scd_serve.model.paged import attend_gathered


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--keys", type=int, default=310, help="keys per sequence")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=200, help="timed calls of each path, in 4 alternated rounds")
    args = p.parse_args()
    cpu_kernel.load()
    torch.set_num_threads(args.threads)
    dtype, block = getattr(torch, args.dtype), 16
    width = -(-args.keys // block)
    shape = (args.batch * width, block, args.kv_heads, args.head_dim)
    k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    tables = torch.randperm(args.batch * width).view(args.batch, width)  # scattered blocks
    lengths = torch.full((args.batch,), args.keys)
    q = torch.randn(args.batch, args.heads, args.head_dim).to(dtype)
    paths = {"torch": lambda: attend_gathered(k, v, tables, lengths, q, None),
             "C++ kernel": lambda: cpu_kernel.attend_blocks(k, v, tables, lengths, q, None)}
    for name, ts in alternated(paths, rounds=4, calls=args.calls // 4, warm=10).items():
        print(f"{args.batch} x {args.keys} keys, {args.heads} heads over {args.kv_heads}, {args.dtype}, "
              f"{args.threads} threads, {name}: median {1e6 * statistics.median(ts):.1f} us")


if __name__ == "__main__":
    main()
