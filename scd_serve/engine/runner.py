"""Runner: the torch side of an engine step, over one preallocated KV pool.

A request filled over the wire on an otherwise idle engine gets its first decode step run a
layer at a time as its K/V lands (StepAhead); the engine samples from those logits instead
of decoding that sequence again.
"""

from __future__ import annotations

import torch

from scd_serve.config.engine import EngineConfig
from scd_serve.engine.grammar import TokenMask
from scd_serve.engine.sampler import Sampled, sample, token_logprobs
from scd_serve.engine.scheduler import ScheduledBatch
from scd_serve.engine.sequence import Sequence
from scd_serve.engine.runtime_protocol import Runtime
from scd_serve.engine.sink import LayerSink
from scd_serve.engine.step_ahead import StepAhead
from scd_serve.errors import TransferCorrupt


class Runner:
    def __init__(self, runtime: Runtime, config: EngineConfig, eos_token_ids: frozenset[int] = frozenset()):
        self.runtime = runtime
        self.eos_token_ids = eos_token_ids  # masked by the sampler until a request's min_tokens
        self.pool = runtime.new_kv_pool(config.num_blocks, config.block_size)  # allocated once, here
        # seq_id -> (first-step logits [vocab], whether the prefill worker made them: a last-row
        # handoff; else StepAhead); set by a writing thread before the sink reports complete (so
        # never for a fill that falls back), taken by the sequence's next decode, or forgotten
        # when it ends before one
        self._ready: dict[int, tuple[torch.Tensor, bool]] = {}
        self.num_steps_ahead = 0  # first tokens sampled from a step run as the fill landed (StepAhead)
        self.num_last_rows = 0  # first tokens sampled from the prefill worker's last row
        self.mask = TokenMask()  # structured outputs' bitmask, allocated on the first constrained step
        self.ran_forward = False  # whether the last run() called the model (else: logits made ahead only)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> Sampled:
        """Cache the scheduled prefill chunks and run one decode step, in one forward where the
        runtime can (mixed_step: the weights are read once); per decode, a sampled token (or why
        there is none) and its log-probability where asked for."""
        # a sequence's last chunk runs its last prompt token too (the scheduler put it in decodes):
        # that row's logits are its first decode's, so the first token takes one forward, not two
        last = {seq.seq_id for seq in batch.decodes if seq.num_to_prefill}
        chunks = [(seq.block_ids, seq.num_cached,
                   seq.token_ids[seq.num_cached:seq.num_cached + n + (seq.seq_id in last)]) for seq, n in batch.prefills]
        wants = ["all" if seq.prompt_logprobs is not None else "last" if seq.seq_id in last else "none"
                 for seq, _ in batch.prefills]
        rows = [None if seq.seq_id in last else self._take_ready(seq) for seq in batch.decodes]
        todo = [i for i, (seq, row) in enumerate(zip(batch.decodes, rows)) if row is None and seq.seq_id not in last]
        steps = [(batch.decodes[i].block_ids, batch.decodes[i].num_cached, batch.decodes[i].last_token) for i in todo]
        logits = None
        # whether this step ran the model: one that only sampled logits made ahead proves nothing
        # about the forward (the engine's count of failing steps in a row goes on over it)
        self.ran_forward = bool(chunks or steps)
        if chunks and steps and self.runtime.mixed_step is not None:
            outs, logits = self.runtime.mixed_step(self.pool, chunks, wants, steps)
        else:
            outs = self.runtime.extend(self.pool, chunks, logits=wants) if chunks else []
            if steps:
                logits = self.runtime.decode_step(self.pool, steps)  # [len(todo), vocab]
        at = {seq.seq_id: i for i, seq in enumerate(batch.decodes)}
        for (seq, _), out in zip(batch.prefills, outs, strict=True):
            if seq.prompt_logprobs is not None:
                self._record_prompt_logprobs(seq, out)
            if seq.seq_id in last:
                rows[at[seq.seq_id]] = out[-1]
        if not batch.decodes:
            return Sampled([])
        if len(todo) == len(rows):
            return sample(logits, batch.decodes, self.eos_token_ids, self.mask)  # nothing was made ahead: no copy
        for i, row in zip(todo, logits if logits is not None else [], strict=True):
            rows[i] = row
        return sample(torch.stack(rows), batch.decodes, self.eos_token_ids, self.mask)

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
        ready = self._ready.pop(seq.seq_id, None)
        # only the step it was made for: the first one, on the filled K/V (not after a preemption)
        fresh = seq.num_output_tokens == 0 and seq.num_preemptions == 0 and seq.num_cached == seq.num_tokens - 1
        if ready is None or not fresh:
            return None
        row, by_producer = ready
        if by_producer:
            self.num_last_rows += 1
        else:
            self.num_steps_ahead += 1
        return row

    def sink_for(self, seq: Sequence, on_complete=None, step_ahead: bool = True) -> LayerSink:
        """The sink a fill writes `seq`'s prompt K/V into; with step_ahead (and a runtime that can),
        its first decode step runs as the layers land (StepAhead)."""
        spec = self.runtime.spec
        block_ids, start, num_tokens = list(seq.block_ids), seq.num_prefix_cached, seq.num_tokens - 1
        ahead = None
        if step_ahead and self.runtime.begin_decode_step is not None:
            item = (block_ids, num_tokens, seq.last_token)
            ahead = StepAhead(lambda: self.runtime.begin_decode_step(self.pool, [item]), spec.num_layers,
                              lambda logits: self._ready.__setitem__(seq.seq_id, (logits[0], False)),
                              request_id=seq.request.request_id)
        fill = _FillWriter(lambda n: self.runtime.kv_writer(self.pool, block_ids, n - start, start),  # start..n-1
                           num_tokens, ahead)
        last = None
        if getattr(self.runtime, "logits_of", None) is not None:
            last = _LastRow(lambda: self.runtime.kv_writer(self.pool, block_ids, 1, num_tokens),  # slot T-1
                            self.runtime, lambda logits: self._ready.__setitem__(seq.seq_id, (logits[0], True)),
                            fill)
        return LayerSink(fill.write, request_id=seq.request.request_id, num_layers=spec.num_layers,
                         num_tokens=num_tokens, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, start=start,
                         prepare=fill.prepare, on_complete=on_complete, on_limit=fill.limit,
                         write_last=last.write if last is not None else None)


