"""A Triton kernel for decode attention over paged K/V, used on CUDA when Triton is installed.

One program per (sequence, kv head) walks that sequence's block table and reads each block
of the pool in place, once for all the query heads that share it (grouped-query attention),
with an online softmax: no gathered copy of the table (paged.py's CPU path copies it below
GATHER_BYTES) and no Python loop over sequences. Prefill chunks keep paged.py's SDPA.

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
                  window: int | None) -> Tensor:
    """One query per sequence over its blocks, read in place; the same contract as
    paged.attend_gathered. k_layer, v_layer: [num_blocks, block_size, kv_heads, hd];
    tables: [B, W] block ids; lengths: [B] keys per sequence; q: [B, heads, hd]. -> [B, heads*hd]"""
    b, heads, hd = q.shape
    block, kv_heads = k_layer.shape[1], k_layer.shape[2]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = tables.to(torch.int32).contiguous()
    lengths = lengths.to(torch.int32).contiguous()
    _decode[(b, kv_heads)](
        q, k_layer, v_layer, tables, lengths, out,
        q.stride(0), q.stride(1), k_layer.stride(0), k_layer.stride(1), k_layer.stride(2),
        v_layer.stride(0), v_layer.stride(1), v_layer.stride(2), tables.stride(0), out.stride(0), out.stride(1),
        1.0 / math.sqrt(hd), window or 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=hd,
        DIM_PAD=max(16, triton.next_power_of_2(hd)), BLOCK=block, WINDOWED=window is not None,
        # float32 pools keep float32 products (no TF32) for parity with the CPU path; the
        # interpreter's tl.dot miscomputes 16-bit inputs (Triton 3.7), so there they are upcast
        DOT_FP32=q.dtype == torch.float32 or _interpreting())
    return out.flatten(1)


if triton is not None:
    @triton.jit
    def _decode(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr,
                stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_tb, stride_ob, stride_oh, scale, window,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                BLOCK: tl.constexpr, WINDOWED: tl.constexpr, DOT_FP32: tl.constexpr):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
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
        # the first block holds key `start`, so every block seen has a key to attend: m stays finite
        for i in range(start // BLOCK, tl.cdiv(length, BLOCK)):
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
        out = acc / total[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
