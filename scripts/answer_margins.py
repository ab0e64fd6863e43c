#!/usr/bin/env python3
"""Where does a codec's top-1 disagree with the oracle, and was the oracle sure there?

Per held-out answer token (teacher-forced on the gold answer), the oracle's first and second
probabilities beside the codec's choice: a disagreement where the oracle's margin is small is a
near-tie any perturbation flips; one where it is large is the codec's own error.

    python scripts/answer_margins.py PRODUCER CONSUMER CODEBOOK heldout.jsonl [--limit 200] [--method scd]
"""

import argparse
import json
import statistics

import torch

from scd_serve.codec.codebook import Codebook
from scd_serve.model.runtime import ModelRuntime
from scd_serve.quality.harness import build_codec
from scd_serve.quality.transfer import ORACLE, teacher_forced, transfer


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
    rows = []
    for line in open(args.data).read().splitlines()[: args.limit]:
        rec = json.loads(line)
        ids = torch.tensor(cb.tokenizer(rec["prompt"])["input_ids"])
        gold = torch.tensor(cb.tokenizer(rec["answer"], add_special_tokens=False)["input_ids"])
        feed, room = torch.cat([ids[-1:], gold[:-1]]), gold.shape[0] + 2
        oracle = teacher_forced(cb, transfer(ORACLE, None, None, cb, ids[:-1], room), feed).float().softmax(-1)
        method = teacher_forced(cb, transfer(args.method, codec, pa, cb, ids[:-1], room), feed).float().softmax(-1)
        for i in range(gold.shape[0]):
            top = oracle[i].topk(2)
            rows.append({"position": i, "margin": float(top.values[0] - top.values[1]), "gold": int(gold[i]),
                         "oracle": int(top.indices[0]), "method": int(method[i].argmax())})
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
