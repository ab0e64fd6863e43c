"""The decode worker's prefix cache: full K/V blocks kept after a request and reused by prompts
that start with the same tokens (block manager bookkeeping without torch, then the engine over
the toy runtime, whose output changes when a block holds the wrong K/V)."""

import asyncio
import random

import pytest
from engine_helpers import cfg, collect, req, wait_clean

from scd_serve.engine.block_manager import BlockManager
from scd_serve.engine.engine import Engine
from scd_serve.engine.request import GenerationRequest
from scd_serve.engine.sequence import Sequence
from scd_serve.testing.fake_runtime import FakeRuntime

pytestmark = pytest.mark.timeout(60)


def seq(tokens, fill=False) -> Sequence:
    return Sequence(GenerationRequest("r", list(tokens)), needs_fill=fill)


def prefilled(bm: BlockManager, tokens, fill=False) -> Sequence:
    """A sequence admitted (with a cache lookup unless filled) whose prompt, all but its last
    token, now has K/V: its full blocks are cached."""
    s = seq(tokens, fill)
    bm.allocate(s, cache_lookup=not fill)
    s.num_cached = s.num_tokens - 1
    bm.cache_full_blocks(s)
    return s


def test_a_prompt_starting_with_cached_blocks_takes_them_and_prefills_only_the_rest():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = prefilled(bm, range(11))  # positions 0..9: blocks 0 and 1 are full
    assert bm.num_cached_blocks == 2
    b = seq([*range(8), 50, 51, 52, 53, 54])  # the same first 8 tokens, then others
    assert bm.allocate(b, cache_lookup=True) == 8
    assert b.block_ids[:2] == a.block_ids[:2] and not set(b.block_ids[2:]) & set(a.block_ids)
    c = seq([*range(7), 99, 8, 9])  # differs inside the second block: only the first is reused
    assert bm.allocate(c, cache_lookup=True) == 4 and c.block_ids[0] == a.block_ids[0]
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (11 + 13 + 10, 0 + 8 + 4)


def test_the_last_token_is_never_taken_from_the_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    prefilled(bm, range(9))  # blocks 0, 1 full (positions 0..7)
    same = seq(range(8))  # 8 tokens: the 8th is fed to the first decode step, so one block only
    assert bm.allocate(same, cache_lookup=True) == 4


def test_only_blocks_whose_every_slot_holds_k_v_are_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(13))
    bm.allocate(a, cache_lookup=True)
    a.num_cached = 6  # a prefill chunk of 6: block 0 written, block 1 half
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 1 and bm.allocate(seq(range(13)), cache_lookup=True) == 4
    a.num_cached = 12
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 3 and bm.allocate(seq(range(13)), cache_lookup=True) == 12


def test_a_fills_blocks_are_not_a_local_prefills():
    """Rebuilt or shipped K/V are not the consumer's own numbers: no reuse across the two."""
    bm = BlockManager(num_blocks=16, block_size=4)
    prefilled(bm, range(9), fill=True)
    assert bm.allocate(seq(range(9)), cache_lookup=True) == 0
    prefilled(bm, range(9))
    assert bm.allocate(seq(range(9)), cache_lookup=True) == 8


def test_a_block_held_by_two_stays_until_both_free_it_then_is_evicted_last_recently_used_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = prefilled(bm, [1, 2, 3])  # the block of 1, 2 cached; 2 blocks held
    b = seq([1, 2, 9])
    assert bm.allocate(b, cache_lookup=True) == 2
    shared = a.block_ids[0]
    bm.free(a)
    assert bm.num_free == 2 and shared in b.block_ids  # still held by b: neither free nor evictable
    bm.free(b)
    assert bm.num_free == 4 and bm.num_cached_blocks == 1  # cached, held by none: evictable
    hog = seq([5, 6, 7, 8, 9, 10, 11])  # 4 blocks: the cached block is evicted for it
    bm.allocate(hog, cache_lookup=True)
    assert bm.num_cached_blocks == 0
    bm.free(hog)
    assert bm.allocate(seq([1, 2, 3]), cache_lookup=True) == 0  # evicted: recomputed, never stale


def test_free_blocks_are_used_before_cached_ones():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.free(prefilled(bm, [1, 2, 3, 4, 5]))
    assert bm.num_cached_blocks == 2
    bm.allocate(seq([7, 7, 7]))  # 2 blocks from the 3 free ones
    assert bm.num_cached_blocks == 2 and bm.num_free == 4  # the 2 free blocks and the 2 cached, evictable


def test_misuse_is_caught_with_shared_blocks():
    bm = BlockManager(num_blocks=6, block_size=2)
    prefilled(bm, [1, 2, 3])
    b = seq([1, 2, 4])
    bm.allocate(b, cache_lookup=True)
    stranger = seq([1])
    stranger.block_ids = list(b.block_ids)
    with pytest.raises(RuntimeError):  # a block list it never got is not freed for its holders
        bm.free(stranger)


