#!/usr/bin/env python3
"""What replaying the prompt's last tokens on the consumer would buy (a measurement, not built in).

For each held-out record: the oracle (the consumer's own prefill), then each method with the
last R prompt tokens left out of the transfer and run by the consumer itself over the rebuilt
rest (target-side context replay); KL and top-1 against the oracle on the scored tokens only.
R = 0 is serving's handoff (the last prompt token alone). A replay costs about R / T of a prefill.
--head S: the consumer also runs the prompt's first S tokens itself (their K/V exact: causal, they
depend on nothing after them), about S / T of a prefill more.

    python scripts/replay_probe.py PAIR_DIR DATA.jsonl [--limit 16] [--codebook DIR]
                                   [--methods scd prior-only raw] [--replay 0 16 64] [--head 0 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from scd_serve import codec as registry
from scd_serve.model.runtime import ModelRuntime
from scd_serve.quality.data import read_records, tokenize
from scd_serve.quality.metrics import kl_and_tv
from scd_serve.quality.scorer import run_oracle
from scd_serve.quality.transfer import teacher_forced, transfer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pair", help="directory with producer/ and consumer/ (and codebook/)")
    p.add_argument("data", help="held-out JSONL records")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--codebook", default=None, help="default: PAIR/codebook")
    p.add_argument("--methods", nargs="+", default=["scd", "prior-only", "raw"])
    p.add_argument("--replay", type=int, nargs="+", default=[0, 16, 64], help="prompt tokens the consumer replays")
    p.add_argument("--head", type=int, nargs="+", default=[0], help="first prompt tokens the consumer runs itself")
    p.add_argument("--max-tokens", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(1)
    a, b = ModelRuntime.load(f"{args.pair}/producer"), ModelRuntime.load(f"{args.pair}/consumer")
    book = args.codebook or f"{args.pair}/codebook"
    items = tokenize(read_records(args.data)[: args.limit], b.tokenizer, args.max_tokens, args.data).items
    codecs = {m: registry.build(m, producer=a, consumer=b, codebook=book) for m in args.methods}
    totals: dict[tuple[str, int, int], list[float]] = {}  # (method, replay, head) -> sums
    started = time.time()
    with torch.no_grad():
        for item in items:
            oracle = run_oracle(b, item, 16, -1)
            t = item.ids.shape[0]
            for name, c in codecs.items():
                for r, head in ((r, s) for r in args.replay for s in args.head):
                    if r >= t - 2 or head >= t - 1 - r:
                        continue
                    cut = t - 1 - r
                    h = transfer(name, c, a, b, item.ids[:cut], len(oracle.scored) + r + 2)
                    for layer, state in b.iter_prefill(item.ids[:head], compute_logits=False) if head else ():
                        b.write_kv(h.pool, h.blocks, layer, state.keys, state.values)  # over the rebuilt ones
                    logits = teacher_forced(b, h, torch.cat([item.ids[cut:], oracle.scored[:-1]]))[r:]
                    kl, _ = kl_and_tv(logits, oracle.logits)
                    agree = (logits.argmax(-1) == oracle.logits.argmax(-1)).sum()
                    acc = totals.setdefault((name, r, head), [0.0, 0.0, 0, 0.0, 0])
                    acc[0] += float(kl.sum())
                    acc[1] += float(agree)
                    acc[2] += int(kl.numel())
                    acc[3] += r / t
                    acc[4] += 1  # the records long enough for this replay
    print(f"{len(items)} records of {args.data}, {time.time() - started:.0f} s")
    for (name, r, head), (kl, agree, n, share, records) in sorted(totals.items()):
        print(f"{name:<12} head {head:<3} replay {r:<4} KL {kl / n:.4f} top-1 {agree / n:.3f}  "
              f"replay/prompt {share / records:.3f} ({records} records)")


if __name__ == "__main__":
    main()
