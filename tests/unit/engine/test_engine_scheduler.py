"""Scheduler + block manager without torch: continuous batching, chunked prefill, preemption."""

import pytest

from scd_serve.config.engine import EngineConfig
from scd_serve.engine.block_manager import BlockManager
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.engine.scheduler import Scheduler
from scd_serve.engine.sequence import Sequence, SequenceStatus

EOS = 99


def make(num_blocks=16, block_size=4, max_num_seqs=4, max_prefill_tokens=8, max_model_len=64, **kw):
    cfg = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                       max_concurrent=max(max_num_seqs, 8), max_prefill_tokens=max_prefill_tokens,
                       max_model_len=max_model_len, **kw)
    bm = BlockManager(cfg.num_blocks, cfg.block_size, cfg.prefix_caching)
    return Scheduler(cfg, bm, frozenset([EOS])), bm


def seq(n, max_tokens=4, fill=False, rid="r"):
    return Sequence(GenerationRequest(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens)),
                    needs_fill=fill)


def step(s: Scheduler, token=7):
    batch = s.schedule()
    finished = s.postprocess(batch, [token] * len(batch.decodes))
    return batch, finished


def test_scheduler_imports_no_torch():
    import scd_serve.engine.block_manager as b
    import scd_serve.engine.scheduler as m
    import scd_serve.engine.sequence as q
    for mod in (m, b, q):
        assert "import torch" not in open(mod.__file__).read()


def test_local_prefill_is_chunked_and_its_last_chunk_decodes_the_last_prompt_token():
    s, bm = make(max_prefill_tokens=4)
    a = seq(10)
    s.add(a)
    b1, _ = step(s)
    assert [(x.seq_id, n) for x, n in b1.prefills] == [(a.seq_id, 4)] and b1.decodes == []
    b2, _ = step(s)
    assert [n for _, n in b2.prefills] == [4] and b2.decodes == [] and a.num_cached == 8
    b3, _ = step(s)  # 1 left of prompt[:-1]: its chunk runs the last prompt token too, whose row is a decode's
    assert [n for _, n in b3.prefills] == [1] and b3.decodes == [a]
    assert a.output_token_ids == [7] and a.num_cached == 10
    b4, _ = step(s)
    assert b4.prefills == [] and b4.decodes == [a] and a.output_token_ids == [7, 7] and a.num_cached == 11


def test_continuous_batching_admits_while_others_decode_and_finishes_on_length():
    s, bm = make()
    a = seq(2, max_tokens=3, rid="a")
    s.add(a)
    batch, _ = step(s)  # prefill 1 token, and the last prompt token gives token 1
    assert batch.decodes == [a] and a.num_output_tokens == 1
    b = seq(2, max_tokens=3, rid="b")
    s.add(b)
    batch, _ = step(s)  # a decodes token 2 beside b's prefill, which gives b's token 1
    assert batch.decodes == [a, b] and [x for x, _ in batch.prefills] == [b]
    _, finished = step(s)
    assert a in finished or a.is_finished
    assert a.finish_reason == "length" and a.num_output_tokens == 3
    while s.has_unfinished():
        step(s)
    assert b.num_output_tokens == 3 and bm.num_free == bm.num_blocks


def test_eos_finishes_with_stop_and_ignore_eos_keeps_going():
    s, bm = make()
    a = seq(1, max_tokens=5)
    s.add(a)
    _, finished = step(s, token=EOS)
    assert finished == [a] and a.finish_reason == "stop" and bm.num_free == bm.num_blocks
    b = Sequence(GenerationRequest("b", [1], SamplingParams(max_tokens=2, ignore_eos=True)))
    s.add(b)
    step(s, token=EOS)
    assert not b.is_finished


def test_max_num_seqs_bounds_the_batch_and_fifo_order_holds():
    s, _ = make(max_num_seqs=2)
    seqs = [seq(1, rid=str(i)) for i in range(4)]
    for x in seqs:
        s.add(x)
    batch, _ = step(s)
    assert batch.decodes == seqs[:2] and len(s.waiting) == 2


def test_waiting_when_pool_is_full_then_admitted_after_free():
    s, bm = make(num_blocks=4, block_size=4, max_model_len=16)
    big = seq(13, max_tokens=3, rid="big")  # 4 blocks
    s.add(big)
    step(s)
    small = seq(2, rid="small")
    s.add(small)
    batch, _ = step(s)
    assert small.status is SequenceStatus.WAITING
    s.finish(big, "abort")
    batch, _ = step(s)
    assert small.status is SequenceStatus.RUNNING