def test_random_churn_never_writes_into_a_shared_block_and_loses_no_block():
    rng, bm, live = random.Random(0), BlockManager(num_blocks=24, block_size=3), []
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(3, 9))] for _ in range(4)]
    for _ in range(3000):
        if live and (rng.random() < 0.3 or bm.num_free < 4):
            bm.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.5:
            s = seq(rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 4))])
            if bm.can_allocate(s, cache_lookup=True):
                hit = bm.allocate(s, cache_lookup=True)
                assert hit % 3 == 0 and hit <= s.num_tokens - 1
                s.num_cached = s.num_tokens - 1
                bm.cache_full_blocks(s)
                live.append(s)
        elif live:
            s = rng.choice(live)
            if bm.can_append(s):
                bm.may_append(s)
                s.append_token(rng.randrange(5))
                bm.cache_full_blocks(s)
        holders: dict[int, int] = {}
        for s in live:
            for blk in s.block_ids:
                holders[blk] = holders.get(blk, 0) + 1
            # the blocks it still writes (position num_cached on) are its own
            assert all(holders[blk] == 1 or blk not in s.block_ids[s.num_cached // 3:] for blk in holders)
        assert len(holders) == bm.num_blocks - bm.num_free  # held blocks + free + evictable = all


# ---------------------------------------------------------------- the engine


def turns(rt, n):
    """A chat's growing prompt: each turn repeats everything before it and adds a message."""
    prompt, out = rt.tokenizer.encode("system: answer briefly. "), []
    for i in range(n):
        prompt = prompt + rt.tokenizer.encode(f"user {i}: question number {i}? ")
        out.append(list(prompt))
    return out


async def test_multi_turn_prompts_reuse_the_earlier_turns_and_answer_as_without_the_cache():
    rt = FakeRuntime()
    eng = Engine(rt, cfg(max_model_len=256))
    eng.start()
    try:
        for i, prompt in enumerate(turns(rt, 4)):
            tokens, events = await collect(eng, req(f"t{i}", prompt, max_tokens=6))
            assert tokens == rt.greedy(prompt, 6)
            cached = events[-1].usage.cached_tokens
            if i == 0:
                assert cached == 0
            else:  # all of the previous turn's prompt that fills whole blocks of 4
                assert len(turns(rt, i)[-1]) - 4 < cached <= len(prompt) - 1 and cached % 4 == 0
        s = eng.stats()
        assert s["prefix_cache_hit_tokens"] > 0 and s["num_cached_blocks"] > 0
        await wait_clean(eng)
    finally:
        await eng.stop(1)


async def test_a_small_pool_evicts_and_every_answer_stays_exact():
    rt = FakeRuntime()
    eng = Engine(rt, cfg(num_blocks=32, max_model_len=64, max_num_seqs=4))
    eng.start()
    try:
        rng = random.Random(3)
        shared = [rt.tokenizer.encode(f"prefix {k} " + "z" * 12) for k in range(6)]  # 6 x 4 blocks > a pool's worth
        for round_ in range(3):
            ps = [rng.choice(shared) + rt.tokenizer.encode(f"q{round_}{i}") for i in range(8)]
            outs = await asyncio.gather(*(collect(eng, req(f"r{round_}.{i}", p, max_tokens=10))
                                          for i, p in enumerate(ps)))
            assert [o[0] for o in outs] == [rt.greedy(p, 10) for p in ps]
        assert eng.stats()["prefix_cache_hit_tokens"] > 0
        await wait_clean(eng)
    finally:
        await eng.stop(1)


async def test_a_fill_aborted_mid_transfer_leaves_nothing_a_later_request_reuses():
    """SGLang's and vLLM's stale-KV bug: the aborted fill's blocks (half written, not cached) go
    to the next request with the same prompt, which must answer as it would alone."""
    rt = FakeRuntime()
    eng = Engine(rt, cfg())
    eng.start()
    try:
        p = rt.tokenizer.encode("a prompt whose transfer breaks off half way")
        started = asyncio.Event()

        async def half_fill(r, sink):  # writes wrong K/V into the first layer, then hangs
            out = rt.kv(r.prompt_token_ids[:-1]) * 7
            sink.write_layer(0, out[0], out[0])
            started.set()
            await asyncio.sleep(30)

        task = asyncio.ensure_future(collect(eng, req("aborted", p, max_tokens=6), half_fill))
        await asyncio.wait_for(started.wait(), 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_clean(eng)
        assert eng.stats()["num_cached_blocks"] == 0
        tokens, events = await collect(eng, req("next", p, max_tokens=6))
        assert tokens == rt.greedy(p, 6) and events[-1].usage.cached_tokens == 0
    finally:
        await eng.stop(1)


async def test_prefix_caching_off_keeps_nothing():
    rt = FakeRuntime()
    eng = Engine(rt, cfg(prefix_caching=False))
    eng.start()
    try:
        for i, prompt in enumerate(turns(rt, 2)):
            _, events = await collect(eng, req(f"t{i}", prompt))
            assert events[-1].usage.cached_tokens == 0
        assert eng.stats()["num_cached_blocks"] == 0
    finally:
        await eng.stop(1)
