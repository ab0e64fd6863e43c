"""A decode step's pieces between its linears, eager against torch.compile(dynamic=True), at the
Qwen2.5-0.5B shape (8 sequences of 300 keys, bfloat16, random tensors; issue 43: whether compiling
them would close the gap to vLLM, whose CPU build compiles its model with inductor):

    .venv/bin/python scripts/decode_pieces.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from scd_serve.model import rope
from scd_serve.model.layers import rms_norm
from scd_serve.model.paged import attend_gathered

SEQS, KEYS, BLOCK, KV_HEADS, HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE = 8, 300, 16, 2, 64, 14, 896, 4864


def norm_add(o, h, w):  # the residual sum and the next norm
    h2 = o + h
    return h2, rms_norm(h2, w, 1e-6)


def kv_rope_write(kv, cos, sin, k_layer, v_layer, slots):  # kv: [B, 2 * kv_heads * hd]
    k, v = kv.split(KV_HEADS * HEAD_DIM, dim=-1)
    k_layer.flatten(0, 1)[slots] = rope.apply(k.unflatten(-1, (KV_HEADS, HEAD_DIM)), cos, sin)
    v_layer.flatten(0, 1)[slots] = v.unflatten(-1, (KV_HEADS, HEAD_DIM))


def q_attend(q, cos, sin, k_layer, v_layer, tables, lengths):  # q: [B, heads, hd]
    return attend_gathered(k_layer, v_layer, tables, lengths, rope.apply(q, cos, sin), None)


def silu_mul(gate_up):  # [B, 2 * intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def median_us(fn, args, calls: int = 300) -> float:
    with torch.no_grad():
        for _ in range(5):
            fn(*args)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(p.parse_args().threads)
    bf, width = torch.bfloat16, -(-KEYS // BLOCK)
    blocks = SEQS * width + 4
    k_layer, v_layer = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(bf) for _ in range(2))
    tables, lengths = torch.arange(SEQS * width).view(SEQS, width), torch.full((SEQS,), KEYS)
    cos, sin = (torch.randn(SEQS, 1, HEAD_DIM).to(bf) for _ in range(2))
    cases = {
        "norm_add": (norm_add, (torch.randn(SEQS, HIDDEN).to(bf), torch.randn(SEQS, HIDDEN).to(bf),
                                torch.randn(HIDDEN).to(bf))),
        "kv_rope_write": (kv_rope_write, (torch.randn(SEQS, 2 * KV_HEADS * HEAD_DIM).to(bf), cos, sin, k_layer,
                                          v_layer, torch.arange(SEQS) * 37)),
        "q_attend": (q_attend, (torch.randn(SEQS, HEADS, HEAD_DIM).to(bf), cos, sin, k_layer, v_layer, tables,
                                lengths)),
        "silu_mul": (silu_mul, (torch.randn(SEQS, 2 * INTERMEDIATE).to(bf),)),
    }
    eager_total = compiled_total = 0.0
    for name, (fn, args) in cases.items():
        start = time.time()
        compiled = torch.compile(fn, dynamic=True)
        with torch.no_grad():
            compiled(*args)
        compile_s = time.time() - start
        eager, fast = [], []
        for _ in range(2):  # alternated, twice each
            eager.append(median_us(fn, args))
            fast.append(median_us(compiled, args))
        eager_total, compiled_total = eager_total + min(eager), compiled_total + min(fast)
        print(f"{name:14} eager {eager[0]:7.1f} / {eager[1]:7.1f} us, compiled {fast[0]:7.1f} / {fast[1]:7.1f} us "
              f"(compiled in {compile_s:.1f} s)", flush=True)
    print(f"a layer: eager {eager_total:.0f} us, compiled {compiled_total:.0f} us; 24 layers: "
          f"{24 * (eager_total - compiled_total) / 1e3:+.1f} ms a step saved by compiling")


if __name__ == "__main__":
    main()
