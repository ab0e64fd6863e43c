#!/usr/bin/env python3
"""Would the consumer answer better if it ran its own upper layers from a mapped residual?

A question about codec design (issue 18), asked with full-rank linear maps (no compression):
- `linear-kv`: every layer's consumer K/V is a ridge map of the producer's attention input at
  the same layer and token (the most any per-token linear decoder of that state can do);
- `deep@L`: layers < L as in `linear-kv`; at L the consumer's residual stream is a ridge map of
  the producer's residual at L, and the consumer runs its own layers L..N-1 over the prompt
  (attention included), so what those layers compute from context is its own computation;
- `deep-exact@L`: the same with the consumer's own K/V below L (isolates the upper part);
- with --codebook: `scd` (the codebook's scd plan on every layer) and `scd-deep@L` (its layers
  below L, the consumer's own from L as in `deep@L`), the codec question: would a run of the
  upper layers beat the plan's per-layer Reuse and Patch there?
Each is scored by greedy exact match of the answer on held-out task prompts, and on the answer's
teacher-forced tokens by top-1 agreement with the oracle (the consumer's own prefill) and
KL(method || oracle). Maps are fitted on calibration prompts.

    python scripts/deep_patch_probe.py PRODUCER CONSUMER calibration.jsonl heldout.jsonl \
        [--fit 48] [--eval 60] [--layers 3 4 5 6] [--codebook DIR]
"""

import argparse
import json

import torch

from scd_serve.model.runtime import ModelRuntime
from scd_serve.codec.codebook import Codebook
from scd_serve.quality.harness import build_codec
from scd_serve.quality.metrics import exact_match, kl_and_tv
from scd_serve.quality.transfer import BLOCK, Handoff, greedy_after, teacher_forced


def states(rt, ids):
    """-> per layer LayerState (keys, values, attn_input, residual) of the prompt."""
    return [state for _, state in rt.iter_prefill(ids, compute_logits=False, residuals=True)]


def fit(x, y, lam=1e-4):
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    gram = x.T @ x
    return torch.linalg.solve(gram + lam * gram.trace() / gram.shape[0] * torch.eye(gram.shape[0], dtype=x.dtype), x.T @ y)


def apply(w, x):
    return (torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64)], 1) @ w).float()


def ids_of(rt, rec):
    return torch.tensor(rt.tokenizer(rec["prompt"])["input_ids"])


