"""The compact decoder-layer math (Llama/Mistral/Qwen2/Qwen3), as plain functions on weights.

Matches transformers' modules op for op: RMSNorm in float32 then cast back, SiLU-gated MLP,
optional q/k/v biases and per-head q/k RMSNorm, SDPA with the default 1/sqrt(head_dim) scale.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from scd_serve.model.spec import ModelSpec
from scd_serve.model.weights import LayerWeights

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    dtype = x.dtype
    x32 = x.float()
    scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if torch.is_grad_enabled() or x32 is x:  # autograd keeps x32 for pow's backward; x's own buffer
        return weight * (x32 * scale).to(dtype)
    # outside autograd in x32's and the cast's own buffers: the same products, two passes fewer
    return x32.mul_(scale).to(dtype).mul_(weight)


class PackedWeight:
    """A linear layer's weight [out, in] reordered once into oneDNN's blocked layout (a serving
    runtime on a CPU: ModelRuntime.pack_linears). bfloat16 (native): each matmul skips the
    reorder F.linear does per call, 1.5-1.7x faster at decode batch sizes, the same numbers.
    float32: oneDNN instead of F.linear's BLAS, 2.3-2.6x faster on 8 and 512 rows of the 0.5B shape
    (AVX-512; 1.2-1.5x with oneDNN held to AVX2), the sums in another order; below hidden 512 its
    ~10 us a call loses to BLAS at decode sizes, so smaller models stay unpacked."""

    def __init__(self, w: Tensor):
        self.out_features, self.in_features = w.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8)

    def __call__(self, x: Tensor, b: Tensor | None) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, b, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def linear(x: Tensor, w: Tensor | PackedWeight, b: Tensor | None) -> Tensor:
    return w(x, b) if isinstance(w, PackedWeight) else F.linear(x, w, b)


def project_q(lw: LayerWeights, spec: ModelSpec, x: Tensor) -> Tensor:
    # x: [..., hidden] -> q: [..., heads, head_dim] (pre-RoPE, after q_norm if any)
    q = linear(x, lw.wq, lw.bq).unflatten(-1, (spec.num_heads, spec.head_dim))
    return rms_norm(q, lw.q_norm, spec.rms_norm_eps) if lw.q_norm is not None else q


def project_kv(lw: LayerWeights, spec: ModelSpec, x: Tensor) -> tuple[Tensor, Tensor]:
    # x: [..., hidden] -> k_pre, v: [..., kv_heads, head_dim] (k after k_norm if any)
    kv = linear(x, lw.wkv, lw.bkv)
    k, v = kv.split(spec.kv_width, dim=-1)
    k = k.unflatten(-1, (spec.num_kv_heads, spec.head_dim))
    v = v.unflatten(-1, (spec.num_kv_heads, spec.head_dim))
    if lw.k_norm is not None:
        k = rms_norm(k, lw.k_norm, spec.rms_norm_eps)
    return k, v


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    # q: [B, Tq, heads, hd]; k, v: [B, S, kv_heads, hd]; mask: [B, 1, Tq, S] bool (True = attend)
    # or None for plain causal with Tq == S. Returns [B, Tq, heads*hd].
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=mask is None, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).flatten(2)


# Rows per pass of a layer's output projection and MLP outside autograd: a whole 4,096-token
# prompt's [T, 2 * intermediate] activations leave the caches; blocks of 512 ran the MLP 1.3-1.9x
# faster in float32, 1.2-1.3x in bfloat16 (0.5B shape, two threads)
MLP_ROWS = 512


def finish_layer(lw: LayerWeights, spec: ModelSpec, h: Tensor, attn: Tensor, fused: Any = None) -> Tensor:
    # h: residual [..., hidden]; attn: attention output [..., heads*hd] -> new residual.
    # fused: the CPU's kernels (model/cpu_kernel.ops) for the norm and SiLU's product, outside autograd
    rows = h.shape[:-1].numel()
    if torch.is_grad_enabled() or rows <= MLP_ROWS:
        return _finish_rows(lw, spec, h, attn, fused)
    h2, attn2 = h.reshape(rows, -1), attn.reshape(rows, -1)  # [rows, hidden], [rows, heads*hd]
    out = torch.empty_like(h2)
    for i in range(0, rows, MLP_ROWS):
        out[i:i + MLP_ROWS] = _finish_rows(lw, spec, h2[i:i + MLP_ROWS], attn2[i:i + MLP_ROWS], fused)
    return out.view(h.shape)


def _finish_rows(lw: LayerWeights, spec: ModelSpec, h: Tensor, attn: Tensor, fused: Any = None) -> Tensor:
    # outside autograd (calibration differentiates through the layers) the sums land in the
    # projections' own fresh buffers (a + b == b + a, bit for bit), SiLU runs in place and its
    # product is written contiguous, which the down projection reads without a copy
    grad = torch.is_grad_enabled()
    out = linear(attn, lw.wo, lw.bo)
    h = h + out if grad else out.add_(h)
    if fused is not None and not grad:
        gate_up = linear(fused.rms_norm(h, lw.ln2, spec.rms_norm_eps), lw.w_gate_up, lw.b_gate_up)
        return linear(fused.silu_mul(gate_up), lw.w_down, lw.b_down).add_(h)
    gate, up = linear(rms_norm(h, lw.ln2, spec.rms_norm_eps), lw.w_gate_up, lw.b_gate_up).chunk(2, dim=-1)
    if grad:
        return h + linear(F.silu(gate) * up, lw.w_down, lw.b_down)
    return linear(torch.mul(F.silu(gate, inplace=True), up), lw.w_down, lw.b_down).add_(h)


def causal_mask(q_pos: Tensor, lengths: Tensor, s: int, window: int | None) -> Tensor:
    """[B, 1, Tq, S] bool: query at absolute position q_pos[b, i] sees key slot j iff
    j <= q_pos[b, i], j < lengths[b] and (with a sliding window) j > q_pos[b, i] - window."""
    # q_pos: [B, Tq] long, lengths: [B] long
    j = torch.arange(s, device=q_pos.device)
    ok = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < lengths[:, None, None])
    if window is not None:
        ok &= j[None, None, :] > q_pos[:, :, None] - window
    return ok.unsqueeze(1)
