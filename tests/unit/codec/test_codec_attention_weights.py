"""The calibration rows' weights (calibration/attention.py): the attention the consumer's own
queries give each row, as its forward computes it, grouped query heads included."""

import pytest
import torch

from scd_serve.calibration import attention
from scd_serve.calibration.attention import MAX_WEIGHT, received_attention
from scd_serve.model import ModelRuntime
from scd_serve.model.layers import project_q
from scd_serve.model.tiny import save_tiny_model


@pytest.mark.parametrize("family, kv_heads", [("llama", 4), ("qwen2", 2)])
def test_weights_are_the_attention_the_rows_receive(tmp_path, monkeypatch, family, kv_heads):
    rt = ModelRuntime.load(save_tiny_model(tmp_path / family, family, num_attention_heads=4,
                                           num_key_value_heads=kv_heads))
    spec, t = rt.spec, 24
    ids = torch.randint(4, spec.vocab_size, (t,), generator=torch.Generator().manual_seed(0))
    states = list(rt.iter_prefill(ids, compute_logits=False))
    layer, state = states[-1]
    w = received_attention(rt, layer, state.keys, state.attn_input)
    assert w.shape == (t,) and w.dtype == torch.float32 and bool((w > 0).all())
    # the same sums from the attention probabilities, head by head, each query head reading its group's keys
    pos = torch.arange(t)
    q = rt.rotary.rotate(project_q(rt.weights.layers[layer], spec, state.attn_input), pos).transpose(0, 1)
    k = rt.rotary.rotate(state.keys, pos).transpose(0, 1).repeat_interleave(spec.num_heads // spec.num_kv_heads, 0)
    scores = (q @ k.transpose(1, 2) / spec.head_dim ** 0.5).masked_fill(torch.ones(t, t).triu(1).bool(), -torch.inf)
    mass = scores.softmax(-1).sum(1).mean(0)  # [T]: what each row receives, summed over queries
    assert torch.allclose(w, (mass / mass.mean()).clamp_max(MAX_WEIGHT).float(), atol=1e-5)
    monkeypatch.setattr(attention, "QUERY_CHUNK", 5)  # the queries scored a few at a time: the same sums
    assert torch.allclose(received_attention(rt, layer, state.keys, state.attn_input), w, atol=1e-6)


def test_long_prompts_estimate_the_weights_from_a_sample_of_queries(tmp_path, monkeypatch):
    rt = ModelRuntime.load(save_tiny_model(tmp_path / "m", "llama"))
    ids = torch.randint(4, rt.spec.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    layer, state = next(iter(rt.iter_prefill(ids, compute_logits=False)))
    every = received_attention(rt, layer, state.keys, state.attn_input)
    monkeypatch.setattr(attention, "MAX_QUERIES", 48)
    sampled = received_attention(rt, layer, state.keys, state.attn_input, torch.Generator().manual_seed(0))
    assert sampled.shape == every.shape and not torch.equal(sampled, every)
    assert float((sampled - every).abs().mean()) < 0.5 * float(every.abs().mean())  # the same picture, roughly
