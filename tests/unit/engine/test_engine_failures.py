"""Engine failures that belong to some requests: a failing step fails its batch, non-finite
logits fail their request alone, and only steps that keep failing end the loop."""

import asyncio
import threading

import pytest
from engine_helpers import cfg, collect, refused_at_once, req, wait_clean
from polls import eventually

from scd_serve.engine.engine import MAX_FAILED_STEPS, Engine
from scd_serve.testing.fake_runtime import FakeRuntime
from scd_serve.errors import EngineDead, StepFailed

pytestmark = pytest.mark.timeout(30)


async def test_engine_death_fails_requests_and_readiness():
    """Steps that keep failing: the first MAX_FAILED_STEPS - 1 fail their requests (StepFailed),
    the next kills the loop (EngineDead for everyone after, fast, with every block freed)."""
    eng = Engine(FakeRuntime(), cfg())
    eng.start()
    assert eng.ready()
    eng.runtime.fail_after_steps = 3
    for i in range(MAX_FAILED_STEPS - 1):
        with pytest.raises(StepFailed):
            await collect(eng, req(f"a{i}", [1, 2, 3], max_tokens=50))
        assert eng.ready()
    with pytest.raises(EngineDead):
        await collect(eng, req("a", [1, 2, 3], max_tokens=50))
    assert not eng.ready()
    await refused_at_once(eng, req("b", [1]), EngineDead)  # fast: never queued on the dead loop
    s = eng.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    await eng.stop(0.1)


async def test_a_failing_step_fails_its_batch_and_the_engine_goes_on(engine):
    """The step that decodes all three requests raises. That step is held until the test has
    armed the fault: on a fast machine the three 30-token requests would otherwise be done
    before a poll of num_running saw them, and on a slow one the fault could land late."""
    rt = engine.runtime
    entered, admitted, batched, go = (threading.Event() for _ in range(4))
    real_extend, real_decode = rt.extend, rt.decode_step

    def hold_first(*_):  # the first step waits until all three requests are in the engine's inbox
        if not admitted.is_set():
            entered.set()
            admitted.wait(10)

    def held_extend(pool, items, *a, **kw):
        hold_first()
        return real_extend(pool, items, *a, **kw)

    def held_decode(pool, items):
        hold_first()
        if len(items) == 3 and not go.is_set():  # the first step that decodes all three
            batched.set()
            go.wait(10)
        return real_decode(pool, items)

    rt.extend, rt.decode_step = held_extend, held_decode
    slow = [asyncio.ensure_future(collect(engine, req(f"s{i}", [1, 2, 3], max_tokens=30))) for i in range(3)]
    assert await asyncio.to_thread(entered.wait, 10)
    # generate() registers a request and queues its "add" in one go: three registered, three queued
    assert await eventually(lambda: engine.stats()["num_requests"] == 3, 10), engine.stats()
    admitted.set()
    assert await asyncio.to_thread(batched.wait, 10), engine.stats()
    rt.fail_after_steps = rt.num_steps  # the held step raises, once (no request is left for another)
    go.set()
    results = await asyncio.gather(*slow, return_exceptions=True)
    failed = [r for r in results if isinstance(r, StepFailed)]
    assert failed and all(isinstance(r, (StepFailed, tuple)) for r in results), results
    assert "injected forward failure" in failed[0].message
    rt.fail_after_steps = None
    assert engine.ready()
    await wait_clean(engine)
    tokens, _ = await collect(engine, req("after", [4, 5], max_tokens=6))
    assert tokens == rt.greedy([4, 5], 6)


class NanFor(FakeRuntime):
    """Non-finite logits for any sequence at its `context`-th token (the other requests of the
    test stay shorter than that)."""

    def __init__(self, context: int):
        super().__init__()
        self.context = context

    def decode_step(self, pool, items):
        rows = super().decode_step(pool, items)
        for i, (_, num_cached, _) in enumerate(items):
            if num_cached + 1 == self.context:
                rows[i] = float("nan")
        return rows


@pytest.mark.parametrize("temperature", [0, 0.7])
async def test_non_finite_logits_fail_that_request_alone(temperature):
    eng = Engine(NanFor(context=22), cfg())
    eng.start()
    try:
        others = [asyncio.ensure_future(collect(eng, req(f"o{i}", [1, 2, 3][:i + 1], max_tokens=12,
                                                         temperature=temperature, seed=i, ignore_eos=True)))
                  for i in range(3)]
        with pytest.raises(StepFailed, match="non-finite logits"):
            await collect(eng, req("poisoned", list(range(1, 21)), max_tokens=12, temperature=temperature, seed=9))
        for task in others:
            tokens, events = await task
            assert len(tokens) == 12 and events[-1].finish_reason == "length"
        assert eng.ready()
        await wait_clean(eng)
    finally:
        await eng.stop(1)
