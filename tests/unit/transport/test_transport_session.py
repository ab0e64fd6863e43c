"""SessionPool / SessionTransfer against scripted stream calls: reuse, the bound on idle
sessions, stale sessions retried once, and every failure ending its session only."""

import asyncio

import grpc
import pytest

from scd_serve.transport.proto import pb
from scd_serve.transport.session import SessionPool
from scd_serve.transport.status import rpc_error

pytestmark = pytest.mark.timeout(10)


class ScriptedCall:
    """A PrefillSession call: answers each written request by its script (messages, an
    error to raise, or 'hang'); `dead` makes it fail like a stream the worker dropped."""

    def __init__(self, script, dead: grpc.StatusCode | None = None):
        self.script = script  # request_id -> list of PrefillChunk | AioRpcError | "hang"
        self.dead = dead
        self.written: list[str] = []
        self.queue: list = []
        self.cancelled = False
        self.waiter: asyncio.Future | None = None

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        if self.waiter is not None:
            self.waiter.cancel()  # like grpc.aio: a pending read of a cancelled call raises CancelledError
        return True

    async def write(self, request) -> None:
        if self.dead is not None:
            raise rpc_error(self.dead, "socket closed")
        self.written.append(request.request_id)
        self.queue += self.script[request.request_id]  # after anything still unread, as on a stream

    async def read(self):
        item = self.queue.pop(0)
        if item == "hang":
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        if isinstance(item, grpc.aio.AioRpcError):
            self.cancelled = True  # the stream ended with that status
            raise item
        return item


def header(rid, total=1):
    return pb.PrefillChunk(header=pb.TransferHeader(request_id=rid, total_chunks=total))


def end(rid):
    return pb.PrefillChunk(end=pb.TransferEnd(request_id=rid))


def ok(rid):
    return [header(rid), end(rid)]


def chunk(rid, seq, total):
    return pb.PrefillChunk(chunk=pb.KVChunk(request_id=rid, seq=seq, total=total))


class Opener:
    def __init__(self, *calls):
        self.calls = list(calls)
        self.opened: list[tuple[ScriptedCall, float]] = []

    def __call__(self, timeout):
        call = self.calls.pop(0)
        self.opened.append((call, timeout))
        return call


async def run(pool, rid, timeout=5.0):
    return [m.WhichOneof("body") async for m in pool.transfer(pb.PrefillRequest(request_id=rid), timeout)]


async def test_transfers_reuse_one_session_and_stop_at_their_end():
    script = {"a": ok("a"), "b": ok("b")}
    call = ScriptedCall(script)
    opener = Opener(call)
    pool = SessionPool(opener, lifetime_s=600, max_idle=4)
    assert await run(pool, "a") == ["header"]  # the TransferEnd is consumed, not yielded
    assert await run(pool, "b") == ["header"]
    assert call.written == ["a", "b"] and pool.num_opened == 1 and pool.num_idle == 1
    assert opener.opened[0][1] == 600  # every session is opened with a deadline
    pool.close()
    assert call.cancelled and pool.num_idle == 0


async def test_idle_sessions_are_bounded_and_done_or_expiring_ones_are_not_reused():
    script = {r: ok(r) for r in "abcd"}
    calls = [ScriptedCall(script) for _ in range(4)]
    pool = SessionPool(Opener(*calls), lifetime_s=600, max_idle=1)
    a, b = pool.transfer(pb.PrefillRequest(request_id="a"), 5), pool.transfer(pb.PrefillRequest(request_id="b"), 5)
    assert [m async for m in a] and [m async for m in b]  # a finished before b started: one session
    assert pool.num_opened == 1
    ta, tb = pool.transfer(pb.PrefillRequest(request_id="c"), 5), pool.transfer(pb.PrefillRequest(request_id="d"), 5)
    await ta.__anext__(), await tb.__anext__()  # both in flight at once: two sessions
    assert [m async for m in ta] == [] and [m async for m in tb] == []
    assert pool.num_opened == 2 and pool.num_idle == 1 and calls[1].cancelled  # the second one over the bound
    pool._idle[0].call.cancelled = True  # the worker ended it meanwhile
    assert await run(pool, "a") == ["header"] and pool.num_opened == 3
    # a transfer that may outlive the idle session's deadline gets a new one
    assert await run(pool, "b", timeout=601) == ["header"] and pool.num_opened == 4


async def test_a_dead_pooled_session_is_retried_once_on_a_fresh_one():
    script = {"a": ok("a"), "b": ok("b")}
    first, second = ScriptedCall(script), ScriptedCall(script)
    pool = SessionPool(Opener(first, second), lifetime_s=600, max_idle=4)
    await run(pool, "a")
    first.dead = grpc.StatusCode.UNAVAILABLE  # worker restarted while the session sat idle
    assert await run(pool, "b") == ["header"]
    assert second.written == ["b"] and first.cancelled and pool.num_opened == 2


