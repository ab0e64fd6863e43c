"""Which dtype is faster for this CPU's matmuls: a one-minute check before choosing `--dtype`.

Without native bf16 (AVX512_BF16 or AMX) torch converts bfloat16 to float32 inside the
kernels, which can cost more than the halved weights save. The default shapes are one
Qwen2.5-0.5B MLP projection over a 1k-token prompt; `--model DIR` times that model's own
engine steps instead (a prefill of --tokens, a decode step of 1 and of 8 sequences after it).
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
    p.add_argument("--model", help="a model directory: time its prefill and decode steps per dtype")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        return model_steps(args)
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


def model_steps(args) -> int:
    """The model's prefill of args.tokens and its decode steps (1 and 8 sequences over that
    context) per dtype, every dtype's copy loaded first, then timed one after another (ratios
    from one run)."""
    from scd_serve.model import ModelRuntime

    ids = torch.randint(3, 30000, (args.tokens,), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name in args.dtypes:
        rt = ModelRuntime.load(args.model, dtype=name)
        num_blocks = -(-args.tokens // 16) + 1
        pool, blocks, x = rt.new_kv_pool(num_blocks, 16), list(range(num_blocks)), ids % rt.spec.vocab_size
        runs[name] = {"prefill": lambda _, rt=rt, pool=pool, b=blocks, x=x: rt.extend(pool, [(b, 0, x)], logits="none"),
                      "decode 1": lambda _, rt=rt, pool=pool, b=blocks: rt.decode_step(pool, [(b, args.tokens, 5)]),
                      "decode 8": lambda _, rt=rt, pool=pool, b=blocks: rt.decode_step(pool, [(b, args.tokens, 5)] * 8)}
    print(f"{args.model}: prefill of {args.tokens} tokens, decode steps over them; {args.threads} thread(s), "
          f"median of {args.repeat}")
    times = {name: {step: median_s(fn, args.repeat) for step, fn in steps.items()} for name, steps in runs.items()}
    base = times[args.dtypes[0]]
    for name, t in times.items():
        print(f"{name:<10}" + "".join(f"{step} {v * 1e3:>8.1f} ms ({base[step] / v:.2f}x)   " for step, v in t.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
