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

    def sink_for(self, seq: Sequence, on_complete=None) -> LayerSink:
        spec = self.runtime.spec
        block_ids, num_tokens = list(seq.block_ids), seq.num_tokens - 1
        writer = []  # the request's KVWriter (slots, rotary tables), made once; LayerSink serializes

        def prepare() -> None:
            if not writer:
                with torch.inference_mode():
                    writer.append(self.runtime.kv_writer(self.pool, block_ids, num_tokens))

        def write(layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
            prepare()
            with torch.inference_mode():
                writer[0].write(layer, k_pre, v)

        return LayerSink(write, request_id=seq.request.request_id, num_layers=spec.num_layers,
                         num_tokens=num_tokens, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                         prepare=prepare, on_complete=on_complete)
