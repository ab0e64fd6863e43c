"""`scd-serve calibrate`: fit an SCD codebook for a producer/consumer pair under a KL budget.

Steps: paired states of both models on calibration prompts -> joint codes per layer and
stream (Reuse) and per candidate patch layer (Patch, linear aligners) -> measured profiling
and plan search under the budget (see search.py) -> MLP aligners for the chosen patches -> a
run of the consumer's upper layers where asked for and measured better (plan.py) ->
DroidSpeak layer choice -> codebook -> the scd plan's decoders distilled on the consumer's KL
(distill.py) -> re-measured through the real codecs -> trade-off PNG.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch

from scd_serve.calibration.assemble import build_codebook, size_stats
from scd_serve.codec import figures
from scd_serve.codec.base import ATTN_INPUTS, OWN_INPUTS
from scd_serve.codec.codebook import Codebook
from scd_serve.calibration.candidates import Candidates
from scd_serve.calibration.curve import plot_tradeoff
from scd_serve.calibration.fit import (collect_rows, fit_layer, refiner_width, subtract_priors, train_aligner,
                                       train_refiners)
from scd_serve.calibration.memory import check_fits, estimate
from scd_serve.calibration.feature_fit import FeatureFit
from scd_serve.codec.features import FeaturePrior, FeatureSpec, most_frequent
from scd_serve.codec.prior import PriorFit
from scd_serve.calibration.distill import distill_plan
from scd_serve.calibration.kl_probe import KLProbe, make_examples
from scd_serve.codec.plan import OWN, LayerPlan, Plan
from scd_serve.calibration.search import PlanSearch, SearchPoint
from scd_serve.codec.codec_spec import spec_of
from scd_serve.config.codec import REBUILD_COSTS, CalibrateConfig
from scd_serve.errors import ConfigError
from scd_serve.extras import tqdm
from scd_serve.model.loader import DTYPES
from scd_serve.calibration.probes import ReplayProbes, choose_run_and_replay, measure_codec, measure_methods
from scd_serve.quality.calibration_report import print_report
from scd_serve.quality.rebuild_cost import RebuildCost, spread
from scd_serve.quality.calibration_data import PROBE_SCORED_TOKENS, REPORT_SCORED_TOKENS, builtin_prompts, user_prompts

# layer 0's input is the token alone: the consumer computes it itself in every plan (plan.py's OWN)
OWN_LAYERS = (0,)
KV_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1)
H_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)


def rank_grid(width: int, fractions: tuple[float, ...]) -> list[int]:
    return sorted({max(1, round(width * f)) for f in fractions})


@dataclass
class CalibrationResult:
    codebook: Codebook
    curve: list[SearchPoint]
    methods: dict[str, dict[str, float]]  # method -> measured kl, payload ratio to raw


def calibrate(producer: Any, consumer: Any, fit_prompts: list, probe_pairs: list, cfg: CalibrateConfig,
              log: Callable[[str], None] = print, show_progress: bool = True,
              distill_pairs: list | None = None, report_pairs: list | None = None,
              choice_pairs: list | None = None) -> CalibrationResult:
    """distill_pairs: (prompt, scored tokens) of the fit set for distillation (default: the fit
    prompts alone, which feed their last tokens; calibration/distill.py). report_pairs: prompts held
    out from everything (calibration_data.py) on which the manifest's figures are measured;
    without them the figures are the probe's, which the plan was chosen on (said in the manifest).
    choice_pairs: the probe prompts scored longer, for the run and replay choice (default: the probe's)."""
    from scd_serve import codec as registry

    pspec, cspec = spec_of(producer), spec_of(consumer)
    if pspec.num_layers != cspec.num_layers:
        raise ConfigError(f"producer has {pspec.num_layers} layers, consumer {cspec.num_layers}: "
                          "a per-layer codebook needs the same layer count")
    started, num_layers = time.time(), cspec.num_layers
    run_layers = cfg.run_candidates(num_layers)
    if any(not 0 < i < num_layers for i in run_layers):
        raise ConfigError(f"run layers must be in 1..{num_layers - 1} (a run from 0 is a local prefill), "
                          f"got {list(run_layers)}", field="run_layers")
    kv_grid = [0] + rank_grid(cspec.kv_width, KV_FRACTIONS)  # 0: the stream's prior alone, nothing shipped
    h_grid = rank_grid(cspec.hidden_size, H_FRACTIONS)
    # Token priors absorb how differently two models mix nearby tokens; for one model the
    # codes alone are exact at full rank (same-model mode stays lossless), so none are fitted.
    same_model = bool(pspec.fingerprint and pspec.fingerprint == cspec.fingerprint)
    prior_fit = prior_fitter(cfg, consumer, fit_prompts) if cfg.uses_prior and not same_model else None
    inputs = OWN_INPUTS if same_model else ATTN_INPUTS  # codec/base.py says why
    with tqdm(total=len(fit_prompts), desc="collect states", disable=not show_progress) as bar:
        rows = collect_rows(producer, consumer, fit_prompts, cfg.max_rows, cfg.seed, bar.update, prior=prior_fit,
                            run_layers=run_layers, inputs=inputs)
    prior, priors = None, {}
    if prior_fit is not None:  # one dense solve: minutes at real shapes, and the fit's memory peak
        with tqdm(total=1, desc=f"solve token prior ({cfg.prior})", disable=not show_progress) as bar:
            prior, priors = prior_fit.solve(cfg.ridge)
            bar.update()
    if prior is not None:  # every layer's rows share one context tensor: reduce it once
        ctx = prior.reduce(rows[0]["ctx"])
        for r in rows:
            r["ctx"] = ctx
    fits = []
    width = refiner_width(consumer, 2 * (num_layers - len(OWN_LAYERS)), prior.rows() if prior else 0, cfg.refiner_width)
    for layer, r in enumerate(tqdm(rows, desc="fit layers", disable=not show_progress)):
        mine = {s: priors[(layer, s)] for s in "kvh" if (layer, s) in priors}
        rows[layer] = r = subtract_priors(r, prior, mine) if mine else r
        fits.append(fit_layer(r, cspec.kv_width, h_grid, cfg.aligner_width, inputs))
        fits[-1].priors, fits[-1].prior = mine, prior
        if cfg.refiner_epochs and isinstance(prior, FeaturePrior) and layer not in OWN_LAYERS:
            train_refiners(fits[-1], r, kv_grid, width, cfg.refiner_epochs)
    h_rows = [r["h"] for r in rows]
    del rows
    with tqdm(total=len(probe_pairs), desc="probe prompts", disable=not show_progress) as bar:
        probe = KLProbe(consumer, make_examples(producer, consumer, probe_pairs, tail=cfg.probe_tail,
                                                progress=bar.update, residual_layers=run_layers))
    cands = Candidates(fits, producer, consumer)
    with tqdm(total=num_layers - len(OWN_LAYERS), desc="profile + search", disable=not show_progress) as bar:
        search = PlanSearch(probe, num_layers, kv_grid, h_grid, cands.layer_kv, cands.stream_kv,
                            progress=lambda msg: (bar.update(1) if msg.startswith("profiled") else bar.set_postfix_str(msg)),
                            profile_probe=KLProbe(consumer, probe.examples[: cfg.num_profile_prompts]),
                            own_layers=OWN_LAYERS, min_top1=cfg.min_top1)
        max_patches = num_layers // 2 if cfg.max_patches is None else cfg.max_patches
        max_width = None if cfg.max_payload is None else max(1, int(cfg.max_payload * 2 * cspec.kv_width * num_layers))
        best, curve, benefit = search.run(cfg.kl_budget, max_patches, max_width)
    plan, kl_linear = best.plan, best.kl
    stats_kl = best.kl
    if cfg.aligner_steps and plan.patch_layers:  # MLP aligners where patches were chosen
        linear = {i: (fits[i].aligners[plan.layers[i].r_h], fits[i].aligner_err[plan.layers[i].r_h])
                  for i in plan.patch_layers}
        for i in tqdm(plan.patch_layers, desc="train aligners", disable=not show_progress):
            train_aligner(fits[i], h_rows[i], plan.layers[i].r_h, cfg.aligner_width, cfg.aligner_steps)
        kl_mlp = search.measure(plan)
        # the MLPs already beat the linear maps on held-out rows; measured KL must agree
        # (within budget, or no worse than linear) before they are kept
        if kl_mlp > max(kl_linear, cfg.kl_budget):
            for i, (g, err) in linear.items():
                fits[i].aligners[plan.layers[i].r_h], fits[i].aligner_err[plan.layers[i].r_h] = g, err
            log(f"MLP aligners: measured KL {kl_mlp:.4f} over budget and linear ({kl_linear:.4f}); kept the linear ones")
        else:
            stats_kl = kl_mlp
    run = {"kl_without": stats_kl}
    probes = ReplayProbes(producer, consumer, choice_pairs or probe_pairs, cfg.probe_tail, run_layers,
                          None if choice_pairs else probe, show_progress)
    # a run's residual code at full rank, or what the fit rows allow (fewer rows than dimensions)
    run_ranks = {layer: min(h_grid[-1], fits[layer].codes["r"].max_rank) for layer in run_layers}
    timer = RebuildCost(producer, consumer, spread([p for p, _ in choice_pairs or probe_pairs], cfg.num_timing_prompts))

    def timed(candidate: Plan, replay: int, head: int) -> float:
        book = build_codebook(fits, {"scd": candidate}, pspec, cspec, extra={"replay_tokens": replay,
                                                                            "head_tokens": head})
        return timer(registry.build("scd", producer=producer, consumer=consumer, codebook=book))

    plan, replay, tail = choose_run_and_replay(search, plan, probes, run_ranks, max_width, cfg.kl_budget,
                                               cfg.min_top1, cfg.max_rebuild, cfg.replay,
                                               timed if cfg.rebuild_cost == "timed" else None, log,
                                               search.closest.plan if search.closest else None, cfg.head)
    stats_kl = tail["kl"]
    run["kl"] = {str(o["run"]): o["kl"] for o in tail["options"]
                 if not o["replay"] and not o["head"] and o["run"] is not None and "kl" in o}
    # Reuse-only at SCD's payload: the equal-payload ablation of Patch (and of a run)
    reuse = (search.fit_width((), plan.code_width(), curve[0].kl_full_rank)  # curve[0]: no patches
             if plan.patch_layers or plan.run_layer is not None else best)
    # DroidSpeak recomputes as many layers as scd's consumer computes (its patches and its run)
    computed = len(plan.patch_layers) + (num_layers - plan.run_layer if plan.run_layer is not None else 0)
    ds_layers = droidspeak_layers(probe, cands, num_layers, max(1, computed), show_progress)
    # zero payload: what the consumer's token priors alone rebuild (how much the codes add)
    prior_only_kl = probe.measure({i: cands.layer_kv(LayerPlan(OWN)) if i in OWN_LAYERS else cands.prior_only
                                   for i in range(num_layers)}) if priors else None
    stats = {
        "kl_budget": cfg.kl_budget, "config": asdict(cfg), "feasible": best.feasible, "plan_kl": stats_kl,
        "probe_positions": probe.num_positions, "fit_prompts": len(fit_prompts),
        "kv_rank_grid": kv_grid, "h_rank_grid": h_grid, "prior_only_kl": prior_only_kl,
        "prior_ridge": getattr(prior_fit, "ridge", cfg.ridge),
        "patch_benefit": {str(k): v for k, v in benefit.items()},
        "run": run | {"layer": plan.run_layer}, "replay": tail,
        "curve": [{"patches": p.num_patches, "patch_layers": list(p.plan.patch_layers),
                   "code_width": p.plan.code_width(), "kl": p.kl, "kl_full_rank": p.kl_full_rank,
                   "feasible": p.feasible} for p in curve],
        "reuse_rel_err": [{s: fits[i].codes[s].rel_error(getattr(lp, f"r_{s}")) for s in "kv"}
                          if lp.mode == "reuse" else {} if lp.mode == OWN else {"aligner": fits[i].aligner_err.get(lp.r_h)}
                          for i, lp in enumerate(plan.layers)],
    }
    stats["reuse_plan"] = {"code_width": reuse.plan.code_width(), "kl": reuse.kl}
    book = build_codebook(fits, {"scd": plan, "reuse": reuse.plan}, pspec, cspec,
                          extra={"droidspeak_layers": ds_layers, "calibration": stats, "replay_tokens": replay,
                                 "head_tokens": tail["head"]})
    if cfg.distill_steps:
        stats["distill"] = distill_plan(book, producer, consumer, cfg, show_progress, distill_pairs or
                                        [(p, torch.zeros(0, dtype=torch.long)) for p in fit_prompts],
                                        held_out_pairs=probe_pairs if report_pairs else None)
    probe_kl = {}  # on held-out reports, also the probe's figure: how far they fall from what the plan was chosen on
    for name in ("scd", "reuse") if report_pairs else ():
        codec = registry.build(name, producer=producer, consumer=consumer, codebook=book)
        probe_kl[name] = measure_codec(probes.at(codec.replay_tokens), codec, consumer)["kl"]
    del probes  # its prompts' states, before the report's are built
    methods, report = measure_methods(producer, consumer, book, report_pairs or choice_pairs or probe_pairs,
                                      cfg.probe_tail, () if plan.run_layer is None else (plan.run_layer,),
                                      show_progress)
    for name, kl in probe_kl.items():
        methods[name]["probe_kl"] = kl
    figures.record(book.manifest, methods, report | {"held_out": bool(report_pairs)}, cfg.min_top1)
    stats["size"] = size_stats(book, consumer)
    stats["seconds"] = round(time.time() - started, 1)
    stats["probe_measurements"] = probe.num_measurements
    return CalibrationResult(book, curve, methods)


def prior_fitter(cfg: CalibrateConfig, consumer: Any, fit_prompts: list) -> Any:
    """The streamed fit of the chosen token prior (features.py or prior.py)."""
    if cfg.prior == "dense":
        return PriorFit(consumer.spec.vocab_size, cfg.prior_taps)
    cspec = spec_of(consumer)
    spec = FeatureSpec(taps=cfg.prior_taps, width=cfg.prior_width, rank=cfg.prior_rank, seed=cfg.seed,
                       hidden=cspec.hidden_size, frequent=cfg.prior_frequent,
                       states=cfg.state_columns(cspec.num_layers, cspec.kv_width),
                       state_layers=cfg.prior_state_layers if 0 < cfg.prior_state_layers < cspec.num_layers else 0)
    return FeatureFit(spec, most_frequent(fit_prompts, cfg.prior_frequent) if cfg.prior_frequent else None)


def droidspeak_layers(probe: KLProbe, cands: Candidates, num_layers: int, count: int,
                      show_progress: bool = False) -> list[int]:
    """DroidSpeak's layer choice by measured profiling: the layers whose recompute from the
    producer's hidden states lowers the all-raw KL the most."""
    raw = {i: cands.raw for i in range(num_layers)}
    base = probe.measure(raw)
    gain = {i: base - probe.measure(raw | {i: cands.droidspeak})
            for i in tqdm(range(num_layers), desc="droidspeak layers", disable=not show_progress)}
    return sorted(sorted(gain, key=gain.get, reverse=True)[:count])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from scd_serve.corpus.qa import SPLITS
    from scd_serve.quality.data import FORMATS_HELP, add_truncation_arguments

    parser.add_argument("--producer", required=True, help="producer (prefill side) model directory")
    parser.add_argument("--consumer", required=True, help="consumer (decode side) model directory")
    parser.add_argument("--data", default="calibration", metavar="SPLIT|FILE",
                        help=f"a split of the built-in data ({', '.join(SPLITS)}; default calibration) or your "
                             f"prompts: {FORMATS_HELP}. Split by document (records of one \"source\" stay together): "
                             "whole documents from the end of the file are held out as --report-prompts (the "
                             "codebook's quality figures, measured once at the end) and --probe-prompts (steer the "
                             f"plan; each scores up to {PROBE_SCORED_TOKENS} tokens of a text's second half, the "
                             "answer, or the consumer's greedy continuation); the first --num-prompts of the rest fit")
    add_truncation_arguments(parser, "a probe prompt without an answer scores the consumer's greedy "
                                     "continuation of this many tokens")
    parser.add_argument("--num-prompts", type=int, default=192, help="prompts that fit the codes and token priors")
    parser.add_argument("--probe-prompts", type=int, default=CalibrateConfig.num_probe_prompts,
                        help="other prompts whose KL steers the plan")
    parser.add_argument("--report-prompts", type=int, default=CalibrateConfig.num_report_prompts,
                        help="prompts of other documents, held out from fitting and choosing, on which the codebook's "
                             f"quality figures are measured (each scores up to {REPORT_SCORED_TOKENS} tokens)")
    parser.add_argument("--kl-budget", type=float, required=True, help="KL budget, nats per answer token")
    parser.add_argument("--min-top1", type=float, default=CalibrateConfig.min_top1,
                        help="the agreement target: share of next tokens equal to the consumer's own (recorded in "
                             "the manifest; `auto` serves a method whose measured top-1 reaches it)")
    parser.add_argument("--max-patches", type=int, default=None, help="most patch layers tried (default L/2)")
    parser.add_argument("--max-payload", type=float, default=None, metavar="FRACTION",
                        help="most code numbers per token as a fraction of raw 16-bit K/V (e.g. 0.4; scd-int8 then "
                             "ships about half of it): the fewest numbers within --kl-budget, or where no plan under "
                             "the cap meets the budget, the least KL under it (default: no cap)")
    parser.add_argument("--max-rows", type=int, default=8192, help="token rows per layer for the fits")
    parser.add_argument("--aligner-steps", type=int, default=300)
    parser.add_argument("--refiner-epochs", type=int, default=CalibrateConfig.refiner_epochs,
                        help="two models with a feature prior: epochs training each reused stream's refiner, an MLP "
                             "over its code and the prompt's token features added to the linear decode (0: none)")
    parser.add_argument("--run-layers", type=int, nargs="+", default=None, metavar="L",
                        help="layers from which the consumer may run its own upper layers over the prompt (from "
                             "a full-rank code of the producer's residual; those above ship nothing): the one of "
                             "least measured KL replaces the plan's layers from there when it beats the plan. "
                             "It costs the decode worker (layers - L) / layers of a prefill (default: every layer "
                             "whose run fits --max-rebuild)")
    parser.add_argument("--max-rebuild", type=float, default=CalibrateConfig.max_rebuild, metavar="SHARE",
                        help="the most a rebuild may cost the decode worker as a share of its own prefill, timed on "
                             "probe prompts for each run, replay and head weighed (0: the plan alone, none of them)")
    parser.add_argument("--rebuild-cost", choices=REBUILD_COSTS, default=CalibrateConfig.rebuild_cost,
                        help="timed: each option's rebuild timed against the consumer's prefill on probe prompts; "
                             "counted: a run from L as (layers - L) / layers of it, a replay of R tokens as R / T "
                             "and a head of S tokens as S / T "
                             "(the same choice on every machine, blind to the codes' decode)")
    parser.add_argument("--replay", type=int, nargs="+", default=list(CalibrateConfig.replay), metavar="R",
                        help="replayed tails tried: the prompt's last R tokens before the handoff's end are computed "
                             "by the consumer over the rebuilt rest instead of rebuilt from codes (about R / T of its "
                             "prefill, timed against --max-rebuild); the shortest meeting the budget is kept, else "
                             "the one of best top-1 (0 alone: never)")
    parser.add_argument("--head", type=int, nargs="+", default=list(CalibrateConfig.head), metavar="S",
                        help="heads tried with each replay and run: the prompt's first S tokens are computed by the "
                             "consumer (exact, and every later token attends to them) and their codes not sent "
                             "(about S / T of its prefill, timed against --max-rebuild; 0 alone: never)")
    parser.add_argument("--distill-steps", type=int, default=CalibrateConfig.distill_steps,
                        help="Adam steps that tune the scd plan's decoders and aligners on the consumer's own "
                             "next-token KL over the fit prompts (payload unchanged; 0: closed-form fits only)")
    parser.add_argument("--distill-lr", type=float, default=CalibrateConfig.distill_lr,
                        help="Adam learning rate of the distillation (held-out prompts keep the best step)")
    parser.add_argument("--prior", default="features", choices=["features", "dense", "none"],
                        help="the consumer's token prior: features (from its own embeddings; size independent of "
                             "the vocabulary), dense (one-hot tables: its fit needs a [taps * (vocab + 1)]^2 float64 "
                             "matrix, refused up front when that will not fit) or none (codes only)")
    parser.add_argument("--prior-taps", type=int, default=3,
                        help="prompt tokens (current and previous) the token prior reads; 0: codes only")
    parser.add_argument("--prior-width", type=int, default=512, help="random features per token of the feature prior")
    parser.add_argument("--prior-states", type=int, default=512,
                        help="feature prior: columns of each token's own K/V at every layer, computed by the "
                             "consumer with the token standing alone (0: its embedding only)")
    parser.add_argument("--prior-state-layers", type=int, default=0,
                        help="feature prior: the token states come from the consumer's first N layers only (0: "
                             "all). A prompt's unseen tokens each pay that pass on the decode side; with 2 or 4 of 8 the "
                             "embedded pair's prior failed (docs/results.md): read the KLs it prints")
    parser.add_argument("--prior-frequent", type=int, default=0,
                        help="tokens of the fit prompts (the most frequent) that get a column of their own in the "
                             "feature prior, as in a dense table (0: none; the count is fixed, not the vocabulary)")
    parser.add_argument("--prior-rank", type=int, default=64,
                        help="columns of the feature prior's shared basis (its codebook size grows with it)")
    parser.add_argument("--prior-ridge", type=float, default=None,
                        help="ridge of the token prior: dense in token counts (default 0.1), features relative "
                             "to the mean feature variance (default: the grid value of least generalized "
                             "cross-validation error)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="dtype the models are loaded in (fits and statistics stay float32/float64)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the models; statistics stay on the CPU)")
    parser.add_argument("--max-memory-gb", type=float, default=None,
                        help="memory calibration may take; refused before loading when the weights and the "
                             "token prior would not fit (default: the RAM available now)")
    parser.add_argument("--out", required=True, help="codebook directory to write")


def run(args: argparse.Namespace) -> int:
    from scd_serve.model import ModelRuntime
    from scd_serve.corpus.qa import SPLITS

    flags = {f.name: getattr(args, f.name) for f in fields(CalibrateConfig) if hasattr(args, f.name)}
    cfg = CalibrateConfig(**flags | dict(num_probe_prompts=args.probe_prompts, num_report_prompts=args.report_prompts,
                                         run_layers=None if args.run_layers is None else tuple(args.run_layers),
                                         replay=tuple(args.replay), head=tuple(args.head)))
    if args.greedy_tokens < 1:
        raise ConfigError(f"--greedy-tokens must be >= 1, got {args.greedy_tokens}", field="greedy_tokens")
    # nothing is loaded before the memory estimate and the data file are checked
    check_fits(estimate(args.producer, args.consumer, args.dtype, cfg), args.device,
               args.max_memory_gb, "calibrate")
    records = None
    if args.data not in SPLITS:
        from scd_serve.quality.data import read_records

        if not Path(args.data).exists():
            raise ConfigError(f"--data {args.data}: no such file, and not a built-in split ({', '.join(SPLITS)})",
                              field="data")
        records = read_records(args.data)
    torch.manual_seed(cfg.seed)
    producer = ModelRuntime.load(args.producer, device=args.device, dtype=DTYPES[args.dtype])
    consumer = ModelRuntime.load(args.consumer, device=args.device, dtype=DTYPES[args.dtype])
    if records is None:
        data = builtin_prompts(consumer.tokenizer, args.data, cfg)
    else:
        context = min(producer.spec.max_position_embeddings, consumer.spec.max_position_embeddings)
        max_tokens = context - args.greedy_tokens if args.max_tokens is None else args.max_tokens
        if max_tokens + args.greedy_tokens > context:
            raise ConfigError(f"--max-tokens {max_tokens} + --greedy-tokens {args.greedy_tokens} exceed the models' "
                              f"context of {context} positions", field="max_tokens")
        data = user_prompts(consumer, args.data, records, cfg, max_tokens, args.greedy_tokens)
    result = calibrate(producer, consumer, data.fit, data.probe, cfg, distill_pairs=data.fit_pairs,
                       report_pairs=data.report, choice_pairs=data.choice)
    result.codebook.manifest["calibration"]["data"] = {"source": args.data, "dtype": args.dtype}
    out = result.codebook.save(args.out)
    spec = spec_of(consumer)
    chosen = result.codebook.plan("scd")
    png = plot_tradeoff(result.curve, chosen, 2 * spec.num_layers * spec.kv_width, cfg.kl_budget, out / "tradeoff.png")
    print_report(result, cfg, out)
    print(f"trade-off curve: {png}")
    return 0
