"""Plan search on a synthetic KL model: budget respected, payload minimised, infeasible flagged."""

from scd_serve.codec.plan import PATCH, REUSE, LayerPlan
from scd_serve.calibration.search import MIN_TOP1_GAIN, PlanSearch

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

    with pytest.raises(ValueError, match="non-negative"):
        LayerPlan(REUSE, -1, 4)
    with pytest.raises(ValueError, match="positive"):
        LayerPlan(PATCH, r_h=0)
    with pytest.raises(ValueError):
        LayerPlan("zip", 1, 1)
    # a rank-0 Reuse stream ships nothing but is still rebuilt (its mean and token prior)
    assert LayerPlan(REUSE, 0, 4).streams == (("v", 4),) and LayerPlan(REUSE, 0, 4).code_width == 4
    assert LayerPlan(REUSE, 0, 0).streams == () and LayerPlan(REUSE, 0, 0).decoded == (("k", 0), ("v", 0))
    assert LayerPlan(PATCH, r_h=8).code_width == 8


def test_width_cap_measures_each_plan_once():
    search, probe = make_search()
    search.run_profile()
    probe.measured.clear()
    search.run(budget=0.01, max_patches=2, max_width=40)  # every full-rank plan over budget and cap
    assert probe.measured and len(set(probe.measured)) == len(probe.measured)


class PriorProbe(FakeProbe):
    """Reuse streams with rank 0 (the token prior alone) allowed: it costs 1.0 a stream, except at
    layer 3, where the prior alone beats any code (a fine-tune moved that layer so that the
    producer's states mislead)."""

    @staticmethod
    def stream_cost(layer, s, r):
        if r == 0:
            return 0.005 if layer == 3 else 1.0
        return {"k": 0.2, "v": 0.4}[s] / r + (0.3 if layer == 2 else 0.0) + (0.02 if layer == 3 else 0.0)

    @staticmethod
    def layer_cost(layer, tag):
        kind, *ranks = tag
        if kind == "patch":
            return 0.02 + 0.5 / ranks[0]
        if kind in ("k", "v"):
            return PriorProbe.stream_cost(layer, kind, ranks[0])
        return PriorProbe.stream_cost(layer, "k", ranks[0]) + PriorProbe.stream_cost(layer, "v", ranks[1])


def test_a_stream_whose_codes_do_not_help_ships_nothing():
    probe = PriorProbe()
    layer_kv = lambda lp: (lambda ex, i: ("reuse", lp.r_k, lp.r_v) if lp.mode == REUSE else ("patch", lp.r_h))
    stream_kv = lambda s, r: (lambda ex, i: ("patch", r) if s == "h" else (s, r))
    search = PlanSearch(probe, 4, [0] + GRID, GRID, layer_kv, stream_kv)
    best, _, _ = search.run(budget=0.5, max_patches=2)
    assert best.feasible and best.plan.layers[3] == LayerPlan(REUSE, 0, 0) and best.plan.layers[3].code_width == 0
    assert all(lp.code_width > 0 for lp in best.plan.layers[:3])  # elsewhere the prior alone costs 1.0 a stream


class TopProbe(FakeProbe):
    """Top-1 agreement falls as KL grows: 1 - 2 KL."""

    def measure_all(self, replace):
        from scd_serve.calibration.kl_probe import Measured

        kl = self.measure(replace)
        return Measured(kl, 1 - 2 * kl, 100)


def test_a_top1_floor_is_met_as_well_as_the_kl_budget():
    layer_kv = lambda lp: (lambda ex, i: ("reuse", lp.r_k, lp.r_v) if lp.mode == REUSE else ("patch", lp.r_h))
    stream_kv = lambda s, r: (lambda ex, i: ("patch", r) if s == "h" else (s, r))
    kl_only, _, _ = PlanSearch(TopProbe(), 4, GRID, GRID, layer_kv, stream_kv).run(budget=0.5, max_patches=2)
    assert kl_only.feasible and kl_only.kl > 0.3  # the KL budget alone lets top-1 fall below 0.4
    floor = PlanSearch(TopProbe(), 4, GRID, GRID, layer_kv, stream_kv, min_top1=0.4)
    best, curve, _ = floor.run(budget=0.5, max_patches=2)
    assert best.feasible and best.kl <= 0.3 and floor.top1[best.plan] >= 0.4
    assert best.plan.code_width() > kl_only.plan.code_width()  # it ships more to agree more
    # a floor no plan reaches: flagged infeasible, the fewest numbers within the KL budget (not the
    # widest plan, which buys no agreement it can reach)
    out_of_reach = PlanSearch(TopProbe(), 4, GRID, GRID, layer_kv, stream_kv, min_top1=0.99)
    none, curve, _ = out_of_reach.run(0.5, 2)
    assert not none.feasible and none.kl <= 0.5 and none.plan == kl_only.plan
    # beside it, the closest plan: within the KL budget, within the probe's noise of the best top-1
    # any plan measured, and the fewest numbers that get there
    closest, top = out_of_reach.closest, max(out_of_reach.top1.values())
    assert closest is not None and closest.kl <= 0.5 and top < 0.99
    assert out_of_reach.top1[closest.plan] >= top - MIN_TOP1_GAIN > out_of_reach.top1[none.plan]
    assert closest.plan.code_width() > none.plan.code_width()
    assert all(p.code_width() >= closest.plan.code_width() for p, t in out_of_reach.top1.items()
               if t >= top - MIN_TOP1_GAIN)
    assert floor.closest is None  # a floor some plan reaches needs no closest plan


def test_the_closest_plans_pass_measures_each_plan_once():
    layer_kv = lambda lp: (lambda ex, i: ("reuse", lp.r_k, lp.r_v) if lp.mode == REUSE else ("patch", lp.r_h))
    stream_kv = lambda s, r: (lambda ex, i: ("patch", r) if s == "h" else (s, r))
    probe = TopProbe()
    search = PlanSearch(probe, 4, GRID, GRID, layer_kv, stream_kv, min_top1=0.99)
    search.run_profile()
    probe.measured.clear()
    search.run(0.5, 2)
    assert search.closest is not None and len(set(probe.measured)) == len(probe.measured)
    # a KL budget no plan meets: the most faithful plan
    worst, curve, _ = PlanSearch(TopProbe(), 4, GRID, GRID, layer_kv, stream_kv, min_top1=0.4).run(0.01, 2)
    assert not worst.feasible and worst.kl == min(p.kl for p in curve)
