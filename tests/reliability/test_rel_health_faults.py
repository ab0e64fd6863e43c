"""F (in-process parts), H3 and I: readiness follows the engine and the peers; engine faults,
codec faults for one request, retries and idempotency."""

import asyncio
import socket
import time

import grpc
import pytest

from rel_checks import CLEAN_TIMEOUT_S, assert_clean, eventually
from scd_serve.engine.engine import MAX_FAILED_STEPS
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.errors import ScdError
from scd_serve.testing.faults import FaultyRuntime, FaultyServicer, fail_decode_for
from scd_serve.testing.soak import LocalStack, completion

pytestmark = pytest.mark.timeout(60)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def ready_is(stack, code: int) -> bool:
    return (await stack.client.get("/ready")).status_code == code


async def test_f1_live_at_once_ready_only_after_handshake(rt):
    port = free_port()
    # no fallback: a worker that needs a prefill worker is not ready before one answers
    # (with --fallback local it is: test_rel_grey.py::test_i3)
    stack = LocalStack(rt, decode={"health_period_s": 0.25}, engine={"fallback_to_local": False})
    await stack.start(prefill_addresses=(f"127.0.0.1:{port}",))  # nobody listens there yet
    try:
        assert (await stack.client.get("/live")).status_code == 200
        r = await stack.client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        await stack.start_prefill(port=port)
        t0 = time.monotonic()
        ok = await eventually(lambda: ready_is(stack, 200), 10, step=0.05)
        took = time.monotonic() - t0
        # within 2 health periods of 0.25 s, + room for a loaded machine; a readiness that never
        # follows the handshake (or only after several 2 s reconnect backoffs) fails
        assert ok and took <= 2 * 0.25 + 2.5, took
        r = await stack.client.post("/v1/completions", json=completion("now ready", 3, scd_method="identity"))
        assert r.status_code == 200
    finally:
        await stack.stop()


async def test_f5_engine_loop_raising_makes_ready_503_and_fails_fast(make_stack):
    holder = {}
    stack, _ = await make_stack(runtime_wrap=lambda rt: holder.setdefault("rt", FaultyRuntime(rt)))
    holder["rt"].fail_after_steps = holder["rt"].num_steps + 3  # H1: evil forward after 3 more steps, for good
    inflight = [asyncio.ensure_future(stack.client.post("/v1/completions", json=completion(f"doomed {i}", 20,
                                                                                          scd_method="identity")))
                for i in range(3)]
    rs = await asyncio.gather(*inflight)
    # a failing step fails its requests (500); MAX_FAILED_STEPS in a row and the loop gives up (503)
    for r in rs:
        assert (r.status_code, r.json()["error"]["code"]) in ((500, "generation_failed"), (503, "engine_dead")), r.text
    for _ in range(MAX_FAILED_STEPS):
        if not stack.engine.ready():
            break
        r = await stack.client.post("/v1/completions", json=completion("doomed too", 20, scd_method="identity"))
        assert r.status_code in (500, 503), r.text
    assert await eventually(lambda: not stack.engine.ready(), 10)
    assert (await stack.client.get("/ready")).status_code == 503
    assert (await stack.client.get("/live")).status_code == 200
    t0 = time.monotonic()
    r = await stack.client.post("/v1/completions", json=completion("after death", 2))
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert time.monotonic() - t0 <= 2.0  # fails fast: one queued on the dead engine would hang until a timeout (30 s+)
    bm = stack.engine.block_manager
    assert await eventually(lambda: bm.num_free == bm.num_blocks, CLEAN_TIMEOUT_S), (bm.num_free, bm.num_blocks)


async def test_f5_engine_loop_stalling_makes_ready_503(make_stack):
    holder = {}
    stack, base = await make_stack(engine={"stall_timeout_s": 1.0},
                                   runtime_wrap=lambda rt: holder.setdefault("rt", FaultyRuntime(rt)))
    holder["rt"].stall_after_steps, holder["rt"].stall_s = holder["rt"].num_steps, 6.0
    req = asyncio.ensure_future(stack.client.post("/v1/completions", json=completion("stall", 2)))
    t0 = time.monotonic()
    # /ready turns 503 1 s (stall_timeout_s) into the 6 s stall, and back when the step returns:
    # watch until 5 s, inside the stall; one that never notices the stall fails
    ok = await eventually(lambda: ready_is(stack, 503), 5.0, step=0.05)
    became = time.monotonic() - t0
    assert ok and became <= 1.0 + 3.0, became
    holder["rt"].stall_after_steps = None
    await req
    assert await eventually(stack.engine.ready, 15)  # recovers once the step returns
    await assert_clean(stack, base)


async def test_h3_codec_failure_for_one_request_only(make_stack):
    stack, base = await make_stack(engine={"fallback_to_local": False})
    prompts = {f"h3-{i}": [10 + i, 20, 30 + i, 40, 50] for i in range(6)}

    async def run(rid):
        req = GenerationRequest(rid, prompts[rid.removesuffix("-solo")], GREEDY, "identity")
        return [ev.token_id async for ev in stack.engine.generate(req, stack.fill)]

    solo = {rid: await run(rid + "-solo") for rid in prompts}
    hits = fail_decode_for(stack.fill, "h3-2")
    results = await asyncio.gather(*(run(rid) for rid in prompts), return_exceptions=True)
    for rid, got in zip(prompts, results):
        if rid == "h3-2":
            assert isinstance(got, ScdError) and got.kind == "transfer_corrupt", got
        else:
            assert got == solo[rid], rid
    assert hits and set(hits) == {"h3-2"}
    await assert_clean(stack, base)


