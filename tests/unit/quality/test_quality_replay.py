"""The replayed tail (codec/base.py): how many tokens a transfer carries, the probe that
measures a replaying codec the way it is served, calibration's choice, and the scorer's path."""

import pytest
import torch

from scd_serve import codec
from scd_serve.codec.codebook import Codebook
from scd_serve.calibration.kl_probe import KLProbe, make_examples
from scd_serve.config.codec import CalibrateConfig
from scd_serve.errors import CodebookError, ConfigError
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from scd_serve.quality.data import Record, tokenize
from scd_serve.calibration.probes import MIN_TOP1_GAIN, ReplayProbes, pick, top1_error
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


def test_the_cheapest_option_meeting_both_targets_else_the_best_top1_worth_its_cost():
    from scd_serve.codec.plan import REUSE, RUN, LayerPlan, Plan

    plan = Plan((LayerPlan(REUSE, 4, 4), LayerPlan(REUSE, 4, 4)))
    ran = Plan((LayerPlan(REUSE, 4, 4), LayerPlan(RUN, r_h=8)))

    def option(replay, run, cost, kl, top1):
        return {"replay": replay, "run": run, "cost": cost, "kl": kl, "top1": top1, "plan": ran if run else plan}

    alone, run1 = option(0, None, 0.0, 0.04, 0.90), option(0, 1, 0.5, 0.03, 0.93)
    r16, r32 = option(16, None, 0.1, 0.04, 0.95), option(32, None, 0.2, 0.03, 0.97)
    assert pick([alone, run1, r16, r32], 0.05, 0.95) == (r16, True)  # the cheapest that meets both
    assert pick([alone, run1, r16, r32], 0.05, 0.99) == (r32, False)  # top-1 out of reach: the best of it
    # within the probe's noise of the best, the cheapest (a run costing twice as much buys nothing sure)
    twin = option(0, 1, 0.5, 0.03, 0.97 + MIN_TOP1_GAIN / 2)
    assert pick([alone, r32, twin], 0.05, 0.99) == (r32, False)
    # a gain below the noise is not worth a prefill: the cheapest within the KL budget
    flat = option(64, None, 0.25, 0.03, 0.90 + MIN_TOP1_GAIN / 2)
    assert pick([alone, flat], 0.05, 0.95) == (alone, False)
    # what is over the KL budget is not weighed by top-1; nothing within it: the least KL
    over = option(16, None, 0.1, 0.06, 0.99)
    assert pick([alone, over], 0.05, 0.95) == (alone, False)
    assert pick([option(0, None, 0.0, 0.09, 0.5), run1 | {"kl": 0.07}], 0.05, 0.95)[0]["run"] == 1
    # over the floor by less than the probe's standard error (0.952 of 2,000 positions: +-0.0048):
    # the cheapest option clear of it, where one is; else the cheapest over the floor all the same
    barely, clear = option(0, None, 0.0, 0.01, 0.952) | {"positions": 2000}, r16 | {"top1": 0.962, "positions": 2000}
    assert top1_error(barely) == pytest.approx((0.952 * 0.048 / 2000) ** 0.5)
    assert pick([barely, clear, r32 | {"positions": 2000}], 0.05, 0.95) == (clear, True)
    assert pick([barely, r16 | {"top1": 0.953, "positions": 2000}], 0.05, 0.95) == (barely, True)
    assert pick([barely | {"positions": 200_000}, clear], 0.05, 0.95)[0]["top1"] == 0.952  # a large probe: sure enough


class FakeProbes:
    """A probe whose top-1 improves with the replay and each layer a run computes, not with a
    head; a replay R and a head S cost (R + S) / 100 counted."""

    def __init__(self):
        self.measured = []

    def share(self, replay, head=0):
        return (replay + head) / 100

    def at(self, replay):
        from types import SimpleNamespace

        from scd_serve.codec.plan import RUN

        def measure_all(layers):  # layers: {i: the fake search's layer_kv, which holds its LayerPlan}
            self.measured.append(replay)
            ran = sum(fn.lp.mode == RUN for fn in layers.values())
            return SimpleNamespace(kl=0.01, top1=0.90 + replay / 1000 + ran / 100, positions=1000)
        return SimpleNamespace(measure_all=measure_all)


