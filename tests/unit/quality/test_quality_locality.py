"""locality: a layer whose keys are a function of the current token scores R^2 ~ 1, values
that carry nothing of the tokens score ~ 0."""

from types import SimpleNamespace

import torch

from scd_serve.quality.locality import format_locality, locality


class LocalKeysConsumer:
    """Layer 0: keys = a table row of the current token, values = fresh noise per position."""

    def __init__(self, vocab=40, hidden=8):
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(vocab, hidden, generator=gen)
        self.key_table = torch.randn(vocab, 2, 4, generator=gen)
        self.noise = torch.Generator().manual_seed(1)
        self.spec = SimpleNamespace(hidden_size=hidden)

    def token_inputs(self, ids):
        return self.embed[ids]

    def iter_prefill(self, ids, compute_logits=False):
        values = torch.randn(ids.shape[0], 2, 4, generator=self.noise)
        yield 0, SimpleNamespace(keys=self.key_table[ids], values=values)


def test_local_keys_score_high_and_noise_values_score_zero():
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 40, (60,), generator=gen) for _ in range(40)]
    rows = locality(LocalKeysConsumer(), prompts, taps=2, width=64, rank=16)
    assert len(rows) == 1
    assert rows[0]["k"] > 0.9, rows
    assert abs(rows[0]["v"]) < 0.15, rows  # noise: nothing to explain (a little overfit goes negative)
    assert "layer" in format_locality(rows, 2)
