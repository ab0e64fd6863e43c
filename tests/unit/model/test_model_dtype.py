"""`--dtype auto` is float32 on the CPU (bfloat16 there rebuilds SCD caches from a float32-calibrated
codebook 10x worse in KL, docs/benchmarks.md), and whether the CPU multiplies bfloat16 natively
(AMX-BF16 or AVX512-BF16, torch allowed AVX-512) is read right: that decides weight packing."""

import pytest
import torch

from scd_serve.model import loader


@pytest.mark.parametrize("flags, capability, native", [
    ("avx512f amx_bf16 amx_tile", "AVX512", True),
    ("avx512f avx512_bf16", "AVX512", True),
    ("avx512f", "AVX512", False),  # AVX-512 without bf16: emulated
    ("", "AVX2", False),
    ("avx512f amx_bf16", "AVX2", False),  # ATEN_CPU_CAPABILITY=avx2: torch will not use it
])
def test_native_bf16_is_read_from_the_cpu_and_torchs_capability(tmp_path, monkeypatch, flags, capability, native):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert loader.cpu_has_native_bf16(str(info)) is native
    assert loader.resolve_dtype("auto", "cpu") is torch.float32  # whatever the CPU
    assert loader.resolve_dtype("bfloat16", "cpu") is torch.bfloat16  # named: as given


def test_no_cpuinfo_is_no_native_bf16(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert loader.cpu_has_native_bf16(str(tmp_path / "missing")) is False
