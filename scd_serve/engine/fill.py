"""run_fill: drive one request's KV fill (a transfer) while watching for its end.

The fill runs beside a watch on the request's queue: what arrives there during a fill is an
engine error (abort, deadline, shutdown, death), which cancels the fill, or, once the sink
holds every layer, the first token. The engine closes the sink before freeing its blocks,
so a fill stuck in a thread cannot write into someone else's blocks, and nobody waits for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from scd_serve.engine.request import GenerationRequest, KVFill
from scd_serve.engine.sink import LayerSink
from scd_serve.errors import ScdError, TransferFailed


async def run_fill(kv_fill: KVFill, req: GenerationRequest, sink: LayerSink,
                   watch: Callable[[], Awaitable[Any]]) -> tuple[ScdError | None, list]:
    """-> (None when every layer was written, else the fill's error; events the engine sent
    meanwhile). Errors from the watch raise. The engine decodes as soon as the sink holds
    every layer, maybe before the fill returns: a token seen then is handed back (yielded
    first), and the fill is let finish, not cancelled (that would abort a good transfer)."""
    fill = asyncio.ensure_future(kv_fill(req, sink))
    watcher = asyncio.ensure_future(watch())
    early: list = []
    try:
        await asyncio.wait({fill, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not watcher.done():
            watcher.cancel()
            await asyncio.wait({watcher})  # it may have taken an event already: never drop one
        if not watcher.cancelled():
            early.append(watcher.result())  # raises the engine's error
            if not sink.complete:
                raise RuntimeError(f"unexpected engine message during a KV fill: {type(early[0]).__name__}")
        if sink.complete:  # every layer is in (the engine may be decoding already): let the fill finish
            if not fill.done():
                left = (req.deadline - time.monotonic()) if req.deadline is not None else None
                await asyncio.wait({fill}, timeout=max(0.0, left) if left is not None else None)
            return None, early
        exc = fill.exception()
        if isinstance(exc, ScdError):
            return exc, early
        if exc is not None:
            return TransferFailed(f"KV fill failed: {type(exc).__name__}"), early
        return TransferFailed(f"KV fill wrote {sink.num_written} of {sink.num_layers} layers"), early
    finally:
        # Not awaited: a fill stuck in a thread cannot be cancelled (the sink is closed anyway);
        # its exception is marked seen (no 'exception was never retrieved' at ERROR)
        for t in (fill, watcher):
            t.cancel()
            t.add_done_callback(lambda task: task.cancelled() or task.exception())
