"""Distillation's step time, one backward over the step's summed loss (how distill.py did it before
2026-12-06) against one backward per example (how it does it now: one graph alive at a time),
alternated in one process on one codebook's scd plan and the same random-token examples:

    .venv/bin/python scripts/distill_step.py --pair out/shaped --codebook CODEBOOK --examples 6 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

import torch

from scd_serve import codec as registry
from scd_serve.bench.stats import alternated
from scd_serve.calibration import distill
from scd_serve.codec.codebook import Codebook
from scd_serve.model.runtime import ModelRuntime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", required=True, help="a directory with producer/ and consumer/")
    p.add_argument("--codebook", required=True)
    p.add_argument("--examples", type=int, default=6, help="examples in a step (random prompts)")
    p.add_argument("--tokens", type=int, default=400, help="tokens in each example's prompt")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    producer = ModelRuntime.load(f"{args.pair}/producer", device="cpu", dtype=torch.float32)
    consumer = ModelRuntime.load(f"{args.pair}/consumer", device="cpu", dtype=torch.float32)
    book = Codebook.load(args.codebook, producer=producer, consumer=consumer)
    codec = registry.build("scd", producer=producer, consumer=consumer, codebook=book)
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(3, consumer.spec.vocab_size, (args.tokens,), generator=gen), torch.zeros(0, dtype=torch.long))
             for _ in range(args.examples)]
    examples = distill.make_examples(codec, producer, consumer, pairs, 1)
    decoders = distill.Decoders(codec, consumer.device)
    opt = torch.optim.Adam(decoders.parameters(), lr=1e-5)

    def summed() -> None:
        opt.zero_grad()
        (sum(decoders.loss(consumer, ex) for ex in examples) / len(examples)).backward()
        opt.step()

    def each() -> None:
        opt.zero_grad()
        for ex in examples:
            (decoders.loss(consumer, ex) / len(examples)).backward()
        opt.step()

    with torch.enable_grad():
        summed()  # warm
        each()
        times = alternated({"summed": summed, "one at a time": each}, rounds=args.rounds, calls=1)
    for name, ts in times.items():
        print(f"{name}: a step of {len(examples)} examples, median {statistics.median(ts):.3f} s "
              f"(min {min(ts):.3f}, max {max(ts):.3f})")


if __name__ == "__main__":
    main()
