"""The cases both attention kernels' tests (CUDA's Triton one, the CPU's C++ one) run: random
pools with tables over shuffled blocks, and a model's decode-only and mixed steps on scattered
blocks with a sliding-window layer. Imported by a child process too (test_model_paged_kernel.py)."""

from __future__ import annotations

import random

import torch

from scd_serve.model.runtime import ModelRuntime
from scd_serve.model.tiny import save_tiny_model


# (heads, kv_heads, head_dim, block, window): grouped and plain heads, a head_dim that is not a
# power of two, larger blocks, sliding windows that start inside a block
SHAPES = [(4, 2, 32, 16, None), (8, 1, 24, 16, None), (2, 2, 64, 32, 20), (14, 2, 64, 16, None), (6, 3, 16, 16, 7)]


def random_pool(seed, heads, kv_heads, hd, block, dtype) -> tuple[torch.Tensor, ...]:
    """-> (k, v [blocks, block, kv_heads, hd], table [5, W] over shuffled blocks, lengths [5] of
    1, block - 1, block, block + 1 and up to 6 blocks, q [5, heads, hd])"""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    lengths = [1, block - 1, block, block + 1, rng.randint(2, 6 * block)]
    width = -(-max(lengths) // block)
    ids = list(range(len(lengths) * width + 3))
    rng.shuffle(ids)
    table = torch.tensor(ids[:len(lengths) * width]).view(len(lengths), width)
    k = torch.randn(len(ids), block, kv_heads, hd, generator=gen).to(dtype)
    v = torch.randn(len(ids), block, kv_heads, hd, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, hd, generator=gen).to(dtype)
    return k, v, table, torch.tensor(lengths), q


def windowed_model(path, dtype=torch.float32) -> ModelRuntime:
    path = save_tiny_model(path, "qwen2", tokenizer=False, num_hidden_layers=3, hidden_size=64,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                           use_sliding_window=True, sliding_window=20, max_window_layers=1)
    return ModelRuntime.load(path, dtype=dtype)


def mixed_and_decode(rt: ModelRuntime, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the mixed step's last logits [3, vocab], a decode step's [3, vocab]), rt.paged_kernel = kernel"""
    tables = [[9, 3, 14, 0], [5, 6, 7, 8], [12, 1, 10, 2]]
    prompts = [list(range(5, 45)), list(range(50, 67)), list(range(100, 133))]
    rt.paged_kernel = kernel
    pool = rt.new_kv_pool(16, 16)
    rt.extend(pool, [(t, 0, torch.tensor(p[:-1])) for t, p in zip(tables[:2], prompts[:2])], "none")
    mixed = rt.extend(pool, [(tables[0], len(prompts[0]) - 1, torch.tensor(prompts[0][-1:])),
                             (tables[2], 0, torch.tensor(prompts[2])),
                             (tables[1], len(prompts[1]) - 1, torch.tensor(prompts[1][-1:]))], "last")
    decode = rt.decode_step(pool, [(t, len(p), 7) for t, p in zip(tables, prompts)])
    return torch.cat(mixed), decode
