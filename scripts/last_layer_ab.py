#!/usr/bin/env python3
"""One prompt's `extend` asking for its last logits, the last layer run for that row alone (the
step's `kept` rows, model/step.py) against every row, alternated in one process.

    python scripts/last_layer_ab.py MODEL_DIR [--tokens 1024] [--dtype float32] [--threads 1] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scd_serve.model.runtime import ModelRuntime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rt = ModelRuntime.load(args.model, dtype=getattr(torch, args.dtype))
    ids = torch.randint(4, rt.spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    pool = rt.new_kv_pool(-(-args.tokens // 16) + 1, 16)
    blocks = list(range(pool.num_blocks))

    def run(kept: bool) -> torch.Tensor:
        step = rt.begin_extend(pool, [(blocks, 0, ids)], "last")
        if not kept:
            step.kept = None  # every row through the last layer, as before the change
        return step.logits()[0]

    print(f"last logits differ by at most {float((run(True) - run(False)).abs().max()):.2e}")
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for kept in (True, False) if r % 2 else (False, True):
            start = time.perf_counter()
            run(kept)
            times[kept].append(time.perf_counter() - start)
    new, old = statistics.median(times[True]), statistics.median(times[False])
    print(f"{args.tokens} tokens, {args.dtype}, {args.threads} thread(s), medians of {args.rounds}: the last row "
          f"alone {new:.3f} s, every row {old:.3f} s, ratio {new / old:.3f}")


if __name__ == "__main__":
    main()
