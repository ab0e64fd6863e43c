"""DecodeStep: one batched decode step that can also run a layer at a time.

`ModelRuntime.decode_step` runs it whole. The engine runs the first step of a request whose
K/V arrives over the wire a layer at a time (engine/runner.py, StepAhead): layer l of the
step reads only layer l of the cache, so it can run as soon as that layer has landed, and
when the last layer lands only that layer and the LM head are left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from scd_serve.errors import InvalidRequest
from scd_serve.model.kv_pool import KVPool
from scd_serve.model.layers import finish_layer, project_kv, project_q, rms_norm
from scd_serve.model.paged import attend_paged, stretches
from scd_serve.model import rope

if TYPE_CHECKING:
    from scd_serve.model.runtime import ModelRuntime

Tensor = torch.Tensor


class DecodeStep:
    """items: (block_ids, num_cached, token_id) per sequence: feeds token_id at position
    num_cached, writing its K/V there. Layers run in order; `logits()` once all have run."""

    @torch.no_grad()
    def __init__(self, rt: ModelRuntime, pool: KVPool, items: Sequence[tuple[Sequence[int], int, int]]):
        if not items:
            raise InvalidRequest("decode_step needs at least one item")
        spec, bs = rt.spec, pool.block_size
        self.rt, self.pool = rt, pool
        self.cached = [int(c) for _, c, _ in items]
        tokens = [int(t) for _, _, t in items]
        rt._check_positions(self.cached, [len(b) for b, _, _ in items], bs)
        if min(tokens) < 0 or max(tokens) >= spec.vocab_size:
            raise InvalidRequest(f"token ids must lie in 0..{spec.vocab_size - 1}")
        if min(len(b) for b, _, _ in items) < 1 or any(min(b) < 0 or max(b) >= pool.num_blocks for b, _, _ in items):
            raise InvalidRequest(f"block ids must lie in 0..{pool.num_blocks - 1}")
        blocks = [list(b) for b, _, _ in items]
        self.slots = torch.tensor([b[c // bs] * bs + c % bs for b, c in zip(blocks, self.cached)],
                                  device=rt.device)  # [B] where each new token's K/V goes
        self.runs = [stretches(b, c + 1, bs) for b, c in zip(blocks, self.cached)]
        pos = torch.tensor(self.cached, device=rt.device)  # [B]
        self.h = rt.weights.embed[torch.tensor(tokens, device=rt.device)]  # [B, hidden]
        self.cos, self.sin = rt.rotary.tables(pos)
        self.layer = 0  # the next layer to run

    @property
    def done(self) -> bool:
        return self.layer == self.rt.spec.num_layers

    @torch.no_grad()
    def run_layer(self) -> None:
        """Run the next layer; it reads only that layer of the pool."""
        spec, layer = self.rt.spec, self.layer
        if self.done:
            raise RuntimeError("every layer of this decode step has run")
        lw = self.rt.weights.layers[layer]
        x = rms_norm(self.h, lw.ln1, spec.rms_norm_eps)
        k_pre, v = project_kv(lw, spec, x)  # [B, kv_heads, hd]
        self.pool.write(layer, self.slots, rope.apply(k_pre, self.cos, self.sin), v)
        q = rope.apply(project_q(lw, spec, x), self.cos, self.sin)  # [B, heads, hd]
        window = spec.window(layer)
        k_layer, v_layer = self.pool.k[layer], self.pool.v[layer]
        attn = torch.cat([attend_paged(k_layer, v_layer, runs, c + 1, q[i:i + 1], c, window)
                          for i, (runs, c) in enumerate(zip(self.runs, self.cached))])  # [B, heads*hd]
        self.h = finish_layer(lw, spec, self.h, attn)
        self.layer += 1

    @torch.no_grad()
    def logits(self) -> Tensor:
        # -> [B, vocab] float32
        while not self.done:
            self.run_layer()
        return self.rt._logits(self.h)

