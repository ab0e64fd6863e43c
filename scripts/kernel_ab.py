"""The prefill attention kernel of a git revision against the working tree's, built side by side
and alternated in one process, medians (issue 43; a kernel change measured apart from the
machine's drift between runs). The 0.5B shape's heads (14 over 2, head_dim 64), random inputs:

    .venv/bin/python scripts/kernel_ab.py ba6c6fa --threads 2 --tokens 1024 4096
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from scd_serve.model import cpu_kernel

CSRC = Path("scd_serve/model/csrc")


def build(name: str, files: dict[str, str], where: Path):
    """The kernels from `files` (name -> source text) as module `name`."""
    where.mkdir(parents=True)
    for file, text in files.items():
        (where / file).write_text(text)
    return cpu_kernel.compile_sources(name, where, where)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("revision", help="a git revision whose scd_serve/model/csrc is the baseline")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = [s.name for s in cpu_kernel.SOURCES] + [h.name for h in cpu_kernel.HEADERS]
    trees = {args.revision: {n: subprocess.run(["git", "show", f"{args.revision}:{CSRC / n}"], check=True,
                                               capture_output=True, text=True).stdout for n in names},
             "working tree": {n: (CSRC / n).read_text() for n in names}}
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {label: build(f"kernel_ab_{i}", files, Path(tmp) / str(i))
                   for i, (label, files) in enumerate(trees.items())}
        heads, kv_heads, hd = 14, 2, 64
        for tokens in args.tokens:
            for dtype in (torch.bfloat16, torch.float32):
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(tokens, n, hd, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads))
                times: dict[str, list[float]] = {label: [] for label in kernels}
                for _ in range(args.rounds):
                    for label, module in kernels.items():
                        start = time.perf_counter()
                        module.prefill_attention(q, k[None], v[None], torch.zeros(1, dtype=torch.long), 0, 0,
                                                 hd**-0.5)
                        times[label].append(time.perf_counter() - start)
                med = {label: statistics.median(t) for label, t in times.items()}
                old, new = med.values()
                each = ", ".join(f"{label} {m * 1e3:.1f} ms a layer" for label, m in med.items())
                case = f"{tokens} tokens, {str(dtype).removeprefix('torch.')}"
                print(f"{case}: {each}; ratio {new / old:.3f}", flush=True)


if __name__ == "__main__":
    main()
