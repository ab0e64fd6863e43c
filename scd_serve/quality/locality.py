"""How local a consumer's cache is: per layer, the share of its K/V variance (R^2 on held-out
prompts) that the last few prompt tokens explain, through the feature prior (codec/features.py).

A pair whose K/V are mostly a function of the last tokens lets a decoder that ignores the
producer (the zero-payload ablation) look good; a pair whose deeper layers carry context
needs the codes. The figure is a lower bound of what token identities explain (the feature
prior is one model of them), and the same model for every pair, so pairs compare.
`scd-serve eval --locality` prints it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from scd_serve.calibration.feature_fit import FeatureFit
from scd_serve.codec.features import FeatureSpec

Tensor = torch.Tensor


def _states(consumer: Any, ids: Tensor):
    for layer, s in consumer.iter_prefill(ids, compute_logits=False):
        t = ids.shape[0]
        yield layer, {"k": s.keys.reshape(t, -1), "v": s.values.reshape(t, -1)}


def locality(consumer: Any, prompts: Sequence[Tensor], taps: int = 3, width: int = 512, rank: int = 64,
             holdout: float = 0.25) -> list[dict[str, float]]:
    """-> per layer {"k": R^2, "v": R^2} on the last `holdout` share of the prompts (fit on the rest)."""
    prompts = [torch.as_tensor(p).long() for p in prompts]
    num_test = max(1, int(len(prompts) * holdout))
    if len(prompts) - num_test < 1:
        raise ValueError(f"locality needs at least 2 prompts, got {len(prompts)}")
    hidden = consumer.spec.hidden_size
    fit = FeatureFit(FeatureSpec(taps=taps, width=width, rank=rank, hidden=hidden))
    for ids in prompts[:-num_test]:
        phi = fit.add_tokens(ids, consumer)
        for layer, streams in _states(consumer, ids):
            for s, y in streams.items():
                fit.add_target((layer, s), phi, y)
    prior, heads = fit.solve()
    sse: dict[tuple, float] = {}
    sums: dict[tuple, list] = {}  # key -> [n, sum y, sum y^2] for the held-out variance
    for ids in prompts[-num_test:]:
        ctx = prior.context(ids, consumer, device="cpu")
        for layer, streams in _states(consumer, ids):
            for s, y in streams.items():
                key = (layer, s)
                y = y.double().cpu()
                pred = prior.apply(*heads[key], ctx).double()
                sse[key] = sse.get(key, 0.0) + float((pred - y).pow(2).sum())
                acc = sums.setdefault(key, [0, torch.zeros(y.shape[1], dtype=torch.float64), 0.0])
                acc[0] += y.shape[0]
                acc[1] += y.sum(0)
                acc[2] += float(y.pow(2).sum())
    out: list[dict[str, float]] = []
    for (layer, s), (n, total, squares) in sorted(sums.items()):
        sst = squares - float(total.pow(2).sum()) / n
        while len(out) <= layer:
            out.append({})
        out[layer][s] = 1.0 - sse[(layer, s)] / max(sst, 1e-30)
    return out


def format_locality(rows: list[dict[str, float]], taps: int) -> str:
    lines = [f"consumer K/V explained by the last {taps} tokens (held-out R^2, feature prior)",
             f"{'layer':<7}{'K':>8}{'V':>8}"]
    lines += [f"{i:<7}{r['k']:>8.3f}{r['v']:>8.3f}" for i, r in enumerate(rows)]
    return "\n".join(lines)
