"""The CPU's C++ kernels (model/cpu_kernel.py: decode and prefill attention, the elementwise ops)
equal the torch path they replace.

Built here once per machine with the test's compiler (~30 s the first time; later runs load the
build); skipped where the machine has no C++ compiler.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from scd_serve.errors import ConfigError
from scd_serve.model import cpu_kernel, layers, rope
from scd_serve.model.loader import cpu_flags
from scd_serve.model.paged import attend_gathered

from step_case import SHAPES, mixed_and_decode, random_pool, windowed_model


@pytest.fixture
def kernels(monkeypatch):
    """The kernels built and this process's steps on them for the test (off after: the suite's
    other tests run the torch path)."""
    monkeypatch.setenv(cpu_kernel.ENV, "auto")
    if reason := cpu_kernel.unavailable_reason():
        pytest.skip(f"CPU kernels cannot be built here: {reason}")
    cpu_kernel.use(True)
    yield
    cpu_kernel.use(False)


def lower_instruction_sets() -> list[str]:
    """-march targets below this CPU with vector paths of their own in csrc/: AVX2 with FMA
    (haswell) under AVX-512, and the plain loops (x86-64) under either, so that one machine
    tests what every CPU runs."""
    if platform.machine() != "x86_64":
        return []
    flags = cpu_flags()
    return (["haswell"] if "avx512f" in flags else []) + (["x86-64"] if {"avx2", "fma"} <= flags else [])


@pytest.fixture(params=["native", *lower_instruction_sets()])
def attention_ops(request, kernels):
    """The kernels built for this CPU, then for each instruction set below it (~1 min a build, once)."""
    return cpu_kernel.load() if request.param == "native" else cpu_kernel.load_for(request.param)


# step_case's shapes, and wider heads and blocks of 2
CPU_SHAPES = SHAPES + [(8, 8, 128, 16, None), (4, 1, 64, 2, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_attention_over_a_gathered_copy(attention_ops, dtype):
    for seed, (heads, kv_heads, hd, block, window) in enumerate(CPU_SHAPES):
        k, v, table, lengths, q = random_pool(seed, heads, kv_heads, hd, block, dtype)
        got = attention_ops.decode_attention(q, k, v, table, lengths, window or 0, hd**-0.5)
        assert got.shape == (5, heads * hd) and got.dtype == dtype
        want = attend_gathered(k.float(), v.float(), table, lengths, q.float(), window)
        # float32: the same sums in another order; bfloat16: the output rounded to 8 mantissa bits
        assert (got.float() - want).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2), (seed, window)


def test_the_kernel_refuses_tables_outside_the_pool(kernels):
    k, v, table, lengths, q = random_pool(0, 4, 2, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="block ids outside the pool"):
        cpu_kernel.attend_blocks(k, v, table + k.shape[0], lengths, q, None)
    with pytest.raises(RuntimeError, match="lengths must lie in"):
        cpu_kernel.attend_blocks(k, v, table, lengths + table.shape[1] * 16, q, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernel.attend_blocks(k, v, table, lengths, q.double(), None)


def prefill_reference(k, v, table, first, q, window):
    """Causal attention of q [T, heads, hd] at positions first.. over the table's keys, in float64."""
    tokens, heads, hd = q.shape
    keys = first + tokens
    kk = k[table].flatten(0, 1)[:keys].double().repeat_interleave(heads // k.shape[2], 1)  # [S, heads, hd]
    vv = v[table].flatten(0, 1)[:keys].double().repeat_interleave(heads // k.shape[2], 1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) / hd ** 0.5
    pos, key_pos = torch.arange(first, keys)[:, None], torch.arange(keys)[None]
    seen = (key_pos <= pos) & ((key_pos > pos - window) if window else True)
    return torch.einsum("hts,shd->thd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vv).reshape(tokens, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefill_kernel_equals_causal_attention_over_the_sequences_keys(attention_ops, dtype):
    """Chunks from the prompt's start and after a cached prefix, of 1 to 150 queries (one to four
    key tiles of 128, a last one cut short), over shuffled blocks, with and without a window."""
    cases = [(0, 150, None), (37, 50, None), (330, 33, None), (200, 70, 64), (0, 1, None), (300, 1, 9), (63, 66, 20)]
    for seed, ((heads, kv_heads, hd, block, _), (first, tokens, window)) in enumerate(zip(CPU_SHAPES, cases)):
        gen = torch.Generator().manual_seed(seed)
        blocks = -(-(first + tokens) // block)
        k = torch.randn(blocks + 4, block, kv_heads, hd, generator=gen).to(dtype)
        v = torch.randn(blocks + 4, block, kv_heads, hd, generator=gen).to(dtype)
        table = torch.randperm(blocks + 4, generator=gen)[:blocks]
        q = torch.randn(tokens, heads, hd, generator=gen).to(dtype)
        got = attention_ops.prefill_attention(q, k, v, table, first, window or 0, hd**-0.5)
        assert got.shape == (tokens, heads * hd) and got.dtype == dtype
        want = prefill_reference(k, v, table, first, q, window)
        assert (got.double() - want).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2), (seed, window)


def test_the_prefill_kernel_refuses_what_lies_outside_the_pool(kernels):
    k, v = torch.randn(4, 16, 2, 32), torch.randn(4, 16, 2, 32)
    q = torch.randn(20, 4, 32)
    with pytest.raises(RuntimeError, match="block ids outside the pool"):
        cpu_kernel.prefill(q, k, v, torch.tensor([1, 4]), 0, None)
    with pytest.raises(RuntimeError, match="must lie in the table's blocks"):
        cpu_kernel.prefill(q, k, v, torch.tensor([1, 2]), 13, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernel.prefill(q.bfloat16(), k, v, torch.tensor([1, 2]), 0, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_pass_prefill_through_the_kernel_equals_the_torch_path(kernels, tmp_path, dtype):
    """The prefill worker's whole-prompt pass (sliding-window layer too): the norms and SiLU through
    the kernels, and the attention where prefill_vectorized."""
    rt = windowed_model(tmp_path, dtype)
    ids = torch.arange(3, 90)
    rt.paged_kernel = False
    want = rt.prefill(ids)
    rt.paged_kernel = True
    got = rt.prefill(ids)
    tol = 1e-4 if dtype == torch.float32 else 0.1 * want.logits.abs().max().item()
    assert (got.logits - want.logits).abs().max() <= tol
    assert (got.keys - want.keys).abs().max() <= tol and (got.values - want.values).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_and_mixed_steps_through_the_kernel_equal_the_torch_path(kernels, tmp_path, dtype):
    """A model's steps (decode-only and a prefill chunk beside decode tokens, on scattered blocks,
    with a sliding-window layer) give the same logits with the kernel as without."""
    rt = windowed_model(tmp_path, dtype)
    (m0, d0), (m1, d1) = mixed_and_decode(rt, False), mixed_and_decode(rt, True)
    tol = 1e-4 if dtype == torch.float32 else 0.1 * m0.abs().max().item()
    assert m0.abs().max() > 0.1
    assert (m0 - m1).abs().max() <= tol and (d0 - d1).abs().max() <= tol
    assert torch.equal(d0.argmax(-1), d1.argmax(-1))


def test_steps_take_the_kernels_only_once_turned_on(kernels):
    assert cpu_kernel.ops(torch.device("cpu"), torch.bfloat16) is not None
    assert cpu_kernel.ops(torch.device("meta"), torch.bfloat16) is None
    assert cpu_kernel.ops(torch.device("cpu"), torch.float16) is None
    cpu_kernel.use(False)
    assert cpu_kernel.ops(torch.device("cpu"), torch.bfloat16) is None  # loaded, but not in use


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_elementwise_ops_round_as_the_torch_path(kernels, dtype):
    """bfloat16: RMSNorm and the rotary write bit for bit (they round where layers.py and rope.py
    round), SiLU's product within one unit in the last place (exp's last float bit); float32:
    the same within float32's rounding."""
    fused, gen = cpu_kernel.ops(torch.device("cpu"), dtype), torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 96, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    q, k, v = (torch.randn(8, h, 32, generator=gen).to(dtype) for h in (6, 2, 2))
    cos, sin = (torch.randn(8, 1, 32, generator=gen).to(dtype) for _ in range(2))
    slots = torch.tensor([3, 17, 40, 41, 63, 5, 6, 0])
    pool_k, pool_v = torch.zeros(4, 16, 2, 32, dtype=dtype), torch.zeros(4, 16, 2, 32, dtype=dtype)
    q_rot = fused.rope_write(q, k, v, cos, sin, pool_k, pool_v, slots)
    want_k, want_v = torch.zeros_like(pool_k), torch.zeros_like(pool_v)
    want_k.flatten(0, 1)[slots], want_v.flatten(0, 1)[slots] = rope.apply(k, cos, sin), v
    gate_up = 3 * torch.randn(8, 2 * 80, generator=gen).to(dtype)
    gate, up = gate_up.clone().chunk(2, dim=-1)
    silu = fused.silu_mul(gate_up)
    want_silu = F.silu(gate) * up
    if dtype == torch.bfloat16:
        assert torch.equal(fused.rms_norm(x, w, 1e-6), layers.rms_norm(x, w, 1e-6))
        assert torch.equal(q_rot, rope.apply(q, cos, sin)) and torch.equal(pool_k, want_k)
        ulp = want_silu.float().abs() * 2 ** -7  # bfloat16 keeps 8 significant bits
        assert ((silu.float() - want_silu.float()).abs() <= ulp).all()
    else:
        torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), layers.rms_norm(x, w, 1e-6))
        torch.testing.assert_close(q_rot, rope.apply(q, cos, sin))
        torch.testing.assert_close(pool_k, want_k)
        torch.testing.assert_close(silu, want_silu)
    assert torch.equal(pool_v, want_v)


def test_the_fused_ops_refuse_what_they_cannot_serve(kernels):
    fused = cpu_kernel.ops(torch.device("cpu"), torch.float32)
    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    pool = torch.zeros(2, 4, 2, 8)
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        fused.rope_write(q, k, k, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), pool, pool.clone(), torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="share q's dtype"):
        fused.rope_write(q, k.double(), k, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), pool, pool.clone(), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="weight must be"):
        fused.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6)
    with pytest.raises(RuntimeError, match="bfloat16 or float32 only"):
        fused.silu_mul(torch.zeros(2, 8, dtype=torch.float16))


