#!/usr/bin/env python3
"""What one forward of a model costs at 1, 16, 64 and 256 tokens (every layer's K/V, no logits;
medians of 30, one thread): at small shapes its fixed cost, which a head or a replayed tail pays
once more on top of a rebuild.

    python scripts/forward_cost.py MODEL_DIR
"""

from __future__ import annotations

import argparse

import torch

from scd_serve.bench.stats import median_s
from scd_serve.model import ModelRuntime


def main(model: str) -> None:
    torch.set_num_threads(1)
    runtime = ModelRuntime.load(model)
    for num_tokens in (1, 16, 64, 256):
        ids = torch.randint(4, runtime.spec.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))

        def forward() -> None:
            with torch.no_grad():
                for _ in runtime.iter_prefill(ids, compute_logits=False):
                    pass

        print(f"{num_tokens} tokens: {median_s(lambda _: forward(), 30) * 1e3:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model directory")
    main(parser.parse_args().model)
