"""Loss-constrained plan search: fewest code numbers per token with measured KL <= budget.

0. Within budget: measured KL <= the budget and, where a floor is given (calibrate's
   min_top1), measured top-1 agreement with the oracle's next token at or above it. A floor
   that no plan reaches leaves the fewest numbers within the KL budget, flagged infeasible,
   and beside it the closest plan: within the KL budget, the fewest numbers whose top-1 is
   within MIN_TOP1_GAIN (the probe's noise) of the best any plan reaches. Which of the two
   serves is the run and replay choice's (probes.py): a replayed tail may reach the floor
   from the cheap plan, and where nothing does, the codes that buy agreement are kept.
1. Profile: for every layer and stream, the KL when only that stream is rebuilt at each
   grid rank (everything else oracle). Raising the KL of the whole plan is predicted as the
   measured KL of the start plan plus these per-stream increments.
2. For a patch set P: start at the largest ranks, lower ranks greedily by least predicted
   KL increase per number saved (a move may skip grid ranks: rank 0, a Reuse stream's prior
   alone, can measure better than the ranks just above it) while the prediction stays within
   budget, then measure the end plan; if it is over budget, bisect back along the move
   sequence on measured KL.
3. Patch candidates are ordered by their measured benefit (KL drop when that layer alone
   is patched in the all-Reuse start plan); the patch count k is the one whose plan ships
   the fewest numbers within budget (ties: fewer patches). The curve over k is kept.
4. With a width cap, a patch set's plan that is over the cap is replaced by its least-KL plan
   under the cap (fit_width); nothing in budget: the least KL under the cap.
5. Optionally (with_run), the chosen plan's upper layers give way to a run of the consumer's
   own layers from a candidate layer, where that measures less KL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

from scd_serve.codec.plan import OWN, PATCH, REUSE, LayerPlan, Plan
from scd_serve.calibration.kl_probe import KLProbe, LayerKV

MIN_TOP1_GAIN = 0.005  # top-1 differences below this are noise on a probe of a few thousand positions


@dataclass
class SearchPoint:
    num_patches: int
    plan: Plan
    kl: float  # measured KL of `plan`
    kl_full_rank: float  # measured KL with the same patch set at the largest ranks
    feasible: bool


class PlanSearch:
    def __init__(self, probe: KLProbe, num_layers: int, kv_grid: list[int], h_grid: list[int],
                 layer_kv: Callable[[LayerPlan], LayerKV], stream_kv: Callable[[str, int], LayerKV],
                 progress: Callable[[str], None] | None = None, profile_probe: KLProbe | None = None,
                 own_layers: Iterable[int] = (), min_top1: float | None = None):
        """layer_kv(lp) rebuilds a layer by its plan; stream_kv(stream, rank) rebuilds one stream
        ("k" / "v" at rank with the other stream oracle, or "h" at rank). own_layers: computed by
        the consumer itself in every plan (plan.py's OWN: exact, nothing to search). min_top1: a
        plan within budget must also agree with the oracle's next token this often on the probe."""
        self.probe, self.num_layers, self.min_top1 = probe, num_layers, min_top1
        self.top1: dict[Plan, float] = {}  # measured top-1 agreement of each plan measured
        self.own_layers = frozenset(own_layers)
        self.profile_probe = profile_probe or probe  # may be a cheaper subset: it only predicts
        self.grid = {"k": sorted(kv_grid), "v": sorted(kv_grid), "h": sorted(h_grid)}
        self.layer_kv, self.stream_kv = layer_kv, stream_kv
        self.progress = progress or (lambda _msg: None)
        self.profile: dict[tuple[str, int, int], float] = {}  # (stream, layer, rank) -> KL
        self.budget: float | None = None
        self.closest: SearchPoint | None = None  # run(): where the top-1 floor is out of reach
        # KL of the plans run() measured: its second pass (the closest plan) walks the same
        # sequences. Not measure()'s: calibrate measures a plan again after training its aligners
        self._kl: dict[Plan, float] = {}

    def measure(self, plan: Plan) -> float:
        """The plan's KL on the probe (and its top-1 agreement, kept, where a floor is set)."""
        replace = {i: self.layer_kv(lp) for i, lp in enumerate(plan.layers)}
        if self.min_top1 is None:
            return self.probe.measure(replace)
        measured = self.probe.measure_all(replace)
        self.top1[plan] = measured.top1
        return measured.kl

    def _measure_once(self, plan: Plan) -> float:
        if plan not in self._kl:
            self._kl[plan] = self.measure(plan)
        return self._kl[plan]

    def meets(self, plan: Plan, kl: float, budget: float) -> bool:
        """Within the KL budget and, where a floor is set, at or above it in measured top-1."""
        return kl <= budget and (self.min_top1 is None or self.top1.get(plan, 0.0) >= self.min_top1)

    def full_rank(self, patches: tuple[int, ...] = ()) -> Plan:
        rk, rh = self.grid["k"][-1], self.grid["h"][-1]
        return Plan(tuple(LayerPlan(OWN) if i in self.own_layers else LayerPlan(PATCH, r_h=rh) if i in patches
                          else LayerPlan(REUSE, rk, rk) for i in range(self.num_layers)))

    @property
    def searched_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.own_layers]

    def run_profile(self) -> None:
        for layer in self.searched_layers:
            for s in ("k", "v", "h"):
                for r in self.grid[s]:
                    self.profile[(s, layer, r)] = self.profile_probe.measure({layer: self.stream_kv(s, r)})
            self.progress(f"profiled layer {layer}")

    def patch_order(self) -> tuple[list[int], dict[int, float], dict[tuple[int, ...], float]]:
        """Layers by measured benefit of patching them alone (positive benefit only), the benefits,
        and the full-rank KLs measured on the way (by patch set: no patch, each layer alone)."""
        full_kl = {(): self.measure(self.full_rank())}
        full_kl |= {(i,): self.measure(self.full_rank((i,))) for i in self.searched_layers}
        benefit = {i: full_kl[()] - full_kl[(i,)] for i in self.searched_layers}
        self.progress("ranked patch candidates")
        order = [i for i in sorted(benefit, key=benefit.get, reverse=True) if benefit[i] > 0]
        return order, benefit, full_kl

    def _moves(self, plan: Plan):
        for i, lp in enumerate(plan.layers):
            if lp.mode == OWN:
                continue
            streams = ("k", "v") if lp.mode == REUSE else ("h",)
            for s in streams:
                cur = getattr(lp, f"r_{s}")
                for new in (r for r in self.grid[s] if r < cur):  # any lower rank: past a notch that
                    delta = self.profile[(s, i, new)] - self.profile[(s, i, cur)]  # costs, one may gain
                    yield max(delta, 0.0), cur - new, i, replace(lp, **{f"r_{s}": new})

    def _descend(self, start: Plan, fits: Callable[[Plan, float, float], bool]) -> list[Plan]:
        """Greedy rank lowering from `start`: each step takes the move with the least predicted
        KL increase per number saved among those `fits(new_plan, predicted_kl, delta)` allows."""
        seq, plan, predicted = [start], start, 0.0
        while True:
            moves = [m for m in self._moves(plan) if fits(plan.with_layer(m[2], m[3]), predicted, m[0])]
            if not moves:
                return seq
            delta, _, layer, lp = min(moves, key=lambda m: (m[0] / m[1], -m[1]))
            plan, predicted = plan.with_layer(layer, lp), predicted + delta
            seq.append(plan)

    def fit_budget(self, patches: tuple[int, ...], budget: float,
                   kl_start: float | None = None, closest: bool = False) -> SearchPoint:
        """Fewest numbers per token with this patch set and measured KL <= budget (kl_start as in
        fit_width). closest: where the full-rank plan misses the top-1 floor, the fewest whose
        top-1 is within MIN_TOP1_GAIN of the full-rank plan's instead."""
        start = self.full_rank(patches)
        kl_start = self.measure(start) if kl_start is None else kl_start
        if kl_start > budget:
            return SearchPoint(len(patches), start, kl_start, kl_start, False)
        # a top-1 floor the full-rank plan misses is out of reach with this patch set: the KL
        # budget alone then steers (the fewest numbers within it), or with `closest` the full-rank
        # plan's agreement less the probe's noise too; the point is not feasible
        floor = self.meets(start, kl_start, budget)
        if floor or not closest:
            fits = lambda plan, kl: self.meets(plan, kl, budget) if floor else kl <= budget
        else:
            near = self.top1.get(start, 0.0) - MIN_TOP1_GAIN
            fits = lambda plan, kl: kl <= budget and self.top1.get(plan, 0.0) >= near
        seq = self._descend(start, lambda plan, pred, delta: kl_start + pred + delta <= budget)
        lo, hi, kl_lo = 0, len(seq) - 1, kl_start  # seq[lo] is known to fit
        kl_hi = self._measure_once(seq[hi]) if hi > 0 else kl_start
        if fits(seq[hi], kl_hi):
            lo, kl_lo = hi, kl_hi
        while hi - lo > 1:  # the prediction was optimistic (or top-1 fell short): bisect on measurements
            mid = (lo + hi) // 2
            kl_mid = self._measure_once(seq[mid])
            if fits(seq[mid], kl_mid):
                lo, kl_lo = mid, kl_mid
            else:
                hi = mid
        return SearchPoint(len(patches), seq[lo], kl_lo, kl_start, floor)

    def fit_width(self, patches: tuple[int, ...], width: int,
                  kl_start: float | None = None) -> SearchPoint:
        """Least predicted KL with this patch set at no more than `width` numbers per token
        (the equal-payload comparison, e.g. Reuse-only at SCD's payload). kl_start: the full-rank
        plan's KL where already measured (a probe pass saved)."""
        start = self.full_rank(patches)
        kl_start = self.measure(start) if kl_start is None else kl_start
        seq = self._descend(start, lambda plan, pred, delta: True)
        plan = next((p for p in seq if p.code_width() <= width), seq[-1])
        kl = self.measure(plan) if plan is not start else kl_start
        return SearchPoint(len(patches), plan, kl, kl_start, self.meets(plan, kl, self.budget) if self.budget else True)

    def run(self, budget: float, max_patches: int,
            max_width: int | None = None) -> tuple[SearchPoint, list[SearchPoint], dict[int, float]]:
        """max_width: most code numbers per token (None: no cap).
        -> (chosen point, one point per patch count 0..k_max, benefit per layer); self.closest
        where the top-1 floor is out of reach and the closest plan is another."""
        self.budget, self._kl = budget, {}
        if not self.profile:
            self.run_profile()
        order, benefit, full_kl = self.patch_order()
        sets = [tuple(sorted(order[:k])) for k in range(min(max_patches, len(order)) + 1)]
        curve = self._points(sets, budget, full_kl, max_width, closest=False)
        allowed = [p for p in curve if max_width is None or p.plan.code_width() <= max_width] or curve
        feasible = [p for p in allowed if p.feasible]
        within_kl = [p for p in allowed if p.kl <= budget]
        if feasible or within_kl:  # (within the KL budget only: the top-1 floor is out of reach, flagged)
            best = min(feasible or within_kl, key=lambda p: (p.plan.code_width(), p.num_patches))
        else:  # nothing meets the budget: the most faithful plan, flagged infeasible
            best = min(allowed, key=lambda p: p.kl)
        self.closest = None
        if within_kl and not feasible and self.min_top1 is not None:
            near = [p for p in self._points(sets, budget, full_kl, max_width, closest=True)
                    if p.kl <= budget and (max_width is None or p.plan.code_width() <= max_width)]
            top = max(self.top1.get(p.plan, 0.0) for p in near) if near else 0.0
            near = [p for p in near if self.top1.get(p.plan, 0.0) >= top - MIN_TOP1_GAIN]
            closest = min(near, key=lambda p: (p.plan.code_width(), p.num_patches)) if near else None
            if closest is not None and closest.plan != best.plan:
                self.closest = closest
        return best, curve, benefit

    def _points(self, sets: list[tuple[int, ...]], budget: float, full_kl: dict, max_width: int | None,
                closest: bool) -> list[SearchPoint]:
        """One point per patch set (fit_budget, or fit_width where it is over the cap)."""
        points = []
        for patches in sets:
            point = self.fit_budget(patches, budget, full_kl.get(patches), closest)
            if max_width is not None and point.plan.code_width() > max_width:
                point = self.fit_width(patches, max_width, point.kl_full_rank)
            points.append(point)
            self.progress(f"{len(patches)} patches{' (closest)' if closest else ''}: "
                          f"{point.plan.code_width()} numbers/token, KL {point.kl:.4f}")
        return points
