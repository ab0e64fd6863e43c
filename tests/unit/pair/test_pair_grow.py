"""Progressive stacking keeps the shallow model's function exactly at the moment of growing."""

import dataclasses

import pytest
import torch

from scd_serve.config.pair import PairConfig
from scd_serve.errors import ConfigError
from scd_serve.pair.grow import grow
from scd_serve.pair.tokenizer import train_tokenizer
from scd_serve.pair.train import build_model


def test_grown_model_computes_the_same_logits_and_has_new_layers():
    tok = train_tokenizer()
    cfg = dataclasses.replace(PairConfig().shrunk(), num_layers=1)
    torch.manual_seed(0)
    small = build_model(cfg, len(tok), tok)
    with torch.no_grad():  # move weights off their init so zeroed copies would matter
        for p in small.parameters():
            p.add_(0.05 * torch.randn_like(p))
    big = grow(small, 3)
    assert big.config.num_hidden_layers == 3
    ids = torch.randint(5, len(tok), (1, 20))
    # the new layers' zeroed output projections add exact zeros: the same float32 ops on the same values
    assert torch.allclose(small(input_ids=ids).logits, big(input_ids=ids).logits, atol=1e-6)
    assert torch.count_nonzero(big.model.layers[1].mlp.down_proj.weight) == 0
    assert torch.equal(big.model.layers[2].self_attn.q_proj.weight, small.model.layers[0].self_attn.q_proj.weight)
    with pytest.raises(ConfigError, match="multiple"):
        grow(big, 4)
