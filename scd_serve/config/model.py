"""Model settings: which local model directory, on which device, in which dtype."""

from __future__ import annotations

import re
from dataclasses import dataclass

from scd_serve.errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the one dtype table: every --dtype and config reads it
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)  # auto: bfloat16 on CUDA (float16 without it), float32 on the CPU
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelConfig:
    path: str  # local Hugging Face directory: config.json + *.safetensors (+ tokenizer files)
    device: str = "cpu"  # "cpu" (default; nothing assumes a GPU) or "cuda" / "cuda:N"
    dtype: str = "float32"  # compute and KV-pool dtype

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError("model path must be a non-empty string", field="path")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise ConfigError(f"device must be cpu, cuda or cuda:N, got {self.device!r}", field="device")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}", field="dtype")

    @property
    def torch_dtype(self):
        import torch  # kept local: config modules are imported by torch-free bookkeeping code

        return getattr(torch, self.dtype)
