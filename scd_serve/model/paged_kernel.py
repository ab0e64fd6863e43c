"""A Triton kernel for decode attention over paged K/V, used on CUDA when Triton is installed.

One program per (sequence, kv head, split) walks its share of that sequence's block table
and reads each block of the pool in place, once for all the query heads that share it
(grouped-query attention), with an online softmax; the splits' partial results are merged
after (flash-decoding: a few sequences of long context still fill the device). No gathered
copy of the table (paged.py's CPU path copies it below GATHER_BYTES) and no Python loop over
sequences. Prefill chunks keep paged.py's SDPA.

Triton is optional: without it, or off CUDA, `usable` is False and paged.py serves. The
tests run this same kernel on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton; torch's CUDA wheels bring it
    triton = None

Tensor = torch.Tensor
MIN_BLOCK = 16  # tl.dot needs every side >= 16: pool blocks smaller than this stay on paged.py


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable(device: torch.device, block_size: int) -> bool:
    """Whether this kernel can serve a pool of block_size on device (the interpreter counts as CUDA)."""
    on_gpu = device.type == "cuda" or _interpreting()
    return triton is not None and on_gpu and block_size >= MIN_BLOCK and block_size & (block_size - 1) == 0


def attend_blocks(k_layer: Tensor, v_layer: Tensor, tables: Tensor, lengths: Tensor, q: Tensor,
                  window: int | None, splits: int | None = None) -> Tensor:
    """One query per sequence over its blocks, read in place; the same contract as
    paged.attend_gathered. k_layer, v_layer: [num_blocks, block_size, kv_heads, hd];
    tables: [B, W] block ids; lengths: [B] keys per sequence; q: [B, heads, hd]. -> [B, heads*hd]
    splits: programs per (sequence, kv head), each over its share of the blocks, merged after
    (None: enough to fill the device; 1 sequence x 2 kv heads alone would use 2 of 132 SMs)."""
    b, heads, hd = q.shape
    block, kv_heads = k_layer.shape[1], k_layer.shape[2]
    width = tables.shape[1]
    splits = max(1, min(width, splits or _splits_to_fill(q.device, b * kv_heads)))
    per_split = -(-width // splits)
    splits = -(-width // per_split)
    q = q.contiguous()
    tables = tables.to(torch.int32).contiguous()
    lengths = lengths.to(torch.int32).contiguous()
    if splits == 1:  # out normalized in place; m and total are not written
        out = m = total = torch.empty_like(q)
    else:  # per split: out [splits, B, heads, hd], its running max m and sum of exponentials [splits, B, heads]
        out = torch.empty(splits, b, heads, hd, device=q.device)
        m, total = torch.empty(2, splits, b, heads, device=q.device)
    _decode[(b, kv_heads, splits)](
        q, k_layer, v_layer, tables, lengths, out, m, total,
        q.stride(0), q.stride(1), k_layer.stride(0), k_layer.stride(1), k_layer.stride(2),
        v_layer.stride(0), v_layer.stride(1), v_layer.stride(2), tables.stride(0),
        out.stride(-3), out.stride(-2), b * out.stride(-3), b * heads, per_split, 1.0 / math.sqrt(hd), window or 0,
        GROUP=heads // kv_heads, GROUP_PAD=max(16, triton.next_power_of_2(heads // kv_heads)), HEAD_DIM=hd,
        DIM_PAD=max(16, triton.next_power_of_2(hd)), BLOCK=block, WINDOWED=window is not None,
        # float32 pools keep float32 products (no TF32) for parity with the CPU path; the
        # interpreter's tl.dot miscomputes 16-bit inputs (Triton 3.7), so there they are upcast
        DOT_FP32=q.dtype == torch.float32 or _interpreting(), MERGE=splits > 1)
    if splits == 1:
        return out.flatten(1)
    # each split's acc is normalized by its own sum: weight it by its share of the whole
    top = m.amax(0)  # [B, heads]; finite: some split holds each sequence's keys
    weight = torch.exp(m - top) * total  # [splits, B, heads]; 0 for splits past a sequence's keys
    merged = (out * weight[..., None]).sum(0) / weight.sum(0)[..., None]
    return merged.to(q.dtype).flatten(1)


def _splits_to_fill(device: torch.device, programs: int) -> int:
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return -(-2 * sms // programs)  # two programs per SM hide the loads' latency


if triton is not None:
    @triton.jit
    def _decode(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, m_ptr, total_ptr,
                stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_tb, stride_ob, stride_oh, stride_os, stride_ms, per_split, scale, window,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                BLOCK: tl.constexpr, WINDOWED: tl.constexpr, DOT_FP32: tl.constexpr, MERGE: tl.constexpr):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        t = tl.arange(0, BLOCK)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        # q: [GROUP_PAD, DIM_PAD], the query heads of this kv head (padding rows are zeros)
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        length = tl.load(len_ptr + seq)
        start = 0
        if WINDOWED:
            start = tl.maximum(length - window, 0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        # this split's blocks; the first block of any split holds a key to attend (key `start`
        # or a whole block), so m is finite once a block is seen
        first = tl.maximum(start // BLOCK, split * per_split)
        for i in range(first, tl.minimum(tl.cdiv(length, BLOCK), (split + 1) * per_split)):
            blk = tl.load(table_ptr + seq * stride_tb + i).to(tl.int64)
            pos = i * BLOCK + t
            ok = (pos < length) & (pos >= start)
            # k, v: [BLOCK, DIM_PAD], one block of this kv head, in place in the pool
            k = tl.load(k_ptr + blk * stride_kb + t[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptr + blk * stride_vb + t[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_FP32:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(ok[None, :], s * scale, float("-inf"))  # [GROUP_PAD, BLOCK]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            rescale = tl.exp(m - m_new)
            total = total * rescale + tl.sum(p, axis=1)
            if DOT_FP32:
                acc = acc * rescale[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        # a split with no blocks of this sequence: total 0, weighted 0 in the merge
        out = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(out_ptr + split * stride_os + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        if MERGE:
            at = split * stride_ms + seq * tl.num_programs(1) * GROUP + heads  # m, total: [splits, B, heads]
            tl.store(m_ptr + at, m, mask=g_ok)
            tl.store(total_ptr + at, total, mask=g_ok)
