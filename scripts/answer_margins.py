#!/usr/bin/env python3
"""Where does a codec's top-1 disagree with the oracle, and was the oracle sure there?

Per scored answer token (teacher-forced on the gold answer, as `scd-serve eval --data` scores
it, with eval's own runs), the oracle's first and second probabilities beside the codec's
choice: a disagreement where the oracle's margin is small is a near-tie any perturbation flips;
one where it is large is the codec's own error.

    python scripts/answer_margins.py PRODUCER CONSUMER CODEBOOK heldout.jsonl [--limit 200] [--method scd]
"""

import argparse
import statistics

import torch

from scd_serve.codec.codebook import Codebook
from scd_serve.model.runtime import ModelRuntime
from scd_serve.quality.data import read_prompts
from scd_serve.quality.harness import build_codec
from scd_serve.quality.scorer import run_method, run_oracle

GREEDY_TOKENS = 16  # eval's default; the greedy runs are not read here


def main():
    ap = argparse.ArgumentParser()
    for name in ("producer", "consumer", "codebook", "data"):
        ap.add_argument(name)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--method", default="scd")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pa, cb = ModelRuntime.load(args.producer), ModelRuntime.load(args.consumer)
    codec = build_codec(args.method, pa, cb, Codebook.load(args.codebook))
    stop = cb.tokenizer.eos_token_id if cb.tokenizer.eos_token_id is not None else -1
    prompts = read_prompts(args.data, cb.tokenizer, cb.spec.max_position_embeddings - GREEDY_TOKENS)
    rows = []
    for p in prompts.items[: args.limit]:
        oracle = run_oracle(cb, p, GREEDY_TOKENS, stop)
        method = run_method(args.method, codec, pa, cb, p, oracle, GREEDY_TOKENS, stop)
        top = oracle.logits.float().softmax(-1).topk(2)  # [m, 2]
        for i in range(oracle.scored.shape[0]):
            rows.append({"position": i, "margin": float(top.values[i, 0] - top.values[i, 1]),
                         "gold": int(oracle.scored[i]), "oracle": int(top.indices[i, 0]),
                         "method": int(method.logits[i].argmax())})
    differ = [r for r in rows if r["oracle"] != r["method"]]
    print(f"{len(rows)} answer tokens; {args.method} differs from the oracle at {len(differ)} "
          f"(top-1 {1 - len(differ) / len(rows):.3f})")
    if differ:
        print("  by answer position:", {p: sum(r["position"] == p for r in differ) for p in sorted({r["position"] for r in differ})})
        print(f"  the oracle's margin there: median {statistics.median(r['margin'] for r in differ):.2f} "
              f"(all tokens: {statistics.median(r['margin'] for r in rows):.2f})")
        print(f"  right there: oracle {sum(r['oracle'] == r['gold'] for r in differ)}, "
              f"{args.method} {sum(r['method'] == r['gold'] for r in differ)}")


if __name__ == "__main__":
    main()
