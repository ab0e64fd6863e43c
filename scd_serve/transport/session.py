"""Transfer sessions: long-lived PrefillSession streams to one prefill worker, reused.

A new RPC per transfer pays call setup on both sides before the first byte of code moves
(~0.6 ms of TTFT on a 2-core machine, measured in docs/benchmarks.md). A session is
one stream that carries one transfer at a time: `SessionPool.transfer()` takes an idle
session (or opens one), writes the request and yields that transfer's messages, then puts
the session back for the next transfer. The iteration ends with the transfer's last chunk
(seq = total - 1): its TransferEnd, already on its way, is read by the session's next
transfer while that one waits for its first chunk, so no read sits between the last
chunk and the first decode step.

Whatever goes wrong (an error status, the transfer's deadline, the caller walking away)
ends that session only: it is cancelled and never reused. Errors surface as
grpc.aio.AioRpcError, as from a plain Prefill call, so callers map them the same way.
Every session is opened with a deadline (`session_lifetime_s`) and is not handed out for
a transfer that could outlive it.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from scd_serve.transport.proto import pb
from scd_serve.transport.status import rpc_error

# A reused session that fails like this before the transfer's first message was already
# dead (worker restarted or draining): the transfer is retried once on a fresh session.
_STALE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


async def _ended(call) -> grpc.aio.AioRpcError:
    """The error to raise for a session stream that has ended: its own status, or
    UNAVAILABLE when the worker closed it cleanly (draining) while a transfer wanted it."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return rpc_error(grpc.StatusCode.UNAVAILABLE, "prefill worker closed the session")
    return rpc_error(code, await call.details())


class _Session:
    def __init__(self, open_stream, lifetime_s: float):
        self.expires = time.monotonic() + lifetime_s
        self.call = open_stream(lifetime_s)  # a grpc.aio StreamStreamCall
        self.used = False  # has carried a transfer before
        self.owed_end = ""  # request id whose TransferEnd is still to be read


class SessionPool:
    """Idle sessions to one worker. `open_stream(timeout_s)` opens a PrefillSession call."""

    def __init__(self, open_stream, lifetime_s: float, max_idle: int):
        self._open_stream = open_stream
        self.lifetime_s = lifetime_s
        self.max_idle = max_idle
        self._idle: list[_Session] = []
        self.num_opened = 0

    def transfer(self, request: pb.PrefillRequest, timeout: float) -> "SessionTransfer":
        """One transfer: an async iterator of its PrefillChunk messages, with cancel()."""
        return SessionTransfer(self, request, timeout)

    def take(self, min_left_s: float, fresh: bool = False) -> _Session:
        """An idle session with at least min_left_s of its deadline left, else a new one."""
        now = time.monotonic()
        while self._idle and not fresh:
            s = self._idle.pop()
            if not s.call.done() and s.expires - now > min_left_s:
                return s
            s.call.cancel()
        self.num_opened += 1
        return _Session(self._open_stream, max(self.lifetime_s, min_left_s + 1.0))

    def give_back(self, s: _Session) -> None:
        if len(self._idle) < self.max_idle and not s.call.done():
            self._idle.append(s)
        else:
            s.call.cancel()

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        for s in self._idle:
            s.call.cancel()
        self._idle.clear()


