"""Paged attention read in place (model/paged.py) equals dense SDPA over the same keys."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from scd_serve.model.paged import attend_paged, stretches


def test_stretches_are_the_maximal_consecutive_runs_covering_the_tokens():
    assert stretches([4, 5, 6, 9, 10, 2], 24, 4) == [(4, 3), (9, 2), (2, 1)]
    assert stretches([4, 5, 6, 9, 10, 2], 13, 4) == [(4, 3), (9, 1)]  # blocks past the tokens are left out
    assert stretches([7], 1, 16) == [(7, 1)]


def dense(q, k, v, first_q, window):
    # q: [Tq, H, hd]; k, v: [S, KV, hd] in position order -> [Tq, H*hd]
    tq, s = q.shape[0], k.shape[0]
    qp = torch.arange(first_q, first_q + tq)[:, None]
    j = torch.arange(s)[None, :]
    mask = (j <= qp) & ((j > qp - window) if window else True)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         enable_gqa=True)
    return out.transpose(0, 1).flatten(1)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_block_layout_equals_dense_attention(seed, dtype):
    rng = random.Random(seed)
    bs, kv, group, hd = rng.choice([1, 3, 4, 16]), 2, rng.choice([1, 3]), 8
    total = rng.randint(1, 60)
    tq = rng.choice([1, rng.randint(1, total)])
    window = rng.choice([None, rng.randint(1, 20)])
    need = -(-total // bs)
    ids = list(range(need + 4))
    rng.shuffle(ids)
    blocks = sorted(ids[:need]) if rng.random() < 0.3 else ids[:need]  # sometimes one stretch
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(need + 4, bs, kv, hd, generator=gen).to(dtype)
    v_pool = torch.randn(need + 4, bs, kv, hd, generator=gen).to(dtype)
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(total)])
    k, v = k_pool.flatten(0, 1)[slots], v_pool.flatten(0, 1)[slots]  # [total, kv, hd] in order
    q = torch.randn(tq, kv * group, hd, generator=gen).to(dtype)
    got = attend_paged(k_pool, v_pool, stretches(blocks, total, bs), total, q, total - tq, window)
    want = dense(q.float(), k.float(), v.float(), total - tq, window)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bfloat16: 8 mantissa bits over sums of <= 60 terms
    assert got.shape == want.shape and (got.float() - want).abs().max() <= tol
