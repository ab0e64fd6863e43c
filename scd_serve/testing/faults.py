"""Fault-injection seams, never reachable from a production flag: wrappers that delegate all
they do not change to the real object they wrap, so the code under test is the real code.

    FaultyRuntime(rt, fail_after_steps=3)        model forward raises (or stalls) after N steps
    FaultyProducer(rt, layer_delay_s=0.5)        prefill-side runtime: slow per layer
    FaultyServicer(servicer, corrupt_seq=1)      prefill gRPC servicer: sleep, die, corrupt a
                                                 byte, drop / duplicate a chunk, refuse calls
    on_decode(fill, before)                      before(layer) ahead of each decode_layer (stall, record)
    fail_decode_for(fill, "req-1")               codec decode_layer raises for one request id
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from scd_serve.model.runtime import PrefillIterator


class FaultyRuntime:
    """Decode-side runtime whose forward (extend / decode_step / begin_decode_step) raises or stalls after N steps."""

    def __init__(self, rt: Any, fail_after_steps: int | None = None, stall_after_steps: int | None = None,
                 stall_s: float = 0.0):
        self._rt, self.fail_after_steps = rt, fail_after_steps
        self.stall_after_steps, self.stall_s = stall_after_steps, stall_s
        self.num_steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def _step(self) -> None:
        self.num_steps += 1
        if self.stall_after_steps is not None and self.num_steps > self.stall_after_steps:
            time.sleep(self.stall_s)
        if self.fail_after_steps is not None and self.num_steps > self.fail_after_steps:
            raise RuntimeError("injected forward failure (faults.FaultyRuntime)")

    def extend(self, pool, items, logits="all"):
        self._step()
        return self._rt.extend(pool, items, logits=logits)

    def decode_step(self, pool, items):
        self._step()
        return self._rt.decode_step(pool, items)

    @property
    def begin_decode_step(self):
        """The first step of a filled request, run ahead by the engine's runner: one forward
        step here too. None when the wrapped runtime cannot (the runner then never runs ahead)."""
        begin = getattr(self._rt, "begin_decode_step", None)
        if begin is None:
            return None

        def faulty(pool, items):
            self._step()
            return begin(pool, items)
        return faulty


class FaultyProducer:
    """Prefill-side runtime that sleeps `layer_delay_s` per layer."""

    def __init__(self, rt: Any, layer_delay_s: float = 0.0):
        self._rt, self.layer_delay_s = rt, layer_delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def iter_prefill(self, ids, compute_logits: bool = True, residuals: bool = False, **kw):
        states = PrefillIterator(self._rt.iter_prefill(ids, compute_logits=compute_logits, residuals=residuals, **kw))
        for layer, state in states:
            if self.layer_delay_s:
                time.sleep(self.layer_delay_s)
            yield layer, state
        return states.logits  # what the runtime's run ends with (logits, or the final row's output)


class _Context:
    """A ServicerContext proxy whose write() goes through the servicer wrapper's faults."""

    def __init__(self, ctx: Any, owner: FaultyServicer):
        self._ctx, self._owner = ctx, owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    async def write(self, msg) -> None:
        o = self._owner
        if msg.WhichOneof("body") != "chunk":
            return await self._ctx.write(msg)
        seq = msg.chunk.seq
        if o.exit_at_chunk is not None and seq >= o.exit_at_chunk:
            os._exit(1)
        if o.stall_at_chunk is not None and seq == o.stall_at_chunk:
            await asyncio.sleep(o.stall_s)
        if seq == o.drop_seq:
            return None
        if o.mutate is not None and seq == o.mutate_seq:
            from scd_serve.transport.chunking import seal

            o.mutate(msg.chunk)
            seal(msg.chunk)  # a valid digest: only the semantic checks can catch it
        if o.swap_first_two and seq == 0:
            self._held = msg  # sent after chunk 1: out of order
            return None
        if seq == o.corrupt_seq and msg.chunk.tensors:
            data = bytearray(msg.chunk.tensors[0].data)
            data[len(data) // 2] ^= 0x01  # one bit, after the digest was computed
            msg.chunk.tensors[0].data = bytes(data)
            o.num_corrupted += 1
        await self._ctx.write(msg)
        if seq == o.duplicate_seq:
            await self._ctx.write(msg)
        if getattr(self, "_held", None) is not None and seq == 1:
            held, self._held = self._held, None
            await self._ctx.write(held)


class FaultyServicer:
    """Wraps a PrefillServicer. Faults (all off by default):
    sleep_s            sleep before the stream starts (past the caller's deadline)
    stall_at_chunk     sleep `stall_s` before writing chunk `seq`
    exit_at_chunk      os._exit(1) when chunk `seq` would be written (a crash mid-stream)
    corrupt_seq        flip one bit of chunk `seq` after it was sealed
    drop_seq           never send chunk `seq`;  duplicate_seq: send chunk `seq` twice
    fail_first         answer the first N Prefill calls with `fail_code` before any work
    mutate             fn(chunk) edits chunk `mutate_seq` in place; it is resealed (valid digest)
    swap_first_two     send chunk 1 before chunk 0
    Records `cancelled` (request ids whose handler saw CancelledError) and `calls`."""

    def __init__(self, servicer: Any, *, sleep_s: float = 0.0, stall_at_chunk: int | None = None,
                 stall_s: float = 0.0, exit_at_chunk: int | None = None, corrupt_seq: int | None = None,
                 drop_seq: int | None = None, duplicate_seq: int | None = None, fail_first: int = 0,
                 fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, mutate=None, mutate_seq: int = 0,
                 swap_first_two: bool = False, shared_calls: list | None = None):
        self.inner = servicer
        self.sleep_s, self.stall_at_chunk, self.stall_s = sleep_s, stall_at_chunk, stall_s
        self.exit_at_chunk, self.corrupt_seq = exit_at_chunk, corrupt_seq
        self.drop_seq, self.duplicate_seq = drop_seq, duplicate_seq
        self.fail_first, self.fail_code = fail_first, fail_code
        self.mutate, self.mutate_seq, self.swap_first_two = mutate, mutate_seq, swap_first_two
        self.armed = True  # False: pass every call straight through (warm-up before a test)
        # calls counted for fail_first; pass one list to several servicers to count across workers
        self.calls: list[str] = shared_calls if shared_calls is not None else []
        self.call_times: list[float] = []
        self.cancelled: list[str] = []
        self.aborts: list[tuple[str, float]] = []  # (request id, when) of Abort RPCs received
        self.deadlines: list[tuple[str, float | None]] = []  # (rpc, seconds left when it arrived)
        self.num_corrupted = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def Info(self, request, context):
        self.deadlines.append(("Info", context.time_remaining()))
        return await self.inner.Info(request, context)

    async def Abort(self, request, context):
        self.deadlines.append(("Abort", context.time_remaining()))
        self.aborts.append((request.request_id, time.monotonic()))
        return await self.inner.Abort(request, context)

    async def Prefill(self, request, context):
        rid = request.request_id
        self.deadlines.append(("Prefill", context.time_remaining()))
        if not self.armed:
            return await self.inner.Prefill(request, context)
        with self._lock:
            self.calls.append(rid)
            self.call_times.append(time.monotonic())
            n = len(self.calls)
        try:
            if n <= self.fail_first:
                await context.abort(self.fail_code, f"injected {self.fail_code.name} (faults.FaultyServicer)")
            if self.sleep_s:
                await asyncio.sleep(self.sleep_s)
            await self.inner.Prefill(request, _Context(context, self))
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


def on_decode(fill: Any, before: Callable[[int], None], request_id: str | None = None) -> Callable[[], None]:
    """Call before(layer) ahead of each decode_layer of a RemoteKVFill's transfers (every request,
    or one), in the transfer thread: a seam to stall, slow, record or fail the rebuild, through
    the fill's public `codec_hooks`. It binds at each transfer's start; returns its remover."""

    class _Hooked:
        """A request's Rebuild (codec/rebuild.py) with `before` ahead of each layer."""

        def __init__(self, rebuild):
            self._rebuild = rebuild

        def prepare(self):
            self._rebuild.prepare()

        def decode_layer(self, layer, code):
            before(layer)
            return self._rebuild.decode_layer(layer, code)

    def hook(rebuild, rid: str):
        return _Hooked(rebuild) if request_id is None or rid == request_id else rebuild

    fill.codec_hooks.append(hook)
    return lambda: fill.codec_hooks.remove(hook)


def fail_decode_for(fill: Any, request_id: str) -> list[str]:
    """Make the consumer codec's decode_layer raise for one request id on a RemoteKVFill;
    returns the list of request ids that hit the fault."""
    hits: list[str] = []

    def fail(layer: int) -> None:
        hits.append(request_id)
        raise RuntimeError("injected decode_layer failure (faults.fail_decode_for)")

    on_decode(fill, fail, request_id)
    return hits
