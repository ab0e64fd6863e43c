"""HF directory -> ModelRuntime: layer-wise prefill, KV pool, inject, recompute, batched decode."""

from scd_serve.model.kv_pool import KVPool
from scd_serve.model.runtime import LayerState, ModelRuntime, PrefillIterator, PrefillOutput
from scd_serve.model.spec import SUPPORTED, ModelSpec

__all__ = ["KVPool", "LayerState", "ModelRuntime", "ModelSpec", "PrefillIterator", "PrefillOutput", "SUPPORTED"]