def test_start_says_why_the_kernels_are_not_used(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("SCD_KERNEL_CACHE", str(tmp_path))  # no build made before here
    monkeypatch.setenv(cpu_kernel.ENV, "off")
    with caplog.at_level(logging.INFO, logger="scd_serve.model"):
        assert cpu_kernel.start() is False
    assert "CPU kernels: not used (SCD_CPU_KERNELS=off)" in caplog.text
    monkeypatch.setenv(cpu_kernel.ENV, "auto")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert cpu_kernel.unavailable_reason() == "no C++ compiler (install g++, or set CXX)"
    monkeypatch.setenv(cpu_kernel.ENV, "yes")
    with pytest.raises(ConfigError, match="SCD_CPU_KERNELS='yes': use auto"):
        cpu_kernel.start()


def test_the_build_is_named_for_this_cpu_and_these_sources(monkeypatch):
    name = cpu_kernel.build_name()
    assert name.startswith("scd_cpu_ops_") and name == cpu_kernel.build_name()
    monkeypatch.setattr(cpu_kernel, "_cpu_flags", lambda: "flags : sse2 avx2")
    assert cpu_kernel.build_name() != name


def test_a_build_made_before_loads_without_a_compiler_from_a_read_only_directory(kernels, tmp_path):
    """An image's build: its directory read-only (compose's read-only root), no compiler there."""
    cache = tmp_path / "cache"
    built = cache / cpu_kernel.build_name() / f"{cpu_kernel.build_name()}.so"
    built.parent.mkdir(parents=True)
    shutil.copy(cpu_kernel._built(), built)
    for path in (built, built.parent, cache):
        path.chmod(0o555)
    env = os.environ | {"SCD_KERNEL_CACHE": str(cache), "CXX": "no-such-compiler-here", cpu_kernel.ENV: "auto"}
    code = ("import torch; from scd_serve.model import cpu_kernel; assert cpu_kernel.unavailable_reason() is None; "
            "cpu_kernel.use(True); print(cpu_kernel.ops(torch.device('cpu'), torch.float32).rms_norm("
            "torch.ones(1, 4), torch.full((4,), 2.0), 0.0).tolist())")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    finally:
        for path in (cache, built.parent):
            path.chmod(0o755)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[[2.0, 2.0, 2.0, 2.0]]"
    # nothing written beside it (the read-only bits do not stop root: this does)
    assert [p.name for p in built.parent.iterdir()] == [built.name]


def test_build_kernels_builds_them_or_says_why_not(kernels, tmp_path):
    """`scd-serve build-kernels`: the build (made already by the fixture: here it is found), and
    where the kernels are off, exit 1 with the reason."""
    cli = [sys.executable, "-m", "scd_serve.cli", "build-kernels"]
    done = subprocess.run(cli, env=os.environ | {cpu_kernel.ENV: "auto"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "CPU kernels ready in" in done.stdout, done.stderr[-2000:]
    off = subprocess.run(cli, env=os.environ | {cpu_kernel.ENV: "off"}, capture_output=True, text=True, timeout=60)
    assert off.returncode == 1 and "CPU kernels unavailable: SCD_CPU_KERNELS=off" in off.stderr


def test_a_build_killed_before_never_blocks_the_next(tmp_path):
    """torch's build lock left by a killed build (a worker stopped in its first start) made every
    later build wait for ever; each build now runs in a directory of its own and renames its
    library into place, and a build that fails leaves nothing behind."""
    built = tmp_path / "scd_cpu_ops_x" / "scd_cpu_ops_x.so"
    built.parent.mkdir()
    (built.parent / "lock").touch()  # what the killed build left
    stale = built.parent / "build-killed"
    stale.mkdir()
    os.utime(stale, (0, 0))
    other = built.parent / "build-running"  # another process building now
    other.mkdir()

    def failing(work):
        (work / "half.o").write_bytes(b"")
        raise RuntimeError("compiler error")

    with pytest.raises(RuntimeError, match="compiler error"):
        cpu_kernel.build_and_publish(built, failing)
    assert not built.exists() and not stale.exists() and other.exists()
    assert sorted(p.name for p in built.parent.iterdir()) == ["build-running", "lock"]

    def building(work):
        (work / built.name).write_bytes(b"library")
        return "module"

    assert cpu_kernel.build_and_publish(built, building) == "module"
    assert built.read_bytes() == b"library"
    assert sorted(p.name for p in built.parent.iterdir()) == ["build-running", "lock", built.name]
