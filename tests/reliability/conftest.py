"""Fixtures of the reliability suite: one tiny model per session, a LocalStack per test, and the
clean-state (CS) check every failure test ends with."""

import pytest

from scd_serve.model.runtime import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from rel_checks import CLEAN_TIMEOUT_S, Baseline, fresh_request
from scd_serve.testing.soak import LocalStack


@pytest.fixture(scope="session")
def rt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(path, "llama", seed=0)  # hidden 64, 2 layers, byte tokenizer
    return ModelRuntime.load(path)


@pytest.fixture(scope="session")
def model_dir(rt, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-dir")
    save_tiny_model(path, "llama", seed=0)
    return path


@pytest.fixture
async def make_stack(rt):
    """make(**LocalStack options) -> (started stack, baseline taken after one warm request)."""
    stacks = []

    async def make(warm=True, **opts):
        stack = await LocalStack(rt, **opts).start()
        stacks.append(stack)
        if warm:
            faulty = getattr(stack.served, "armed", None) is not None
            if faulty:
                stack.served.armed = False  # faults are for the test, not the warm-up
            await fresh_request(stack)
            await fresh_request(stack, "local")
            if faulty:
                stack.served.armed = True
        await stack.wait_clean(CLEAN_TIMEOUT_S)
        return stack, Baseline()

    yield make
    for s in stacks:
        await s.stop()
