"""The contract between the API (or a decode worker) and the engine: what goes in, what comes out.

Plain Python, no torch: the API imports these without loading a model.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scd_serve.errors import InvalidRequest

if TYPE_CHECKING:
    from scd_serve.engine.sink import LayerSink

MAX_SEED = 2**63 - 1


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    method: str = "local"  # transfer method: "local" (no transfer), "raw", "scd", ...
    deadline: float | None = None  # time.monotonic() by which the request must finish

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `text_delta` may be "" (held back: partial UTF-8 or a possible stop
    sequence prefix). The last event has finish_reason ("stop" | "length") and usage."""

    token_id: int | None  # None on a final event that carries only held-back text
    text_delta: str
    finish_reason: str | None = None
    usage: Usage | None = None


# A KV fill writes the K/V of prompt tokens 0..T-2 into the request's blocks through the sink
# (the transfer client implements one over gRPC). Raising fails the request.
KVFill = Callable[[GenerationRequest, "LayerSink"], Awaitable[Any]]
