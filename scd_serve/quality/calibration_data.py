"""What `scd-serve calibrate` fits, steers and reports on: three disjoint sets of prompts.

- fit:    paired states of both models fit the codes, priors and maps; distillation trains on them;
- probe:  the plan search measures candidate plans on them (its KL steers the choice);
- report: held out from everything above; the codebook's quality figures (the manifest's
          `calibration.methods`, what `auto` and users read) are measured on them once, at the end.

A user's file is split by document, never inside one: records sharing a "source" stay together,
and whole documents from the end of the file go to report, then probe (records without a source
are their own documents; a file's neighbouring records often come from one text, so contiguous
blocks are taken rather than every n-th record). A figure measured on the probe after the search
chose by it, or on records of the documents the maps were fitted on, overstates quality.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scd_serve.config.codec import CalibrateConfig
from scd_serve.errors import ConfigError
from scd_serve.extras import tqdm

Tensor = torch.Tensor
# --data FILE: a probe prompt scores at most this many tokens of its reference (every plan the
# search measures runs them all again; the fit still reads whole records)
PROBE_SCORED_TOKENS = 64
# a report prompt scores up to this many (measured once per method: as `eval` scores a text)
REPORT_SCORED_TOKENS = 512


@dataclass
class CalibrationData:
    fit: list[Tensor]  # prompt ids [T] (a text whole: any stretch of it is a prompt)
    fit_pairs: list[tuple[Tensor, Tensor]]  # (prompt ids, scored ids or empty): distillation's examples
    probe: list[tuple[Tensor, Tensor]]  # (prompt ids, scored ids)
    report: list[tuple[Tensor, Tensor]]
    report_documents: int = 0
    # the probe prompts scored as long as the report's: what the run and replay choice reads (a
    # replay mends the tokens nearest the prompt, so a short score would overrate it)
    choice: list[tuple[Tensor, Tensor]] | None = None

    def summary(self) -> str:
        return (f"fit on {len(self.fit)}, probe on {len(self.probe)}, report on {len(self.report)} "
                f"({self.report_documents} documents held out from fitting and choosing)")


def split_sizes(n: int, cfg: CalibrateConfig) -> tuple[int, int, int]:
    """(fit, probe, report) prompt counts for n usable records; a file smaller than asked for
    keeps about an eighth each (at least 1) for probe and report."""
    probe, report = cfg.num_probe_prompts, cfg.num_report_prompts
    if n < cfg.num_prompts + probe + report:
        probe, report = min(probe, max(1, n // 8)), min(report, max(1, n // 8))
    if n < probe + report + 1:
        raise ConfigError(f"calibration needs at least {probe + report + 1} usable records (fit, probe and report "
                          f"prompts), got {n}", field="data")
    return min(cfg.num_prompts, n - probe - report), probe, report


def split_by_document(documents: list[str], probe: int, report: int) -> tuple[list[int], list[int], list[int]]:
    """Record indices -> (fit, probe, report): whole documents from the end go to report until it
    holds `report` records, then to probe; the rest fit. A document larger than what is left is
    still taken whole (the held-out sets may grow past their counts, the fit set never shares a
    document with them) unless that would leave nothing to fit."""
    order: dict[str, list[int]] = {}
    for i, d in enumerate(documents):
        order.setdefault(d, []).append(i)
    groups = list(order.values())
    taken: list[list[int]] = [[], []]  # report, probe
    for slot, want in ((0, report), (1, probe)):
        reserve = 2 - slot  # records left for what is still to be filled: probe (after report) and fit
        while groups and len(taken[slot]) < want and sum(map(len, groups)) - len(groups[-1]) >= reserve:
            taken[slot] = groups.pop() + taken[slot]
    fit = [i for g in groups for i in g]
    if not taken[0] or not taken[1] or not fit:
        raise ConfigError(f"calibration cannot hold out whole documents: {len(order)} documents for "
                          f"{len(documents)} records; give records of more documents (their \"source\")", field="data")
    return fit, sorted(taken[1]), sorted(taken[0])


def user_prompts(consumer, data: str, records: list, cfg: CalibrateConfig, max_tokens: int, greedy_tokens: int,
                 show_progress: bool = True) -> CalibrationData:
    """--data FILE -> fit, probe and report prompts, split by document. A probe or report prompt
    without an answer scores the consumer's own greedy continuation of `greedy_tokens` tokens."""
    from scd_serve.quality.data import tokenize
    from scd_serve.quality.scorer import run_oracle

    prompts = tokenize(records, consumer.tokenizer, max_tokens, data)
    items = prompts.items
    num_fit, num_probe, num_report = split_sizes(len(items), cfg)
    fit_i, probe_i, report_i = split_by_document([p.document for p in items], num_probe, num_report)
    fit_i = fit_i[:num_fit]
    print(f"{prompts.summary()}; asked for {cfg.num_prompts} + {cfg.num_probe_prompts} + {cfg.num_report_prompts} "
          "(fit + probe + report)", flush=True)
    eos = getattr(consumer.tokenizer, "eos_token_id", None)

    def scored(p, limit: int) -> tuple[Tensor, Tensor]:
        ref = p.reference if p.reference is not None else \
            run_oracle(consumer, p, greedy_tokens, -1 if eos is None else int(eos)).scored
        return p.ids, ref[:limit]

    choice = [scored(items[i], REPORT_SCORED_TOKENS) for i in tqdm(probe_i, desc="probe references",
                                                                    disable=not show_progress)]

    no_answer = torch.zeros(0, dtype=torch.long)
    out = CalibrationData(
        fit=[torch.cat([items[i].ids, items[i].reference]) if items[i].kind == "text" and items[i].reference
             is not None else items[i].ids for i in fit_i],
        fit_pairs=[(items[i].ids, no_answer if items[i].reference is None else items[i].reference[:PROBE_SCORED_TOKENS])
                   for i in fit_i],
        probe=[(ids, ref[:PROBE_SCORED_TOKENS]) for ids, ref in choice],
        report=[scored(items[i], REPORT_SCORED_TOKENS) for i in tqdm(report_i, desc="report references",
                                                                      disable=not show_progress)],
        report_documents=len({items[i].document for i in report_i}), choice=choice)
    print(out.summary(), flush=True)
    return out


def builtin_prompts(tokenizer, split: str, cfg: CalibrateConfig) -> CalibrationData:
    """The project's QA prompts (each its own document): fit, then probe, then report."""
    pairs = load_prompts(tokenizer, split, cfg.num_prompts + cfg.num_probe_prompts + cfg.num_report_prompts, cfg.seed)
    fit = pairs[: cfg.num_prompts]
    probe = pairs[cfg.num_prompts: cfg.num_prompts + cfg.num_probe_prompts]
    report = pairs[cfg.num_prompts + cfg.num_probe_prompts:]
    return CalibrationData([p for p, _ in fit], fit, probe, report, len(report))


def load_prompts(tokenizer, split: str, n: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """(prompt ids with <bos>, answer ids) from the project's deterministic data."""
    from scd_serve.corpus.qa import load_split

    if tokenizer is None:
        raise ConfigError("the consumer model directory has no tokenizer; calibration needs one for its prompts")
    out = []
    for ex in load_split(split, n, seed=seed):
        prompt = tokenizer(ex["prompt"])["input_ids"]
        answer = tokenizer(ex["answer"], add_special_tokens=False)["input_ids"]
        out.append((torch.tensor(prompt), torch.tensor(answer)))
    return out
