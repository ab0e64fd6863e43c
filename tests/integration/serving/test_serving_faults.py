"""Transfer failures end in a retry, a local fallback or a clear error, never a hang (B, C, D, I)."""

import asyncio
import threading
import time

import grpc
import pytest

from scd_serve.errors import DeadlineExceeded, TransferCorrupt, Unavailable
from scd_serve.prefill import service as prefill_service
from scd_serve.testing.faults import on_decode
from scd_serve.transport.chunking import chunk_message
from scd_serve.transport.client import PrefillClient
from scd_serve.config.transport import TransportConfig
from scd_serve.transport.proto import pb

from serving_helpers import (SlowRuntime, decode_stack, engine_for, greedy, make_decode, prompts, start_prefill,
                             wait_until)

pytestmark = pytest.mark.timeout(60)


def dying_runtime(rt, holder):
    """A producer whose server is stopped (like a killed process) once layer 1 starts."""
    loop = asyncio.get_running_loop()

    def on_layer(layer):
        if layer == 1:
            stopped = threading.Event()

            def stop():
                asyncio.ensure_future(holder[0].server.stop(grace=None)).add_done_callback(lambda _: stopped.set())
            loop.call_soon_threadsafe(stop)
            # layer 1 is produced only once the server is down (a fixed 0.3 s sleep let a slow
            # machine send it first, and the transfer then succeeded)
            stopped.wait(10)
    return SlowRuntime(rt, on_layer=on_layer)


async def _clean(engine, fill, *nodes, timeout=10.0):
    """Nothing in flight on either side and every block free, within `timeout` s (a leak never clears)."""
    assert await wait_until(lambda: fill.num_inflight == 0 and all(n.servicer.transfers == {} for n in nodes), timeout)
    assert await wait_until(lambda: engine.block_manager.num_free == engine.block_manager.num_blocks, timeout)


async def test_worker_dying_mid_stream_retries_on_another(rt):
    holder = []
    bad = await start_prefill(dying_runtime(rt, holder))
    holder.append(bad)
    good = await start_prefill(rt)
    peers, fill = await make_decode(rt, [bad.address, good.address])
    engine = engine_for(rt)
    try:
        p = prompts(1, seed=3)[0]
        want = await greedy(engine, "local", p)
        # both idle: make the dying one win the first choice
        peers.balancer.choose = lambda cands, exclude=(): next(
            (c for c in sorted(cands, key=lambda c: c.address != bad.address) if c.address not in set(exclude)), None)
        t0 = time.monotonic()
        got = await greedy(engine, "r", p, "identity", fill)
        assert got == want
        assert fill.stats.num_retries == 1 and fill.per_peer == {good.address: 1}
        assert time.monotonic() - t0 < 10  # a hang would end only at the 30 s prefill deadline
        await _clean(engine, fill, good)
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await good.stop()
        await bad.stop()


@pytest.mark.parametrize("fallback", [True, False])
async def test_only_worker_dying_falls_back_or_fails_503(rt, fallback):
    holder = []
    bad = await start_prefill(dying_runtime(rt, holder))
    holder.append(bad)
    peers, fill = await make_decode(rt, [bad.address])
    engine = engine_for(rt, fallback_to_local=fallback)
    try:
        p = prompts(1, seed=4)[0]
        want = await greedy(engine, "local", p)
        t0 = time.monotonic()
        if fallback:
            assert await greedy(engine, "r", p, "identity", fill) == want
        else:
            with pytest.raises(Unavailable, match="transfer failed"):
                await greedy(engine, "r", p, "identity", fill)
        assert time.monotonic() - t0 < 10  # a hang would end only at the 30 s prefill deadline
        await _clean(engine, fill)
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await bad.stop()


async def test_corrupt_chunk_is_refused_before_decoding(rt, monkeypatch):
    def corrupting(*args, **kw):
        msg = chunk_message(*args, **kw)
        if msg.chunk.seq == 1:
            data = bytearray(msg.chunk.tensors[0].data)
            data[0] ^= 0xFF
            msg.chunk.tensors[0].data = bytes(data)
        return msg
    monkeypatch.setattr(prefill_service, "chunk_message", corrupting)
    async with decode_stack(rt) as (node, fill, engine):
        decoded: list[int] = []
        on_decode(fill, decoded.append)
        with pytest.raises(TransferCorrupt, match="xxh64") as info:
            await greedy(engine, "r", prompts(1)[0], "identity", fill)
        assert info.value.http_status == 502 and info.value.grpc_code == "DATA_LOSS"
        assert decoded == [0]  # chunk 1 (layer 1, a cold transfer) never reached decode_layer
        await _clean(engine, fill, node)


