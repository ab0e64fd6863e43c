"""What the engine needs from a model runtime (model/runtime.py's ModelRuntime; testing's FakeRuntime).

Items are (block_ids, num_cached, tokens) for prompt chunks and (block_ids, num_cached,
last_token) for decode steps; the pool is the runtime's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class KVWriterLike(Protocol):
    def write(self, layer: int, k_pre: Any, v: Any) -> None:
        """k_pre, v: [tokens, kv_heads, head_dim] of one layer, keys before RoPE."""


class Runtime(Protocol):
    spec: Any  # num_layers, num_kv_heads, head_dim (and max_position_embeddings where known)
    tokenizer: Any
    path: Any  # the model directory (generation_config.json), or None
    # One forward for prompt chunks and decode steps together (weights read once); None: two forwards.
    # (pool, chunks, chunk_logits, steps) -> (chunk outputs, decode logits [len(steps), vocab])
    mixed_step: Callable[..., tuple[list, Any]] | None
    # The first decode step of a filled request, a layer at a time (engine/step_ahead.py); None: no head start.
    begin_decode_step: Callable[..., Any] | None

    def new_kv_pool(self, num_blocks: int, block_size: int) -> Any: ...

    def extend(self, pool: Any, items: Sequence[tuple[Sequence[int], int, Any]],
               logits: str | Sequence[str] = "all") -> list[Any]:
        """Cache each item's tokens; per item its logits rows ("all" | "last") or None ("none")."""

    def decode_step(self, pool: Any, items: Sequence[tuple[Sequence[int], int, int]]) -> Any:
        """One token per item; -> logits [len(items), vocab]."""

    def kv_writer(self, pool: Any, block_ids: Sequence[int], num_tokens: int) -> KVWriterLike: ...
