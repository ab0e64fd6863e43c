"""A model's decode-only and mixed steps on scattered blocks, with a sliding-window layer: the
case both attention kernels' tests (CUDA's Triton one, the CPU's C++ one) run with and without
their kernel. Imported by a child process too (test_model_paged_kernel.py)."""

from __future__ import annotations

import torch

from scd_serve.model.runtime import ModelRuntime
from scd_serve.model.tiny import save_tiny_model


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
