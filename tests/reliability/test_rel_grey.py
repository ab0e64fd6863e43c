"""I. Grey failures of a prefill worker: one that passes its health checks but hangs its
transfers (the breaker opens, requests are served by retry or fallback within their deadline),
K/V that is checksum-true but non-finite, and a decode worker that keeps serving on its local
fallback with no prefill worker at all (and says so in /ready)."""

import asyncio
import time

import pytest
import torch

from rel_checks import assert_clean
from scd_serve.config.transport import TransportConfig
from scd_serve.decode.breaker import CLOSED, OPEN
from scd_serve.testing.faults import FaultyServicer
from scd_serve.testing.soak import completion
from scd_serve.transport.tensors import DTYPES

pytestmark = pytest.mark.timeout(90)
STALL_S = 1.0


async def post(stack, prompt, n=3, **kw):
    t0 = time.monotonic()
    r = await stack.client.post("/v1/completions", json=completion(prompt, n, scd_method="identity", **kw))
    return r, time.monotonic() - t0


async def test_i1_hung_worker_opens_its_breaker_and_requests_are_served_by_the_fallback(make_stack):
    """The worker accepts every Prefill call and sends nothing. Before: each request waited
    prefill_timeout_s (30 s by default) and ended in 504 (DEADLINE_EXCEEDED was neither retried
    nor a fallback reason), and the worker was never marked down."""
    transport = TransportConfig(rpc_timeout_s=2, prefill_timeout_s=30, stall_timeout_s=STALL_S)
    stack, base = await make_stack(transport=transport, api={"request_timeout_s": 10.0},
                                   decode={"breaker_failures": 2, "breaker_cooldown_s": 30.0},
                                   servicer_wrap=lambda sv: FaultyServicer(sv, sleep_s=60))
    (peer,) = stack.peers.peers.values()
    for i in range(2):  # each waits one stall timeout, then prefills locally
        r, took = await post(stack, f"hung worker {i}")
        assert r.status_code == 200, r.text
        assert took < 10.0, took  # well inside the request's deadline (the old path took 30 s, then 504)
    assert peer.breaker.state == OPEN and len(stack.served.calls) == 2
    assert stack.engine.num_fallbacks >= 2
    # open: the next request does not wait on the hung worker at all
    r, took = await post(stack, "after the breaker opened")
    assert r.status_code == 200 and len(stack.served.calls) == 2, r.text
    ready = await stack.client.get("/ready")
    assert ready.status_code == 200 and "fallback local" in ready.json()["prefill"], ready.text
    assert "circuit open" in ready.json()["prefill_peers"][peer.address]
    stack.served.armed = False  # the worker is healthy again: the half-open probe closes the breaker
    peer.breaker.open_until = 0.0
    transfers = stack.fill.stats.num_transfers
    r, _ = await post(stack, "the probe")
    assert r.status_code == 200 and stack.fill.stats.num_transfers == transfers + 1
    assert peer.breaker.state == CLOSED
    await assert_clean(stack, base)


async def test_i1_hung_worker_is_retried_on_another_worker(make_stack, rt):
    """Two workers, the first hung: the transfer is retried on the second within the deadline."""
    transport = TransportConfig(rpc_timeout_s=2, prefill_timeout_s=30, stall_timeout_s=STALL_S)
    stack, base = await make_stack(transport=transport, engine={"fallback_to_local": False},
                                   servicer_wrap=lambda sv: FaultyServicer(sv, sleep_s=60))
    hung = stack.prefill, stack.servicer, stack.served
    stack.servicer_wrap = None
    healthy = await stack.start_prefill()  # a second worker, healthy
    healthy_worker = stack.prefill
    stack.prefill, stack.servicer, stack.served = hung  # what stop() and the clean check look at
    try:
        stack.peers.add(healthy, static=True)
        await stack.peers.check_all()
        transfers = stack.fill.stats.num_transfers
        for i in range(4):  # round-robin over the two: the hung one is picked, then skipped
            r, took = await post(stack, f"two workers {i}")
            assert r.status_code == 200 and took < 10.0, (r.text, took)
        assert stack.fill.stats.num_transfers == transfers + 4
        assert stack.fill.stats.num_retries >= 1 and stack.served.calls
    finally:
        await healthy_worker.stop()


def _nan_values(chunk) -> None:
    t = chunk.tensors[-1]  # identity: "v" of the chunk's last layer
    n = len(t.data) // torch.empty((), dtype=DTYPES[t.dtype]).element_size()
    t.data = torch.full((n,), float("nan"), dtype=DTYPES[t.dtype]).numpy().tobytes()


async def test_i2_non_finite_kv_with_a_valid_checksum_is_refused_before_the_cache(make_stack):
    stack, base = await make_stack(engine={"fallback_to_local": False},
                                   servicer_wrap=lambda sv: FaultyServicer(sv, mutate=_nan_values, mutate_seq=0))
    steps = stack.engine.num_steps
    r, _ = await post(stack, "nan values with a true digest")
    assert r.status_code == 502 and r.json()["error"]["code"] == "transfer_corrupt", r.text
    assert "non-finite" in r.json()["error"]["message"]
    assert stack.engine.num_steps == steps  # nothing was decoded from it
    await assert_clean(stack, base)


async def test_i2_non_finite_kv_falls_back_to_a_local_prefill(make_stack):
    stack, base = await make_stack(servicer_wrap=lambda sv: FaultyServicer(sv, mutate=_nan_values, mutate_seq=0))
    local = await stack.client.post("/v1/completions", json=completion("the same prompt", 6, scd_method="local"))
    fallbacks = stack.engine.num_fallbacks
    r, _ = await post(stack, "the same prompt", 6)
    assert r.status_code == 200 and stack.engine.num_fallbacks == fallbacks + 1, r.text
    assert r.json()["choices"][0]["text"] == local.json()["choices"][0]["text"]
    await assert_clean(stack, base)


async def test_i3_with_fallback_local_no_prefill_worker_still_ready_and_serving(make_stack):
    """Before: every prefill worker down made the decode worker not ready even with
    --fallback local, so the gateway answered 503 to everything."""
    stack, base = await make_stack(decode={"health_period_s": 0.1})
    await stack.stop_prefill()
    end = time.monotonic() + 10
    while stack.peers.ready():  # the health loop marks the worker down
        assert time.monotonic() < end, "the dead prefill worker was never marked down"
        await asyncio.sleep(0.05)
    ready = await stack.client.get("/ready")
    assert ready.status_code == 200 and "fallback local" in ready.json()["prefill"], ready.text
    r, _ = await post(stack, "no prefill worker at all")
    assert r.status_code == 200, r.text
    await assert_clean(stack, base, fresh=False)
