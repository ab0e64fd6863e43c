"""One layer's code fit (`calibration/fit.fit_layer`) at a model shape, on synthetic rows: its
time (three rounds) and the process's peak RSS, with each stream's code read from its own state
(`--inputs own`, as codebooks of one model and those before code_inputs) or from the layer's
attention input (`--inputs attn`, two models' now). Defaults: the Qwen2.5-0.5B shape and
calibrate's rows of the benchmark in docs/benchmarks.md (8 prompts of 512 tokens):

    OMP_NUM_THREADS=1 .venv/bin/python scripts/fit_layer_cost.py --inputs own
    OMP_NUM_THREADS=1 .venv/bin/python scripts/fit_layer_cost.py --inputs attn
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from scd_serve.calibration.fit import fit_layer
from scd_serve.codec.base import ATTN_INPUTS, OWN_INPUTS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", choices=("own", "attn"), required=True)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--kv-width", type=int, default=128)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x_a, x_b = torch.randn(args.rows, args.hidden, generator=g), torch.randn(args.rows, args.hidden, generator=g)
    k_a, k_b, v_a, v_b = (torch.randn(args.rows, args.kv_width, generator=g) for _ in range(4))
    inputs = ATTN_INPUTS if args.inputs == "attn" else OWN_INPUTS
    # A rows as collect_rows hands them over: streams of one input share one tensor
    a = {"k": k_a, "v": v_a, "h": x_a}
    rows = {"k": (a[inputs["k"]], k_b), "v": (a[inputs["v"]], v_b), "h": (x_a, x_b)}
    h_ranks = [args.hidden // 16, args.hidden // 8, args.hidden // 4, args.hidden // 2, args.hidden]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fit_layer(rows, args.kv_width, h_ranks, aligner_width=128, inputs=inputs)
        times.append(time.perf_counter() - start)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"inputs {args.inputs}: fit_layer {', '.join(f'{t:.2f}' for t in times)} s; peak RSS {rss_mb} MB")


if __name__ == "__main__":
    main()
