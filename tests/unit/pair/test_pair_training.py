"""make-demo-pair on a shrunken config: deterministic, loadable HF dirs, a real fine-tune."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from scd_serve.config.pair import PairConfig
from scd_serve.pair.make_pair import make_pair


def _weights(directory):
    return load_file(str(directory / "model.safetensors"))


def test_same_seed_same_weights_and_a_shifted_consumer(tmp_path):
    cfg = PairConfig(seed=3).shrunk()
    make_pair(cfg, tmp_path / "a", probe_n=0, log=lambda _: None)
    make_pair(cfg, tmp_path / "b", probe_n=0, log=lambda _: None)
    for side in ("producer", "consumer"):
        wa, wb = _weights(tmp_path / "a" / side), _weights(tmp_path / "b" / side)
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), side

    prod, cons = _weights(tmp_path / "a" / "producer"), _weights(tmp_path / "a" / "consumer")
    assert any(not torch.equal(prod[k], cons[k]) for k in prod)  # the fine-tune moved weights

    other = tmp_path / "c"
    make_pair(PairConfig(seed=4).shrunk(), other, probe_n=0, log=lambda _: None)
    wc = _weights(other / "producer")
    assert any(not torch.equal(prod[k], wc[k]) for k in prod)


def test_saved_dirs_load_with_transformers_and_keep_their_rope(tmp_path):
    make_pair(PairConfig(seed=0).shrunk(), tmp_path, probe_n=0, log=lambda _: None)
    thetas = []
    for side in ("producer", "consumer"):
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / side))
        tok = AutoTokenizer.from_pretrained(str(tmp_path / side))
        ids = tok("records kapo ; queries find kapo", return_tensors="pt")["input_ids"]
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))
        assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
        thetas.append(model.config.rope_parameters["rope_theta"])
    assert thetas == [1e4, 1e6]
