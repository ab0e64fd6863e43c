"""Scheduler: continuous batching over the block manager. Plain Python, no torch.

One engine step is `batch = schedule()` -> `tokens = runner.run(batch)` ->
`postprocess(batch, tokens)`: one token for every running sequence with its prompt cached,
and up to `max_prefill_tokens` of chunked local prefill, whose last chunk also yields the
sequence's first token. Running sequences get their next
slot before waiting ones are admitted; when the pool runs dry the newest running sequence
is preempted and later recomputed locally from its tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from scd_serve.config.engine import EngineConfig
from scd_serve.engine.block_manager import BlockManager
from scd_serve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens to cache now)
    # one token each; a sequence in prefills too decodes its last prompt token in its last chunk
    decodes: list[Sequence] = field(default_factory=list)
    filling: list[Sequence] = field(default_factory=list)  # just got blocks; their KV fill may start
    preempted: list[Sequence] = field(default_factory=list)
    step_ahead: bool = False  # the one filling sequence's first decode step may run as its K/V lands

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.decodes)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_ids: frozenset[int] = frozenset()):
        self.config, self.block_manager, self.eos_token_ids = config, block_manager, eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.filling: dict[int, Sequence] = {}
        self.running: list[Sequence] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.filling or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        for seq in list(self.running):  # oldest first
            if seq.status is not SequenceStatus.RUNNING or seq.num_to_prefill:
                continue
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.may_append(seq)
                batch.decodes.append(seq)
        if not batch.preempted:  # re-admitting right after a preemption would only thrash
            self._admit(batch)
        budget = self.config.max_prefill_tokens
        for seq in self.running:
            if budget and seq.num_to_prefill:
                n = min(seq.num_to_prefill, budget)
                batch.prefills.append((seq, n))
                budget -= n
                if n == seq.num_to_prefill:  # the last chunk carries the last prompt token too: one step
                    batch.decodes.append(seq)  # to the first output token, as a prefill's last row gives it
        # Only on an otherwise idle engine: there the step hides in the wait for bytes; under load
        # it would take the CPU from the batch, which decodes that step for a fraction of the cost.
        batch.step_ahead = not self.running and len(self.filling) == len(batch.filling) == 1
        return batch

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int]) -> list[Sequence]:
        """Advance prefills, append one token per decode; returns the sequences that finished."""
        for seq, n in batch.prefills:
            seq.num_cached += n
            self.block_manager.cache_full_blocks(seq)
        finished = []
        for seq, token in zip(batch.decodes, token_ids, strict=True):
            seq.append_token(token)
            self.block_manager.cache_full_blocks(seq)
            params = seq.request.params
            if token in params.stop_token_ids:
                self.finish(seq, "stop")
                seq.stop_reason = token  # vLLM reports the id; EOS leaves it None
            elif token in self.eos_token_ids and (not params.ignore_eos or seq.grammar is not None):
                # (a grammar ends at an end token: its matcher took it, and allows nothing after)
                self.finish(seq, "stop")
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                self.finish(seq, "length")
            else:
                continue
            finished.append(seq)
        return finished

    def fill_done(self, seq: Sequence, num_filled: int | None = None) -> None:
        """The KV fill wrote tokens num_prefix_cached..num_filled-1 (default T-1; those before
        were cached): the sequence prefills the rest of its prompt but the last token here (a
        replayed tail), then decodes from that token."""
        handoff = seq.num_tokens - 1
        filled = handoff if num_filled is None else num_filled
        if not seq.num_prefix_cached <= filled <= handoff:
            raise ValueError(f"a fill of {filled} tokens for a handoff of {handoff}")
        if self.filling.pop(seq.seq_id, None) is None:
            return  # aborted meanwhile
        seq.num_cached, seq.status = filled, SequenceStatus.RUNNING
        self.block_manager.cache_full_blocks(seq)
        self.running.append(seq)

    def fill_failed(self, seq: Sequence) -> bool:
        """Fallback: the fill broke off, so prefill locally into the blocks it already holds
        (after its cached prefix, whose blocks others may hold too)."""
        if self.filling.pop(seq.seq_id, None) is None:
            return False
        seq.needs_fill, seq.num_cached, seq.status = False, seq.num_prefix_cached, SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove from every queue and free its blocks. Idempotent; reachable from every state."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.FILLING:
            del self.filling[seq.seq_id]
        else:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def expired(self, now: float) -> list[tuple[Sequence, str]]:
        """Sequences past their deadline ("deadline") or queued too long ("queue_timeout")."""
        out = []
        for seq in [*self.waiting, *self.filling.values(), *self.running]:
            deadline = seq.request.deadline
            if deadline is not None and now >= deadline:
                out.append((seq, "deadline"))
            elif (seq.status is SequenceStatus.WAITING
                  and now - seq.waiting_since >= self.config.queue_timeout_s):
                out.append((seq, "queue_timeout"))
        return out

    def _admit(self, batch: ScheduledBatch) -> None:
        while self.waiting and len(self.running) + len(self.filling) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # a prompt starts from its longest cached prefix (prompt log-probabilities need the
            # forward pass over every prompt token); a fill writes only the rest
            lookup = seq.prompt_logprobs is None
            if not self.block_manager.can_allocate(seq, lookup):
                break  # FIFO: no overtaking, so a long prompt is not starved by short ones
            self.waiting.popleft()
            seq.num_cached = self.block_manager.allocate(seq, lookup)
            if not seq.num_preemptions:
                seq.num_prefix_cached = seq.num_cached
            if seq.queue_s is None:
                seq.queue_s = time.monotonic() - seq.waiting_since
            if seq.needs_fill:
                seq.status = SequenceStatus.FILLING
                self.filling[seq.seq_id] = seq
                batch.filling.append(seq)
            else:
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                if not seq.num_to_prefill:  # a 1-token prompt: its blocks already hold the first slot
                    batch.decodes.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_cached = 0
        seq.needs_fill = False  # recompute locally from prompt + output so far
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        seq.waiting_since = time.monotonic()  # the queue timeout counts from the preemption
