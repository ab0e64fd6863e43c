"""HF directory -> ModelRuntime: layer-wise prefill, KV pool, inject, recompute, batched decode."""

from scd_serve.model.runtime import ModelRuntime

__all__ = ["ModelRuntime"]