async def test_a_fresh_session_failing_is_not_retried():
    pool = SessionPool(Opener(ScriptedCall({}, dead=grpc.StatusCode.UNAVAILABLE)), lifetime_s=600, max_idle=4)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await run(pool, "a")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and pool.num_opened == 1 and pool.num_idle == 0


async def test_an_error_after_the_first_message_ends_the_session_without_a_retry():
    busy = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    cut = rpc_error(grpc.StatusCode.UNAVAILABLE, "stream removed")
    call = ScriptedCall({"a": ok("a"), "b": [busy], "c": [header("c"), cut]})
    calls = [call, ScriptedCall({"c": ok("c")}), ScriptedCall({})]
    pool = SessionPool(Opener(*calls), lifetime_s=600, max_idle=4)
    await run(pool, "a")
    with pytest.raises(grpc.aio.AioRpcError) as e:  # an answer, not a stale session: no retry
        await run(pool, "b")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and pool.num_idle == 0 and call.cancelled
    call2 = calls[1]
    call2.script["c"] = [header("c"), cut]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await run(pool, "c")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and pool.num_opened == 2 and pool.num_idle == 0


async def test_the_deadline_cancels_the_session_and_an_end_for_another_request_is_refused():
    slow = ScriptedCall({"a": [header("a"), "hang"]})
    wrong = ScriptedCall({"b": [header("b"), end("zzz")]})
    pool = SessionPool(Opener(slow, wrong), lifetime_s=600, max_idle=4)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await run(pool, "a", timeout=0.2)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and slow.cancelled
    assert asyncio.get_running_loop().time() - t0 < 1.0 and pool.num_idle == 0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await run(pool, "b")
    assert e.value.code() == grpc.StatusCode.DATA_LOSS and wrong.cancelled and pool.num_idle == 0


async def test_cancel_mid_transfer_drops_the_session():
    call = ScriptedCall({"a": [header("a"), "hang"]})
    pool = SessionPool(Opener(call), lifetime_s=600, max_idle=4)
    t = pool.transfer(pb.PrefillRequest(request_id="a"), 5)
    assert (await t.__anext__()).WhichOneof("body") == "header"
    assert t.cancel() and call.cancelled and not t.cancel()
    assert [m async for m in t] == [] and pool.num_idle == 0


@pytest.mark.parametrize("field,value", [("session_lifetime_s", 0), ("session_lifetime_s", 7200),
                                         ("max_idle_sessions", -1)])
def test_session_settings_are_validated_with_the_field_named(field, value):
    from scd_serve.config.transport import TransportConfig
    from scd_serve.errors import ConfigError

    with pytest.raises(ConfigError, match=field):
        TransportConfig(**{field: value})


async def test_iteration_ends_at_the_last_chunk_and_the_next_transfer_reads_the_end():
    two = lambda rid, last: [header(rid, 2), chunk(rid, 0, 2), chunk(rid, 1, 2), last]  # noqa: E731
    stray = chunk("zz", 0, 1)  # where b's end is due
    call = ScriptedCall({"a": two("a", end("a")), "b": two("b", stray), "c": ok("c")})
    pool = SessionPool(Opener(call), lifetime_s=600, max_idle=4)
    assert await run(pool, "a") == ["header", "chunk", "chunk"]
    assert [m.WhichOneof("body") for m in call.queue] == ["end"]  # not read yet: off the critical path
    assert pool.num_idle == 1 and pool._idle[0].owed_end == "a"
    assert await run(pool, "b") == ["header", "chunk", "chunk"]  # a's end was read first
    assert call.written == ["a", "b"] and pool.num_opened == 1
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await run(pool, "c")
    assert e.value.code() == grpc.StatusCode.DATA_LOSS and "'b'" in e.value.details() and call.cancelled


async def test_send_writes_at_once_and_its_deadline_is_the_transfers():
    call = ScriptedCall({"a": ok("a")})
    pool = SessionPool(Opener(call), lifetime_s=600, max_idle=4)
    t = pool.transfer(pb.PrefillRequest(request_id="a"), 5)
    await t.send()
    assert call.written == ["a"]  # before any read: the caller prepares while the worker answers
    assert [m.WhichOneof("body") async for m in t] == ["header"] and call.written == ["a"]

    class StuckWrite(ScriptedCall):
        async def write(self, request):
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter

    stuck = StuckWrite({})
    t = SessionPool(Opener(stuck), lifetime_s=600, max_idle=4).transfer(pb.PrefillRequest(request_id="b"), 0.2)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await t.send()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and stuck.cancelled
