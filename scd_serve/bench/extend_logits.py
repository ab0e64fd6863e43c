"""What the output head costs a prefill chunk: `extend` with every position's logits against none.

The engine asks a chunk for logits only for prompt log-probabilities; at a 150k vocabulary
the head is several layers' work. Medians of each, alternated to share the noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    from scd_serve.model import ModelRuntime

    torch.set_num_threads(args.threads)
    rt = ModelRuntime.load(args.model)
    ids = torch.randint(0, rt.spec.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    block = 16
    num_blocks = -(-args.tokens // block)
    pool, blocks = rt.new_kv_pool(num_blocks, block), list(range(num_blocks))
    seconds: dict[str, list[float]] = {"all": [], "none": []}
    for _ in range(args.repeats):
        for want in seconds:
            start = time.perf_counter()
            rt.extend(pool, [(blocks, 0, ids)], logits=want)
            seconds[want].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    # 4 significant digits, not 3 decimals: a tiny model's pass takes well under a millisecond
    out = {"tokens": args.tokens, "all_s": float(f"{med['all']:.4g}"), "none_s": float(f"{med['none']:.4g}"),
           "ratio": round(med["all"] / med["none"], 2)}
    print(out)
    return out


if __name__ == "__main__":
    main()
