"""How many KV pool blocks a worker allocates, and the longest sequence it accepts.

Plain Python: the caller measures memory (decode/main.py) and passes bytes. The pool gets
what it is given, but never more than max_num_seqs sequences of max_model_len need.
max_model_len defaults to the model's context, lowered to what the pool holds; an explicit
one that does not fit is refused with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from scd_serve.errors import ConfigError

GIB = 2**30
RAW_DTYPE_BYTES = 2  # what a raw K/V transfer ships per number (16-bit): the unit of "payload / raw"


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    max_model_len: int
    note: str  # one line for the start-up log: where the size came from


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes  # K and V of every layer


def activation_reserve(hidden: int, intermediate: int, vocab: int, prefill_tokens: int, num_seqs: int,
                       dtype_bytes: int) -> int:
    """Working memory a step needs besides weights and pool: a prefill chunk's widest
    activations (the MLP's gate and up) and float32 logits with sampling copies per sequence."""
    chunk = prefill_tokens * (2 * intermediate + 4 * hidden) * dtype_bytes
    return chunk + num_seqs * vocab * 4 * 4


def size_pool(*, token_bytes: int, block_size: int, budget_bytes: int, model_context: int, max_num_seqs: int,
              num_blocks: int = 0, max_model_len: int = 0, budget_from: str = "") -> KVBudget:
    """num_blocks / max_model_len: explicit values (0 = size them here)."""
    if token_bytes < 1 or block_size < 1 or model_context < 1 or max_num_seqs < 1:
        raise ConfigError("KV sizing needs positive token bytes, block size, model context and max_num_seqs")
    if max_model_len > model_context:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's context of {model_context} "
                          f"positions (max_position_embeddings)", field="max_model_len")
    want_len = max_model_len or model_context
    if num_blocks:
        note = f"--num-blocks {num_blocks}"
    else:
        fits = budget_bytes // (token_bytes * block_size)
        needed = max_num_seqs * -(-want_len // block_size)  # more could never be used at once
        num_blocks = min(fits, needed)
        note = (f"{budget_from}: {budget_bytes / GIB:.2f} GiB at {token_bytes} bytes per token"
                + (f", capped at {max_num_seqs} sequences of {want_len} tokens" if needed < fits else ""))
    pool_tokens = num_blocks * block_size
    if max_model_len and pool_tokens < max_model_len:
        raise ConfigError(
            f"the KV pool holds {pool_tokens} tokens ({note}), less than --max-model-len {max_model_len}: "
            f"give the pool more memory (--kv-cache-gib, --gpu-memory-utilization, --num-blocks) or lower "
            f"--max-model-len", field="max_model_len")
    if pool_tokens < min(want_len, block_size):
        raise ConfigError(f"the KV pool holds {pool_tokens} tokens ({note}): not one block; give it more memory "
                          f"(--kv-cache-gib, --gpu-memory-utilization or --num-blocks)", field="num_blocks")
    length = min(want_len, pool_tokens)
    if length < want_len:
        note += f"; max_model_len lowered from {want_len} to {length} to fit the pool"
    return KVBudget(num_blocks=num_blocks, max_model_len=length, note=f"KV pool {pool_tokens} tokens ({note})")
