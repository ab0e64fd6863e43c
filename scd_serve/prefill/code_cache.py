"""Bounded LRU cache of encoded codes, so a repeated prompt skips the producer entirely.

Keyed by (method, token ids): an exact prompt match. Codes are kept as the Tensor
messages already built for the wire, one list per layer. Bounded by bytes and entries.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def cache_key(method: str, codec_version: str, token_ids, start: int = 0) -> tuple[str, str, int, int, bytes]:
    """Codes of token_ids[start:] by `method` in that codec's version (one entry per codebook;
    the producer's pass saw all of token_ids)."""
    digest = hashlib.blake2b(array("I", token_ids).tobytes(), digest_size=16).digest()
    return (method, codec_version, len(token_ids), start, digest)


class CodeCache:
    def __init__(self, max_bytes: int, max_entries: int):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[tuple, tuple[list[list], int]] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key) -> list[list] | None:
        """Per-layer Tensor message lists, or None; a hit becomes most recent."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self.num_hits += 1
        return entry[0]

    def put(self, key, layers: list[list]) -> bool:
        """Store codes; False if they alone exceed the byte budget (nothing is evicted then)."""
        size = sum(len(t.data) for tensors in layers for t in tensors)
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old[1]
        while self._entries and (self.num_bytes + size > self.max_bytes or len(self._entries) >= self.max_entries):
            _, (_, evicted) = self._entries.popitem(last=False)
            self.num_bytes -= evicted
        self._entries[key] = (layers, size)
        self.num_bytes += size
        return True