class SessionTransfer:
    """Yields the header and chunk messages of one transfer; ends after its last chunk.

    One timer per transfer (not one per read) enforces its deadline by cancelling the
    session."""

    def __init__(self, pool: SessionPool, request: pb.PrefillRequest, timeout: float):
        self._pool = pool
        self._request = request
        self._timeout = timeout
        self._session: _Session | None = None
        self._timer: asyncio.TimerHandle | None = None  # set on send() or the first read
        self._expired = False
        self._sent = False
        self._reused = False  # the session had carried a transfer before this one
        self._retried = False
        self._got_message = False
        self._total = 0  # chunks in this transfer, from its header
        self._last_seen = False  # the chunk with seq = total - 1 was yielded
        self._finished = False

    def cancel(self) -> bool:
        """Stop reading: the session is cancelled (the worker sees the stream go away)."""
        if self._finished:
            return False
        self._finish()
        if self._session is not None:
            self._session.call.cancel()
        return True

    def _finish(self) -> None:
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()

    def _expire(self) -> None:
        self._expired = True
        if self._session is not None:
            self._session.call.cancel()

    async def send(self) -> None:
        """Write the request now, so that the caller can prepare while the worker answers.
        A failure here surfaces on the first read (which may retry on a fresh session)."""
        self._start()
        if self._session is None:
            self._take_session()
        try:
            await self._session.call.write(self._request)
            self._sent = True
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        except asyncio.CancelledError:
            if self._timed_out():
                raise self._deadline_error() from None
            raise

    def _timed_out(self) -> bool:
        """The timer, not our caller, cancelled what we were waiting on."""
        if self._expired and not asyncio.current_task().cancelling():
            self.cancel()
            return True
        return False

    def _deadline_error(self) -> grpc.aio.AioRpcError:
        return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"transfer {self._request.request_id} took over {self._timeout:.1f}s")

    def _start(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._timeout, self._expire)

    def _take_session(self) -> None:
        left = self._timer.when() - asyncio.get_running_loop().time()
        self._session = self._pool.take(left, fresh=self._retried)
        self._reused, self._session.used = self._session.used, True

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.PrefillChunk:
        if self._finished:
            raise StopAsyncIteration
        if self._last_seen:  # done: the TransferEnd is read later (module docstring)
            self._finish()
            self._session.owed_end = self._request.request_id
            self._pool.give_back(self._session)
            raise StopAsyncIteration
        self._start()
        try:
            msg = await self._read()
        except BaseException:
            if self._timed_out():
                raise self._deadline_error() from None
            self.cancel()
            raise
        body = msg.WhichOneof("body")
        if body != "end":
            self._got_message = True
            header = msg.header if body == "header" else msg.chunk.header if msg.chunk.HasField("header") else None
            if header is not None:
                self._total = header.total_chunks
            self._last_seen = body == "chunk" and msg.chunk.seq + 1 == self._total
            return msg
        self._finish()
        if msg.end.request_id != self._request.request_id:
            self._session.call.cancel()
            raise rpc_error(grpc.StatusCode.DATA_LOSS, f"session ended transfer {msg.end.request_id!r} "
                                                       f"while {self._request.request_id!r} was running")
        self._pool.give_back(self._session)
        raise StopAsyncIteration

    async def _read(self) -> pb.PrefillChunk:
        while True:
            if self._session is None:
                self._take_session()
                if self._expired:  # the timer fired while no session was held
                    raise asyncio.CancelledError()
            try:
                if not self._sent:
                    await self._session.call.write(self._request)
                    self._sent = True
                if self._session.owed_end:
                    await self._read_owed_end()
                msg = await self._session.call.read()
                if msg is grpc.aio.EOF:
                    raise await _ended(self._session.call)
                return msg
            except asyncio.InvalidStateError:  # a write after the stream ended
                exc = await _ended(self._session.call)
            except grpc.aio.AioRpcError as err:
                exc = err
            if self._got_message or not self._reused or self._retried or exc.code() not in _STALE:
                raise exc
            self._session.call.cancel()  # a dead pooled session: once more on a fresh one
            self._session, self._sent, self._retried = None, False, True

    async def _read_owed_end(self) -> None:
        """The previous transfer's TransferEnd (and any resend of its chunks before it)."""
        call, owed = self._session.call, self._session.owed_end
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                raise await _ended(call)
            body = msg.WhichOneof("body")
            rid = msg.end.request_id if body == "end" else msg.chunk.request_id if body == "chunk" else ""
            if rid != owed:
                raise rpc_error(grpc.StatusCode.DATA_LOSS, f"session sent {body} of {rid!r} while the end of "
                                                           f"transfer {owed!r} was due")
            if body == "end":
                self._session.owed_end = ""
                return
