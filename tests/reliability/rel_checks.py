"""The clean-state (CS) check every reliability test ends with, and its baseline."""

import asyncio
import os

from polls import eventually  # the suite's deadline poll (tests/polls.py), for the rel_* tests too
from scd_serve.testing.soak import completion

# How long the clean-state check waits for leaks to go: a pass returns as soon as it is clean; a
# leak never goes away, so this only has to outlast a loaded machine (it used to be 2 s).
CLEAN_TIMEOUT_S = 10.0


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


async def assert_clean(stack, baseline: Baseline, timeout: float = CLEAN_TIMEOUT_S, fresh: bool = True):
    """CS: KV blocks all free, no transfer on either side, nothing unfinished, tasks and fds back."""
    leaks = await stack.wait_clean(timeout)
    assert leaks == {}, f"not clean after {timeout}s: {leaks}"
    await eventually(lambda: len(asyncio.all_tasks()) <= baseline.tasks, timeout)
    tasks = asyncio.all_tasks()
    assert len(tasks) <= baseline.tasks, f"{len(tasks) - baseline.tasks} extra asyncio tasks: " \
        f"{sorted(t.get_name() + ':' + repr(t.get_coro())[:60] for t in tasks)}"
    await eventually(lambda: num_fds() <= baseline.fds + 5, timeout)  # a socket may still be closing
    assert num_fds() <= baseline.fds + 5, f"fds {num_fds()} > baseline {baseline.fds} + 5"
    if fresh:
        if getattr(stack.served, "armed", None) is not None:
            stack.served.armed = False  # the fault was the test's; the fresh request is not faulted
        await fresh_request(stack)
