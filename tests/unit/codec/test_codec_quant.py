import pytest
import torch

from scd_serve import codec
from scd_serve.codec.quant import pack, quantize_groups, unpack
from scd_serve.codec.codec_spec import rotate

from codec_fakes import FakeConsumer, make_spec, make_state


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip(bits):
    q = torch.randint(0, 1 << bits, (5, 32))
    assert torch.equal(unpack(pack(q, bits), bits).long(), q)
    assert pack(q, bits).shape == (5, 32 * bits // 8)


@pytest.mark.parametrize("bits,ratio", [(4, 0.3125), (2, 0.1875)])
@pytest.mark.parametrize("t", [32, 45])  # 45: the last key group is padded
def test_quant_error_bound_and_payload(bits, ratio, t):
    p, c = make_spec(1e4), make_spec(1e6)
    state = make_state(p, t=t)
    qc = codec.build(f"quant{bits}", producer=p, consumer=c)
    code = qc.encode_layer(0, state)
    assert code["kq"].dtype == torch.uint8 and code["ks"].dtype == torch.float16
    consumer = FakeConsumer(c)
    k_pre, v = qc.decode_layer(0, code, consumer)
    pos = torch.arange(t)
    target_k = rotate(p, state.keys, pos).reshape(t, -1)
    k_err = (consumer.rotate_keys(k_pre, pos).reshape(t, -1) - target_k).abs()
    v_err = (v - state.values).reshape(t, -1).abs()
    # asymmetric rounding: at most half a step of the group's range, plus fp16 slack
    levels = (1 << bits) - 1
    k_step = torch.cat([(g.amax(0) - g.amin(0)).expand_as(g) for g in torch.split(target_k, 32)]) / levels
    vs = state.values.reshape(t, -1, 32)  # values: per token over channel groups of 32
    v_step = ((vs.amax(-1, keepdim=True) - vs.amin(-1, keepdim=True)) / levels).expand_as(vs).reshape(t, -1)
    for err, step in [(k_err, k_step), (v_err, v_step)]:
        assert (err <= step / 2 + 2e-2).all(), float((err - step / 2).max())
    assert err.max() > 0  # it is lossy
    raw_bytes = 2 * t * p.kv_width * 2
    t_pad = -(-t // 32) * 32
    expect = (t_pad + t) * p.kv_width * bits / 8 + 4 * (t_pad // 32) * p.kv_width + 4 * t * (p.kv_width // 32)
    assert codec.payload_bytes(code) == expect
    if t == 32:
        assert codec.payload_bytes(code) / raw_bytes == pytest.approx(ratio)


def test_quantize_groups_constant_input_is_exact():
    x = torch.full((2, 4, 3), 1.5)
    q, s, m = quantize_groups(x, 4)
    torch.testing.assert_close(q * s.float() + m.float(), x)


def test_droidspeak_recomputes_chosen_layers(producer_spec=make_spec(1e4, layers=8)):
    c = make_spec(1e6, layers=8)
    ds = codec.build("droidspeak", producer=producer_spec, consumer=c)
    assert ds.layers == {0}
    assert ds.states_needed(0) == {codec.ATTN_INPUT} and ds.states_needed(3) == {codec.KEYS, codec.VALUES}
    consumer = FakeConsumer(c)
    state = make_state(producer_spec)
    code = ds.encode_layer(0, state)
    assert set(code) == {"h"} and code["h"].dtype == torch.float16
    k, v = ds.decode_layer(0, code, consumer)
    ref_k, ref_v = consumer.recompute_kv(0, state.attn_input)
    # fp16 attn_input (2^-11 relative) through the float32 K/V projection; another layer's weights is O(1)
    torch.testing.assert_close(k, ref_k, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(v, ref_v, atol=1e-2, rtol=1e-2)
    raw = codec.build("raw", producer=producer_spec)
    assert codec.payload_bytes(ds.encode_layer(5, state)) == codec.payload_bytes(raw.encode_layer(5, state))