def answer(rt, kvs, ids, gold):
    """Write per-layer (k_pre, v) of ids[:-1], then run ids[-1] and the gold answer's tokens but
    the last. -> (greedy answer text, teacher-forced logits [n, vocab])."""
    prefix, n = ids.shape[0] - 1, gold.shape[0]
    nb = -(-(prefix + n + 2) // BLOCK)
    h = Handoff(rt.new_kv_pool(nb, BLOCK), list(range(nb)), prefix, 0, 0.0)
    for layer, (k, v) in enumerate(kvs):
        rt.write_kv(h.pool, h.blocks, layer, k[:prefix], v[:prefix])
    logits = teacher_forced(rt, h, torch.cat([ids[-1:], gold[:-1]]))
    return rt.tokenizer.decode(greedy_after(rt, h, logits[0], n, -1), skip_special_tokens=True), logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("producer")
    ap.add_argument("consumer")
    ap.add_argument("calibration")
    ap.add_argument("heldout")
    ap.add_argument("--fit", type=int, default=48)
    ap.add_argument("--eval", type=int, default=60)
    ap.add_argument("--per-prompt", type=int, default=400)
    ap.add_argument("--layers", type=int, nargs="+", default=[3, 4, 5, 6])
    ap.add_argument("--codebook", help="also score its scd plan, and that plan below L with the run from L")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pa, cb = ModelRuntime.load(args.producer), ModelRuntime.load(args.consumer)
    n_layers = cb.spec.num_layers
    gen = torch.Generator().manual_seed(0)
    xs = {}  # name -> list of rows
    for line in open(args.calibration).read().splitlines()[: args.fit]:
        ids = ids_of(pa, json.loads(line))
        idx = torch.randperm(ids.shape[0], generator=gen)[: args.per_prompt]
        for layer, (sa, sb) in enumerate(zip(states(pa, ids), states(cb, ids))):
            xs.setdefault(("x", layer), []).append(sa.attn_input[idx].double())
            xs.setdefault(("kv", layer), []).append(torch.cat([sb.keys.flatten(1), sb.values.flatten(1)], 1)[idx].double())
            xs.setdefault(("ha", layer), []).append(sa.residual[idx].double())
            xs.setdefault(("hb", layer), []).append(sb.residual[idx].double())
    xs = {k: torch.cat(v) for k, v in xs.items()}
    kv_map = [fit(xs[("x", i)], xs[("kv", i)]) for i in range(n_layers)]
    h_map = {i: fit(xs[("ha", i)], xs[("hb", i)]) for i in args.layers}
    print("fitted on", xs[("x", 0)].shape[0], "rows", flush=True)

    kvw = cb.spec.num_kv_heads * cb.spec.head_dim
    shape = (cb.spec.num_kv_heads, cb.spec.head_dim)
    codec = args.codebook and build_codec("scd", pa, cb, Codebook.load(args.codebook))
    names = ["oracle", "linear-kv"] + [f"{p}@{i}" for i in args.layers for p in ("deep", "deep-exact")]
    names += ["scd"] + [f"scd-deep@{i}" for i in args.layers] if codec else []
    hits = {n: [] for n in names}
    agree = {n: [] for n in names}  # answer text identical to the oracle's
    top1 = {n: [] for n in names}  # per answer token: argmax equals the oracle's
    kl = {n: [] for n in names}
    for j, line in enumerate(open(args.heldout).read().splitlines()[: args.eval]):
        rec = json.loads(line)
        ids = ids_of(cb, rec)
        gold = torch.tensor(cb.tokenizer(rec["answer"], add_special_tokens=False)["input_ids"])
        sa, sb = states(pa, ids), states(cb, ids)
        own = [(s.keys, s.values) for s in sb]
        lin = []
        for i in range(n_layers):
            kv = apply(kv_map[i], sa[i].attn_input)
            lin.append((kv[:, :kvw].unflatten(1, shape), kv[:, kvw:].unflatten(1, shape)))
        runs = {"oracle": own, "linear-kv": lin}
        if codec:  # as serving rebuilds them: codes of the producer's prefill of the prefix
            prefix = ids[:-1]
            runs["scd"] = [codec.decode_layer(layer, codec.encode_layer(layer, state), cb, tokens=prefix)
                           for layer, state in pa.iter_prefill(prefix, compute_logits=False)]
        for i in args.layers:
            upper = [(s.keys, s.values) for _, s in cb.run_from(i, apply(h_map[i], sa[i].residual))]
            runs[f"deep@{i}"] = lin[:i] + upper
            runs[f"deep-exact@{i}"] = own[:i] + upper
            if codec:
                runs[f"scd-deep@{i}"] = runs["scd"][:i] + upper
        out = {name: answer(cb, kvs, ids, gold) for name, kvs in runs.items()}
        for name, (text, logits) in out.items():
            hits[name].append(exact_match(text, rec["answer"]))
            agree[name].append(float(text == out["oracle"][0]))
            top1[name] += (logits.argmax(-1) == out["oracle"][1].argmax(-1)).float().tolist()
            kl[name] += kl_and_tv(logits, out["oracle"][1])[0].tolist()
        if (j + 1) % 10 == 0:
            print(j + 1, {k: round(sum(v) / len(v), 3) for k, v in hits.items()}, flush=True)
    print("final EM", {k: round(sum(v) / len(v), 3) for k, v in hits.items()})
    print("final agreement with the oracle", {k: round(sum(v) / len(v), 3) for k, v in agree.items()})
    print("final top-1 agreement", {k: round(sum(v) / len(v), 3) for k, v in top1.items()})
    print("final KL", {k: round(sum(v) / len(v), 3) for k, v in kl.items()})


if __name__ == "__main__":
    main()
