"""An attention kernel of a git revision against the working tree's, built side by side and
alternated in one process, medians (issue 43; a kernel change measured apart from the machine's
drift between runs). The 0.5B shape's heads (14 over 2, head_dim 64), random inputs: the
prefill's (one prompt of --tokens) or the decode step's (--batch sequences of --tokens keys each,
their blocks scattered over the pool):

    .venv/bin/python scripts/kernel_ab.py ba6c6fa --threads 2 --tokens 1024 4096
    .venv/bin/python scripts/kernel_ab.py ecc62d3 --kernel decode --threads 2 --tokens 310 1000
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
    p.add_argument("--kernel", choices=("prefill", "decode"), default="prefill")
    p.add_argument("--batch", type=int, default=8, help="decode: sequences a step")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = [s.name for s in cpu_kernel.SOURCES] + [h.name for h in cpu_kernel.HEADERS]
    trees = {args.revision: revision_files(args.revision, names),
             "working tree": {n: (CSRC / n).read_text() for n in names}}
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {label: build(f"kernel_ab_{i}", files, Path(tmp) / str(i))
                   for i, (label, files) in enumerate(trees.items())}
        for tokens in args.tokens:
            for dtype in (getattr(torch, d) for d in args.dtypes):
                call, calls = (prefill_call if args.kernel == "prefill" else decode_call)(tokens, dtype, args.batch)
                times: dict[str, list[float]] = {label: [] for label in kernels}
                for _ in range(args.rounds):
                    for label, module in kernels.items():
                        start = time.perf_counter()
                        for _ in range(calls):
                            call(module)
                        times[label].append((time.perf_counter() - start) / calls)
                med = {label: statistics.median(t) for label, t in times.items()}
                old, new = med.values()
                each = ", ".join(f"{label} {m * 1e3:.3f} ms a layer" for label, m in med.items())
                case = f"{args.kernel}, {tokens} tokens, {str(dtype).removeprefix('torch.')}"
                print(f"{case}: {each}; ratio {new / old:.3f}", flush=True)


HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64


def revision_files(revision: str, names: list[str]) -> dict[str, str]:
    """The kernel sources at `revision` (a header it did not have yet is left out)."""
    files = {}
    for name in names:
        shown = subprocess.run(["git", "show", f"{revision}:{CSRC / name}"], capture_output=True, text=True)
        if shown.returncode == 0:
            files[name] = shown.stdout
    return files


def prefill_call(tokens: int, dtype: torch.dtype, _batch: int):
    """-> (a call of the prefill kernel of one prompt of `tokens`, calls a timed sample)"""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, n, HEAD_DIM, generator=g).to(dtype) for n in (HEADS, KV_HEADS, KV_HEADS))
    table = torch.zeros(1, dtype=torch.long)
    return (lambda module: module.prefill_attention(q, k[None], v[None], table, 0, 0, HEAD_DIM**-0.5)), 1


def decode_call(keys: int, dtype: torch.dtype, batch: int, block: int = 16):
    """-> (a call of the decode kernel for `batch` sequences of `keys` each, calls a timed sample)"""
    g = torch.Generator().manual_seed(0)
    width = -(-keys // block)
    k, v = (torch.randn(batch * width, block, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(batch * width, generator=g).view(batch, width)
    lengths = torch.full((batch,), keys)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    # a call takes ~0.1-1 ms: each timed sample is the mean of 50
    return (lambda module: module.decode_attention(q, k, v, tables, lengths, 0, HEAD_DIM**-0.5)), 50


if __name__ == "__main__":
    main()
