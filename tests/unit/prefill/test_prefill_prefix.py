"""The producer's prefix cache (prefill/prefix.py): a prompt that starts with one seen before
is prefilled from the cached blocks on, with the states a whole prefill gives those rows."""

import pytest
import torch

from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from scd_serve.prefill.prefix import PrefixStates


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    return ModelRuntime.load(save_tiny_model(tmp_path_factory.mktemp("prefix"), "llama"))


def whole(rt, tokens):
    return [s for _, s in rt.iter_prefill(torch.tensor(tokens), compute_logits=False, residuals=True)]


def test_a_later_turn_is_prefilled_after_the_cached_blocks_with_the_whole_prefills_states(rt):
    cache = PrefixStates(rt, num_tokens=256, block_size=8)
    first = list(range(5, 45))  # 40 tokens: blocks of 8, the last token's block not full
    got = list(cache.layers(first, start=0))
    assert [s.start for _, s in got] == [0] * rt.spec.num_layers and cache.num_hit_tokens == 0
    turn = first + list(range(60, 80))  # the next turn repeats it
    rows = list(cache.layers(turn, start=30))  # the decode side holds 30 of them
    assert cache.num_hit_tokens == 24  # whole blocks only, and none past `start`
    for (layer, s), ref in zip(rows, whole(rt, turn)):
        assert s.start == 24 and s.keys.shape[0] == len(turn) - 24
        for name in ("keys", "values", "attn_input", "residual"):
            torch.testing.assert_close(getattr(s, name), getattr(ref, name)[24:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.rows_from(30).keys, ref.keys[30:], atol=1e-4, rtol=1e-4)
    assert cache.blocks.num_free == cache.blocks.num_blocks  # nothing held after the run


def test_a_run_stopped_half_way_caches_nothing_and_a_full_pool_prefills_whole(rt):
    cache = PrefixStates(rt, num_tokens=64, block_size=8)
    run = cache.layers(list(range(5, 45)), start=0)
    next(run)
    run.close()  # the transfer stopped: its blocks are half written
    assert cache.blocks.num_cached_blocks == 0 and cache.blocks.num_free == cache.blocks.num_blocks
    assert cache.layers(list(range(3, 3 + 80)), start=0) is None  # 80 tokens > the pool's 64


def test_a_run_asked_for_the_final_row_ends_with_its_output_cached_prefix_or_not(rt):
    """last_hidden (the last-row handoff): the final row's output, whose logits are a whole
    prefill's last, from the dense run and from one over cached blocks."""
    cache = PrefixStates(rt, num_tokens=256, block_size=8)
    for tokens, start, hit in ((list(range(5, 45)), 0, 0), (list(range(5, 45)) + list(range(60, 70)), 40, 40)):
        run = cache.layers(tokens, start, last_hidden=True)
        states = []
        while True:
            try:
                states.append(next(run)[1])
            except StopIteration as end:
                h = end.value
                break
        assert states[-1].start == hit and h.shape == (1, rt.spec.hidden_size)
        want = rt.prefill(torch.tensor(tokens), capture=False).logits[-1:]
        torch.testing.assert_close(rt.logits_of(h), want, atol=1e-4, rtol=1e-4)
