"""The contract between the API (or a decode worker) and the engine: what goes in, what comes out.

Plain Python, no torch: the API imports these without loading a model.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scd_serve.config.methods import LOCAL
from scd_serve.errors import InvalidRequest

if TYPE_CHECKING:
    from scd_serve.engine.sink import LayerSink

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI allows 20 for chat, 5 for completions; vLLM 20)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


@dataclass(frozen=True)
class SamplingParams:
    """Range checks live here so the API and the engine reject the same values the same way."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 = off, else >= 1
    seed: int | None = None  # None = nondeterministic
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens below min_p x the best token's probability; 0 = off
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from each token already generated
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the output so far
    repetition_penalty: float = 1.0  # > 0; 1 = off; divides positive logits of prompt+output tokens (HF)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), bias in [-100, 100]
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings are ignored until this many tokens
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation (vLLM extension)
    logprobs: int | None = None  # None = off; k: the chosen token's log-probability and the k best
    prompt_logprobs: int | None = None  # None = off; k: the same for every prompt token (local prefill)

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}",
                                 field="temperature")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {p!r}", field="top_p")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k == 0 or k < -1:
            raise InvalidRequest(f"top_k must be -1 (off) or an integer >= 1, got {k!r}", field="top_k")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED):
            raise InvalidRequest(f"seed must be an integer in [0, 2^63-1], got {s!r}", field="seed")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {m!r}", field="max_tokens")
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise InvalidRequest("stop must be a list of non-empty strings", field="stop")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf)
        if self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}",
                                 field="repetition_penalty")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequest(f"logit_bias keys must be token ids >= 0, got {token!r}", field="logit_bias")
            _check_range("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        n = self.min_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= m:
            raise InvalidRequest(f"min_tokens must be an integer in [0, max_tokens={m}], got {n!r}",
                                 field="min_tokens")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be token ids >= 0", field="stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}", field=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shapes_logits(self) -> bool:
        """True when the logits are changed before choosing (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


def _check_range(name: str, x: Any, lo: float, hi: float) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not lo <= x <= hi:
        raise InvalidRequest(f"{name} must be a number in [{lo:g}, {hi:g}], got {x!r}", field=name)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    method: str = LOCAL  # transfer method: LOCAL (no transfer), "raw", "scd", ... (config/methods.py)
    deadline: float | None = None  # time.monotonic() by which the request must finish
    grammar: Any = None  # structured outputs: a compiled engine.grammar.Grammar the output must match
    transfer: Any = None  # the decode worker's Transfer (decode/transfer.py): what its KV fill reads; opaque here

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache held

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's own distribution (raw logits: before
    temperature, penalties or bias, as vLLM reports them), and the `k` most likely tokens."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    rank: int | None = None  # the token's place in the distribution, 1 = the most likely (vLLM's rank)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `text_delta` may be "" (held back: partial UTF-8 or a possible stop
    sequence prefix). The last event has finish_reason ("stop" | "length") and usage."""

    token_id: int | None  # None on a final event that carries only held-back text
    text_delta: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprob: TokenLogprob | None = None  # with params.logprobs
    # first event only, with params.prompt_logprobs: one per prompt token (None for the first)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    stop_reason: int | str | None = None  # last event: the stop string or stop_token_id that ended it
    queue_s: float | None = None  # last event: seconds from arrival to first admission to the batch


# A KV fill writes the K/V of prompt tokens 0..T-2 into the request's blocks through the sink
# (the transfer client implements one over gRPC). Raising fails the request.
KVFill = Callable[[GenerationRequest, "LayerSink"], Awaitable[Any]]