class _FillWriter:
    """One fill's writes into the pool: the request's KV writer (slots, rotary tables) made once,
    before the first layer, and the step ahead told of each layer. LayerSink serializes calls."""

    def __init__(self, make_writer, num_tokens: int, ahead: StepAhead | None):
        self._make_writer, self._num_tokens, self._writer, self._ahead = make_writer, num_tokens, None, ahead

    def limit(self, num_tokens: int) -> None:
        """A fill of fewer tokens (a replayed tail): its own writer, and no step ahead, since the
        engine prefills the tail before the first decode step."""
        self._num_tokens, self._writer, self._ahead = num_tokens, None, None

    def drop_step_ahead(self) -> None:
        self._ahead = None

    def prepare(self) -> None:
        if self._writer is None:
            with torch.inference_mode():
                self._writer = self._make_writer(self._num_tokens)
                if self._ahead is not None:
                    self._ahead.start()

    def write(self, layer: int, k_pre: torch.Tensor, v: torch.Tensor) -> None:
        # k_pre, v: [tokens from the sink's start, kv_heads, head_dim] of one layer, keys before RoPE
        self.prepare()
        with torch.inference_mode():
            self._writer.write(layer, k_pre, v)
            if self._ahead is not None:
                self._ahead.landed(layer)


class _LastRow:
    """The prompt's last row as the producer computed it (the last-row handoff): each layer's K/V
    written at slot T-1, and once every layer's is in, the final output's logits handed over as
    the first step's. The fill's step ahead is dropped at the first row: it would compute the same."""

    def __init__(self, make_writer, runtime, on_logits, fill: _FillWriter):
        self._make_writer, self._rt, self._on_logits, self._fill = make_writer, runtime, on_logits, fill
        self._writer, self._layers = None, set()

    def write(self, layer: int, k_pre: torch.Tensor, v: torch.Tensor, h: torch.Tensor | None) -> None:
        # k_pre, v: [1, kv_heads, head_dim] of one layer, keys before RoPE; h: [1, hidden] or None
        spec = self._rt.spec
        if h is not None and h.shape[-1] != spec.hidden_size:
            raise TransferCorrupt(f"last.h has {h.shape[-1]} columns; the model's hidden size is {spec.hidden_size}")
        self._fill.drop_step_ahead()
        with torch.inference_mode():
            if self._writer is None:
                self._writer = self._make_writer()
            # a producer may run another dtype
            self._writer.write(layer, k_pre.to(self._rt.dtype), v.to(self._rt.dtype))
            self._layers.add(layer)
            if h is not None and len(self._layers) == spec.num_layers:
                logits = self._rt.logits_of(h.to(self._rt.dtype))  # [1, vocab] float32
                if not bool(torch.isfinite(logits).all()):
                    raise TransferCorrupt("last.h gives non-finite logits: refused")
                self._on_logits(logits)
