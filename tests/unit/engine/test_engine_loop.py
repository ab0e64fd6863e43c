"""Engine over the toy runtime: batching correctness, determinism, aborts, deadlines, fills, drain
(failures of some requests: test_engine_failures.py)."""

import asyncio
import threading
import time

import pytest
from engine_helpers import cfg, collect, refused_at_once, req, wait_clean
from polls import eventually

from scd_serve.engine.engine import Engine
from scd_serve.testing.fake_runtime import FakeRuntime
from scd_serve.errors import DeadlineExceeded, Overloaded, PromptTooLong, ShuttingDown, TransferFailed

pytestmark = pytest.mark.timeout(30)


def prompts(rt, n):
    return [rt.tokenizer.encode(f"prompt number {i} " + "x" * (i * 3)) for i in range(n)]


async def test_greedy_output_equals_reference(engine):
    rt = engine.runtime
    for prompt in ([5], rt.tokenizer.encode("hello world, a longer prompt over several blocks")):
        tokens, events = await collect(engine, req("a", prompt, max_tokens=12))
        assert tokens == rt.greedy(prompt, 12)
        last = events[-1]
        assert last.finish_reason in ("length", "stop")
        assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == len(tokens)
        assert "".join(e.text_delta for e in events) == rt.tokenizer.decode(tokens, skip_special_tokens=True)
    await wait_clean(engine)


async def test_sixteen_concurrent_prompts_equal_solo_runs(engine):
    rt = engine.runtime
    ps = prompts(rt, 16)
    solo = [rt.greedy(p, 10) for p in ps]
    outs = await asyncio.gather(*(collect(engine, req(f"r{i}", p, max_tokens=10)) for i, p in enumerate(ps)))
    assert [o[0] for o in outs] == solo
    await wait_clean(engine)


async def test_preemption_under_a_small_pool_keeps_outputs_exact():
    eng = Engine(FakeRuntime(), cfg(num_blocks=32, max_model_len=64, max_num_seqs=8))
    eng.start()
    try:
        rt = eng.runtime
        ps = [rt.tokenizer.encode("p%d " % i + "y" * 20) for i in range(8)]  # 8 x 24+ tokens > 128 slots
        outs = await asyncio.gather(*(collect(eng, req(f"r{i}", p, max_tokens=20)) for i, p in enumerate(ps)))
        assert [o[0] for o in outs] == [rt.greedy(p, 20) for p in ps]
        await wait_clean(eng)
    finally:
        await eng.stop(1)


async def test_seeded_sampling_is_deterministic(engine):
    p = engine.runtime.tokenizer.encode("seeded")
    a, _ = await collect(engine, req("a", p, temperature=1.0, top_p=0.9, seed=123, max_tokens=16))
    b, _ = await collect(engine, req("b", p, temperature=1.0, top_p=0.9, seed=123, max_tokens=16))
    c, _ = await collect(engine, req("c", p, temperature=1.0, top_p=0.9, seed=124, max_tokens=16))
    assert a == b and a != c


async def test_client_gone_aborts_and_frees_blocks(engine):
    engine.runtime.step_delay_s = 0.005
    gen = engine.generate(req("a", [1, 2, 3], max_tokens=100))
    n = 0
    async for _ in gen:
        n += 1
        if n == 3:
            break
    await gen.aclose()
    await wait_clean(engine, timeout=1.0)
    steps = engine.runtime.num_steps
    await asyncio.sleep(0.1)
    assert engine.runtime.num_steps == steps  # it stopped generating
    tokens, _ = await collect(engine, req("a", [1, 2, 3], max_tokens=4))  # the id is free again
    assert len(tokens) == 4


async def test_overloaded_is_immediate_and_prompt_too_long_names_both_numbers():
    eng = Engine(FakeRuntime(), cfg(max_concurrent=16, max_num_seqs=16))
    eng.runtime.step_delay_s = 0.01
    eng.start()
    try:
        gens = [eng.generate(req(f"r{i}", [1, 2], max_tokens=50)) for i in range(16)]
        firsts = await asyncio.gather(*(g.__anext__() for g in gens))
        assert len(firsts) == 16
        e = await refused_at_once(eng, req("x", [1]), Overloaded)  # at once: it never waits for a slot
        assert e.headers["Retry-After"] == "1"
        with pytest.raises(PromptTooLong) as e:
            await eng.generate(req("y", [1] * 100, max_tokens=29)).__anext__()
        assert "100" in e.value.message and "29" in e.value.message and "128" in e.value.message
        for g in gens:
            await g.aclose()
        await wait_clean(eng)
        tokens, _ = await collect(eng, req("z", [1] * 100, max_tokens=28))  # exactly max_model_len: fine
        assert len(tokens) == 28 or tokens[-1] == eng.tokenizer.eos_token_id
    finally:
        await eng.stop(1)


