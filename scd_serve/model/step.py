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
from scd_serve.model.kv_pool import KVPool, block_table
from scd_serve.model.layers import attend, attend_all, finish_layer, project_kv, project_q, rms_norm
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
        width = -(-(max(self.cached) + 1) // bs)  # blocks the longest sequence needs
        self.table = block_table([list(b)[:width] for b, _, _ in items], pool.num_blocks, rt.device)  # [B, width]
        pos = torch.tensor(self.cached, device=rt.device)  # [B]
        rows = torch.arange(len(items), device=rt.device)
        self.slots = self.table[rows, pos // bs] * bs + pos % bs  # [B]
        # One sequence on consecutive blocks without a sliding window (the usual first step of
        # a request): attend over views of its own slots, no gather and no mask. Same values.
        self.first = _consecutive(items[0][0], width) if len(items) == 1 and not spec.sliding_layers else None
        self.masks = None if self.first is not None else rt._masks(pos[:, None], pos + 1, width * bs, force=True)
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
        if self.first is not None:
            kc, vc = self.pool.span(layer, self.first, self.cached[0] + 1)  # [1, T, kv_heads, hd]
            attn = attend_all(q[:, None], kc, vc)
        else:
            kc, vc = self.pool.gather(layer, self.table)  # [B, S, kv_heads, hd]
            attn = attend(q[:, None], kc, vc, self.masks[spec.window(layer)])
        self.h = finish_layer(lw, spec, self.h, attn[:, 0])
        self.layer += 1

    @torch.no_grad()
    def logits(self) -> Tensor:
        # -> [B, vocab] float32
        while not self.done:
            self.run_layer()
        return self.rt._logits(self.h)


def _consecutive(block_ids: Sequence[int], width: int) -> int | None:
    """The first block id if the first `width` blocks are consecutive, else None."""
    ids = list(block_ids)[:width]
    return ids[0] if ids == list(range(ids[0], ids[0] + width)) else None