async def test_deadline_ends_a_stalled_transfer_on_both_sides(rt):
    async with decode_stack(rt, SlowRuntime(rt, delay=5.0)) as (node, fill, engine):
        from scd_serve.engine.request import GenerationRequest, SamplingParams
        t0 = time.monotonic()
        req = GenerationRequest("slow", prompts(1)[0], SamplingParams(temperature=0, max_tokens=4),
                                method="identity", deadline=t0 + 1.0)
        with pytest.raises(DeadlineExceeded):
            async for _ in engine.generate(req, kv_fill=fill):
                pass
        # the 1 s deadline + room; one checked only when a layer arrives would end at the first, at 5 s
        assert time.monotonic() - t0 < 1.0 + 3.0
        await _clean(engine, fill, node)
        assert fill.stats.num_retries == 0  # DEADLINE_EXCEEDED is never retried


async def test_client_going_away_cancels_the_remote_prefill(rt):
    async with decode_stack(rt, SlowRuntime(rt, delay=4.0)) as (node, fill, engine):
        task = asyncio.ensure_future(greedy(engine, "gone", prompts(1)[0], "identity", fill))
        assert await wait_until(lambda: node.servicer.transfers, 10.0)
        task.cancel()
        t0 = time.monotonic()
        await _clean(engine, fill, node)
        assert time.monotonic() - t0 < 3.0  # a prefill that went on would hold its transfer for ~8 s
        assert node.servicer.num_served == 0


async def test_abort_rpc_and_transfer_lease_free_the_prefill_side(rt):
    node = await start_prefill(SlowRuntime(rt, delay=0.5), transfer_lease_s=0.6)
    client = PrefillClient(node.address, TransportConfig())
    try:
        req = pb.PrefillRequest(request_id="a1", token_ids=[1, 2, 3], method="identity")
        call = client.prefill(req, timeout=10)
        first = await call.read()
        assert first.WhichOneof("body") == "header"
        assert await client.abort("a1", "test") is True
        with pytest.raises(grpc.aio.AioRpcError) as e:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "aborted" in e.value.details()
        assert await wait_until(lambda: node.servicer.transfers == {}, 10.0), node.servicer.transfers
        assert await client.abort("a1", "again") is False  # idempotent
        # nobody aborts the second one: the 0.6 s lease ends it
        call = client.prefill(pb.PrefillRequest(request_id="a2", token_ids=[1, 2, 3], method="identity"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await wait_until(lambda: node.servicer.transfers == {}, 10.0), node.servicer.transfers
    finally:
        await client.close()
        await node.stop()


async def test_full_worker_says_resource_exhausted_and_stays_serving(rt):
    node = await start_prefill(SlowRuntime(rt, delay=0.5), max_concurrent=1)
    client = PrefillClient(node.address, TransportConfig())
    try:
        first = client.prefill(pb.PrefillRequest(request_id="x1", token_ids=[5, 6], method="identity"), timeout=10)
        await first.read()
        second = client.prefill(pb.PrefillRequest(request_id="x2", token_ids=[5, 6], method="identity"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await second.read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        assert await client.serving()
        for bad, field in [(dict(request_id="", token_ids=[1]), "request_id"),
                           (dict(request_id="y", token_ids=[]), "token_ids"),
                           (dict(request_id="y", token_ids=[999]), "vocab"),
                           (dict(request_id="y", token_ids=[1], last_token=999), "last_token"),
                           (dict(request_id="y", token_ids=[1], method="nope"), "method")]:
            call = client.prefill(pb.PrefillRequest(**({"method": "identity"} | bad)), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    finally:
        await client.close()
        await node.stop()


async def test_closing_the_decode_side_ends_transfers_in_flight_at_once(rt):
    # a shutting-down decode worker must not leave a transfer thread blocked on its stream
    async with decode_stack(rt, SlowRuntime(rt, delay=6.0)) as (node, fill, engine):
        task = asyncio.ensure_future(greedy(engine, "closing", prompts(1)[0], "identity", fill))
        assert await wait_until(lambda: node.servicer.transfers and fill.num_inflight, 10.0)
        t0 = time.monotonic()
        fill.close()
        with pytest.raises(Unavailable, match="CANCELLED"):  # the stream's end, well before its 30 s deadline
            await asyncio.wait_for(task, 10.0)
        # at once, + room: a receiver blocked on its stream would wake only at the first chunk (6 s)
        assert time.monotonic() - t0 < 3.0
        assert await wait_until(lambda: not node.servicer.transfers, 10.0)  # the worker saw the stream go
