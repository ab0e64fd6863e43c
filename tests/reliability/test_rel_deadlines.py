"""C. Deadlines and timeouts: every RPC has one, stalls end at them on both sides, queue waits
are bounded, and a transfer lease frees the prefill side even when the reader stalls."""

import asyncio
import threading
import time

import grpc
import pytest

from rel_checks import assert_clean
from scd_serve.config.transport import TransportConfig
from scd_serve.faults import FaultyRuntime, FaultyServicer
from scd_serve.soak import completion
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
    assert r.status_code == 504 and r.json()["error"]["type"] == "deadline_exceeded", r.text
    assert took <= 1.0 + 0.5, took
    rid = stack.served.calls[-1]
    ok = False
    for _ in range(50):  # the prefill handler observes the cancellation
        if rid in stack.served.cancelled:
            ok = True
            break
        await asyncio.sleep(0.02)
    assert ok, stack.served.cancelled
    await assert_clean(stack, base, timeout=1.0)


async def test_c3_queue_timeout_while_the_only_slot_is_busy(make_stack):
    slow = {}
    stack, base = await make_stack(engine={"max_num_seqs": 1, "queue_timeout_s": 1.0},
                                   runtime_wrap=lambda rt: slow.setdefault("rt", FaultyRuntime(rt)))
    slow["rt"].stall_after_steps, slow["rt"].stall_s = 0, 0.1  # 50 tokens ~ 5 s
    busy = asyncio.ensure_future(stack.client.post("/v1/completions", json=completion("busy", 50)))
    while stack.engine.stats()["num_running"] < 1:
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    r = await stack.client.post("/v1/completions", json=completion("queued", 4))
    took = time.monotonic() - t0
    assert r.status_code in (503, 504), r.text
    assert 1.0 <= took <= 1.5, took
    busy.cancel()
    await asyncio.gather(busy, return_exceptions=True)
    slow["rt"].stall_after_steps = None
    await assert_clean(stack, base)


async def test_c4_lease_frees_prefill_when_the_reader_stops(make_stack):
    from scd_serve.faults import FaultyProducer
    slow = {}
    stack, base = await make_stack(prefill={"transfer_lease_s": 2.0},
                                   producer_wrap=lambda rt: slow.setdefault("p", FaultyProducer(rt)))
    slow["p"].layer_delay_s = 4.0  # the transfer would live ~8 s without its lease
    client = PrefillClient(f"127.0.0.1:{stack.prefill_port}", TransportConfig(rpc_timeout_s=2))
    try:
        call = client.prefill(pb.PrefillRequest(request_id="stalled", token_ids=[9] * 50, method="identity"),
                              timeout=60)
        first = await call.read()
        assert first.WhichOneof("body") == "header"
        t0 = time.monotonic()
        while stack.servicer.transfers and time.monotonic() - t0 < 4:
            await asyncio.sleep(0.02)
        took = time.monotonic() - t0
        assert not stack.servicer.transfers and 1.7 <= took <= 2.0 + 0.5, took
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
    real = stack.fill._rebuild_layer

    def stalled(layer, *args):  # the receiver stops consuming at the first layer
        release.wait(10)
        return real(layer, *args)

    stack.fill._rebuild_layer = stalled
    t0 = time.monotonic()
    r = await stack.client.post("/v1/completions", json=completion("x" * 200, 3, scd_method="identity"))
    assert r.status_code == 504, r.text
    assert time.monotonic() - t0 <= 1.5 + 0.5
    while stack.servicer.transfers and time.monotonic() - t0 < 3.0:
        await asyncio.sleep(0.02)
    assert not stack.servicer.transfers, "prefill still holds the transfer after its lease"
    release.set()
    stack.fill._rebuild_layer = real
    await assert_clean(stack, base)
