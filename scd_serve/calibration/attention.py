"""Where the consumer's attention lands: the weight of each calibration row.

A rebuilt row's error reaches a later token in proportion to the attention that token pays the
row, so the fits weigh each row by the attention the consumer's own later queries give it
(weighted least squares). On `llama-lora-code` (full-rank maps of the attention input and the
token's features to K/V, 30 held-out texts; scripts/attention_weight_study.py), weighing every
row so took held-out KL 0.0155 -> 0.0127; on 41 rows a prompt, as calibration samples them,
0.0158 -> 0.0137 (docs/results.md).
"""

from __future__ import annotations

from typing import Any

import torch

from scd_serve.model.layers import project_q

Tensor = torch.Tensor
MAX_QUERIES = 256  # queries a prompt's weights are estimated from (a random subset past it)
QUERY_CHUNK = 32  # queries scored at once: a long prompt's scores stay small (heads x 32 x T)
MAX_WEIGHT = 16.0  # of a row, the prompt's mean row being 1: the first rows (attention sinks)
# receive tens of times the mean, and a few such rows would outweigh the rest of a sample


def received_attention(consumer: Any, layer: int, keys: Tensor, attn_input: Tensor,
                       generator: torch.Generator | None = None) -> Tensor:
    """keys [T, kv_heads, hd] (pre-RoPE) and attn_input [T, hidden]: the consumer's own at
    `layer`. -> [T] float32 on the CPU: the attention each row receives from the prompt's
    queries, summed over them and averaged over heads, scaled to mean 1 and capped at MAX_WEIGHT
    (a sliding window, where a layer has one, is not applied: a weight, not the forward)."""
    spec, t = consumer.spec, keys.shape[0]
    with torch.no_grad():
        qi = torch.arange(t)
        if t > MAX_QUERIES:
            qi = torch.randperm(t, generator=generator)[:MAX_QUERIES].sort().values
        qi = qi.to(keys.device)
        pos = torch.arange(t, device=keys.device)
        q = project_q(consumer.weights.layers[layer], spec, attn_input[qi])  # [nq, heads, hd]
        q = consumer.rotary.rotate(q, qi)
        k = consumer.rotary.rotate(keys, pos)  # [T, kv_heads, hd]
        q, k = q.unflatten(1, (spec.num_kv_heads, -1)).float(), k.float()  # q: [nq, kv_heads, group, hd]
        mass = torch.zeros(t, device=keys.device)
        for i in range(0, qi.shape[0], QUERY_CHUNK):  # [kv, group, chunk, T] scores at a time
            scores = torch.einsum("qkgd,tkd->kgqt", q[i:i + QUERY_CHUNK], k) * spec.head_dim ** -0.5
            scores.masked_fill_(pos[None, :] > qi[i:i + QUERY_CHUNK, None], float("-inf"))
            mass += scores.softmax(-1).sum(2).mean((0, 1))  # [T]
    return (mass / mass.mean().clamp_min(1e-12)).clamp_max(MAX_WEIGHT).float().cpu()