def test_preemption_frees_newest_and_recomputes_it_locally():
    s, bm = make(num_blocks=4, block_size=2, max_num_seqs=4, max_model_len=8, prefix_caching=False)
    a = seq(3, max_tokens=5, rid="a")  # 2 blocks
    b = seq(3, max_tokens=5, rid="b")  # 2 blocks
    s.add(a)
    s.add(b)
    step(s)  # both prefill 2 tokens and decode position 2 (in block 1)
    step(s)  # both decode position 3 (in block 1)
    assert bm.num_free == 0
    batch, _ = step(s)  # position 4 needs a 3rd block each: b (newest) is preempted
    assert batch.preempted == [b] and batch.decodes == [a]
    assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_cached == 0
    assert b.output_token_ids == [7, 7]  # keeps what it generated; recomputes K/V of all but the last
    s.finish(a, "abort")
    batch, _ = step(s)
    assert [(x, n) for x, n in batch.prefills] == [(b, 4)] and batch.decodes == [b]


def test_remote_fill_holds_blocks_then_decodes_from_t_minus_1():
    s, bm = make()
    a = seq(6, fill=True)
    s.add(a)
    batch, _ = step(s)
    assert batch.filling == [a] and a.status is SequenceStatus.FILLING and batch.is_empty
    assert len(a.block_ids) == 2
    s.fill_done(a)
    batch, _ = step(s)
    assert batch.prefills == [] and batch.decodes == [a] and a.num_cached == 6


def test_a_fill_short_of_the_handoff_prefills_its_replayed_tail_then_decodes():
    s, bm = make()
    a = seq(6, fill=True)
    s.add(a)
    step(s)
    s.fill_done(a, 3)  # tokens 0..2 filled; 3 and 4 are the replayed tail, 5 the first decode step's
    batch, _ = step(s)
    assert [(x, n) for x, n in batch.prefills] == [(a, 2)] and batch.decodes == [a]
    assert a.output_token_ids == [7]  # the tail's chunk ran the last prompt token too
    batch, _ = step(s)
    assert batch.prefills == [] and batch.decodes == [a] and a.output_token_ids == [7, 7]
    b = seq(6, fill=True, rid="b")
    s.add(b)
    step(s)
    with pytest.raises(ValueError):
        s.fill_done(b, 6)  # more than the handoff of 5


def test_fill_failure_falls_back_to_local_prefill_in_same_blocks():
    s, bm = make()
    a = seq(6, fill=True)
    s.add(a)
    step(s)
    blocks = list(a.block_ids)
    assert s.fill_failed(a)
    batch, _ = step(s)
    assert [(x, n) for x, n in batch.prefills] == [(a, 5)] and a.block_ids == blocks
    assert not s.fill_failed(a)  # only from FILLING


def test_finish_is_idempotent_from_every_state():
    s, bm = make(max_num_seqs=1)
    run, fill, wait = seq(3, rid="run"), seq(3, fill=True, rid="fill"), seq(3, rid="wait")
    s.add(run)
    step(s)
    s2, bm2 = make()
    s2.add(fill)
    step(s2)
    s.add(wait)
    for sched, x in ((s, run), (s2, fill), (s, wait)):
        sched.finish(x, "abort")
        sched.finish(x, "abort")
        assert x.is_finished and x.block_ids == []
    assert not s.has_unfinished() and not s2.has_unfinished()
    assert bm.num_free == bm.num_blocks and bm2.num_free == bm2.num_blocks
    s2.fill_done(fill)  # a late "filled" for an aborted sequence is ignored
    assert not s2.has_unfinished()


def test_expired_reports_queue_timeout_and_deadline():
    s, _ = make(num_blocks=4, block_size=4, max_model_len=16, queue_timeout_s=1.0)
    a = seq(13, rid="a")
    s.add(a)
    step(s)
    b = seq(13, rid="b")
    b.waiting_since = 0.0
    s.add(b)
    c = seq(1, rid="c")
    c.request.deadline = 5.0
    assert s.expired(0.5) == []
    assert (b, "queue_timeout") in s.expired(1.0)
    s.add(c)
    assert (c, "deadline") in s.expired(5.0)
