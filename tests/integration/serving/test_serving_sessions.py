"""Transfer sessions over a real gRPC channel: the same messages as a Prefill call, one
stream reused across transfers, per-transfer limits on both sides, and sessions that end
cleanly on errors, aborts and shutdown."""

import time

import grpc
import pytest
from serving_helpers import SlowRuntime, settled, start_prefill, tiny_runtime, worker_and_client

from scd_serve.transport.chunking import StreamVerifier
from scd_serve.transport.proto import pb

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    return tiny_runtime(tmp_path_factory.mktemp("m"))


def request(rid, tokens=(5, 6, 7, 8), **kw):
    return pb.PrefillRequest(request_id=rid, token_ids=list(tokens), method="identity", **kw)


async def verified(rt, rid, stream, tokens=(5, 6, 7, 8)):
    v = StreamVerifier(rid, "identity", len(tokens), rt.spec.num_layers)
    chunks = [c for c in [v.on_message(m) async for m in stream] if c is not None]
    v.finish()
    return [(c.layer_start, c.layer_end, [t.data for t in c.tensors]) for c in chunks]


async def test_sessions_carry_the_same_codes_as_prefill_calls_and_are_reused(rt):
    async with worker_and_client(rt, cache_bytes=0) as (node, client):
        plain = await verified(rt, "p", client.prefill(request("p"), timeout=10))
        for i in range(3):
            assert await verified(rt, f"s{i}", client.transfer(request(f"s{i}"), timeout=10)) == plain
        assert client.sessions.num_opened == 1 and client.sessions.num_idle == 1
        assert await settled(node, 4)


async def test_an_error_ends_its_session_only(rt):
    async with worker_and_client(rt) as (node, client):
        await verified(rt, "a", client.transfer(request("a"), timeout=10))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await verified(rt, "bad", client.transfer(request("bad", tokens=[10**6]), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocab" in e.value.details()
        assert client.sessions.num_idle == 0
        await verified(rt, "b", client.transfer(request("b"), timeout=10))
        assert client.sessions.num_opened == 2 and await settled(node, 2)


async def test_each_transfer_has_its_own_deadline_on_both_sides(rt):
    async with worker_and_client(SlowRuntime(rt, delay=0.3)) as (node, client):
        t0 = time.monotonic()  # the client gives up: its session is cancelled, the worker stops
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await verified(rt, "c", client.transfer(request("c"), timeout=0.4))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1.0
        # the worker holds the transfer to timeout_ms even when the client would wait longer
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await verified(rt, "w", client.transfer(request("w", timeout_ms=400), timeout=10))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1.5
        assert await settled(node, 0) and client.sessions.num_idle == 0  # neither counts as served


async def test_abort_ends_a_session_transfer_and_the_next_one_runs(rt):
    slow = SlowRuntime(rt, delay=0.3)
    async with worker_and_client(slow) as (node, client):
        stream = client.transfer(request("x"), timeout=10)
        assert (await stream.__anext__()).WhichOneof("body") == "header"
        assert await client.abort("x", "test") is True
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stream:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "aborted" in e.value.details()
        slow.delay = 0.0
        await verified(rt, "y", client.transfer(request("y"), timeout=10))


async def test_shutdown_ends_idle_sessions_at_once_and_a_restarted_worker_gets_new_ones(rt):
    async with worker_and_client(rt) as (node, client):
        await verified(rt, "a", client.transfer(request("a"), timeout=10))
        idle = client.sessions._idle[0].call
        t0 = time.monotonic()
        node.servicer.end_idle_sessions()
        await node.server.stop(grace=5)  # nothing in flight: does not wait out the grace
        assert time.monotonic() - t0 < 1.0
        # the idle session still holds transfer a's TransferEnd (read lazily), then its status
        assert (await idle.read()).end.request_id == "a"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await idle.read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
        port = int(node.address.rsplit(":", 1)[1])
        restarted = await start_prefill(rt, port=port)
        try:
            await verified(rt, "b", client.transfer(request("b"), timeout=10))
            assert client.sessions.num_opened == 2
        finally:
            await restarted.stop()
