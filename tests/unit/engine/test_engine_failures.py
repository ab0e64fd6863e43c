"""Engine failures that belong to some requests: a failing step fails its batch, non-finite
logits fail their request alone, and only steps that keep failing end the loop."""

import asyncio
import time

import pytest
from engine_helpers import cfg, collect, req, wait_clean

from scd_serve.engine.engine import MAX_FAILED_STEPS, Engine
from scd_serve.testing.toy_runtime import ToyRuntime
from scd_serve.errors import EngineDead, StepFailed

pytestmark = pytest.mark.timeout(30)


async def test_engine_death_fails_requests_and_readiness():
    """Steps that keep failing: the first MAX_FAILED_STEPS - 1 fail their requests (StepFailed),
    the next kills the loop (EngineDead for everyone after, fast, with every block freed)."""
    eng = Engine(ToyRuntime(), cfg())
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
    t0 = time.monotonic()
    with pytest.raises(EngineDead):
        await collect(eng, req("b", [1]))
    assert time.monotonic() - t0 < 0.1
    s = eng.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    await eng.stop(0.1)


async def test_a_failing_step_fails_its_batch_and_the_engine_goes_on(engine):
    rt = engine.runtime
    slow = [asyncio.ensure_future(collect(engine, req(f"s{i}", [1, 2, 3], max_tokens=30))) for i in range(3)]
    while engine.stats()["num_running"] < 3:
        await asyncio.sleep(0.005)
    rt.fail_after_steps = rt.num_steps  # the next step raises, once
    results = await asyncio.gather(*slow, return_exceptions=True)
    failed = [r for r in results if isinstance(r, StepFailed)]
    assert failed and all(isinstance(r, (StepFailed, tuple)) for r in results), results
    assert "injected forward failure" in failed[0].message
    rt.fail_after_steps = None
    assert engine.ready()
    await wait_clean(engine)
    tokens, _ = await collect(engine, req("after", [4, 5], max_tokens=6))
    assert tokens == rt.greedy([4, 5], 6)


class NanFor(ToyRuntime):
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
