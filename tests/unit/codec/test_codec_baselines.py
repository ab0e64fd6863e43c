import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from scd_serve import codec
from scd_serve.codec.codec_spec import rotate, spec_of
from scd_serve.errors import ConfigError

from codec_fakes import FakeConsumer, make_spec, make_state


@pytest.fixture
def producer_spec():
    return make_spec(1e4)


@pytest.fixture
def consumer_spec():
    return make_spec(1e6)


def test_rotary_matches_transformers():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, rope_theta=1e6)
    spec = spec_of(cfg)
    assert (spec.num_kv_heads, spec.head_dim, spec.rope_theta) == (2, 16, 1e6)
    k = torch.randn(9, 2, 16)
    pos = torch.arange(9)
    cos, sin = LlamaRotaryEmbedding(cfg)(k, pos[None])
    # HF layout is [B, heads, T, hd]
    _, ref = apply_rotary_pos_emb(k.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    # float32 cos/sin by two formulas (ours, HF's): a few ulp of |k| ~ 4; a wrong theta or pairing is > 1e-2
    torch.testing.assert_close(rotate(spec, k, pos), ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate(spec, rotate(spec, k, pos), pos, inverse=True), k, atol=1e-5, rtol=1e-5)


def test_identity_is_lossless(producer_spec, consumer_spec):
    c = codec.build("identity", producer=producer_spec, consumer=consumer_spec)
    state = make_state(producer_spec)
    code = c.encode_layer(0, state)
    k, v = c.decode_layer(0, code, FakeConsumer(consumer_spec))
    assert torch.equal(k, state.keys) and torch.equal(v, state.values)
    assert codec.payload_bytes(code) == 2 * state.keys.numel() * 4


@pytest.mark.parametrize("with_unrotate", [True, False])
def test_raw_reproduces_producer_post_rope_keys(producer_spec, consumer_spec, with_unrotate):
    c = codec.build("raw", producer=producer_spec, consumer=consumer_spec)
    state = make_state(producer_spec)
    code = c.encode_layer(1, state)
    assert {t.dtype for t in code.values()} == {torch.float16}
    assert codec.payload_bytes(code) == 2 * state.keys.numel() * 2
    consumer = FakeConsumer(consumer_spec, with_unrotate=with_unrotate)
    k_pre, v = c.decode_layer(1, code, consumer)
    pos = torch.arange(state.keys.shape[0])
    # what write_kv stores (consumer RoPE) equals what the producer attended to, up to fp16
    stored = consumer.rotate_keys(k_pre, pos)
    # fp16 rounds to within 2^-11 relative (4.9e-4): 5e-3 is 10x that (the rotations are float32)
    torch.testing.assert_close(stored, rotate(producer_spec, state.keys, pos), atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(v, state.values, atol=5e-3, rtol=5e-3)
    # different thetas: consumer-side pre-RoPE keys are not the producer's pre-RoPE keys
    assert (k_pre - state.keys).abs().max() > 0.1


def test_states_needed_and_unknown_method(producer_spec):
    assert codec.build("raw", producer=producer_spec).states_needed(0) == {codec.KEYS, codec.VALUES}
    with pytest.raises(ConfigError, match="unknown transfer method"):
        codec.build("zip", producer=producer_spec)
    assert {"identity", "raw"} <= set(codec.METHODS)
