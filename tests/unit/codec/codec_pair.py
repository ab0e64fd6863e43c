"""A tiny producer/consumer pair for codec tests: the consumer is a perturbed copy of the
producer with another rope_theta (a stand-in for a fine-tune), both saved as HF directories."""

from __future__ import annotations

from pathlib import Path

import torch

from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model


def make_pair(root: Path, layers: int = 4, noise: float = 0.15, seed: int = 0) -> tuple[ModelRuntime, ModelRuntime]:
    import transformers

    a = save_tiny_model(root / "producer", "llama", seed=seed, num_hidden_layers=layers, rope_theta=1e4,
                        initializer_range=0.1)
    model = transformers.LlamaForCausalLM.from_pretrained(str(a))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    model.config.rope_parameters = dict(model.config.rope_parameters, rope_theta=1e6)
    b = root / "consumer"
    model.save_pretrained(str(b))
    return ModelRuntime.load(a), ModelRuntime.load(b)


def prompts(n: int, length: int = 48, seed: int = 0, vocab: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt [length], answer [4]) pairs of random byte tokens."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (length,), generator=gen), torch.randint(0, vocab, (4,), generator=gen))
            for _ in range(n)]
