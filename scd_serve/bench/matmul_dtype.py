"""Which dtype is faster for this CPU's matmuls: a one-minute check before choosing `--dtype`.

Without native bf16 (AVX512_BF16 or AMX) torch converts bfloat16 to float32 inside the
kernels, which can cost more than the halved weights save. The default shapes are one
Qwen2.5-0.5B MLP projection over a 1k-token prompt.
"""

from __future__ import annotations

import argparse

import torch

from scd_serve.bench.stats import median_s
from scd_serve.model.loader import DTYPES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--inter", type=int, default=4864)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    flops = 2.0 * args.tokens * args.hidden * args.inter
    print(f"linear [{args.tokens}x{args.hidden}] x [{args.inter}x{args.hidden}]^T, {args.threads} thread(s), "
          f"median of {args.repeat}")
    base = None
    for name in args.dtypes:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(args.tokens, args.hidden, generator=gen).to(DTYPES[name])  # [T, hidden]: activations
        w = torch.randn(args.inter, args.hidden, generator=gen).to(DTYPES[name])  # [inter, hidden], nn.Linear
        t = median_s(lambda _: torch.nn.functional.linear(x, w), args.repeat)
        base = base or t
        print(f"{name:<10}{t * 1e3:>10.1f} ms{flops / t / 1e9:>10.1f} GFLOP/s{t / base:>8.2f}x float32")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
