"""Attention over paged K/V that reads the pool's blocks in place.

A sequence's blocks fall into a few stretches of consecutive ids (the block manager hands
out neighbours when it can). Each stretch is a view of the pool, so a decode step reads
every cached key once instead of copying a padded block table (~8.6 GB per step at
Llama-3-8B, 32 sequences of 2k tokens): scores per stretch, one softmax across them, values
summed per stretch. A prefill chunk over one stretch takes the fused SDPA instead (for one
query on the CPU, SDPA with grouped heads measured 1.6-2.3x slower than two matmuls), except in
bfloat16 on a CPU that multiplies it natively, where blocks of queries take the two matmuls too
(attend_blocks: SDPA's CPU kernel computes in float32 there, 2.6x slower).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def stretches(block_ids: Sequence[int], num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """(first block, block count) of the maximal consecutive runs holding positions 0..num_tokens-1."""
    out: list[tuple[int, int]] = []
    for block in list(block_ids)[: -(-num_tokens // block_size)]:
        if out and block == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((int(block), 1))
    return out


def attend_paged(k_layer: Tensor, v_layer: Tensor, runs: Sequence[tuple[int, int]], num_tokens: int,
                 q: Tensor, first_q: int, window: int | None) -> Tensor:
    """Causal attention of queries at positions first_q..first_q+Tq-1 over keys 0..num_tokens-1.
    k_layer, v_layer: [num_blocks, block_size, kv_heads, hd] (one layer of the pool, keys post-RoPE);
    runs: stretches() of the sequence; q: [Tq, heads, hd] post-RoPE. -> [Tq, heads*hd]"""
    bs = k_layer.shape[1]
    tq = q.shape[0]
    lo = 0 if window is None else max(0, first_q - window + 1)  # the oldest key any query sees
    pieces = []  # (k [S, kv_heads, hd], v, position of the first key)
    pos = 0
    for first, count in runs:
        start, end = max(pos, lo), min(pos + count * bs, num_tokens)
        if start < end:
            base = first * bs - pos  # slot of position p in this stretch: base + p
            pieces.append((k_layer.flatten(0, 1)[base + start:base + end],
                           v_layer.flatten(0, 1)[base + start:base + end], start))
        pos += count * bs
    q_pos = torch.arange(first_q, first_q + tq, device=q.device) if tq > 1 else None
    if tq > 1 and bf16_blocks(q):
        return attend_blocks(q, q_pos, pieces, window)
    if len(pieces) == 1 and tq > 1:
        k, v, start = pieces[0]
        # a chunk from the prompt's start over its own keys alone is plain causal: SDPA's fused
        # causal kernel then, ~1.8x faster on the CPU than the same attention with a mask
        causal = window is None and start == first_q and k.shape[0] == tq
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=None if causal else _mask(q_pos, start, k.shape[0], window),
                                             is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1).flatten(1)
    return _attend_pieces(q, q_pos, pieces, window)


def bf16_blocks(q: Tensor) -> bool:
    """Whether a prefill's attention takes query blocks of two bfloat16 matmuls (attend_blocks)
    instead of SDPA: bfloat16 queries on a CPU that multiplies bfloat16 natively, outside autograd."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu" and not torch.is_grad_enabled() and native_bf16()


@functools.cache
def native_bf16() -> bool:
    from scd_serve.model.loader import cpu_has_native_bf16

    return cpu_has_native_bf16()


def attend_blocks(q: Tensor, q_pos: Tensor, pieces: list[tuple[Tensor, Tensor, int]], window: int | None) -> Tensor:
    """Causal attention of queries q [Tq, heads, hd] at positions q_pos over pieces' keys, a block
    of PREFILL_QUERY_BLOCK queries at a time over the keys it can see (each block as
    _attend_pieces does a decode step: bfloat16 matmuls and softmax, float32 inside it). -> [Tq, heads*hd]"""
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    scale = _power_of_two_scale(q.shape[-1])
    if scale is not None:  # the queries scaled once instead of every block's scores: the same bits
        q = q * scale
    for a in range(0, q.shape[0], PREFILL_QUERY_BLOCK):
        b = min(a + PREFILL_QUERY_BLOCK, q.shape[0])
        # the keys the block's queries see: none newer than its last, none older than its first's window
        lo, hi = (0 if window is None else int(q_pos[a]) - window + 1), int(q_pos[b - 1]) + 1
        seen = [(k[i - start:j - start], v[i - start:j - start], i) for k, v, start in pieces
                for i, j in [(max(start, lo), min(start + k.shape[0], hi))] if i < j]
        out[a:b] = _attend_pieces(q[a:b], q_pos[a:b], seen, window, scaled=scale is not None)
    return out


def _power_of_two_scale(head_dim: int) -> float | None:
    """1 / sqrt(head_dim) where it is a power of two (head_dim 16, 64, 256): multiplying by it
    only shifts exponents, so scaling the queries gives the scores scaling them would, bit for bit."""
    root = math.isqrt(head_dim)
    return 1.0 / root if root * root == head_dim and root & (root - 1) == 0 else None


