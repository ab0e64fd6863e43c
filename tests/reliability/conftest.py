"""Fixtures of the reliability suite: one tiny model per session, a LocalStack per test, and the
clean-state (CS) check every failure test ends with."""

import asyncio
import os

import pytest

from scd_serve.model.runtime import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from scd_serve.soak import LocalStack, completion


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


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Baseline:
    def __init__(self):
        self.tasks = len(asyncio.all_tasks())
        self.fds = num_fds()


async def fresh_request(stack, method="identity"):
    r = await stack.client.post("/v1/completions", json=completion("fresh after the fault", 4, scd_method=method))
    assert r.status_code == 200, r.text
    return r


async def assert_clean(stack, baseline: Baseline, timeout: float = 2.0, fresh: bool = True):
    """CS: KV blocks all free, no transfer on either side, nothing unfinished, tasks and fds back."""
    leaks = await stack.wait_clean(timeout)
    assert leaks == {}, f"not clean after {timeout}s: {leaks}"
    end = asyncio.get_running_loop().time() + timeout
    while len(asyncio.all_tasks()) > baseline.tasks and asyncio.get_running_loop().time() < end:
        await asyncio.sleep(0.02)
    tasks = asyncio.all_tasks()
    assert len(tasks) <= baseline.tasks, f"{len(tasks) - baseline.tasks} extra asyncio tasks: " \
        f"{sorted(t.get_name() + ':' + repr(t.get_coro())[:60] for t in tasks)}"
    assert num_fds() <= baseline.fds + 5, f"fds {num_fds()} > baseline {baseline.fds} + 5"
    if fresh:
        if getattr(stack.served, "armed", None) is not None:
            stack.served.armed = False  # the fault was the test's; the fresh request is not faulted
        await fresh_request(stack)


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
        await stack.wait_clean()
        return stack, Baseline()

    yield make
    for s in stacks:
        await s.stop()