async def test_queue_timeout_gives_deadline_exceeded_in_time():
    eng = Engine(FakeRuntime(), cfg(num_blocks=8, max_model_len=32, queue_timeout_s=0.5))
    eng.runtime.step_delay_s = 0.15
    eng.start()
    try:
        hog = eng.generate(req("hog", [1] * 28, max_tokens=4))  # holds 7-8 of 8 blocks for 6 steps (~0.9 s)
        hog_task = asyncio.ensure_future(collect_gen(hog))
        # the hog has its blocks (its add is queued ahead of the late one's anyway)
        assert await eventually(lambda: eng.stats()["num_free_blocks"] < eng.stats()["num_total_blocks"], 10)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as e:
            await collect(eng, req("late", [2] * 28, max_tokens=4))  # no prefix of the hog's to reuse
        assert 0.5 <= time.monotonic() - t0 < 1.0 and "queue_timeout_s" in e.value.message
        await hog_task
        await wait_clean(eng)
    finally:
        await eng.stop(1)


async def collect_gen(gen):
    return [e async for e in gen]


async def test_request_deadline_ends_a_long_generation(engine):
    engine.runtime.step_delay_s = 0.01
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        r = req("a", [1, 2], max_tokens=100, )
        r.deadline = time.monotonic() + 0.2
        await collect(engine, r)
    assert time.monotonic() - t0 < 0.6
    await wait_clean(engine)


async def test_stop_sequence_ends_output_before_it(engine):
    rt = engine.runtime
    p = rt.tokenizer.encode("stop test")
    ref = rt.tokenizer.decode(rt.greedy(p, 30), skip_special_tokens=True)
    stop = ref[10:12]
    cut = ref.find(stop)
    tokens, events = await collect(engine, req("a", p, max_tokens=30, stop=(stop,)))
    assert "".join(e.text_delta for e in events) == ref[:cut]
    assert events[-1].finish_reason == "stop"
    await wait_clean(engine)


def fill_from(rt, fail_at_layer=None, delay=0.0):
    calls = []

    async def kv_fill(r, sink):
        out = rt.prefill(r.prompt_token_ids[:-1])
        calls.append(r.request_id)
        for layer in range(sink.num_layers):
            if layer == fail_at_layer:
                raise ConnectionError("peer went away")
            await asyncio.sleep(delay)
            sink.write_layer(layer, out.keys[layer][sink.start:], out.values[layer][sink.start:])
    kv_fill.calls = calls
    return kv_fill


async def test_remote_fill_gives_the_same_tokens_as_local(engine):
    rt = engine.runtime
    ps = prompts(rt, 6)
    fill = fill_from(rt)
    outs = await asyncio.gather(*(collect(engine, req(f"r{i}", p, max_tokens=8), fill) for i, p in enumerate(ps)))
    assert [o[0] for o in outs] == [rt.greedy(p, 8) for p in ps]
    assert len(fill.calls) == 6
    await wait_clean(engine)


async def test_failed_fill_falls_back_to_local_or_fails_cleanly():
    rt = FakeRuntime()
    p = rt.tokenizer.encode("fallback please")
    for fallback in (True, False):
        eng = Engine(rt, cfg(fallback_to_local=fallback))
        eng.start()
        try:
            if fallback:
                tokens, _ = await collect(eng, req("a", p), fill_from(rt, fail_at_layer=1))
                assert tokens == rt.greedy(p, 8) and eng.stats()["num_fallbacks"] == 1
            else:
                with pytest.raises(TransferFailed):
                    await collect(eng, req("a", p), fill_from(rt, fail_at_layer=1))
            await wait_clean(eng)
        finally:
            await eng.stop(1)


async def test_late_write_after_abort_is_refused(engine):
    rt = engine.runtime
    sinks = []

    async def slow_fill(r, sink):
        sinks.append(sink)
        await asyncio.sleep(10)

    gen = engine.generate(req("a", [1, 2, 3, 4, 5]), slow_fill)
    task = asyncio.ensure_future(gen.__anext__())
    while not sinks:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await gen.aclose()
    await wait_clean(engine)
    out = rt.prefill([1, 2, 3, 4])
    with pytest.raises(TransferFailed):
        sinks[0].write_layer(0, out.keys[0], out.values[0])


async def test_late_write_after_a_complete_fill_is_refused(engine):
    """Once every layer is in, the sink is closed: a stray write (say, from an attempt that was
    given up) can never land in blocks the sequence has since freed."""
    rt = engine.runtime
    sinks = []

    async def fill(r, sink):
        sinks.append(sink)
        await fill_from(rt)(r, sink)

    gen = engine.generate(req("a", [1, 2, 3, 4, 5], max_tokens=50), fill)
    first = await gen.__anext__()  # decoding has started; the request is still running
    assert first.token_id == rt.greedy([1, 2, 3, 4, 5], 1)[0]
    out = rt.prefill([1, 2, 3, 4])
    try:
        with pytest.raises(TransferFailed):
            sinks[0].write_layer(0, out.keys[0], out.values[0])
    finally:
        await gen.aclose()
    await wait_clean(engine)


