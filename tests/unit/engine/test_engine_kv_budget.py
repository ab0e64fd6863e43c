"""KV pool sizing (engine/kv_budget.py, and the decode worker's measurement of its memory)."""

from __future__ import annotations

import pytest

from scd_serve.engine.kv_budget import GIB, activation_reserve, bytes_per_token, size_pool
from scd_serve.errors import ConfigError

QWEN05_FP32 = bytes_per_token(24, 2, 64, 4)  # Qwen2.5-0.5B's shape


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert QWEN05_FP32 == 24 * 2 * 2 * 64 * 4 == 24576
    assert bytes_per_token(32, 8, 128, 2) == 131072  # Llama-3-8B in bfloat16: 128 KiB per token


def test_the_pool_takes_its_budget_and_the_model_context_when_it_fits():
    b = size_pool(token_bytes=QWEN05_FP32, block_size=16, budget_bytes=4 * GIB, model_context=32768, max_num_seqs=32,
                  budget_from="test")
    assert b.num_blocks == 4 * GIB // (QWEN05_FP32 * 16) and b.max_model_len == 32768
    assert "4.00 GiB" in b.note and "24576 bytes per token" in b.note


def test_never_more_than_max_num_seqs_full_sequences():
    b = size_pool(token_bytes=2048, block_size=16, budget_bytes=100 * GIB, model_context=4096, max_num_seqs=32)
    assert b.num_blocks == 32 * 4096 // 16 and "capped at 32 sequences" in b.note


def test_a_small_budget_lowers_max_model_len_and_says_so():
    b = size_pool(token_bytes=QWEN05_FP32, block_size=16, budget_bytes=100 * 2**20, model_context=32768, max_num_seqs=8)
    tokens = b.num_blocks * 16
    assert tokens < 32768 and b.max_model_len == tokens and "lowered from 32768" in b.note


def test_explicit_values_are_kept_or_refused_with_the_numbers():
    b = size_pool(token_bytes=1, block_size=16, budget_bytes=0, model_context=4096, max_num_seqs=8, num_blocks=300,
                  max_model_len=2048)
    assert (b.num_blocks, b.max_model_len) == (300, 2048)
    with pytest.raises(ConfigError, match=r"holds 1600 tokens .* less than --max-model-len 2048"):
        size_pool(token_bytes=1, block_size=16, budget_bytes=0, model_context=4096, max_num_seqs=8, num_blocks=100,
                  max_model_len=2048)
    with pytest.raises(ConfigError, match="exceeds the model's context of 4096"):
        size_pool(token_bytes=1, block_size=16, budget_bytes=GIB, model_context=4096, max_num_seqs=8,
                  max_model_len=8192)
    with pytest.raises(ConfigError, match="not one block"):
        size_pool(token_bytes=QWEN05_FP32, block_size=16, budget_bytes=1000, model_context=4096, max_num_seqs=8)


def test_activation_reserve_grows_with_the_vocabulary_and_the_prefill_chunk():
    small = activation_reserve(896, 4864, 151936, 512, 32, 2)
    assert small > 32 * 151936 * 4  # float32 logits for every sequence at least
    assert activation_reserve(896, 4864, 151936, 1024, 32, 2) > small


def test_the_decode_worker_sizes_its_pool_from_memory(tmp_path):
    from scd_serve.config.decode import DecodeConfig
    from scd_serve.decode.main import available_ram, kv_budget
    from scd_serve.model import ModelRuntime
    from scd_serve.model.tiny import save_tiny_model

    rt = ModelRuntime.load(save_tiny_model(tmp_path, "qwen2", tokenizer=False))
    per_token = bytes_per_token(rt.spec.num_layers, rt.spec.num_kv_heads, rt.spec.head_dim, 4)
    b = kv_budget(rt, DecodeConfig(gpu_memory_utilization=0.9, kv_cache_gib=1 / 1024))
    assert b.num_blocks == min(2**20 // (per_token * 16), 32 * -(-rt.spec.max_position_embeddings // 16))
    auto = kv_budget(rt, DecodeConfig(gpu_memory_utilization=0.9, kv_cache_gib=0))
    assert "quarter of the RAM" in auto.note and auto.num_blocks * 16 * per_token <= available_ram()
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):  # refused where the settings are made
        kv_budget(rt, DecodeConfig(gpu_memory_utilization=1.5, kv_cache_gib=0))


def test_available_ram_obeys_the_containers_memory_limit(tmp_path, monkeypatch):
    """In a container /proc/meminfo is the host's: the cgroup limit minus usage bounds the pool."""
    import scd_serve.decode.main as decode_main

    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(f"{4 * GIB}\n")
    usage.write_text(f"{3 * GIB}\n")
    monkeypatch.setattr(decode_main, "CGROUP_MEMORY", ((str(limit), str(usage)),))
    assert decode_main.available_ram() == GIB
    usage.write_text(f"{1 << 50}\n")  # were it read as a limit, nothing would be left
    limit.write_text("max\n")  # no limit: the host's figure stands
    assert decode_main.available_ram() > 0
    monkeypatch.setattr(decode_main, "CGROUP_MEMORY", ((str(tmp_path / "none"), str(usage)),))
    assert decode_main.available_ram() > 0  # no cgroup files at all
