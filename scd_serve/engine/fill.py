"""run_fill: drive one request's KV fill (a transfer) while watching for its end.

The fill runs as a task beside a watch on the request's queue: anything arriving there
during a fill is an error from the engine (abort, deadline, shutdown, engine death), which
cancels the fill. The sink is closed by the engine before its blocks are freed, so a fill
that ignores cancellation (or is stuck in a thread) still cannot write into someone else's
blocks, and nobody waits for it to unwind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from scd_serve.engine.request import GenerationRequest, KVFill
from scd_serve.engine.sink import LayerSink
from scd_serve.errors import ScdError, TransferFailed


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
        # Not awaited: a fill stuck in a thread cannot be cancelled, and the request's error must
        # not wait for it. Safe, because the engine closes the sink before freeing the blocks.
        for t in (fill, watcher):
            t.cancel()
            t.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    """Mark an abandoned task's exception as seen (no 'exception was never retrieved' at ERROR)."""
    if not task.cancelled():
        task.exception()
