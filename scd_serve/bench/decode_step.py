"""Benchmark of ModelRuntime.decode_step (a command printing figures, not a test).

A random model of the embedded pair's shape (or --model DIR) with random K/V for B sequences
of about each context (lengths spread +-25%, so padding and masks are exercised).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from scd_serve.config.model import DTYPE_NAMES
from scd_serve.model import paged_kernel
from scd_serve.model.runtime import ModelRuntime
from scd_serve.model.tiny import save_tiny_model

PAIR_SHAPE = dict(num_hidden_layers=8, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=384, vocab_size=4096, max_position_embeddings=4096)


def bench(rt: ModelRuntime, batch: int, context: int, block_size: int, steps: int) -> float:
    gen = torch.Generator().manual_seed(0)
    lengths = [max(1, int(context * (0.75 + 0.5 * i / max(1, batch - 1)))) for i in range(batch)]
    per_seq = -(-(max(lengths) + steps + 1) // block_size)
    pool = rt.new_kv_pool(batch * per_seq, block_size)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    tokens = [1] * batch

    def step(offset: int) -> None:
        items = [(b, n + offset, t) for b, n, t in zip(blocks, lengths, tokens)]
        logits = rt.decode_step(pool, items)
        tokens[:] = logits.argmax(-1).tolist()  # the sync a real engine step pays too

    step(0)  # warm-up
    start = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: random model of the pair's shape)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--attention", default="auto", choices=["auto", "torch"],
                   help="auto: the Triton kernel where it serves (CUDA), else torch; torch: torch's path everywhere")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or save_tiny_model(tmp, "qwen3", tokenizer=False, **PAIR_SHAPE)
        rt = ModelRuntime.load(path, args.device, getattr(torch, args.dtype))
    rt.paged_kernel = args.attention == "auto"
    kernel = rt.paged_kernel and paged_kernel.usable(rt.device, args.block_size)
    print(f"model {rt.fingerprint} layers={rt.spec.num_layers} hidden={rt.spec.hidden_size} device={rt.device} "
          f"dtype={args.dtype} threads={torch.get_num_threads()} attention={'triton' if kernel else 'torch'}")
    print(f"{'batch':>5} {'context':>7} {'ms/step':>8} {'tokens/s':>9}")
    for context in args.context:
        for batch in args.batch:
            sec = bench(rt, batch, context, args.block_size, args.steps)
            print(f"{batch:>5} {context:>7} {sec * 1e3:>8.2f} {batch / sec:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
