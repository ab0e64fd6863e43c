"""From a local HF directory (or, when no such path exists, a hub id) to spec, weights,
rotary tables, fingerprint and tokenizer. Every failure is a ModelLoadError naming the problem."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scd_serve.errors import ModelLoadError
from scd_serve.model import adapter
from scd_serve.model.rope import Rotary, inv_freq_and_scaling
from scd_serve.config.model import DTYPE_NAMES
from scd_serve.model.spec import ModelSpec, spec_from_config
from scd_serve.model.weights import ModelWeights, group, read_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # name -> torch dtype


@dataclass
class Loaded:
    path: Path
    spec: ModelSpec
    weights: ModelWeights | None  # None: loaded without them (shapes, rotary and fingerprint only)
    rotary: Rotary
    fingerprint: str
    tokenizer: Any | None
    config: dict[str, Any]


def resolve(path: str | Path) -> Path:
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise ModelLoadError(f"{p}: is a file, expected a model directory (config.json + *.safetensors)")
        return p
    text = str(path)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):  # looks like "org/name"
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
        except Exception as exc:  # offline, unknown repo, ...
            raise ModelLoadError(f"{text}: no such directory, and fetching it as a hub id failed ({type(exc).__name__})") from None
    raise ModelLoadError(f"{p}: no such model directory")


def read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no config.json, not a Hugging Face model directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path / 'config.json'}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path / 'config.json'}: expected a JSON object")
    return cfg


def load_tokenizer(path: Path) -> Any | None:
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: tokenizer files present but unreadable ({exc})") from None


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A --dtype name or a torch dtype. "auto": bfloat16 on CUDA (float16 without it), float32 on
    the CPU. (bfloat16 is 2.75x faster to prefill on a CPU that multiplies it natively, but a
    codebook calibrated in float32 then rebuilds 10x worse: docs/benchmarks.md, "Which dtype".)"""
    if not isinstance(dtype, str):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda" and torch.cuda.is_available():
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX-BF16 or AVX512-BF16) and torch may use
    it (ATEN_CPU_CAPABILITY not lowered below AVX-512). There bfloat16 prefills ~3x faster than
    float32 (0.5B shape, 1,024 tokens, docs/benchmarks.md) and its weights are worth packing
    (ModelRuntime.pack_linears); without it bfloat16 is emulated, slower."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags(cpuinfo))


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo's first `flags` line); empty where there is none
    (not Linux, no /proc: the safe answer)."""
    try:
        with open(cpuinfo) as f:
            return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return set()


def check_device(device: str | torch.device, dtype: torch.dtype) -> torch.device:
    if dtype not in DTYPES.values():
        raise ModelLoadError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"bad device {device!r} ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {device!r} is not supported; use cpu or cuda[:N]")
    return dev


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
         weights: bool = True) -> Loaded:
    dev = check_device(device, dtype)
    root = resolve(path)
    if adapter.is_adapter(root):  # a LoRA adapter: served as its base with the adapter merged in
        root = adapter.merged(root)
    cfg = read_config(root)
    spec = spec_from_config(cfg, where=str(root / "config.json"))
    found, digest = read_tensors(root, spec)  # memory-mapped: checked and hashed, not yet read in
    grouped = group(found, spec, dev, dtype) if weights else None
    del found
    inv_freq, scaling = inv_freq_and_scaling(spec, cfg)
    rotary = Rotary(inv_freq, scaling, dev, dtype)
    fingerprint = f"{spec.family}-{digest[:16]}"
    return Loaded(root, spec, grouped, rotary, fingerprint, load_tokenizer(root), cfg)
