import pytest

from scd_serve.engine.block_manager import BlockManager
from scd_serve.engine.request import GenerationRequest
from scd_serve.engine.sequence import Sequence


def seq(n_tokens: int) -> Sequence:
    return Sequence(GenerationRequest("r", list(range(n_tokens))))


def test_allocate_covers_every_token_and_free_returns_all():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(9)  # 9 tokens -> 3 blocks
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_ids) == 3 and bm.num_free == 5 and len(set(s.block_ids)) == 3
    bm.free(s)
    assert bm.num_free == 8 and s.block_ids == []
    bm.free(s)  # idempotent
    assert bm.num_free == 8


def test_can_allocate_is_false_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(9)
    assert not bm.can_allocate(s)
    with pytest.raises(RuntimeError):
        bm.allocate(s)
    assert bm.num_free == 2


def test_append_takes_a_block_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(4)
    bm.allocate(s)
    s.num_cached = 3  # next step writes position 3: still in block 0
    assert bm.can_append(s)
    bm.may_append(s)
    assert len(s.block_ids) == 1
    s.num_cached = 4  # position 4 needs block 1
    bm.may_append(s)
    assert len(s.block_ids) == 2 and bm.num_free == 2


def test_blocks_are_never_shared():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = seq(5), seq(6)
    bm.allocate(a)
    bm.allocate(b)
    assert not set(a.block_ids) & set(b.block_ids)
    assert bm.num_free == 0
    bm.free(a)
    with pytest.raises(RuntimeError):  # a foreign block list is caught, not silently freed twice
        a.block_ids = list(b.block_ids)
        bm.free(a)


def test_a_sequence_grows_into_the_block_after_its_last_so_its_blocks_form_few_runs():
    bm = BlockManager(num_blocks=16, block_size=2)
    a, b = seq(4), seq(2)
    bm.allocate(a)  # blocks 0, 1
    a.num_cached = 4
    bm.may_append(a)  # 2 is free: a stays one run
    bm.allocate(b)  # the lowest free: 3
    for n in (2, 4):
        b.num_cached = n
        bm.may_append(b)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4, 5]
    a.num_cached = 6
    bm.may_append(a)  # 3 is taken: a starts a second run at the lowest free block
    assert a.block_ids == [0, 1, 2, 6]
    bm.free(b)
    c = seq(6)
    bm.allocate(c)  # the hole b left, lowest first
    assert c.block_ids == [3, 4, 5] and bm.num_free == 16 - 7


def test_random_churn_keeps_ownership_and_counts_exact():
    import random
    rng, bm, live = random.Random(0), BlockManager(num_blocks=32, block_size=3), []
    for _ in range(2000):
        if live and (rng.random() < 0.3 or bm.num_free < 4):
            bm.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.5:
            s = seq(rng.randint(1, 9))
            if bm.can_allocate(s):
                bm.allocate(s)
                s.num_cached = s.num_tokens - 1
                live.append(s)
        elif live:
            s = rng.choice(live)
            s.num_cached += 1
            if bm.can_append(s):
                bm.may_append(s)
            else:
                s.num_cached -= 1
        held = [blk for s in live for blk in s.block_ids]
        assert len(held) == len(set(held)) == bm.num_blocks - bm.num_free  # no block shared, none lost
    assert len(bm._lowest) <= 4 * bm.num_blocks + 32
