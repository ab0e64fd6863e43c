"""Time the engine's sampler on one step's logits (a command printing figures, not a test).

Random logits (scale 3) are flatter than a model's, so top_p sorts every row: its worst case.
"""

from __future__ import annotations

import argparse

import torch

from scd_serve.bench.stats import median_s
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.engine.sampler import sample
from scd_serve.engine.sequence import Sequence

CASES = {
    "temperature 0.8": dict(temperature=0.8),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "top_k 50 + penalties": dict(temperature=0.8, top_k=50, repetition_penalty=1.1, presence_penalty=0.5),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    print(f"vocab {args.vocab}, batch {args.batch}, threads {torch.get_num_threads()}")
    for name, params in CASES.items():
        seqs = [Sequence(GenerationRequest(str(i), list(range(i, args.prompt_tokens + i)), SamplingParams(seed=i, **params)))
                for i in range(args.batch)]
        for s in seqs:
            for t in range(args.output_tokens):
                s.append_token(t)
        seconds = median_s(lambda _: sample(logits, seqs), args.repeats)
        print(f"{name:>22}: {seconds * 1e3:8.1f} ms per step (median of {args.repeats})")


if __name__ == "__main__":
    main()
