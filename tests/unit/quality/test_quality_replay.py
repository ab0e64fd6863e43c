"""The replayed tail (codec/base.py): how many tokens a transfer carries, the probe that
measures a replaying codec the way it is served, calibration's choice, and the scorer's path."""

import pytest
import torch

from scd_serve import codec
from scd_serve.codec.codebook import Codebook
from scd_serve.codec.kl_probe import KLProbe, make_examples
from scd_serve.config.codec import CalibrateConfig
from scd_serve.errors import CodebookError, ConfigError
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from scd_serve.quality.data import Record, tokenize
from scd_serve.quality.probes import MIN_TOP1_GAIN, pick_replay
from scd_serve.quality.scorer import Scorer


class Replaying:
    def __init__(self, n):
        self.replay_tokens = n


def test_a_transfer_carries_all_but_the_replayed_tail_and_at_least_one_token():
    assert codec.transferred(object(), 10) == 10  # a codec without a replay
    assert codec.transferred(Replaying(3), 10) == 7
    assert codec.transferred(Replaying(30), 10) == 1
    assert codec.transferred(Replaying(3), 0) == 0


def test_the_codebook_says_its_replay_and_refuses_a_bad_one():
    assert Codebook({}, {}).replay_tokens == 0  # codebooks from before it
    assert Codebook({"replay_tokens": 16}, {}).replay_tokens == 16
    for bad in (-1, 2.5, True, "16"):
        with pytest.raises(CodebookError, match="replay_tokens"):
            Codebook({"replay_tokens": bad}, {}).replay_tokens
    with pytest.raises(ConfigError, match="replay"):
        CalibrateConfig(kl_budget=0.1, replay=(0, -16))


def test_the_shortest_replay_meeting_both_targets_else_the_best_top1_worth_its_cost():
    m = {0: {"kl": 0.08, "top1": 0.90}, 16: {"kl": 0.04, "top1": 0.95}, 32: {"kl": 0.03, "top1": 0.97}}
    assert pick_replay(m, 0.05, 0.95) == (16, True)
    assert pick_replay(m, 0.05, 0.99) == (32, False)  # none meets: the best top-1
    flat = {0: {"kl": 0.08, "top1": 0.90}, 64: {"kl": 0.07, "top1": 0.90 + MIN_TOP1_GAIN / 2}}
    assert pick_replay(flat, 0.05, 0.95) == (0, False)  # a gain below the noise is not worth a prefill


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    return ModelRuntime.load(save_tiny_model(tmp_path_factory.mktemp("m") / "m", "qwen2", seed=3,
                                             num_hidden_layers=3))


def test_a_replay_probe_scores_the_same_positions_with_the_same_oracle(rt):
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(0, 200, (n,), generator=gen), torch.randint(0, 200, (5,), generator=gen)) for n in (30, 12)]
    base = make_examples(rt, rt, pairs, tail=2)
    replayed = make_examples(rt, rt, pairs, tail=2, replay=8)
    for a, b, (prompt, _) in zip(base, replayed, pairs):
        assert b.prefix == max(1, a.prefix - 8) and b.scored_from == a.prefix - b.prefix
        assert torch.allclose(a.oracle_logits, b.oracle_logits, atol=1e-4)
    assert KLProbe(rt, replayed).num_positions == KLProbe(rt, base).num_positions == 2 * (2 - 1 + 5)

    def producer_kv(ex, layer):  # the oracle's own K/V: nothing changes at any replay
        return ex.producer[layer].keys, ex.producer[layer].values

    measured = KLProbe(rt, replayed).measure_all({i: producer_kv for i in range(3)})
    assert measured.kl == pytest.approx(0.0, abs=1e-8) and measured.top1 == 1.0


def test_the_scorer_ships_fewer_tokens_and_the_consumer_computes_the_rest(rt):
    records = [Record("f:1", "text", "the cat sat on the mat and looked at the rain outside the window"),
               Record("f:2", "prompt", "numbers: one two three four", "five")]
    prompts = tokenize(records, rt.tokenizer, 64, "f")
    whole = codec.build("identity", producer=rt, consumer=rt)
    tail = codec.build("identity", producer=rt, consumer=rt)
    tail.replay_tokens = 5
    _, full, replayed = Scorer(rt, rt, prompts, greedy_tokens=3, show_progress=False).evaluate(
        {"oracle": None, "identity": whole, "identity-replay": tail})
    assert full["kl"] == 0.0 and replayed["kl"] == pytest.approx(0.0, abs=1e-9) and replayed["top1"] == 1.0
    handoff = sum(int(p.ids.numel()) - 1 for p in prompts.items)
    assert replayed["payload_bytes_per_token"] == pytest.approx(
        full["payload_bytes_per_token"] * (handoff - 5 * len(prompts.items)) / handoff)
