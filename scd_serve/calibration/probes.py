"""Codecs measured on probe prompts, each with its replayed tail, and the choice of that tail,
of the head and of a run.

A codec with `replay_tokens` R (codec/base.py) is sent the codes of all but the prompt's last
R handed-off tokens; the consumer computes those itself over the rebuilt rest (target-side
context replay, as Mixture-of-Translators does). Its figures must be measured the way it is
served, so `ReplayProbes` keeps one probe per R over the same prompts and scored positions.

Calibration weighs the replays in `CalibrateConfig.replay` with the heads in `CalibrateConfig.head`
(the prompt's first S tokens computed by the consumer, codec/rebuild.py) and runs of the
consumer's upper layers (plan.py): all are the consumer computing part of the cache itself, a
run for every token and some layers, a replay or a head for some tokens and every layer. A
head's rows are the consumer's own (causal: its prefill of them alone computes the oracle's), so
the probe measures one by keeping the oracle's first S rows of every rebuilt layer
(`with_head`), with no probe of its own. Counted, a replay costs the decode worker R / T of its
own prefill of a T-token prompt, a head S / T and a run from L (N - L) / N; what
a rebuild costs on top (the prior's context, the codes' decode) is only known by timing it, so
an option whose count fits max_rebuild is timed (`cost`, quality/rebuild_cost.py) and must fit
it measured.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from scd_serve.codec.base import payload_bytes
from scd_serve.codec.codec_spec import spec_of
from scd_serve.codec.rebuild import begin, codes_from
from scd_serve.calibration.kl_probe import KLProbe, make_examples, split_prompt
from scd_serve.calibration.search import MIN_TOP1_GAIN
from scd_serve.codec.plan import Plan
from scd_serve.engine.kv_budget import RAW_DTYPE_BYTES, bytes_per_token
from scd_serve.extras import tqdm


class ReplayProbes:
    """The probe prompts at each replay: `at(0)` is `base` (or built), others are built on demand
    and only the latest is held (each holds a pool and both models' states per prompt)."""

    def __init__(self, producer: Any, consumer: Any, pairs: list, tail: int = 1, residual_layers=(),
                 base: KLProbe | None = None, show_progress: bool = True):
        self.producer, self.consumer, self.pairs, self.tail = producer, consumer, pairs, tail
        self.residual_layers, self.show_progress = tuple(residual_layers), show_progress
        self._held: dict[int, KLProbe] = {0: base} if base is not None else {}

    def at(self, replay: int) -> KLProbe:
        if replay not in self._held:
            with tqdm(total=len(self.pairs), desc=f"probe prompts, replay {replay}",
                      disable=not self.show_progress) as bar:
                examples = make_examples(self.producer, self.consumer, self.pairs, tail=self.tail, progress=bar.update,
                                         residual_layers=self.residual_layers, replay=replay)
            self._held = {r: p for r, p in self._held.items() if r == 0}
            self._held[replay] = KLProbe(self.consumer, examples)
        return self._held[replay]

    def share(self, replay: int, head: int = 0) -> float:
        """The replayed and head tokens' share of the probe prompts' handed-off tokens (as
        make_examples splits each prompt, without building the probe)."""
        splits = [split_prompt(len(prompt), self.tail, replay) for prompt, _ in self.pairs]
        return sum(r + min(head, p - 1) for p, r in splits) / max(1, sum(p + r for p, r in splits))


def with_head(layer_kv: Any, head: int) -> Any:
    """A probe's layer rebuild (kl_probe.LayerKV) with the prompt's first `head` rows the
    consumer's own, as HeadRebuild serves them (at least the last transferred row rebuilt)."""
    if not head:
        return layer_kv

    @functools.wraps(layer_kv)
    def headed(ex, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = layer_kv(ex, layer)  # [P, kv_heads, head_dim] each
        n, own = min(head, ex.prefix - 1), ex.consumer[layer]
        return torch.cat([own.keys[:n].to(k.dtype), k[n:]]), torch.cat([own.values[:n].to(v.dtype), v[n:]])
    return headed


def codec_sums(probe: KLProbe, codec: Any, consumer: Any) -> dict[str, float]:
    """Through the real encode/decode, on the probe's scored positions: the KL summed, the
    positions whose top-1 is the oracle's, the positions, the payload's bytes and raw 16-bit
    K/V's of the whole handoff (replayed tokens included: raw would ship them). Sums, so that
    prompts measured apart add up."""
    nbytes, prompt = {"n": 0}, {"ex": None, "rebuild": None}  # the probe runs each example's layers in turn

    def rebuild(ex, layer):
        if prompt["ex"] is not ex:
            prompt["ex"], prompt["rebuild"] = ex, begin(codec, ex.tokens, consumer)
        code = codec.encode_layer(layer, ex.producer[layer].rows_from(codes_from(codec, 0, ex.prefix)))
        nbytes["n"] += payload_bytes(code)
        return prompt["rebuild"].decode_layer(layer, code)

    spec = spec_of(consumer)
    measured = probe.measure_all({i: rebuild for i in range(spec.num_layers)})
    raw = sum(e.prefix + e.scored_from for e in probe.examples) * bytes_per_token(
        spec.num_layers, spec.num_kv_heads, spec.head_dim, RAW_DTYPE_BYTES)
    return {"kl": measured.kl * measured.positions, "agree": measured.top1 * measured.positions,
            "positions": measured.positions, "bytes": nbytes["n"], "raw": raw}


def figures_of(sums: dict[str, float]) -> dict[str, float]:
    n = max(sums["positions"], 1)
    return {"kl": sums["kl"] / n, "top1": sums["agree"] / n, "payload_ratio": sums["bytes"] / sums["raw"]}


def measure_codec(probe: KLProbe, codec: Any, consumer: Any) -> dict[str, float]:
    """KL and top-1 agreement on the probe's scored positions, and payload relative to raw."""
    return figures_of(codec_sums(probe, codec, consumer))


def measure_methods(producer: Any, consumer: Any, book: Any, pairs: list, tail: int = 1, residual_layers=(),
                    show_progress: bool = True) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """Every method a codebook serves (and prior-only, its zero-payload control) measured on
    `pairs` (prompt ids [T], scored ids [n]) at its own replay: the manifest's
    `calibration.methods` (calibrate's report, `scd-serve measure`). One prompt at a time, every
    method on it, then the next: a prompt's probe holds a pool and both models' states (0.14 GB
    at the 0.5B shape), so holding all of them was calibration's memory peak.
    -> ({method: kl, top1, payload_ratio, replay_tokens, head_tokens}, {prompts, positions})"""
    from scd_serve import codec as registry

    names = [m for m in registry.METHODS if m != "identity"] + ["prior-only"]
    codecs = {name: registry.build(name, producer=producer, consumer=consumer, codebook=book) for name in names}
    replays = {name: int(getattr(codecs[name], "replay_tokens", 0)) for name in names}
    sums = {name: dict.fromkeys(("kl", "agree", "positions", "bytes", "raw"), 0.0) for name in names}
    for pair in tqdm(pairs, desc="measure methods", disable=not show_progress):
        for replay in sorted(set(replays.values())):
            probe = KLProbe(consumer, make_examples(producer, consumer, [pair], tail=tail,
                                                    residual_layers=residual_layers, replay=replay))
            for name in (n for n in names if replays[n] == replay):
                for key, value in codec_sums(probe, codecs[name], consumer).items():
                    sums[name][key] += value
    methods = {name: figures_of(sums[name]) | {"replay_tokens": replays[name],
                                                "head_tokens": int(getattr(codecs[name], "head_tokens", 0))}
               for name in names}
    return methods, {"prompts": len(pairs), "positions": int(sums[names[-1]]["positions"])}


def choose_run_and_replay(search: Any, plan: Plan, probes: ReplayProbes, run_ranks: dict[int, int],
                          max_width: int | None, kl_budget: float, min_top1: float, max_rebuild: float,
                          replays: tuple[int, ...], cost: Callable[[Plan, int, int], float] | None = None,
                          log: Callable[[str], None] = print, closest: Plan | None = None,
                          heads: tuple[int, ...] = (0,)) -> tuple[Plan, int, dict]:
    """The consumer's own share of the rebuild, chosen jointly: `plan` or a run from a layer of
    `run_ranks` (plan.py, on a residual code of that rank), each with each replay and each head.
    An option whose counted share of a prefill ((N - L) / N for the run, R / T and S / T of the
    probe's prompts for the replay and the head) fits max_rebuild is measured on the probe at that
    replay, then timed (`_weigh`), `cost(plan, replay, head)` -> its rebuild over the consumer's
    prefill (None: the count stands for it). `plan` alone is always weighed: where nothing fits,
    it is the cheapest. closest (search.py: the plan nearest a top-1 floor the
    search found out of reach): weighed the same way only when no option of `plan` meets both
    targets, and chosen only by `pick` over all.
    -> (plan, replay, {"options": every one weighed, "head": its head, ...}) by `pick` among those timed within."""
    weighed: list[dict] = []
    weigh = dict(run_ranks=run_ranks, max_width=max_width, max_rebuild=max_rebuild, replays=replays, heads=heads,
                 cost=cost, log=log, weighed=weighed)
    within = _weigh(search, plan, probes, **weigh)
    chosen, meets = pick(within, kl_budget, min_top1)
    if not meets and closest is not None:
        log("no option meets both targets: the closest plan's options too")
        within += _weigh(search, closest, probes, **weigh, closest=True)
        chosen, meets = pick(within, kl_budget, min_top1)
    return chosen["plan"], chosen["replay"], {
        "options": weighed, "meets": meets, "tokens": chosen["replay"], "head": chosen["head"], "run": chosen["run"],
        "kl": chosen["kl"],
        "top1": chosen["top1"], "rebuild": chosen["cost"], "rebuild_within": chosen["cost"] <= max_rebuild,
        "closest": bool(chosen.get("closest"))}


def _weigh(search: Any, plan: Plan, probes: ReplayProbes, run_ranks: dict[int, int], max_width: int | None,
           max_rebuild: float, replays: tuple[int, ...], heads: tuple[int, ...],
           cost: Callable[[Plan, int, int], float] | None, log: Callable[[str], None], weighed: list[dict],
           closest: bool = False) -> list[dict]:
    """choose_run_and_replay's options of one plan, each appended to `weighed`. Every option whose
    count fits max_rebuild is measured on the probe (cheap: the scored tail alone runs), then timed
    in the order of its count (most of what weighing costs, ~25 s an option at the 0.5B shape),
    except one as long in every way as one timed over, or no better on the probe (KL and top-1)
    than one counted cheaper and timed within. -> those timed within max_rebuild (else the plan
    alone). closest: the options are the closest plan's (marked so)."""
    tag = " (closest plan)" if closest else ""
    n = len(plan.layers)
    runs = [(None, plan)] + [(layer, Plan.with_run(plan, layer, rank)) for layer, rank in sorted(run_ranks.items())]
    options = []
    for replay in sorted(set(replays) | {0}):
        for head in sorted(set(heads) | {0}):
            share = probes.share(replay, head) if replay or head else 0.0
            for layer, candidate in runs:
                ran = (n - layer) / n if layer is not None else 0.0
                base = not replay and not head and layer is None
                if not base and (share + ran > max_rebuild
                                 or (max_width is not None and candidate.code_width() > max_width)):
                    continue
                m = probes.at(replay).measure_all({i: with_head(search.layer_kv(lp), head)
                                                   for i, lp in enumerate(candidate.layers)})
                options.append({"replay": replay, "head": head, "run": layer, "counted": round(share + ran, 4),
                                "kl": m.kl, "top1": m.top1, "positions": m.positions}
                               | ({"closest": True} if closest else {}) | {"plan": candidate, "ran": ran})
    within, over = [], []  # over: (replay, head, run's share) of options timed over max_rebuild
    for o in sorted(options, key=lambda o: o["counted"]):  # the plan alone first
        weighed.append(record := {k: v for k, v in o.items() if k not in ("plan", "ran")})
        name = f"replay {o['replay']}, head {o['head']}, run from {o['run']}{tag}: probe KL {o['kl']:.4f}, " \
               f"top-1 {o['top1']:.3f}"
        base = o is options[0]
        if not base and any(o["replay"] >= r and o["head"] >= s and o["ran"] >= f for r, s, f in over):
            continue  # longer than one already over
        if not base and any(w["kl"] <= o["kl"] and w["top1"] >= o["top1"] and w["cost"] <= max_rebuild
                            for w in within):
            log(f"{name}, no better than an option counted cheaper: not timed")
            continue
        o["cost"] = record["cost"] = round(cost(o["plan"], o["replay"], o["head"]) if cost is not None
                                           else o["counted"], 4)
        log(f"{name}, rebuild {o['cost']:.2f} of a prefill (counted {o['counted']:.2f})"
            + (f", over --max-rebuild {max_rebuild}" if o["cost"] > max_rebuild else ""))
        if o["cost"] > max_rebuild:
            over.append((o["replay"], o["head"], o["ran"]))
            if not base:  # the plan alone is weighed all the same: where nothing fits, it is the cheapest
                continue
        within.append(o)
    return [o for o in within if o["cost"] <= max_rebuild] or within[:1]  # within[0]: the plan alone


def pick(options: list[dict], kl_budget: float, min_top1: float) -> tuple[dict, bool]:
    """options: {replay, run, cost, kl, top1, plan, positions} -> (the cheapest meeting both
    targets, True), of those clearing the top-1 floor by the probe's standard error where some
    do (one that clears it by less is about as likely under it on other texts: a zoo pair's
    probe 0.952 over the floor 0.95 read 0.948 on its report prompts); else, of those within the
    KL budget (the top-1 target out of reach), the cheapest whose top-1 is within MIN_TOP1_GAIN
    of the best (closer is the probe's noise, not worth a prefill), when it gains MIN_TOP1_GAIN
    over the cheapest of them all, else that cheapest; else the least KL."""
    def cheapest(among: list[dict]) -> dict:
        return min(among, key=lambda o: (o["cost"], o["plan"].code_width()))

    if meets := [o for o in options if o["kl"] <= kl_budget and o["top1"] >= min_top1]:
        return cheapest([o for o in meets if o["top1"] - top1_error(o) >= min_top1] or meets), True
    within = [o for o in options if o["kl"] <= kl_budget]
    if not within:
        return min(options, key=lambda o: o["kl"]), False
    best = max(o["top1"] for o in within)
    near = cheapest([o for o in within if o["top1"] >= best - MIN_TOP1_GAIN])
    floor = cheapest(within)
    return (near if near["top1"] >= floor["top1"] + MIN_TOP1_GAIN else floor), False


def top1_error(option: dict) -> float:
    """The standard error of an option's probe top-1 (a share of its scored positions; 0 where
    they are not counted)."""
    n, p = option.get("positions", 0), option["top1"]
    return math.sqrt(p * (1 - p) / n) if n else 0.0
