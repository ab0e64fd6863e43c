"""Engine settings: KV pool size, batch limits, admission and deadlines."""

from __future__ import annotations

from dataclasses import dataclass

from scd_serve.errors import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    # Paged KV pool, preallocated once at start: num_blocks * block_size token slots.
    block_size: int = 16
    num_blocks: int = 512
    max_model_len: int = 2048  # longest prompt + generated tokens
    max_num_seqs: int = 32  # sequences holding KV blocks at once (the decode batch bound)
    max_concurrent: int = 128  # requests admitted at once (holding or waiting for blocks); then 429
    max_prefill_tokens: int = 512  # local prefill per step (chunked, so decode steps stay short)
    queue_timeout_s: float = 30.0  # longest wait for KV blocks / a batch slot, then 504
    request_timeout_s: float = 300.0  # deadline of a request that carries none
    stall_timeout_s: float = 10.0  # one loop iteration longer than this: stalled (ready() false)
    idle_poll_s: float = 0.05  # an idle loop wakes this often (deadlines, liveness)
    retry_after_s: int = 1  # sent with 429
    fallback_to_local: bool = True  # a failed KV fill prefills locally instead of failing the request
    # Keep full K/V blocks after their request ends and reuse them for prompts that start with the
    # same tokens (multi-turn chats, shared system prompts); evicted LRU when the pool needs room.
    prefix_caching: bool = True
    # Structured outputs: the most whitespace characters between two JSON elements (0: none, compact
    # JSON). Bounded so that a small or unsure model cannot spend max_tokens on blanks; 16 leaves
    # room for pretty-printed nesting.
    json_whitespace: int = 16
    # --seed: requests without a seed draw theirs from one stream seeded with this, in arrival
    # order, so a fresh server answers the same unseeded requests alike (None: from entropy)
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_model_len", "max_num_seqs", "max_concurrent",
                     "max_prefill_tokens", "retry_after_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"engine.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.json_whitespace, int) or isinstance(self.json_whitespace, bool) \
                or not 0 <= self.json_whitespace <= 1024:
            raise ConfigError(f"engine.json_whitespace must be an integer in [0, 1024], got {self.json_whitespace!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            raise ConfigError(f"engine.seed must be an integer in [0, 2^63), got {self.seed!r}")
        for name in ("queue_timeout_s", "request_timeout_s", "stall_timeout_s", "idle_poll_s"):
            value = getattr(self, name)
            if not (0 < value <= 86400):
                raise ConfigError(f"engine.{name} must be in (0, 86400] seconds, got {value!r}")
        if self.num_blocks * self.block_size < self.max_model_len:
            # otherwise a single sequence could run out of blocks with nobody left to preempt
            raise ConfigError(
                f"engine KV pool holds {self.num_blocks * self.block_size} tokens "
                f"(num_blocks {self.num_blocks} x block_size {self.block_size}), "
                f"less than max_model_len {self.max_model_len}")
        if self.max_concurrent < self.max_num_seqs:
            raise ConfigError(f"engine.max_concurrent ({self.max_concurrent}) must be >= "
                              f"max_num_seqs ({self.max_num_seqs})")
        if self.idle_poll_s >= self.stall_timeout_s:
            raise ConfigError("engine.idle_poll_s must be shorter than stall_timeout_s")
