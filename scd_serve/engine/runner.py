"""Runner: the torch side of an engine step, over one preallocated KV pool."""

from __future__ import annotations

from typing import Any

import torch

from scd_serve.config.engine import EngineConfig
from scd_serve.engine.sampler import sample
from scd_serve.engine.scheduler import ScheduledBatch
from scd_serve.engine.sequence import Sequence
from scd_serve.engine.sink import LayerSink


class Runner:
    def __init__(self, runtime: Any, config: EngineConfig):
        self.runtime = runtime
        self.pool = runtime.new_kv_pool(config.num_blocks, config.block_size)  # allocated once, here

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """Cache the scheduled prefill chunks, then one decode step; one sampled token per decode."""
        if batch.prefills:
            items = [(seq.block_ids, seq.num_cached, seq.token_ids[seq.num_cached:seq.num_cached + n])
                     for seq, n in batch.prefills]
            self.runtime.extend(self.pool, items)  # logits unused: the last prompt token is a decode step
        if not batch.decodes:
            return []
        items = [(seq.block_ids, seq.num_cached, seq.last_token) for seq in batch.decodes]
        logits = self.runtime.decode_step(self.pool, items)  # [B, vocab]
        return sample(logits, batch.decodes)

    def sink_for(self, seq: Sequence) -> LayerSink:
        spec = self.runtime.spec
        block_ids = list(seq.block_ids)

        def write(layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
            with torch.inference_mode():
                self.runtime.write_kv(self.pool, block_ids, layer, k_pre, v, start=0)

        return LayerSink(write, request_id=seq.request.request_id, num_layers=spec.num_layers,
                         num_tokens=seq.num_tokens - 1, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
