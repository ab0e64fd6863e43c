"""Plan search on a synthetic KL model: budget respected, payload minimised, infeasible flagged."""

from scd_serve.codec.plan import PATCH, REUSE, LayerPlan
from scd_serve.codec.search import PlanSearch

GRID = [4, 8, 16, 32]


class FakeProbe:
    """KL = sum over layers of a per-layer cost; layer 2 is a 'transition' layer that Reuse
    handles badly and Patch handles well; an interaction term makes the sum super-additive."""

    def __init__(self):
        self.measured = []  # each replacement measured, as its tags

    @staticmethod
    def layer_cost(layer, tag):
        kind, *ranks = tag
        if kind == "patch":
            return 0.02 + 0.5 / ranks[0]
        if kind == "k":
            return (0.3 if layer == 2 else 0.0) + 0.2 / ranks[0]
        if kind == "v":
            return (0.3 if layer == 2 else 0.0) + 0.4 / ranks[0]
        rk, rv = ranks
        return (0.6 if layer == 2 else 0.0) + 0.2 / rk + 0.4 / rv

    def measure(self, replace):
        self.measured.append(tuple(tag(None, i) for i, tag in sorted(replace.items())))
        total = sum(self.layer_cost(i, tag(None, i)) for i, tag in replace.items())
        return total * (1 + 0.05 * len(replace))


def make_search():
    probe = FakeProbe()
    layer_kv = lambda lp: (lambda ex, i: ("reuse", lp.r_k, lp.r_v) if lp.mode == REUSE else ("patch", lp.r_h))
    stream_kv = lambda s, r: (lambda ex, i: ("patch", r) if s == "h" else (s, r))
    return PlanSearch(probe, 4, GRID, GRID, layer_kv, stream_kv), probe


def test_budget_is_met_with_fewer_numbers_and_patch_is_chosen():
    search, probe = make_search()
    best, curve, benefit = search.run(budget=0.5, max_patches=2)
    assert max(benefit, key=benefit.get) == 2
    assert best.feasible and best.kl <= 0.5
    assert probe.measure({i: search.layer_kv(lp) for i, lp in enumerate(best.plan.layers)}) == best.kl
    assert best.plan.layers[2].mode == PATCH
    assert best.plan.code_width() < search.full_rank((2,)).code_width()
    # k=0 cannot meet the budget: layer 2 alone costs over 0.6 under Reuse
    assert not curve[0].feasible


def test_infeasible_budget_returns_most_faithful_plan():
    search, _ = make_search()
    best, curve, _ = search.run(budget=0.01, max_patches=1)
    assert not best.feasible
    assert best.kl == min(p.kl for p in curve)


def test_fit_width_respects_payload():
    search, _ = make_search()
    search.run(budget=0.5, max_patches=1)
    point = search.fit_width((), 64)
    assert point.plan.code_width() <= 64
    assert all(lp.mode == REUSE for lp in point.plan.layers)


def test_width_cap_over_budget_gives_least_kl_under_the_cap():
    search, _ = make_search()
    uncapped, _, _ = search.run(budget=0.01, max_patches=2)
    best, curve, _ = search.run(budget=0.01, max_patches=2, max_width=40)
    assert uncapped.plan.code_width() > 40  # without the cap: the full-rank, most faithful plan
    assert not best.feasible and best.plan.code_width() <= 40
    assert all(p.plan.code_width() <= 40 for p in curve)
    assert best.kl == min(p.kl for p in curve)
    assert best.plan.layers[2].mode == PATCH  # the transition layer still earns its patch


def test_width_cap_keeps_a_plan_within_budget_and_cap():
    search, _ = make_search()
    best, _, _ = search.run(budget=0.5, max_patches=2, max_width=64)
    assert best.feasible and best.kl <= 0.5 and best.plan.code_width() <= 64


def test_layer_plan_validation():
    import pytest

    with pytest.raises(ValueError):
        LayerPlan(REUSE, 0, 4)
    with pytest.raises(ValueError):
        LayerPlan("zip", 1, 1)
    assert LayerPlan(PATCH, r_h=8).code_width == 8


def test_width_cap_measures_each_plan_once():
    search, probe = make_search()
    search.run_profile()
    probe.measured.clear()
    search.run(budget=0.01, max_patches=2, max_width=40)  # every full-rank plan over budget and cap
    assert probe.measured and len(set(probe.measured)) == len(probe.measured)