async def _two_workers(rt, wrap, **decode_opts):
    a, b = LocalStack(rt, servicer_wrap=wrap), LocalStack(rt, servicer_wrap=wrap)
    addrs = (await a.start_prefill(), await b.start_prefill())
    decode = await LocalStack(rt, engine={"fallback_to_local": False}, decode=decode_opts,
                              health_loop=False).start(prefill_addresses=addrs)
    return a, b, decode


async def _stop(*stacks):
    for s in stacks:
        if getattr(s, "engine", None) is not None:
            await s.stop()
        else:
            await s.stop_prefill()


async def test_i1_unavailable_then_success_is_one_accepted_transfer(rt):
    shared = []
    a, b, d = await _two_workers(rt, lambda sv: FaultyServicer(sv, fail_first=1, shared_calls=shared))
    try:
        want = (await d.client.post("/v1/completions", json=completion("retry me", 6, scd_method="local"))).json()
        r = await d.client.post("/v1/completions", json=completion("retry me", 6, scd_method="identity"))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want["choices"][0]["text"]
        assert len(shared) == 2 <= d.fill.config.max_attempts
        assert d.fill.stats.num_retries == 1 and d.fill.stats.num_transfers == 1
        assert sum(d.fill.per_peer.values()) == 1
        times = sorted(a.served.call_times + b.served.call_times)
        assert times[1] - times[0] >= 0.04  # backoff before the second attempt
        assert await eventually(lambda: a.servicer.transfers == {} and b.servicer.transfers == {}, CLEAN_TIMEOUT_S)
        assert await d.wait_clean(CLEAN_TIMEOUT_S) == {}
    finally:
        await _stop(d, a, b)


async def test_i2_a_transfer_timeout_with_time_left_is_retried_on_another_worker(rt):
    """DEADLINE_EXCEEDED of a transfer whose request still has time: before, neither retried nor
    a fallback reason (a hung worker cost every request it got a 504)."""
    shared = []
    timeout = grpc.StatusCode.DEADLINE_EXCEEDED
    a, b, d = await _two_workers(rt, lambda sv: FaultyServicer(sv, fail_first=1, fail_code=timeout, shared_calls=shared))
    try:
        r = await d.client.post("/v1/completions", json=completion("retried", 3, scd_method="identity"))
        assert r.status_code == 200, r.text
        assert d.fill.stats.num_retries == 1 and len(shared) == 2
        assert await d.wait_clean(CLEAN_TIMEOUT_S) == {}
    finally:
        await _stop(d, a, b)


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION])
async def test_i2_non_retryable_statuses_are_not_retried(rt, code):
    shared = []
    a, b, d = await _two_workers(rt, lambda sv: FaultyServicer(sv, fail_first=1, fail_code=code, shared_calls=shared))
    try:
        r = await d.client.post("/v1/completions", json=completion("no retry", 3, scd_method="identity"))
        assert 400 <= r.status_code < 600 and r.status_code != 500, r.text
        assert d.fill.stats.num_retries == 0 and len(shared) == 1
        assert await d.wait_clean(CLEAN_TIMEOUT_S) == {}
    finally:
        await _stop(d, a, b)


async def test_i3_prefill_permanently_down_is_503_within_the_deadline(make_stack):
    stack, base = await make_stack(engine={"fallback_to_local": False}, api={"request_timeout_s": 5.0},
                                   servicer_wrap=lambda sv: FaultyServicer(sv))
    await stack.stop_prefill()
    for i in range(3):
        t0 = time.monotonic()
        r = await stack.client.post("/v1/completions", json=completion(f"down {i}", 3, scd_method="identity"))
        assert r.status_code == 503, r.text
        assert time.monotonic() - t0 < 5.0  # a 503 before the 5 s request timeout, never a 504 at it
    assert stack.fill.stats.num_failed <= 3 * stack.fill.config.max_attempts
    assert await stack.wait_clean(CLEAN_TIMEOUT_S) == {}
    assert (await stack.client.post("/v1/completions", json=completion("local still works", 3,
                                                                      scd_method="local"))).status_code == 200


async def test_i4_late_chunk_after_abort_never_lands_in_reused_blocks(make_stack):
    stack, base = await make_stack(engine={"num_blocks": 32, "block_size": 8, "max_num_seqs": 1, "max_concurrent": 4})
    sinks, hold = [], asyncio.Event()

    async def hanging_fill(req, sink):  # takes the blocks, then waits as a slow transfer would
        sinks.append(sink)
        await hold.wait()

    prompt_a, prompt_b = [11] * 200, [12] * 199 + [13]
    solo_b = [ev.token_id async for ev in stack.engine.generate(GenerationRequest("b-solo", prompt_b, GREEDY), None)]
    gen_a = stack.engine.generate(GenerationRequest("a", prompt_a, GREEDY, "hang"), hanging_fill)
    task_a = asyncio.ensure_future(anext(gen_a))
    assert await eventually(lambda: sinks, 10)
    task_a.cancel()
    await asyncio.gather(task_a, return_exceptions=True)
    await gen_a.aclose()
    assert await stack.wait_clean(CLEAN_TIMEOUT_S) == {}
    import torch
    spec = stack.rt.spec
    garbage = torch.full((199, spec.num_kv_heads, spec.head_dim), 1e4)
    out_b, refused = [], []
    async for ev in stack.engine.generate(GenerationRequest("b", prompt_b, GREEDY), None):
        out_b.append(ev.token_id)
        for layer in range(spec.num_layers):  # the late chunk of the dead request arrives now
            try:
                sinks[0].write_layer(layer, garbage, garbage)
            except ScdError as exc:
                refused.append(exc.kind)
    assert refused and set(refused) == {"transfer_failed"}
    assert out_b == solo_b
    await assert_clean(stack, base)
