#!/usr/bin/env python3
"""What weighing calibration's rows costs its first stage: `collect_rows` (both models' prefill of
each prompt, the sampled rows kept) with the rows' attention weights (calibration/attention.py)
and with every weight 1, alternated, one thread.

    python scripts/row_weight_cost.py PAIR_DIR [--prompts N] [--tokens T] [--rounds R]

PAIR_DIR holds producer/, consumer/ and calibration.jsonl of {"text"} records (e.g. the
random-weight pair of `scd-serve make-shaped-pair --out out/shaped`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from scd_serve.calibration import fit as fit_module
from scd_serve.model import ModelRuntime


def main(pair: Path, num_prompts: int, tokens: int, rounds: int) -> None:
    torch.set_num_threads(1)
    producer, consumer = ModelRuntime.load(pair / "producer"), ModelRuntime.load(pair / "consumer")
    texts = [json.loads(line)["text"] for line in (pair / "calibration.jsonl").read_text().splitlines() if line.strip()]
    prompts = [torch.tensor(consumer.tokenizer(t)["input_ids"][:tokens]) for t in texts[:num_prompts]]
    print(f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens")
    weighed = fit_module.received_attention
    alike = lambda consumer, layer, keys, attn_input, generator=None: torch.ones(keys.shape[0])  # noqa: E731
    for r in range(rounds):
        for name, weights in (("weighed", weighed), ("alike", alike)):
            fit_module.received_attention = weights
            start = time.perf_counter()
            with torch.no_grad():
                fit_module.collect_rows(producer, consumer, prompts, 8192)
            print(f"round {r}: rows {name:<8} {time.perf_counter() - start:.2f} s", flush=True)
    fit_module.received_attention = weighed


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", type=Path, help="directory with producer/, consumer/ and calibration.jsonl")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512, help="each prompt cut to this many tokens")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    main(a.pair, a.prompts, a.tokens, a.rounds)
