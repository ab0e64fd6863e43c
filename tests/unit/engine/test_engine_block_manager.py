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
