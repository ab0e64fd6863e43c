"""LayerSink: where a KV fill writes one request's prompt K/V, layer by layer. Every write is
checked (layer range, shape) before it touches the pool; once closed (aborted, failed, timed
out) it refuses writes, so a late chunk never lands in blocks freed for another request.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any

from scd_serve.errors import TransferCorrupt, TransferFailed


class LayerSink:
    def __init__(self, write: Callable[[int, Any, Any], None], *, request_id: str, num_layers: int,
                 num_tokens: int, kv_heads: int, head_dim: int, start: int = 0,
                 prepare: Callable[[], None] | None = None,
                 on_complete: Callable[[], None] | None = None, on_limit: Callable[[int], None] | None = None,
                 write_last: Callable[[int, Any, Any, Any], None] | None = None):
        self._write = write  # (layer, k_pre, v) -> stores into this request's blocks
        # (layer, k_pre, v, h or None) -> the prompt's last row (write_last_row); None: not taken here
        self._write_last = write_last
        self._prepare = prepare  # per-request work before the first write (idempotent)
        # Called once, in the writing thread, as the last layer lands: the engine can start
        # decoding without waiting for the fill to report back through the event loop.
        self._on_complete = on_complete
        self._on_limit = on_limit  # told the new token count when a fill covers fewer (limit)
        self.request_id = request_id
        self.num_layers = num_layers
        # Writes cover prompt positions start..num_tokens-1: start > 0 after a cached prefix;
        # num_tokens is T-1, every prompt token but the last (fewer after limit)
        self.start, self.num_tokens = start, num_tokens
        if not 0 <= start < num_tokens:
            raise ValueError(f"a sink from position {start} for {num_tokens} tokens")
        self.shape = (num_tokens - start, kv_heads, head_dim)
        self._handoff = num_tokens
        self._lock, self._closed = threading.Lock(), False
        self._written: set[int] = set()

    @property
    def complete(self) -> bool:
        return len(self._written) == self.num_layers

    @property
    def closed(self) -> bool:
        """The request no longer takes K/V (aborted, timed out, filled, fell back)."""
        return self._closed

    @property
    def num_written(self) -> int:
        return len(self._written)

    def limit(self, num_tokens: int) -> None:
        """The fill writes K/V up to position `num_tokens` of the T-1 only (a codec's replayed
        tail, codec/base.py): the engine prefills the rest itself. Before every write of an
        attempt; a retry may set it again."""
        if not self.start < num_tokens <= self._handoff:
            raise TransferFailed(f"a fill to position {num_tokens} does not fit positions {self.start}.."
                                 f"{self._handoff - 1}")
        with self._lock:
            if num_tokens == self.num_tokens:
                return
            self.num_tokens, self.shape = num_tokens, (num_tokens - self.start, *self.shape[1:])
            self._written.clear()  # an earlier attempt's layers were of the other length
            if self._on_limit is not None:
                self._on_limit(num_tokens)

    @property
    def takes_last_row(self) -> bool:
        """Whether write_last_row lands (the engine can take its first token from it)."""
        return self._write_last is not None and self.num_tokens == self._handoff

    def write_last_row(self, layer: int, k_pre: Any, v: Any, h: Any = None) -> None:
        """The prompt's last token's row of one layer, where the producer computed it (the
        last-row handoff, PrefillRequest.last_token), before that layer's write_layer; with
        the last layer, its output h [1, hidden]: the engine samples the first token from it
        instead of a decode step of its own. Ignored where not taken (takes_last_row)."""
        # k_pre, v: [1, kv_heads, head_dim], k before RoPE; h: [1, hidden]
        layer = self._check_layer(layer)
        for name, t in (("last.k", k_pre), ("last.v", v)):
            if t is None or tuple(t.shape) != (1, *self.shape[1:]):
                shape = None if t is None else tuple(t.shape)
                raise TransferCorrupt(f"layer {layer} {name} has shape {shape}, expected {(1, *self.shape[1:])}")
        if h is not None and (h.dim() != 2 or h.shape[0] != 1):
            raise TransferCorrupt(f"layer {layer} last.h has shape {tuple(h.shape)}, expected (1, hidden)")
        with self._lock:
            if self._closed:
                raise TransferFailed(f"request {self.request_id} no longer accepts K/V (aborted or timed out)")
            if self.takes_last_row:
                self._write_last(layer, k_pre, v, h)

    def _check_layer(self, layer: Any) -> int:
        try:
            layer = operator.index(layer)  # int, numpy or 0-d tensor integers; not floats
        except TypeError:
            raise TransferCorrupt(f"layer must be an integer, got {type(layer).__name__}") from None
        if not 0 <= layer < self.num_layers:
            raise TransferCorrupt(f"layer {layer} outside 0..{self.num_layers - 1}")
        return layer

    def write_layer(self, layer: int, k_pre: Any, v: Any) -> None:
        # k_pre, v: [num_tokens - start, kv_heads, head_dim]; k before RoPE (the pool rotates it)
        layer = self._check_layer(layer)
        for name, t in (("k", k_pre), ("v", v)):
            if tuple(t.shape) != self.shape:
                raise TransferCorrupt(f"layer {layer} {name} has shape {tuple(t.shape)}, expected {self.shape}")
        with self._lock:  # close() waits for a write in progress
            if self._closed:
                raise TransferFailed(f"request {self.request_id} no longer accepts K/V (aborted or timed out)")
            self._write(layer, k_pre, v)
            self._written.add(layer)
            done_now = self.complete and self._on_complete is not None
            if done_now:
                callback, self._on_complete = self._on_complete, None
        if done_now:
            callback()

    def prepare(self) -> None:
        """Do the per-request setup now (e.g. while the codes are on their way) rather than
        in the first write; a closed sink skips it."""
        with self._lock:
            if not self._closed and self._prepare is not None:
                self._prepare()

    def close(self) -> None:
        with self._lock:
            self._closed = True
