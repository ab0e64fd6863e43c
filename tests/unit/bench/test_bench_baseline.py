"""The static-batch baseline: batches form from what is queued, and each row's stream ends
after its own max_tokens while the batch runs on to its longest."""

from __future__ import annotations

import asyncio
import queue

import torch

from scd_serve.bench.baseline import _Streamer, take_batch


def test_take_batch_takes_what_is_queued_up_to_the_size():
    jobs: queue.Queue = queue.Queue()
    for i in range(5):
        jobs.put(i)
    assert take_batch(jobs, 3) == [0, 1, 2]
    assert take_batch(jobs, 3) == [3, 4]  # nothing more arrives within the wait: a smaller batch


def test_each_row_streams_exactly_its_own_tokens():
    async def run():
        loop = asyncio.get_running_loop()
        outs = [asyncio.Queue(), asyncio.Queue()]
        s = _Streamer(loop, outs, [1, 3])
        s.put(torch.zeros(2, 5))  # the prompts: not streamed
        for step in range(3):
            s.put(torch.tensor([10 + step, 20 + step]))
        s.end()
        await asyncio.sleep(0)
        got = []
        for out in outs:
            row = []
            while (tok := await out.get()) is not None:
                row.append(tok)
            got.append(row)
        return got

    assert asyncio.run(run()) == [[10], [20, 21, 22]]
