"""A PEFT LoRA adapter directory served as a model: merged into its base's weights at load.

Most fine-tunes users bring are adapters (adapter_config.json + adapter_model.safetensors over
a base model). `merged(adapter)` writes base + the adapter's deltas, W + (alpha / r) B A per
targeted linear layer, as a model directory of its own (the base's config and tokenizer, the
merged weights) under $SCD_CACHE_DIR, keyed by both; later loads read it back. Plain torch and
safetensors, no peft: a worker needs nothing the base model does not.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from scd_serve.errors import ModelLoadError
from scd_serve.model.checkpoint import cache_dir

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's name for the wrapped model


def is_adapter(path: str | Path) -> bool:
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def merged(adapter: str | Path, base: str | Path | None = None) -> Path:
    """The model directory of `adapter` merged into `base` (default: the adapter's
    base_model_name_or_path, which must then be a local model directory; a relative one is
    read from the adapter's directory)."""
    adapter = Path(adapter)
    cfg = _config(adapter)
    named = base or cfg.get("base_model_name_or_path") or ""
    base = Path(named) if Path(named).is_absolute() or (Path(named) / "config.json").is_file() else adapter / named
    if not named or not (base / "config.json").is_file():
        raise ModelLoadError(f"{adapter}: its base model {named or '(none named)'} is not a local model directory; "
                             f"set base_model_name_or_path in {ADAPTER_CONFIG} to the base's directory")
    weights = adapter / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise ModelLoadError(f"{adapter}: no {ADAPTER_WEIGHTS} (only safetensors adapters are read)")
    base_files = sorted(base.glob("*.safetensors"))
    key = hashlib.sha256(weights.read_bytes() + json.dumps(cfg, sort_keys=True).encode()
                         + "".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in base_files).encode())
    out = cache_dir() / "merged" / f"{adapter.name}-{key.hexdigest()[:16]}"
    if (out / "config.json").is_file():
        return out
    state = {}
    for f in base_files:
        state.update(load_file(str(f)))
    _apply(state, load_file(str(weights)), cfg, adapter)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():  # config, generation config, tokenizer: the base's
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy2(f, tmp / f.name)
    save_file(state, str(tmp / "model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _config(adapter: Path) -> dict:
    try:
        cfg = json.loads((adapter / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{adapter / ADAPTER_CONFIG}: unreadable ({exc})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{adapter}: a {cfg.get('peft_type')} adapter; only LoRA adapters are merged")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ModelLoadError(f"{adapter}: per-module ranks or alphas (rank_pattern, alpha_pattern) are not "
                             f"supported; merge it with peft (merge_and_unload) and pass the merged model")
    return cfg


def _apply(state: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], cfg: dict, adapter: Path) -> None:
    """state[W] += scale * B @ A for every module the adapter holds A and B of (in place)."""
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    modules = {name.removesuffix(".lora_A.weight") for name in lora if name.endswith(".lora_A.weight")}
    if not modules:
        raise ModelLoadError(f"{adapter}: no LoRA weights (lora_A/lora_B) in {ADAPTER_WEIGHTS}")
    for module in sorted(modules):
        a, b = lora[f"{module}.lora_A.weight"], lora.get(f"{module}.lora_B.weight")  # a: [r, in], b: [out, r]
        target = module.removeprefix(PREFIX) + ".weight"
        if b is None or target not in state:
            raise ModelLoadError(f"{adapter}: LoRA module {module} has no lora_B or no base weight {target}")
        delta = b.float() @ a.float() * scale  # [out, in]
        if cfg.get("fan_in_fan_out"):
            delta = delta.T
        w = state[target]
        if delta.shape != w.shape:
            raise ModelLoadError(f"{adapter}: {target} is {tuple(w.shape)} in the base, the adapter's delta "
                                 f"{tuple(delta.shape)}: made for another base model")
        state[target] = (w.float() + delta).to(w.dtype)
