"""One proxied response: watch the client while waiting for the upstream, relay the body, close once.

`ClientWatch` races upstream work against the client's http.disconnect, so a client that
leaves before the first byte cancels the upstream request (Starlette cancels the relay
after that). If the upstream breaks mid-body, an SSE stream ends as the workers end a
failed stream (a `data: {"error": ...}` event, then `data: [DONE]`; only whole events are
relayed); any other body is cut off, never clean but truncated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import httpx

from scd_serve.api.sse import data
from scd_serve.control.lifecycle import cancel_all
from scd_serve.errors import DeadlineExceeded, Unavailable
from scd_serve.gateway.metrics import RequestClock

log = logging.getLogger("scd_serve.gateway")
T = TypeVar("T")
SSE_END = b"\n\n"  # what ends an event in the workers' streams (api/sse.py)
SSE_DONE = b"data: [DONE]"


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
                on_broken: Callable[[], None], clock: RequestClock | None = None) -> AsyncIterator[bytes]:
    """The upstream body; an SSE stream that breaks ends with an error event and [DONE].
    `clock` is told of each relayed event and of the body's end."""
    sse = resp.headers.get("content-type", "").startswith("text/event-stream")
    pending = b""  # SSE: the bytes of an event not yet complete
    try:
        async for chunk in resp.aiter_raw():
            if not sse:
                yield chunk
                continue
            pending += chunk
            cut = pending.rfind(SSE_END) + len(SSE_END)
            if cut >= len(SSE_END):
                if clock is not None:  # before the yield, which returns only when the next chunk is wanted
                    for event in pending[:cut].split(SSE_END)[:-1]:
                        if event.strip() != SSE_DONE:
                            clock.event()
                yield pending[:cut]
                pending = pending[cut:]
        if pending:
            yield pending
    except httpx.TransportError as exc:
        on_broken()
        log.warning("request_id=%s upstream %s broke mid-response: %s (%s)", request_id, worker,
                    type(exc).__name__, "error event sent" if sse else "cut off")
        if not sse:
            raise
        why = f"the decode worker {worker} failed mid-stream ({type(exc).__name__})"
        err = DeadlineExceeded(why) if isinstance(exc, httpx.TimeoutException) else Unavailable(why)
        yield (data(err.to_body(request_id)) + data("[DONE]")).encode()
    finally:
        if clock is not None:
            clock.end()
        await done()