def test_options_are_measured_then_timed_by_count_skipping_the_longer_than_one_over_and_the_no_better():
    from types import SimpleNamespace

    from scd_serve.calibration.probes import choose_run_and_replay
    from scd_serve.codec.plan import REUSE, LayerPlan, Plan

    plan = Plan(tuple(LayerPlan(REUSE, 4, 4) for _ in range(4)))
    def layer_kv(lp):
        def rebuild(ex, layer):
            raise AssertionError("a fake probe rebuilds nothing")
        rebuild.lp = lp
        return rebuild

    search = SimpleNamespace(layer_kv=layer_kv)
    measured = {(0, None): 0.2, (0, 2): 0.7, (0, 3): 0.45, (16, None): 0.55}
    timed = []

    def cost(candidate, replay, head):
        timed.append((replay, head, candidate.run_layer))
        return measured[(replay, candidate.run_layer)]

    probes = FakeProbes()
    chosen, replay, info = choose_run_and_replay(search, plan, probes, {2: 8, 3: 8}, None, 0.05, 0.99, 0.5,
                                                 (0, 16, 32, 48), cost, log=lambda _: None, heads=(0, 8))
    # counted (replay R, head S: (R + S) / 100; a run from L: (4 - L) / 4), 12 options fit 0.5: each
    # measured on its replay's probe
    assert probes.measured == [0] * 5 + [16] * 4 + [32] * 2 + [48]
    # timed by count: the plan alone; head 8 alone is no better on the probe (not timed); replay 16
    # is over, so nothing as long in every way is timed; the run from 3 is better and within; head
    # 8 with it no better than it; the run from 2 better still, and over
    assert timed == [(0, 0, None), (16, 0, None), (0, 0, 3), (0, 0, 2)]
    assert {(o["replay"], o["head"], o["run"]) for o in info["options"] if "cost" not in o} == {
        (0, 8, None), (0, 8, 3), (16, 8, None), (16, 8, 3), (16, 0, 3), (32, 0, None), (32, 8, None), (48, 0, None)}
    assert all("kl" in o for o in info["options"]) and len(info["options"]) == 12
    # none reaches top-1 0.99: of those within, the run from 3 gains more than MIN_TOP1_GAIN over the plan alone
    assert (replay, info["head"], chosen.run_layer) == (0, 0, 3) and info["rebuild"] == 0.45
    assert info["rebuild_within"]
    # nothing within: the plan alone all the same, said to be over
    probes = FakeProbes()
    chosen, replay, info = choose_run_and_replay(search, plan, probes, {2: 8, 3: 8}, None, 0.05, 0.99, 0.1,
                                                 (0, 16), cost, log=lambda _: None)
    assert (replay, chosen.run_layer) == (0, None) and not info["rebuild_within"] and probes.measured == [0]


def test_the_closest_plan_is_weighed_only_where_the_cheap_one_misses_the_targets():
    from types import SimpleNamespace

    from scd_serve.calibration.probes import choose_run_and_replay
    from scd_serve.codec.plan import REUSE, LayerPlan, Plan

    cheap = Plan(tuple(LayerPlan(REUSE, 0, 0) for _ in range(4)))
    wide = Plan(tuple(LayerPlan(REUSE, 8, 8) for _ in range(4)))

    class Probes(FakeProbes):  # the wide plan agrees 0.02 more at every replay
        def at(self, replay):
            def measure_all(layers):
                self.measured.append((replay, layers[0]))
                return SimpleNamespace(kl=0.01, top1=0.90 + replay / 1000 + (0.02 if layers[0] == 8 else 0.0), positions=1000)
            return SimpleNamespace(measure_all=measure_all)

    search = SimpleNamespace(layer_kv=lambda lp: lp.r_k)
    args = ({}, None, 0.05)
    # no option reaches top-1 0.99: the closest plan's options are weighed, and its agreement wins
    probes = Probes()
    chosen, replay, info = choose_run_and_replay(search, cheap, probes, *args, 0.99, 0.5, (0, 16), None,
                                                 lambda _: None, wide)
    assert chosen is wide and replay == 16 and info["closest"] and info["top1"] == pytest.approx(0.936)
    assert probes.measured == [(0, 0), (16, 0), (0, 8), (16, 8)]
    # the cheap plan reaches 0.91 with a replay of 16: the closest plan is never measured
    probes = Probes()
    chosen, replay, info = choose_run_and_replay(search, cheap, probes, *args, 0.91, 0.5, (0, 16), None,
                                                 lambda _: None, wide)
    assert chosen is cheap and replay == 16 and info["meets"] and not info["closest"]
    assert probes.measured == [(0, 0), (16, 0)]


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
    # the share calibration charges a replay, worked out from the prompts, is the built probe's
    share = sum(e.scored_from for e in replayed) / sum(e.prefix + e.scored_from for e in replayed)
    assert ReplayProbes(rt, rt, pairs, tail=2).share(8) == pytest.approx(share) == pytest.approx((8 + 8) / (28 + 10))


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
