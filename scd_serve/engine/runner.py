"""Runner: the torch side of an engine step, over one preallocated KV pool.

A request filled over the wire on an otherwise idle engine gets its first decode step run
a layer at a time as its K/V lands (StepAhead, in the writing thread): when the last layer
arrives, only that layer and the LM head are left, and the engine samples the first token
from the logits that are ready instead of decoding that sequence again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from scd_serve.config.engine import EngineConfig
from scd_serve.engine.sampler import sample, token_logprobs
from scd_serve.engine.scheduler import ScheduledBatch
from scd_serve.engine.sequence import Sequence
from scd_serve.engine.sink import LayerSink

log = logging.getLogger("scd_serve.engine")


class Runner:
    def __init__(self, runtime: Any, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset()):
        self.runtime = runtime
        self.eos_token_ids = eos_token_ids  # masked by the sampler until a request's min_tokens
        self.pool = runtime.new_kv_pool(config.num_blocks, config.block_size)  # allocated once, here
        # seq_id -> first-step logits [vocab] from StepAhead; set by a writing thread before the
        # sink reports complete (so never for a fill that falls back), taken by the sequence's
        # next decode, or forgotten when it ends before one
        self._ready: dict[int, torch.Tensor] = {}
        self.num_steps_ahead = 0  # first tokens sampled from a step made ahead (engine stats)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """Cache the scheduled prefill chunks and run one decode step, in one forward where the
        runtime can (mixed_step: the weights are read once); one sampled token per decode."""
        chunks = [(seq.block_ids, seq.num_cached, seq.token_ids[seq.num_cached:seq.num_cached + n])
                  for seq, n in batch.prefills]
        # the last prompt token is a decode step: a chunk's logits serve prompt log-probabilities only
        wants = ["all" if seq.prompt_logprobs is not None else "none" for seq, _ in batch.prefills]
        rows = [self._take_ready(seq) for seq in batch.decodes]
        todo = [i for i, row in enumerate(rows) if row is None]
        steps = [(batch.decodes[i].block_ids, batch.decodes[i].num_cached, batch.decodes[i].last_token) for i in todo]
        logits = None
        mixed = getattr(self.runtime, "mixed_step", None)
        if chunks and steps and mixed is not None:
            outs, logits = mixed(self.pool, chunks, wants, steps)
        else:
            outs = self.runtime.extend(self.pool, chunks, logits=wants) if chunks else []
            if steps:
                logits = self.runtime.decode_step(self.pool, steps)  # [len(todo), vocab]
        for (seq, _), out in zip(batch.prefills, outs, strict=True):
            if seq.prompt_logprobs is not None:
                self._record_prompt_logprobs(seq, out)
        if not batch.decodes:
            return []
        if len(todo) == len(rows):
            return sample(logits, batch.decodes, self.eos_token_ids)  # nothing was made ahead: no copy
        for i, row in zip(todo, logits if logits is not None else [], strict=True):
            rows[i] = row
        return sample(torch.stack(rows), batch.decodes, self.eos_token_ids)

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """logits [n, vocab] of the chunk at positions num_cached.. : row j predicts token
        num_cached + j + 1. Only prompt tokens not yet recorded (a recompute adds nothing)."""
        start, known = seq.num_cached, len(seq.prompt_logprobs)
        first = known - start - 1  # the row that predicts the first prompt token not yet recorded
        rows = list(range(first, min(logits.shape[0], seq.num_prompt_tokens - start - 1)))
        if first < 0 or not rows:  # (first < 0: a gap, which chunks in order never leave)
            return
        targets = [seq.token_ids[start + j + 1] for j in rows]
        k = seq.request.params.prompt_logprobs
        seq.prompt_logprobs.extend(token_logprobs(logits[rows].float().cpu(), targets, [k] * len(rows)))

    def forget(self, seq: Sequence) -> None:
        """Drop a first step made ahead for a sequence that ends before its next decode."""
        self._ready.pop(seq.seq_id, None)

    def _take_ready(self, seq: Sequence) -> torch.Tensor | None:
        row = self._ready.pop(seq.seq_id, None)
        # only the step it was made for: the first one, on the filled K/V (not after a preemption)
        fresh = seq.num_output_tokens == 0 and seq.num_preemptions == 0 and seq.num_cached == seq.num_tokens - 1
        if row is None or not fresh:
            return None
        self.num_steps_ahead += 1
        return row

    def sink_for(self, seq: Sequence, on_complete=None, step_ahead: bool = True) -> LayerSink:
        """The sink a fill writes `seq`'s prompt K/V into; with step_ahead (and a runtime that can),
        its first decode step runs as the layers land (StepAhead)."""
        spec = self.runtime.spec
        block_ids, num_tokens = list(seq.block_ids), seq.num_tokens - 1
        writer = []  # the request's KVWriter (slots, rotary tables), made once; LayerSink serializes
        ahead = None
        if step_ahead and getattr(self.runtime, "begin_decode_step", None) is not None:
            item = (block_ids, num_tokens, seq.last_token)
            ahead = StepAhead(lambda: self.runtime.begin_decode_step(self.pool, [item]), spec.num_layers,
                              lambda logits: self._ready.__setitem__(seq.seq_id, logits[0]),
                              request_id=seq.request.request_id)

        def prepare() -> None:
            if not writer:
                with torch.inference_mode():
                    writer.append(self.runtime.kv_writer(self.pool, block_ids, num_tokens))
                    if ahead is not None:
                        ahead.start()

        def write(layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
            prepare()
            with torch.inference_mode():
                writer[0].write(layer, k_pre, v)
                if ahead is not None:
                    ahead.landed(layer)

        return LayerSink(write, request_id=seq.request.request_id, num_layers=spec.num_layers,
                         num_tokens=num_tokens, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                         prepare=prepare, on_complete=on_complete)


class StepAhead:
    """The first decode step of a request whose K/V is being written a layer at a time: it
    runs each layer of the step as soon as that layer and all before it have landed, and
    hands the logits to `on_logits` when the last one has. A failure here only gives up the
    head start (logged): the K/V is intact and the engine decodes the sequence as usual."""

    def __init__(self, begin: Callable[[], Any], num_layers: int, on_logits: Callable[[Any], None],
                 request_id: str = ""):
        self._begin = begin  # -> a DecodeStep (runtime.begin_decode_step); its setup runs in start()
        self._landed = [False] * num_layers
        self._on_logits = on_logits
        self._step: Any = None
        self._failed = False
        self._delivered = False
        self.request_id = request_id
        self.elapsed_s = 0.0  # time spent in the step (setup, layers, head): what it costs the writer

    def start(self) -> None:
        """Set the step up now (while the K/V is still on its way), not at the first layer."""
        if self._step is None and not self._failed and not self._delivered:
            self._guard(self._set_up)

    def landed(self, layer: int) -> None:
        if self._delivered:
            return  # the logits are out; the engine may be decoding this sequence already
        if self._step is not None and layer < self._step.layer:
            # a layer the step already read was written again (a retry from another prefill
            # worker): start over, on the K/V as it is now
            self._step, self._landed = None, [False] * len(self._landed)
        self._landed[layer] = True
        self.start()
        if self._step is not None:
            self._guard(self._advance)

    def _set_up(self) -> None:
        self._step = self._begin()

    def _advance(self) -> None:
        step = self._step
        while not step.done and self._landed[step.layer]:
            step.run_layer()
        if step.done:
            self._step, self._delivered = None, True
            self._on_logits(step.logits())  # [1, vocab]

    def _guard(self, work: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - a lost head start, never a lost request
            self._step, self._failed = None, True
            log.warning("request_id=%s first step ahead of the fill failed (%s: %s); decoding it as usual",
                        self.request_id, type(exc).__name__, exc)
        finally:
            self.elapsed_s += time.perf_counter() - t0
