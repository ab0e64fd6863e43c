"""How well each way of fitting the codes predicts a pair's consumer K/V on documents it was not
fitted on (issue 40; docs/results.md "Codes fitted to predict"): per layer and stream, the
relative squared error left of what the consumer's token prior leaves, at a quarter of the
stream's width and at full width, for
  joint own   the joint SVD of the producer's own stream and the consumer's (the codes before),
  rrr own     reduced-rank regression on the producer's own stream,
  rrr h       reduced-rank regression on the producer's attention input of the layer (the codes now),
  rrr h3      the same on the attention inputs of layers l-2..l (not built),
  refined     rrr h and its refiner (codec/refiner.py: an MLP over the code and the prompt's token
              features, one for every rank), and that refiner at rank 0 (no code: what the token
              features alone give beyond the linear prior; trained with rank 0 in its grid, which
              calibration leaves out: on other documents it lost, docs/results.md).

    .venv/bin/python scripts/code_fit_study.py PAIR_DIR

PAIR_DIR holds producer/, consumer/ and eval/calibration.jsonl (a zoo pair); the first 80% of
its documents fit (up to 120 prompts), the rest (up to 40 prompts) score.
"""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

import torch

from scd_serve.calibration.fit import collect_rows, refiner_width
from scd_serve.codec.features import FeaturePrior
from scd_serve.codec.lowrank import fit_code
from scd_serve.codec.refiner import fit_refiner
from scd_serve.config.codec import CalibrateConfig
from scd_serve.model.runtime import ModelRuntime
from scd_serve.quality.calibrate import prior_fitter
from scd_serve.quality.data import read_prompts


def rel_error(pred: torch.Tensor, b: torch.Tensor) -> float:
    return float((pred - b).pow(2).sum() / (b - b.mean(0)).pow(2).sum())


def scored_error(a, b, av, bv, rank: int, regression: bool = True) -> float:
    """A rank-r code fitted on (a, b), its error on the scored rows (av, bv)."""
    jc = fit_code(a, b, max_rank=rank, regression=regression)
    return rel_error((av.double() - jc.mu_a) @ jc.enc[:, :rank] @ jc.decoder(rank) + jc.mu_b, bv.double())


def refined_errors(a, b, av, bv, ctx, ctx_v, ranks: list[int], width: int, epochs: int = 40) -> dict[int, float]:
    """The refiner calibration would train on (a, b), scored at each rank on the scored rows."""
    jc = fit_code(a, b, max_rank=ranks[-1], regression=True)
    code = lambda x: ((x.double() - jc.mu_a) @ jc.enc[:, :ranks[-1]]).to(torch.float16).float()  # as it ships
    z, zv = code(a), code(av)
    dec = {r: jc.decoder(r).float() for r in ranks if r}
    linear = lambda zz, r: jc.mu_b.float() + (zz[:, :r] @ dec[r] if r else 0.0)
    ref, _ = fit_refiner(z, ctx, lambda idx, r: b[idx].float() - linear(z[idx], r), ranks, width, epochs)
    with torch.no_grad():
        return {r: rel_error(linear(zv, r) + ref(zv[:, :r], ctx_v), bv.float()) for r in ranks}


class PairRows(NamedTuple):
    """A zoo pair's rows for the studies: the first 80% of its calibration documents fit (up to 120
    prompts, 30k rows), the rest (up to 40 prompts, 10k rows) score; the same positions at every layer."""
    consumer: ModelRuntime
    rows: list  # collect_rows of the fitted prompts: per layer {stream: (producer's, consumer's)}
    scored: list  # the same of the scored prompts
    ctx: dict  # "fit" / "score": the rows' reduced token features
    prior: Any  # the token prior fitted on the fitted prompts
    heads: dict

    def left(self, which: str, layer: int, s: str) -> torch.Tensor:
        """The consumer's rows of `which` ("fit" or "score") less the token prior: what codes carry."""
        rs = self.rows if which == "fit" else self.scored
        return rs[layer][s][1] - FeaturePrior.apply(*self.heads[(layer, s)], self.ctx[which])


def pair_rows(pair: str) -> PairRows:
    from transformers import AutoTokenizer

    producer = ModelRuntime.load(f"{pair}/producer", dtype="float32")
    consumer = ModelRuntime.load(f"{pair}/consumer", dtype="float32")
    items = read_prompts(f"{pair}/eval/calibration.jsonl", AutoTokenizer.from_pretrained(f"{pair}/consumer"), 512).items
    docs = sorted({x.document for x in items})
    fitted = set(docs[: int(0.8 * len(docs))])
    fit_ids = [x.ids for x in items if x.document in fitted][:120]
    score_ids = [x.ids for x in items if x.document not in fitted][:40]
    cfg = CalibrateConfig(kl_budget=0.05)
    fit_prior = prior_fitter(cfg, consumer, fit_ids)
    rows = collect_rows(producer, consumer, fit_ids, 30000, prior=fit_prior)
    prior, heads = fit_prior.solve(cfg.ridge)
    # the same features (spec, frequent tokens) for the scored prompts' contexts; nothing fitted on them
    scored = collect_rows(producer, consumer, score_ids, 10000, prior=prior_fitter(cfg, consumer, fit_ids))
    ctx = {"fit": prior.reduce(rows[0]["ctx"]), "score": prior.reduce(scored[0]["ctx"])}
    return PairRows(consumer, rows, scored, ctx, prior, heads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pair")
    args = p.parse_args()
    d = pair_rows(args.pair)
    rows, scored, ctx = d.rows, d.scored, d.ctx

    def h(rs, layers):
        return torch.cat([rs[j]["h"][0] for j in layers], 1)

    width = refiner_width(d.consumer, 2 * (len(rows) - 1), d.prior.rows(), CalibrateConfig.refiner_width)
    print(f"stream layer rank: joint own / rrr own / rrr h / rrr h3 / refined (width {width}; rank 0: refiner alone)")
    for s in ("k", "v"):
        for layer in range(1, len(rows)):
            b, bv = d.left("fit", layer, s), d.left("score", layer, s)
            below = range(max(0, layer - 2), layer + 1)
            refined = refined_errors(rows[layer]["h"][0], b, scored[layer]["h"][0], bv, ctx["fit"].float(),
                                     ctx["score"].float(), [0, b.shape[1] // 4, b.shape[1]], width)
            print(f"{s} {layer} 0: refiner alone {refined[0]:.3f}", flush=True)
            for rank in (b.shape[1] // 4, b.shape[1]):
                own = (rows[layer][s][0], b, scored[layer][s][0], bv, rank)
                print(f"{s} {layer} {rank}: {scored_error(*own, regression=False):.3f} / {scored_error(*own):.3f} / "
                      f"{scored_error(rows[layer]['h'][0], b, scored[layer]['h'][0], bv, rank):.3f} / "
                      f"{scored_error(h(rows, below), b, h(scored, below), bv, rank):.3f} / {refined[rank]:.3f}", flush=True)


if __name__ == "__main__":
    main()
