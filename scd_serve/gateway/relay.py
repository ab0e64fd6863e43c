"""One proxied response: watch the client while waiting for the upstream, relay the body, close once.

`ClientWatch` races upstream work against the client's http.disconnect, so a client that
leaves before the first byte cancels the upstream request (Starlette cancels the relay
after that). `first_byte` bounds the wait for a decode worker's response: a worker that sends
nothing within the first-byte deadline, or stops heartbeating while the gateway waits (frozen,
SIGSTOP, its host gone), raises NoFirstByte and the request goes to another worker, since
nothing was sent yet. A stream the gateway cannot finish ends as the workers end a failed
stream (a `data: {"error": ...}` event, then `data: [DONE]`; only whole events are relayed):
when the upstream breaks, when the worker stops heartbeating mid-stream, and when the gateway
is stopping and its grace is over. Any other body is cut off then, never clean but truncated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import httpx

from scd_serve.api.sse import USAGE_COMMENT, data
from scd_serve.control.lifecycle import cancel_all
from scd_serve.errors import DeadlineExceeded, ScdError, ShuttingDown, Unavailable
from scd_serve.gateway.metrics import RequestClock

log = logging.getLogger("scd_serve.gateway")
T = TypeVar("T")
SSE_END = b"\n\n"  # what ends an event in the workers' streams (api/sse.py)
SSE_DONE = b"data: [DONE]"
POLL_S = 0.25  # how often a wait looks at the worker's heartbeats and the gateway's shutdown


class NoFirstByte(Exception):
    """The decode worker sent nothing in time (or went silent); the request may go elsewhere."""


class Closing:
    """The gateway's shutdown: streams still open `grace_s` after it began end with an error event."""

    def __init__(self):
        self.deadline: float | None = None

    def begin(self, grace_s: float) -> None:
        self.deadline = time.monotonic() + grace_s

    @property
    def due(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


class ClientWatch:
    """Resolves when the ASGI receive channel says http.disconnect (call after the body was read)."""

    def __init__(self, receive: Callable[[], Awaitable[dict]]):
        self.task = asyncio.ensure_future(self._watch(receive))

    @staticmethod
    async def _watch(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    @property
    def gone(self) -> bool:
        return self.task.done()

    async def run(self, work: Awaitable[T]) -> T | None:
        """The result (or exception) of `work`, or None when the client left first (work is cancelled)."""
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait({task, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                await cancel_all(task)
        return None if task.cancelled() else task.result()

    async def close(self) -> None:
        await cancel_all(self.task)


async def until(work: Awaitable[T], stop: Callable[[], str | None], timeout_s: float | None = None) -> T:
    """The result of `work`; `stop()` (a reason) is asked every POLL_S while it runs, and a reason,
    or `timeout_s` passing, cancels it and raises NoFirstByte."""
    task = asyncio.ensure_future(work)
    end = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not task.done():
            left = POLL_S if end is None else min(POLL_S, end - time.monotonic())
            await asyncio.wait({task}, timeout=max(left, 0.0))
            if task.done():
                break
            why = stop() or (f"nothing within {timeout_s:g} s" if end is not None and time.monotonic() >= end
                             else None)
            if why:
                raise NoFirstByte(why)
    finally:
        if not task.done():
            await cancel_all(task)
    return task.result()


async def _next(chunks: AsyncIterator[bytes]) -> bytes | None:
    return await anext(chunks, None)


class Upstream:
    """Close the upstream response and free the worker slot, exactly once (also when cancelled)."""

    def __init__(self, resp: httpx.Response, release: Callable[[], None]):
        self.resp, self.release, self.done = resp, release, False

    async def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.release()
            with anyio.CancelScope(shield=True):  # a client that left cancels the relay: close anyway
                await self.resp.aclose()


async def relay(resp: httpx.Response, done: Upstream, worker: str, request_id: str | None,
                on_broken: Callable[[], None], clock: RequestClock | None = None,
                stop: Callable[[], ScdError | None] = lambda: None) -> AsyncIterator[bytes]:
    """The upstream body; an SSE stream that breaks or is stopped (`stop()` returns the error)
    ends with an error event and [DONE]. `clock` is told of each relayed event, of a usage
    trailer (which is not relayed) and of the body's end."""
    sse = resp.headers.get("content-type", "").startswith("text/event-stream")
    pending = b""  # SSE: the bytes of an event not yet complete
    chunks = resp.aiter_raw()
    err: ScdError | None = None
    reason = lambda: getattr(stop(), "message", None)  # noqa: E731
    try:
        while True:
            if reason():  # between chunks too: a worker that keeps sending is no reason to go on
                raise NoFirstByte(reason())
            if (chunk := await until(_next(chunks), reason)) is None:
                break
            if not sse:
                if clock is not None:
                    clock.body(chunk)
                yield chunk
                continue
            pending += chunk
            cut = pending.rfind(SSE_END) + len(SSE_END)
            if cut >= len(SSE_END):
                events, pending = pending[:cut], pending[cut:]
                if clock is not None or USAGE_COMMENT in events:
                    events = _account(events, clock)
                if events:
                    yield events
        if pending:
            yield pending
    except NoFirstByte:
        err = stop() or Unavailable(f"the decode worker {worker} stopped answering")
        log.warning("request_id=%s stream from %s ended by the gateway: %s", request_id, worker, err.message)
        if not sse:
            raise
    except httpx.TransportError as exc:
        on_broken()
        log.warning("request_id=%s upstream %s broke mid-response: %s (%s)", request_id, worker,
                    type(exc).__name__, "error event sent" if sse else "cut off")
        if not sse:
            raise
        why = f"the decode worker {worker} failed mid-stream ({type(exc).__name__})"
        err = DeadlineExceeded(why) if isinstance(exc, httpx.TimeoutException) else Unavailable(why)
    finally:
        if clock is not None:
            clock.end()
        await done()
    if err is not None:
        yield (data(err.to_body(request_id)) + data("[DONE]")).encode()


def _account(events: bytes, clock: RequestClock | None) -> bytes:
    """Whole SSE events: each is counted on `clock`; a usage trailer goes to it and is dropped."""
    kept = []
    for event in events.split(SSE_END)[:-1]:
        if event.startswith(USAGE_COMMENT):
            if clock is not None:
                clock.trailer(event[len(USAGE_COMMENT):])
            continue
        if clock is not None and event.strip() != SSE_DONE:
            clock.event()  # before the yield, which returns only when the next chunk is wanted
        kept.append(event + SSE_END)
    return b"".join(kept)


def shutting_down_or_silent(closing: Closing, silent: Callable[[], bool], worker: str) -> Callable[[], ScdError | None]:
    """A relay's `stop`: the gateway's grace is over, or the worker stopped heartbeating."""
    def stop() -> ScdError | None:
        if closing.due:
            return ShuttingDown("the gateway is shutting down; retry the request")
        if silent():
            return Unavailable(f"the decode worker {worker} stopped answering mid-stream (no heartbeat)")
        return None
    return stop
