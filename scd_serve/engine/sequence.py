"""Sequence: one request's state inside the engine (tokens, blocks, progress). No torch."""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto
from typing import Any

from scd_serve.engine.request import GenerationRequest

_ids = itertools.count()


def cache_namespace(method: str, fill: bool) -> str:
    """Whose K/V a sequence's blocks hold, for the prefix cache: the consumer's own prefill, or
    a fill's by `method` (rebuilt or shipped: other numbers), so that a prefix is only reused
    where it was made the same way."""
    return f"fill:{method}" if fill else "local"


class SequenceStatus(Enum):
    WAITING = auto()  # admitted, waiting for KV blocks and a batch slot
    FILLING = auto()  # holds blocks; a KV fill (transfer) is writing the prompt's K/V
    RUNNING = auto()  # in the batch: local prefill chunks, then one decode step per engine step
    FINISHED = auto()


class Sequence:
    """Tokens 0..num_cached-1 have K/V in the pool; the next step feeds token num_cached. Every
    sequence gets the K/V of token_ids[:-1] (local prefill, a remote fill, or a recompute after
    preemption), then decodes from its last token: the first decode step yields the first output
    (a local prefill's last chunk is that step too: it runs the last token with the chunk)."""

    def __init__(self, request: GenerationRequest, *, needs_fill: bool = False):
        self.seq_id = next(_ids)
        self.request = request
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix-cache keys of its leading full blocks (block manager)
        self.num_cached = 0
        # prompt tokens whose K/V came from the prefix cache at (first) admission; a fill writes
        # from there (a filling sequence has never been preempted: a preemption recomputes locally)
        self.num_prefix_cached = 0
        self.status = SequenceStatus.WAITING
        self.needs_fill = needs_fill  # cleared after a preemption: recompute is local
        # Fixed for the sequence's life: what it computes after a cached prefix or a fill attends
        # to that K/V, even after a preemption or a fallback
        self.cache_namespace = cache_namespace(request.method, needs_fill)
        self.waiting_since = time.monotonic()  # the queue timeout counts from here; reset on preemption
        self.queue_s: float | None = None  # arrival -> first admission (set once; vLLM's queue time)
        self.finish_reason: str | None = None
        self.sampler_state: Any = None  # the sampler's per-sequence RNG; opaque here
        self.seed: int | None = request.params.seed  # the RNG's seed (the engine's --seed stream gives one)
        # structured outputs: the grammar's matcher, advanced by the sampler; opaque here
        self.grammar: Any = request.grammar.matcher() if request.grammar is not None else None
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # params.prompt_logprobs: one TokenLogprob per prompt token, filled by the local prefill
        # (the first token has no context, so None); a recompute after preemption adds nothing
        want = request.params.prompt_logprobs is not None
        self.prompt_logprobs: list[Any] | None = [None] if want else None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request.request_id!r}, tokens={self.num_tokens}, "
                f"cached={self.num_cached}, blocks={len(self.block_ids)}, {self.status.name})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_to_prefill(self) -> int:
        """Tokens still to be cached before the sequence can decode (all but the last)."""
        return max(0, self.num_tokens - 1 - self.num_cached)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.num_cached = self.num_tokens  # the fed token (old last) now has K/V in the pool
        self.token_ids.append(token_id)
