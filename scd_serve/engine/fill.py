"""run_fill: drive one request's KV fill (a transfer) while watching for its end.

The fill runs as a task beside a watch on the request's queue: anything arriving there
during a fill is an error from the engine (abort, deadline, shutdown, engine death), which
cancels the fill. The sink is closed by the engine before its blocks are freed, so a fill
that ignores cancellation still cannot write into someone else's blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from scd_serve.engine.request import GenerationRequest, KVFill
from scd_serve.engine.sink import LayerSink
from scd_serve.errors import ScdError, TransferFailed

_CANCEL_WAIT_S = 1.0  # how long we wait for a cancelled fill to unwind


async def run_fill(kv_fill: KVFill, req: GenerationRequest, sink: LayerSink,
                   watch: Callable[[], Awaitable[Any]]) -> ScdError | None:
    """None when every layer was written; the fill's error otherwise. Errors from the watch raise."""
    fill = asyncio.ensure_future(kv_fill(req, sink))
    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({fill, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            item = watcher.result()  # raises the engine's error
            raise RuntimeError(f"unexpected engine message during a KV fill: {type(item).__name__}")
        exc = fill.exception()
        if isinstance(exc, ScdError):
            return exc
        if exc is not None:
            return TransferFailed(f"KV fill failed: {type(exc).__name__}")
        if not sink.complete:
            return TransferFailed(f"KV fill wrote {sink.num_written} of {sink.num_layers} layers")
        return None
    finally:
        pending = [t for t in (fill, watcher) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=_CANCEL_WAIT_S)
