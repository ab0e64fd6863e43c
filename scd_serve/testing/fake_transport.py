"""In-process fake transport: a PrefillClient look-alike that calls a servicer directly.

Same messages, no sockets: tests count prefill calls and take workers down without starting
a gRPC server. Errors surface as grpc.aio.AioRpcError, as through a real channel.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from scd_serve.config.transport import TransportConfig
from scd_serve.transport.proto import pb
from scd_serve.transport.status import rpc_error


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class FakeContext:
    """The part of grpc.aio.ServicerContext the prefill servicer uses."""

    def __init__(self, timeout: float | None):
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=1)  # like a full window: writer waits for reader

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def write(self, msg) -> None:
        await self.queue.put(msg)

    def set_trailing_metadata(self, md) -> None:
        pass

    async def abort(self, code, details="") -> None:
        raise _Abort(code, details)


class FakeCall:
    """Async iterator over the servicer's stream; ends with AioRpcError on abort/deadline."""

    def __init__(self, servicer, request, timeout: float | None):
        self.ctx = FakeContext(timeout)
        self._task = asyncio.ensure_future(servicer.Prefill(request, self.ctx))

    def cancel(self) -> bool:
        return self._task.cancel()

    def __aiter__(self):
        return self

    async def __anext__(self):
        getter = asyncio.ensure_future(self.ctx.queue.get())
        try:
            await asyncio.wait({getter, self._task}, timeout=self.ctx.time_remaining(),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        if not self._task.done():  # the deadline passed: what the real channel would raise
            self._task.cancel()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if self._task.cancelled():
            raise rpc_error(grpc.StatusCode.CANCELLED, "cancelled")
        exc = self._task.exception()
        if isinstance(exc, _Abort):
            raise rpc_error(exc.code, exc.details)
        if exc is not None:
            raise rpc_error(grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
        raise StopAsyncIteration


class FakePrefillClient:
    """Drop-in for transport.client.PrefillClient backed by an in-process servicer."""

    def __init__(self, servicer, address: str = "fake:0", config: TransportConfig | None = None):
        self.servicer, self.address = servicer, address
        self.config = config or TransportConfig()
        self.num_prefill_calls = 0
        self.timeouts: list[float | None] = []
        self.up = True  # tests flip this to simulate a dead worker

    def _check_up(self) -> None:
        if not self.up:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self.address} is down")

    async def info(self, timeout: float | None = None) -> pb.InfoReply:
        self._check_up()
        return await self.servicer.Info(pb.InfoRequest(), FakeContext(timeout))

    async def connect_streams(self, timeout: float) -> bool:
        return self.up

    def prefill(self, request: pb.PrefillRequest, timeout: float) -> FakeCall:
        self._check_up()
        self.num_prefill_calls += 1
        self.timeouts.append(timeout)
        return FakeCall(self.servicer, request, timeout)

    async def abort(self, request_id: str, reason: str, timeout: float | None = None) -> bool:
        self._check_up()
        reply = await self.servicer.Abort(pb.AbortRequest(request_id=request_id, reason=reason), FakeContext(timeout))
        return reply.was_running

    async def serving(self, timeout: float | None = None) -> bool:
        return self.up

    async def close(self) -> None:
        pass
