"""Tiny random HF models (and a byte-level tokenizer) for tests and demos across the project.

`save_tiny_model(dir, "qwen3")` writes config.json + model.safetensors (+ tokenizer files)
that transformers and ModelRuntime both load; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scd_serve.model.spec import SUPPORTED

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, head_dim=16,
    # larger than HF's 0.02 so greedy choices have clear margins (no near-ties in tests)
    initializer_range=0.2,
)


def tiny_config(family: str, **overrides: Any):
    import transformers

    arch = SUPPORTED[family]  # LlamaForCausalLM -> LlamaConfig
    cfg_cls = getattr(transformers, arch.removesuffix("ForCausalLM") + "Config")
    kwargs = dict(TINY) | overrides
    theta = kwargs.pop("rope_theta", None)
    cfg = cfg_cls(**kwargs)
    if theta is not None:
        cfg.rope_parameters = dict(cfg.rope_parameters, rope_theta=float(theta))
    cfg.architectures = [arch]
    return cfg


def save_tiny_model(path: str | Path, family: str = "llama", seed: int = 0, tokenizer: bool = True, **overrides: Any) -> Path:
    """Random weights from torch.manual_seed(seed), saved with save_pretrained (float32)."""
    import transformers

    path = Path(path)
    cfg = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, SUPPORTED[family])(cfg).eval()
    model.save_pretrained(str(path))
    if tokenizer:
        byte_tokenizer(cfg.vocab_size).save_pretrained(str(path))
    return path


def byte_tokenizer(vocab_size: int = 256):
    """Byte-level BPE without merges: every UTF-8 byte is one token (ids 0..255)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256:
        raise ValueError("a byte tokenizer needs vocab_size >= 256")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
