"""Paged attention read in place (model/paged.py) equals dense SDPA over the same keys."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from scd_serve.model import paged
from scd_serve.model.paged import attend_blocks, attend_gathered, attend_paged, stretches


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
    check_random_layout(random.Random(seed), seed, dtype)


@pytest.mark.parametrize("seed", range(8))
def test_a_bfloat16_prefill_in_query_blocks_equals_dense_attention(seed, monkeypatch):
    """bfloat16 on a CPU that multiplies it natively: a prefill's queries in blocks, each over the
    keys it sees (a prefix before the chunk, windows, several stretches), blocks of 7 here."""
    monkeypatch.setattr(paged, "native_bf16", lambda: True)
    monkeypatch.setattr(paged, "PREFILL_QUERY_BLOCK", 7)
    called = []
    monkeypatch.setattr(paged, "attend_blocks", lambda *a: called.append(1) or attend_blocks(*a))
    rng = random.Random(100 + seed)
    with torch.no_grad():  # as the engine runs (calibration differentiates through SDPA)
        check_random_layout(rng, seed, torch.bfloat16, tq=rng.randint(2, 60))
    assert called


def check_random_layout(rng, seed, dtype, tq: int | None = None):
    bs, kv, group, hd = rng.choice([1, 3, 4, 16]), 2, rng.choice([1, 3]), 8
    total = rng.randint(tq or 1, 60)
    tq = tq or rng.choice([1, rng.randint(1, total)])
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


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_per_sequence_over_gathered_blocks_equals_dense_attention(seed, dtype):
    # bfloat16 on the CPU takes two matmuls instead of SDPA: the same attention, padded rows and
    # windows included
    rng = random.Random(seed)
    bs, kv, group, hd, b = rng.choice([1, 4, 16]), rng.choice([1, 2, 4]), rng.choice([1, 3, 7]), 8, rng.randint(1, 5)
    window = rng.choice([None, rng.randint(1, 20)])
    lengths = [rng.randint(1, 50) for _ in range(b)]
    width = -(-max(lengths) // bs)
    num_blocks = b * width + 2
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks, bs, kv, hd, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks, bs, kv, hd, generator=gen).to(dtype)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.tensor([ids[i * width:(i + 1) * width] for i in range(b)])  # padded with valid ids
    q = torch.randn(b, kv * group, hd, generator=gen).to(dtype)
    got = attend_gathered(k_pool, v_pool, tables, torch.tensor(lengths), q, window)
    for i, n in enumerate(lengths):
        slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for p in range(n)])
        k, v = k_pool.flatten(0, 1)[slots], v_pool.flatten(0, 1)[slots]
        want = dense(q[i:i + 1].float(), k.float(), v.float(), n - 1, window)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert got.dtype == dtype and (got[i:i + 1].float() - want).abs().max() <= tol
