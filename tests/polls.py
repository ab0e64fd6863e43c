"""Waiting for a condition with a deadline: poll until it holds or the time is up, never one
look after a fixed sleep (on a shared 2-core machine a test can lose the CPU for hundreds of ms).

    assert await eventually(lambda: not stack.servicer.transfers, 10), stack.servicer.transfers

The timeout is how long a *failure* takes to show, not how long a pass takes, so it is
generous; the bug a bound exists for is named next to it. `cond` may return an awaitable."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable


async def eventually(cond: Callable[[], Any], timeout: float, step: float = 0.02) -> bool:
    """True once cond() is truthy; False if it still is not after `timeout` s (checked at the end too)."""
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return True
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(step)


def eventually_sync(cond: Callable[[], Any], timeout: float, step: float = 0.01) -> bool:
    """eventually() for a thread without an event loop."""
    end = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(step)
