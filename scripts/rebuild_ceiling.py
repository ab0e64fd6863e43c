#!/usr/bin/env python3
"""What each way of rebuilding the consumer's K/V can reach on a pair, before any payload limit.

Per strategy, ridge maps (full rank, closed form) are fitted on every token of the calibration
texts, then each held-out text's first half is rebuilt and its second half scored against the
consumer's own prefill (KL per token, top-1 agreement), as `scd-serve eval` scores a text.
Strategies, per layer l (k, v: pre-RoPE; h: the normalized attention input; e: the consumer's
own layer-0 input of a token, from its embeddings alone):
  raw        the producer's K/V as they are
  means      the consumer's mean K/V (nothing shipped)
  prior      e of the token and the two before it -> consumer K/V (what a token prior can do)
  kv         producer [k, v]_l -> consumer [k, v]_l (Reuse at full rank)
  kv+prior   producer [k, v]_l and the three e -> consumer [k, v]_l
  h+prior    producer h_l and the three e -> consumer [k, v]_l
  allh+prior producer h of every layer and the three e -> consumer [k, v]_l
  run@L      layers below L as h+prior; the consumer runs L.. from a map of the producer's residual
Layer 0 of the consumer depends on the token alone; `*0` variants compute it exactly.

    python scripts/rebuild_ceiling.py PAIR_DIR [NUM_FIT] [NUM_HELD] [SCORED] [FIT_FILE HELD_FILE]

PAIR_DIR holds producer/, consumer/ and eval/ (calibration.jsonl and heldout.jsonl of {"text"}
records, or the files named).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from scd_serve.model.runtime import ModelRuntime
from scd_serve.quality.metrics import kl_and_tv

Tensor = torch.Tensor


def texts(path: Path, n: int) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()][:n]


def lagged(e: Tensor, taps: int = 3) -> Tensor:
    """e [T, d] -> [T, taps * d]: the token and the taps - 1 before it (zeros before the start)."""
    t = e.shape[0]
    return torch.cat([e] + [torch.cat([e.new_zeros(min(j, t), e.shape[1]), e[: t - j]]) for j in range(1, taps)], 1)


class Ridge:
    """Streamed normal equations of y ~ [x, 1] W, each row weighed by w (None: all 1)."""

    def __init__(self):
        self.xtx = self.xty = None

    def add(self, x: Tensor, y: Tensor, w: Tensor | None = None) -> None:
        x = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], 1)
        y = y.double()
        if w is not None:  # weighted least squares: rows times sqrt(w)
            root = w.double().sqrt()[:, None]
            x, y = x * root, y * root
        if self.xtx is None:
            self.xtx, self.xty = x.T @ x, x.T @ y
        else:
            self.xtx += x.T @ x
            self.xty += x.T @ y

    def solve(self, ridge: float = 1e-3) -> Tensor:
        d = self.xtx.shape[0]
        lam = ridge * float(self.xtx.diagonal()[:-1].mean()) if d > 1 else 0.0
        eye = torch.eye(d, dtype=torch.float64)
        eye[-1, -1] = 0
        return torch.linalg.solve(self.xtx + lam * eye, self.xty)

    @staticmethod
    def apply(w: Tensor, x: Tensor) -> Tensor:
        return (x.double() @ w[:-1] + w[-1]).float()


def states(rt: ModelRuntime, ids: Tensor) -> list:
    return [s for _, s in rt.iter_prefill(ids, compute_logits=False, residuals=True)]


def features(sa, eb: Tensor | None, name: str, layer: int, dims: bool = False):
    if dims:  # the producer's columns of these features (they come first): sa is (kv_width, hidden)
        kv2, hidden = sa
        return {"kv+prior": kv2, "h+prior": hidden}[name]
    t = eb.shape[0]
    kv = lambda s: torch.cat([s.keys.reshape(t, -1), s.values.reshape(t, -1)], 1)
    prior = lagged(eb)
    return {"means": eb[:, :0], "prior": prior, "kv": kv(sa[layer]), "kv+prior": torch.cat([kv(sa[layer]), prior], 1),
            "h+prior": torch.cat([sa[layer].attn_input, prior], 1),
            "allh+prior": torch.cat([s.attn_input for s in sa] + [prior], 1)}[name]


MAPPED = ("means", "prior", "kv", "kv+prior", "h+prior", "allh+prior")


def main(pair: str, num_fit: int = 200, num_held: int = 30, scored: int = 96, fit_file: str = "calibration.jsonl",
         held_file: str = "heldout.jsonl") -> None:
    torch.set_num_threads(2)
    root = Path(pair)
    rt_a, rt_b = ModelRuntime.load(root / "producer"), ModelRuntime.load(root / "consumer")
    spec, tok = rt_b.spec, rt_b.tokenizer
    n, kvh, hd = spec.num_layers, spec.num_kv_heads, spec.head_dim
    run_layers = [n // 2, (2 * n) // 3]
    fits = {(name, l): Ridge() for name in MAPPED for l in range(n)}
    run_fits = {l: Ridge() for l in run_layers}
    sa_dims = [(2 * spec.kv_width, spec.hidden_size)] * n
    started = time.time()
    with torch.no_grad():
        for text in texts(root / "eval" / fit_file, num_fit):
            ids = torch.tensor(tok(text)["input_ids"])
            sa, sb = states(rt_a, ids), states(rt_b, ids)
            eb = sb[0].attn_input  # the consumer's layer-0 input: a function of each token alone
            for l in range(n):
                y = torch.cat([sb[l].keys.reshape(len(ids), -1), sb[l].values.reshape(len(ids), -1)], 1)
                for name in MAPPED:
                    fits[(name, l)].add(features(sa, eb, name, l), y)
            for l in run_layers:
                run_fits[l].add(torch.cat([sa[l].residual, lagged(eb)], 1), sb[l].residual)
        maps = {k: r.solve() for k, r in fits.items()}
        ranks = sorted({spec.kv_width // 2, spec.kv_width})  # codes of 0.25 and 0.5 of raw per layer
        low = {}
        for name in ("kv+prior", "h+prior"):
            for l in range(n):
                w, xtx = maps[(name, l)], fits[(name, l)].xtx
                d_p = features(sa_dims[l], None, name, l, dims=True)  # the producer's columns come first
                wp = w[:d_p]
                cov = wp.T @ xtx[:d_p, :d_p] @ wp  # the producer part's fitted covariance
                evals, evecs = torch.linalg.eigh(cov)
                for r in ranks:
                    v = evecs[:, -r:]
                    wr = w.clone()
                    wr[:d_p] = wp @ v @ v.T
                    low[(name, l, r)] = wr
        run_maps = {l: r.solve() for l, r in run_fits.items()}
        print(f"fitted on {num_fit} texts in {time.time() - started:.0f} s", flush=True)

        totals: dict[str, list[float]] = {}
        for text in texts(root / "eval" / held_file, num_held):
            ids = torch.tensor(tok(text)["input_ids"])
            half = ids.shape[0] // 2
            prefix, feed = ids[:half], ids[half: half + scored]
            sa, sb = states(rt_a, prefix), states(rt_b, prefix)
            eb = sb[0].attn_input
            shape = lambda x: (x[:, : kvh * hd].reshape(-1, kvh, hd), x[:, kvh * hd:].reshape(-1, kvh, hd))
            oracle_kv = [(s.keys, s.values) for s in sb]
            variants = {"oracle": oracle_kv, "raw": [(s.keys, s.values) for s in sa]}
            for name in MAPPED:
                rebuilt = [shape(Ridge.apply(maps[(name, l)], features(sa, eb, name, l))) for l in range(n)]
                variants[name] = rebuilt
                variants[name + "*0"] = [oracle_kv[0]] + rebuilt[1:]
            for name in ("kv+prior", "h+prior"):  # the producer's part at a code rank (reduced-rank regression)
                for r in ranks:
                    rebuilt = [shape(Ridge.apply(low[(name, l, r)], features(sa, eb, name, l))) for l in range(n)]
                    variants[f"{name}@{r}*0"] = [oracle_kv[0]] + rebuilt[1:]
            for L in run_layers:
                below = variants["h+prior*0"][:L]
                r = Ridge.apply(run_maps[L], torch.cat([sa[L].residual, lagged(eb)], 1))
                variants[f"run@{L}"] = below + [(s.keys, s.values) for _, s in rt_b.run_from(L, r)]
            oracle = None
            for name, kv in variants.items():
                pool = rt_b.new_kv_pool(-(-(half + scored) // 16), 16)
                blocks = list(range(-(-(half + scored) // 16)))
                for l, (k, v) in enumerate(kv):
                    rt_b.write_kv(pool, blocks, l, k, v)
                logits = rt_b.extend(pool, [(blocks, half, feed)])[0].double()
                if name == "oracle":
                    oracle = logits
                    continue
                tally(totals.setdefault(name, [0.0, 0.0, 0]), logits, oracle)
        print_totals("strategy", totals, num_held, scored)


def tally(acc: list, logits: Tensor, oracle: Tensor) -> None:
    """Adds to acc [KL sum, top-1 hits, positions] one text's scored rows, logits [m, vocab]
    against the oracle's."""
    acc[0] += float(kl_and_tv(logits, oracle)[0].sum())
    acc[1] += float((logits.argmax(-1) == oracle.argmax(-1)).sum())
    acc[2] += logits.shape[0]


def print_totals(label: str, totals: dict, num_held: int, scored: int) -> None:
    print(f"{label:<14}{'KL':>9}{'top-1':>8}   ({num_held} held-out texts, {scored} scored tokens each)")
    for name, (kl, top1, count) in totals.items():
        print(f"{name:<14}{kl / count:>9.4f}{top1 / count:>8.3f}", flush=True)


def pair_arguments(description: str):
    """The command line both studies share: PAIR_DIR [NUM_FIT] [NUM_HELD] [SCORED]."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("pair", help="directory with producer/, consumer/ and eval/")
    ap.add_argument("num_fit", type=int, nargs="?", default=200, help="calibration texts the maps are fitted on")
    ap.add_argument("num_held", type=int, nargs="?", default=30, help="held-out texts scored")
    ap.add_argument("scored", type=int, nargs="?", default=96, help="tokens scored per held-out text")
    return ap


if __name__ == "__main__":
    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("fit_file", nargs="?", default="calibration.jsonl", help="under PAIR/eval/")
    ap.add_argument("held_file", nargs="?", default="heldout.jsonl", help="under PAIR/eval/")
    a = ap.parse_args()
    main(a.pair, a.num_fit, a.num_held, a.scored, a.fit_file, a.held_file)
