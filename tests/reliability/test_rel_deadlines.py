"""C. Deadlines and timeouts: every RPC has one, stalls end at them on both sides, queue waits
are bounded, and a transfer lease frees the prefill side even when the reader stalls."""

import asyncio
import threading
import time

import grpc
import pytest

from rel_checks import assert_clean, eventually
from scd_serve.config.transport import TransportConfig
from scd_serve.testing.faults import FaultyRuntime, FaultyServicer, on_decode
from scd_serve.testing.soak import completion
from scd_serve.transport.client import PrefillClient
from scd_serve.transport.proto import pb

pytestmark = pytest.mark.timeout(60)
NO_FALLBACK = {"fallback_to_local": False}


async def test_c1_every_rpc_arrives_with_a_deadline(make_stack):
    stack, base = await make_stack(servicer_wrap=lambda sv: FaultyServicer(sv))
    await stack.peers.check_all()  # health checks
    for i in range(3):
        r = await stack.client.post("/v1/completions", json=completion(f"deadline {i}", 3, scd_method="identity"))
        assert r.status_code == 200
    await stack.peers.handshake(next(iter(stack.peers.peers.values())))  # Info again
    seen = {rpc for rpc, _ in stack.served.deadlines}
    assert {"Prefill", "Info"} <= seen, seen
    assert all(left is not None for _, left in stack.served.deadlines), stack.served.deadlines
    for peer in stack.peers.peers.values():
        assert all(t is not None for _, t in peer.client.deadlines.timeouts)
    await assert_clean(stack, base)


async def test_c1_client_interceptor_sees_the_prefill_stream(make_stack):
    stack, _ = await make_stack()
    peer = next(iter(stack.peers.peers.values()))
    assert any("Prefill" in m for m, _ in peer.client.deadlines.timeouts), list(peer.client.deadlines.timeouts)


async def test_c2_prefill_sleeping_past_the_deadline(make_stack):
    transport = TransportConfig(rpc_timeout_s=2, prefill_timeout_s=1.0)
    stack, base = await make_stack(engine=NO_FALLBACK, transport=transport,
                                   servicer_wrap=lambda sv: FaultyServicer(sv, sleep_s=30))
    t0 = time.monotonic()
    r = await stack.client.post("/v1/completions", json=completion("sleepy", 3, scd_method="identity"))
    took = time.monotonic() - t0
    assert r.status_code == 504 and r.json()["error"]["code"] == "transfer_timeout", r.text
    # the transfer's own deadline, not the request's: with a fallback or another worker it would be served
    assert took <= 1.0 + 4.0, took  # without the 1 s deadline the call waits out the servicer's 30 s sleep
    rid = stack.served.calls[-1]
    # the prefill handler observes the cancellation (without it, it sleeps on for 30 s)
    assert await eventually(lambda: rid in stack.served.cancelled, 10), stack.served.cancelled
    await assert_clean(stack, base)


async def test_c3_queue_timeout_while_the_only_slot_is_busy(make_stack):
    slow = {}
    stack, base = await make_stack(engine={"max_num_seqs": 1, "queue_timeout_s": 1.0},
                                   runtime_wrap=lambda rt: slow.setdefault("rt", FaultyRuntime(rt)))
    slow["rt"].stall_after_steps, slow["rt"].stall_s = 0, 0.2  # 50 tokens ~ 10 s (cancelled below)
    busy = asyncio.ensure_future(stack.client.post("/v1/completions", json=completion("busy", 50)))
    assert await eventually(lambda: stack.engine.stats()["num_running"] >= 1, 10), stack.engine.stats()
    t0 = time.monotonic()
    r = await stack.client.post("/v1/completions", json=completion("queued", 4))
    took = time.monotonic() - t0
    assert r.status_code in (503, 504), r.text
    # not before its 1 s (load only makes it later); a queue wait that ignored the timeout (or
    # noticed it only when the slot frees) would last until the busy request's ~10 s end
    assert 1.0 <= took <= 1.0 + 4.0, took
    busy.cancel()
    await asyncio.gather(busy, return_exceptions=True)
    slow["rt"].stall_after_steps = None
    await assert_clean(stack, base)


async def test_c4_lease_frees_prefill_when_the_reader_stops(make_stack):
    from scd_serve.testing.faults import FaultyProducer
    slow = {}
    stack, base = await make_stack(prefill={"transfer_lease_s": 2.0},
                                   producer_wrap=lambda rt: slow.setdefault("p", FaultyProducer(rt)))
    slow["p"].layer_delay_s = 6.0  # the transfer would live ~12 s without its lease (first layer at 6 s)
    client = PrefillClient(f"127.0.0.1:{stack.prefill_port}", TransportConfig(rpc_timeout_s=2))
    try:
        t0 = time.monotonic()  # before the call: the lease starts when the server takes it, later
        call = client.prefill(pb.PrefillRequest(request_id="stalled", token_ids=[9] * 50, method="identity"),
                              timeout=60)
        first = await call.read()
        assert first.WhichOneof("body") == "header"
        assert await eventually(lambda: not stack.servicer.transfers, 10), stack.servicer.transfers
        took = time.monotonic() - t0
        # not before the 2 s lease (less a timer's rounding); no lease, or one checked only
        # between layers, would hold the transfer until the first layer ends at 6 s
        assert 2.0 - 0.05 <= took <= 2.0 + 3.0, took
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        slow["p"].layer_delay_s = 0.0
    finally:
        await client.close()
    await assert_clean(stack, base)


async def test_c4_decode_side_reader_stall_ends_on_both_sides(make_stack):
    stack, base = await make_stack(engine=NO_FALLBACK, api={"request_timeout_s": 1.5},
                                   prefill={"transfer_lease_s": 2.0})
    release = threading.Event()
    remove = on_decode(stack.fill, lambda layer: release.wait(10))  # the receiver stops consuming at the first layer
    t0 = time.monotonic()
    r = await stack.client.post("/v1/completions", json=completion("x" * 200, 3, scd_method="identity"))
    assert r.status_code == 504, r.text
    assert time.monotonic() - t0 <= 1.5 + 3.5  # without the 1.5 s request timeout: the 10 s stall
    # the 2 s lease (or the decode side's cancel) frees it; a transfer held by the stalled reader
    # would stay until the stall's 10 s end
    assert await eventually(lambda: not stack.servicer.transfers, 2.0 + 4.0 - (time.monotonic() - t0)), \
        "prefill still holds the transfer after its lease"
    release.set()
    remove()
    await assert_clean(stack, base)
