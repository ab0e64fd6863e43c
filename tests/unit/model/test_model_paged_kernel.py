"""The CUDA decode-attention kernel (model/paged_kernel.py) equals the torch path.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), in a child process:
the variable decides how Triton compiles at import, and with it set every Step in the test
process would take the interpreted kernel. With a GPU, the last test runs it compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from scd_serve.model import paged_kernel

from step_case import SHAPES

pytestmark = pytest.mark.skipif(paged_kernel.triton is None, reason="Triton is not installed")

# Shared by the child and the CUDA test: random pools (step_case.py), one query each.
SETUP = """
import torch
from scd_serve.model.paged import attend_gathered
from scd_serve.model.paged_kernel import attend_blocks
from step_case import random_pool

def case(seed, heads, kv_heads, hd, block, window, dtype, device="cpu", splits=None):
    args = [x.to(device) for x in random_pool(seed, heads, kv_heads, hd, block, dtype)]
    got = attend_blocks(*args, window, splits).float().cpu()
    want = attend_gathered(*[x.cpu().float() if x.is_floating_point() else x.cpu() for x in args], window)
    return (got - want).abs().max().item()
"""


def interpreted(code: str) -> str:
    # step_case.py beside this file importable in the child, as pytest makes it here
    here = str(Path(__file__).parent)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_kernel_equals_attention_over_a_gathered_copy_in_the_interpreter():
    """Every split of the blocks (flash-decoding), 64 more than any table has."""
    out = interpreted(SETUP + textwrap.dedent(f"""
        for seed, shape in enumerate({SHAPES!r}):
            for splits in (1, 2, 5, 64):  # one program per sequence and kv head, or its blocks split
                print(case(seed, *shape, torch.float32, splits=splits), case(seed, *shape, torch.bfloat16, splits=splits))
        """))
    errors = [tuple(map(float, line.split())) for line in out.splitlines()]
    assert len(errors) == 4 * len(SHAPES)
    for fp32, bf16 in errors:
        # float32: the same sums in another order; bfloat16: the output rounded to 8 mantissa bits
        assert fp32 <= 1e-5 and bf16 <= 2e-2, errors


def test_decode_and_mixed_steps_through_the_kernel_equal_the_torch_path(tmp_path):
    """A model's steps (decode-only and a prefill chunk beside decode tokens, on scattered
    blocks, with a sliding-window layer) give the same logits with the kernel as without."""
    out = interpreted(f"""
        from step_case import mixed_and_decode, windowed_model

        rt = windowed_model({str(tmp_path)!r})
        (m0, d0), (m1, d1) = mixed_and_decode(rt, False), mixed_and_decode(rt, True)
        print((m0 - m1).abs().max().item(), (d0 - d1).abs().max().item(), m0.abs().max().item())
        """)
    mixed, decode, scale = map(float, out.split())
    assert scale > 0.1 and mixed <= 1e-4 and decode <= 1e-4, out


def test_the_kernel_serves_only_cuda_and_blocks_it_can_tile(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not paged_kernel.usable(torch.device("cpu"), 16)
    assert paged_kernel.usable(torch.device("cuda"), 16) and paged_kernel.usable(torch.device("cuda"), 64)
    assert not paged_kernel.usable(torch.device("cuda"), 8)  # tl.dot needs 16 on every side
    assert not paged_kernel.usable(torch.device("cuda"), 24)  # not a power of two


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_kernel_equals_the_torch_path_on_cuda(dtype):
    scope: dict = {}
    exec(SETUP, scope)
    for seed, shape in enumerate(SHAPES):
        for splits in (None, 1, 3):  # None: enough to fill the device's SMs
            err = scope["case"](seed, *shape, dtype, device="cuda", splits=splits)
            assert err <= (1e-5 if dtype == torch.float32 else 2e-2), (shape, splits, err)
