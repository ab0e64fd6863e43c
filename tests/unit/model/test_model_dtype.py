"""`--dtype auto` on the CPU follows the CPU: bfloat16 where it multiplies bf16 natively (AMX-BF16
or AVX512-BF16, torch allowed AVX-512), float32 elsewhere; a named dtype is taken as given."""

import pytest
import torch

from scd_serve.model import loader


@pytest.fixture
def cpu(tmp_path, monkeypatch):
    def make(flags: str, capability: str = "AVX512"):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx2 {flags}\n")
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(loader, "cpu_has_native_bf16",
                            lambda path=str(info), real=loader.cpu_has_native_bf16: real(path))
        return info
    return make


@pytest.mark.parametrize("flags, capability, want", [
    ("avx512f amx_bf16 amx_tile", "AVX512", torch.bfloat16),
    ("avx512f avx512_bf16", "AVX512", torch.bfloat16),
    ("avx512f", "AVX512", torch.float32),  # AVX-512 without bf16: emulated
    ("", "AVX2", torch.float32),
    ("avx512f amx_bf16", "AVX2", torch.float32),  # ATEN_CPU_CAPABILITY=avx2: torch will not use it
])
def test_auto_on_the_cpu_follows_its_bf16_support(cpu, flags, capability, want):
    cpu(flags, capability)
    assert loader.resolve_dtype("auto", "cpu") is want
    assert loader.resolve_dtype("float32", "cpu") is torch.float32  # named: as given
    assert loader.resolve_dtype("bfloat16", "cpu") is torch.bfloat16


def test_no_cpuinfo_is_float32(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert loader.cpu_has_native_bf16(str(tmp_path / "missing")) is False
