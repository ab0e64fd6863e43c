"""A circuit breaker per prefill worker (plain Python): stop sending transfers to a worker
that keeps failing them, try it again with one request after a cool-down.

A grey failure (health checks answered, transfers hung or broken) would otherwise cost every
request a full timeout. closed: `failures_to_open` failures in a row open it; open: nothing
is sent for `cooldown_s`; half-open: one probe transfer, whose success closes it and whose
failure opens it again for twice as long (up to `max_cooldown_s`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class Breaker:
    def __init__(self, failures_to_open: int = 3, cooldown_s: float = 2.0, max_cooldown_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        if failures_to_open < 1 or not 0 < cooldown_s <= max_cooldown_s:
            raise ValueError("breaker needs failures_to_open >= 1 and 0 < cooldown_s <= max_cooldown_s")
        self.failures_to_open = failures_to_open
        self.base_cooldown_s, self.max_cooldown_s = cooldown_s, max_cooldown_s
        self.clock = clock
        self.state = CLOSED
        self.failures = 0  # consecutive
        self.cooldown_s, self.open_until = cooldown_s, 0.0
        self.probing = False  # half-open: the one trial transfer is in flight
        self.num_opened = 0

    def available(self) -> bool:
        """May a transfer be sent now? (No side effect: `started` claims the probe.)"""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            return self.clock() >= self.open_until
        return not self.probing

    def started(self) -> None:
        """A transfer was sent: past the cool-down it is the half-open probe."""
        if self.state == OPEN and self.clock() >= self.open_until:
            self.state = HALF_OPEN
        if self.state == HALF_OPEN:
            self.probing = True

    def succeeded(self) -> None:
        self.state, self.failures, self.probing, self.cooldown_s = CLOSED, 0, False, self.base_cooldown_s

    def failed(self) -> None:
        self.failures += 1
        if self.state == HALF_OPEN:
            self.cooldown_s = min(2 * self.cooldown_s, self.max_cooldown_s)
            self._open()
        elif self.state == CLOSED and self.failures >= self.failures_to_open:
            self._open()

    def released(self) -> None:
        """A transfer ended with no verdict on the worker (the client left, the worker was
        full): a half-open breaker may probe again."""
        self.probing = False

    def _open(self) -> None:
        self.state, self.probing = OPEN, False
        self.open_until = self.clock() + self.cooldown_s
        self.num_opened += 1

    def describe(self) -> str:
        """'' while closed; else what /ready and logs should say."""
        if self.state == CLOSED:
            return ""
        left = max(0.0, self.open_until - self.clock())
        return (f"circuit {self.state} after {self.failures} failed transfers"
                + (f" (next try in {left:.1f} s)" if self.state == OPEN and left else ""))
