"""Load-aware choice of a worker: least (reported load + requests we sent since), round-robin on ties.

Between two heartbeats (~0.5 s) the reported load is stale: adding our own requests in
flight spreads a burst instead of piling it onto the worker that looked idle.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Candidate:
    address: str
    running: int = 0
    waiting: int = 0
    capacity: int = 0  # 0 = unknown


@dataclass
class LoadBalancer:
    inflight: Counter = field(default_factory=Counter)
    _turn: itertools.count = field(default_factory=itertools.count)

    def score(self, c: Candidate) -> float:
        """Load per unit of capacity; reported numbers below zero count as zero (never a bonus)."""
        load = max(c.running, 0) + max(c.waiting, 0) + self.inflight[c.address]
        return load / c.capacity if c.capacity > 0 else float(load)

    def choose(self, candidates: Iterable[Candidate], exclude: Iterable[str] = ()) -> Candidate | None:
        pool = [c for c in candidates if c.address not in set(exclude)]
        if not pool:
            return None
        best = min(self.score(c) for c in pool)
        tied = sorted((c for c in pool if self.score(c) == best), key=lambda c: c.address)
        return tied[next(self._turn) % len(tied)]

    def acquire(self, address: str) -> None:
        self.inflight[address] += 1

    def release(self, address: str) -> None:
        self.inflight[address] -= 1
        if self.inflight[address] <= 0:
            del self.inflight[address]

    @contextmanager
    def track(self, address: str):
        """Count a request against `address` while it runs (released in finally)."""
        self.acquire(address)
        try:
            yield
        finally:
            self.release(address)