def _mask(q_pos: Tensor, start: int, n: int, window: int | None) -> Tensor:
    # -> [Tq, S] bool, True = attend: key position start+j for each query position
    j = torch.arange(start, start + n, device=q_pos.device)
    ok = j[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= j[None, :] > q_pos[:, None] - window
    return ok


def _attend_pieces(q: Tensor, q_pos: Tensor | None, pieces: list[tuple[Tensor, Tensor, int]], window: int | None,
                   scaled: bool = False) -> Tensor:
    # scaled: q comes multiplied by 1 / sqrt(hd) already
    tq, heads, hd = q.shape
    kv_heads = pieces[0][0].shape[1]
    group = heads // kv_heads
    # [kv_heads, group*Tq, hd]: one plain batched matmul per stretch (a broadcast over the group
    # would make matmul expand, i.e. copy, the keys)
    qg = q.view(tq, kv_heads, group, hd).permute(1, 2, 0, 3).reshape(kv_heads, group * tq, hd)
    scores = []
    # keys every query sees need no mask: those from the window's start for the latest query up
    # to the earliest query (a prefill block masks its last ~Tq keys, not all it reads)
    lo, hi = ((int(q_pos.max()) - window + 1 if window is not None else None, int(q_pos.min()) + 1)
              if tq > 1 else (None, None))
    for k, _, start in pieces:  # k: [S, kv_heads, hd] -> scores [kv_heads, group*Tq, S]
        # bfloat16 scores stay bfloat16 (the matmul rounded them already): torch's softmax
        # computes in float32 inside and writes bfloat16, two passes over [.., S] float32 fewer
        s = torch.matmul(qg, k.permute(1, 2, 0))
        if not scaled:
            s.div_(math.sqrt(hd))
        if tq > 1:  # one query sees every key left after the window clip: nothing to mask
            n = k.shape[0]
            a = 0 if lo is None else min(max(lo - start, 0), n)
            b = max(min(hi - start, n), a)
            grid = s.view(kv_heads, group, tq, n)
            for i, j in ((0, a), (b, n)):  # the stretches some query may not see
                if i < j:
                    grid[..., i:j].masked_fill_(~_mask(q_pos, start + i, j - i, window), float("-inf"))
        scores.append(s)
    probs = torch.softmax(torch.cat(scores, dim=-1) if len(scores) > 1 else scores[0], dim=-1)
    out, at = None, 0
    for (_, v, _), s in zip(pieces, scores):  # v: [S, kv_heads, hd]
        part = torch.matmul(probs[..., at:at + s.shape[-1]], v.permute(1, 0, 2))  # [kv_heads, group*Tq, hd]
        out = part if out is None else out + part
        at += s.shape[-1]
    return out.view(kv_heads, group, tq, hd).permute(2, 0, 1, 3).reshape(tq, heads * hd)


# Queries per block of a bfloat16 prefill's attention on the CPU (attend_blocks): one thread,
# the 0.5B shape, 1,024 tokens, 11-16 ms a layer in blocks of 64 against SDPA's 29 ms (its CPU
# kernel computes in float32); blocks of 32 and 128 were slower (scripts/prefill_forward.py attention)
PREFILL_QUERY_BLOCK = 64

# A decode step whose whole block table of one layer is at most this many bytes gathers it
# (one copy, one batched SDPA): below it, one attention call per sequence costs more in Python
# than the copy (hidden 64: 2.3x slower at 32 sequences of 128 tokens); above it the copy does.
GATHER_BYTES = 8 << 20


def attend_gathered(k_layer: Tensor, v_layer: Tensor, tables: Tensor, lengths: Tensor, q: Tensor,
                    window: int | None) -> Tensor:
    """One query per sequence over a gathered copy of its blocks.
    tables: [B, W] block ids (rows padded with any valid id); lengths: [B] keys per sequence
    (its query is the last of them); q: [B, heads, hd]. -> [B, heads*hd]"""
    b, width = tables.shape
    bs, kv_heads, hd = k_layer.shape[1:]
    shape = (b, width * bs, kv_heads, hd)
    k = k_layer.flatten(1).index_select(0, tables.reshape(-1)).view(shape)  # whole blocks: one memcpy each
    v = v_layer.flatten(1).index_select(0, tables.reshape(-1)).view(shape)
    j = torch.arange(width * bs, device=q.device)
    keep = j[None, :] < lengths[:, None]
    if window is not None:
        keep &= j[None, :] >= lengths[:, None] - window
    if q.device.type == "cpu" and q.dtype != torch.float32:
        # SDPA's CPU kernel for one bfloat16 query per sequence measured 7-9x slower than these two
        # matmuls (8 sequences of ~300 keys, 0.5B shape, AVX512-BF16 without AMX: 2.9 against 0.33 ms
        # a layer, half a decode step); in float32 the two are even
        group = q.shape[1] // kv_heads
        qg = q.view(b, kv_heads, group, hd)
        # keys made [B, kv_heads, S, hd] and read transposed: a copy of k.permute(0, 2, 3, 1) moves single
        # 2-byte elements (0.17 against 0.014 ms a layer at 8 x 320 keys)
        keys = k.transpose(1, 2).contiguous()
        scores = torch.matmul(qg, keys.mT).float().mul_(1 / math.sqrt(hd))  # [B, kv_heads, group, S]
        probs = torch.softmax(scores.masked_fill_(~keep[:, None, None, :], float("-inf")), dim=-1).to(q.dtype)
        return torch.matmul(probs, v.transpose(1, 2)).view(b, -1)  # [B, kv_heads, group, hd] -> [B, heads*hd]
    out = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=keep[:, None, None, :], enable_gqa=q.shape[1] != kv_heads)
    return out[:, :, 0].flatten(1)