async def test_stalled_step_makes_engine_not_ready():
    """A step that does not return makes the engine not ready, and ready again once it does.
    The step is held until the test has seen /ready flip (a fixed 1 s stall and a look at
    0.6 s raced on a loaded machine: the step could start late, or the look come late)."""
    eng = Engine(FakeRuntime(), cfg(stall_timeout_s=0.3, idle_poll_s=0.01))
    entered, release = threading.Event(), threading.Event()
    real = eng.runtime.decode_step

    def stalled(pool, items):
        entered.set()
        release.wait(10)
        return real(pool, items)

    eng.runtime.decode_step = stalled
    eng.start()
    try:
        task = asyncio.ensure_future(collect(eng, req("a", [1], max_tokens=1)))
        assert await asyncio.to_thread(entered.wait, 10)
        assert await eventually(lambda: not eng.ready(), 10), "a stalled step never made the engine not ready"
        assert not task.done()  # still inside the stalled step
        release.set()
        await task
        assert await eventually(eng.ready, 10), "the engine did not become ready again after the stall"
    finally:
        release.set()
        await eng.stop(1)


async def test_stop_drains_then_ends_long_streams_with_shutting_down():
    eng = Engine(FakeRuntime(), cfg())
    eng.runtime.step_delay_s = 0.01
    eng.start()
    short = asyncio.ensure_future(collect(eng, req("short", [1, 2], max_tokens=3)))
    long = asyncio.ensure_future(collect(eng, req("long", [1, 2], max_tokens=120)))
    await asyncio.sleep(0.02)
    stopping = asyncio.ensure_future(eng.stop(grace_s=0.3))
    await asyncio.sleep(0.01)
    with pytest.raises(ShuttingDown):
        await collect(eng, req("new", [1]))
    assert not eng.ready()
    tokens, _ = await short
    assert len(tokens) == 3
    with pytest.raises(ShuttingDown):
        await long
    await stopping
    s = eng.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"] and not eng._thread.is_alive()


async def test_abort_storm_leaves_survivors_exact_and_state_clean():
    """Checklist D3: 50 greedy requests, every 5th cancelled at a random time."""
    import random
    rng = random.Random(0)
    engine = Engine(FakeRuntime(), cfg(max_concurrent=64, num_blocks=256))
    engine.start()
    rt = engine.runtime
    rt.step_delay_s = 0.002
    ps = [rt.tokenizer.encode(f"storm {i} " + "z" * (i % 7)) for i in range(50)]
    tasks = [asyncio.ensure_future(collect(engine, req(f"r{i}", p, max_tokens=12))) for i, p in enumerate(ps)]
    for i in range(0, 50, 5):
        await asyncio.sleep(rng.uniform(0, 0.01))
        tasks[i].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, (p, res) in enumerate(zip(ps, results)):
        if i % 5:
            assert res[0] == rt.greedy(p, 12), i
    await wait_clean(engine)
    tokens, _ = await collect(engine, req("r0", ps[0], max_tokens=12))  # a cancelled id is reusable
    assert tokens == rt.greedy(ps[0], 12)
    await engine.stop(1)


async def test_cancel_around_fill_completion_never_leaks(engine):
    """Checklist D4: cancel within a few ms of 'transfer done', many times; clean state after each."""
    import random
    rng = random.Random(1)
    rt = engine.runtime
    fill = fill_from(rt)
    p = rt.tokenizer.encode("handoff race prompt")
    for i in range(200):
        task = asyncio.ensure_future(collect(engine, req(f"h{i}", p, max_tokens=3), fill))
        await asyncio.sleep(rng.uniform(0, 0.004))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_clean(engine)
    assert engine.ready()


async def test_one_failing_fill_does_not_disturb_the_others():
    """Checklist H3: only the request whose fill breaks fails; the rest equal their solo runs."""
    rt = FakeRuntime()
    eng = Engine(rt, cfg(fallback_to_local=False))
    eng.start()
    try:
        good, bad = fill_from(rt, delay=0.001), fill_from(rt, fail_at_layer=1, delay=0.001)
        ps = prompts(rt, 8)
        results = await asyncio.gather(
            *(collect(eng, req(f"r{i}", p), bad if i == 3 else good) for i, p in enumerate(ps)),
            return_exceptions=True)
        assert isinstance(results[3], TransferFailed)
        assert [r[0] for i, r in enumerate(results) if i != 3] == [rt.greedy(p, 8) for i, p in enumerate(ps) if i != 3]
        await wait_clean(eng)
    finally:
        await eng.stop(1)


async def test_deadline_does_not_wait_for_a_fill_stuck_in_a_thread(engine):
    import threading
    release = threading.Event()

    async def stuck_fill(r, sink):  # a thread cannot be cancelled; the error must not wait for it
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 5)

    r = req("a", [1, 2, 3, 4])
    r.deadline = time.monotonic() + 0.3
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await collect(engine, r, stuck_fill)
    assert time.monotonic() - t0 < 0.8
    await wait_clean(engine)
    release.set()
