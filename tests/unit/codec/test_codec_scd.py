"""Reuse / Patch codecs per layer, same-model lossless mode, int8 codes."""

import pytest
import torch

from scd_serve import codec
from scd_serve.calibration.assemble import build_codebook
from scd_serve.calibration.fit import collect_rows, fit_layer, train_aligner
from scd_serve.codec.plan import PATCH, REUSE, LayerPlan, Plan
from scd_serve.codec.codec_spec import spec_of

from codec_pair import make_pair, prompts


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"), layers=2)


def fitted(producer, consumer, n=6, h_ranks=(8, 32)):
    rows = collect_rows(producer, consumer, [p for p, _ in prompts(n, 40)], max_rows=4096)
    return [fit_layer(r, spec_of(consumer).kv_width, h_ranks, aligner_width=32) for r in rows], rows


def transfer_then_generate(codec_, producer, consumer, prompt, n):
    """The serving handoff: K/V for tokens 0..T-2 through the codec, then greedy decode."""
    states = [s for _, s in producer.iter_prefill(prompt[:-1], compute_logits=False)]
    pool = consumer.new_kv_pool(8, 16)
    blocks = list(range(8))
    for layer, state in enumerate(states):
        k, v = codec_.decode_layer(layer, codec_.encode_layer(layer, state), consumer)
        consumer.write_kv(pool, blocks, layer, k, v)
    t = prompt.shape[0]
    token = int(consumer.extend(pool, [(blocks, t - 1, prompt[-1:])])[0][-1].argmax())
    out = [token]
    while len(out) < n:
        token = int(consumer.decode_step(pool, [(blocks, t + len(out) - 1, token)])[0].argmax())
        out.append(token)
    return out


def test_same_model_full_rank_is_lossless(pair):
    rt, _ = pair
    d = spec_of(rt).kv_width
    fits, _ = fitted(rt, rt)
    plan = Plan(tuple(LayerPlan(REUSE, d, d) for _ in range(2)))
    book = build_codebook(fits, {"scd": plan, "reuse": plan}, spec_of(rt), spec_of(rt))
    scd = codec.build("scd", producer=rt, consumer=rt, codebook=book)
    prompt, _ = prompts(1, 40, seed=7)[0]
    state = next(iter(rt.iter_prefill(prompt, compute_logits=False)))[1]
    k, v = scd.decode_layer(0, scd.encode_layer(0, state), rt)
    torch.testing.assert_close(k, state.keys, atol=2e-2, rtol=1e-2)  # fp16 codes
    torch.testing.assert_close(v, state.values, atol=2e-2, rtol=1e-2)
    assert transfer_then_generate(scd, rt, rt, prompt, 12) == rt.generate_greedy(prompt, 12)


def test_low_rank_same_model_is_lossy_but_smaller(pair):
    rt, _ = pair
    fits, _ = fitted(rt, rt)
    plan = Plan(tuple(LayerPlan(REUSE, 4, 8) for _ in range(2)))
    book = build_codebook(fits, {"scd": plan, "reuse": plan}, spec_of(rt), spec_of(rt))
    reuse = codec.build("reuse", producer=rt, consumer=rt, codebook=book)
    state = next(iter(rt.iter_prefill(prompts(1, 40, seed=3)[0][0], compute_logits=False)))[1]
    code = reuse.encode_layer(0, state)
    assert code["zk"].shape == (40, 4) and code["zv"].shape == (40, 8) and code["zk"].dtype == torch.float16
    assert codec.payload_bytes(code) == 40 * 12 * 2
    k, _ = reuse.decode_layer(0, code, rt)
    assert k.shape == state.keys.shape
    err = float((k - state.keys).norm() / state.keys.norm())
    assert 1e-3 < err < 1.0


def test_patch_layer_recomputes_with_consumer_weights(pair):
    producer, consumer = pair
    fits, rows = fitted(producer, consumer, n=30, h_ranks=(8, 64))
    d = spec_of(consumer).kv_width
    train_aligner(fits[1], rows[1]["h"], 64, width=64, steps=20)
    plan = Plan((LayerPlan(REUSE, d, d), LayerPlan(PATCH, r_h=64)))
    book = build_codebook(fits, {"scd": plan, "reuse": Plan((plan.layers[0],) * 2)}, spec_of(producer), spec_of(consumer))
    scd = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    assert scd.states_needed(1) == {codec.ATTN_INPUT} and scd.states_needed(0) == {codec.KEYS, codec.VALUES}
    prompt = prompts(1, 40, seed=5)[0][0]
    sa = [s for _, s in producer.iter_prefill(prompt, compute_logits=False)]
    code = scd.encode_layer(1, sa[1])
    assert set(code) == {"zh"} and code["zh"].shape == (40, 64)
    k, v = scd.decode_layer(1, code, consumer)
    # the code is the fp16 projection of H_in,A (a float64 reference: within fp16 rounding, 2^-11)
    g = fits[1].aligners[64]
    z = (sa[1].attn_input.double() - fits[1].codes["h"].mu_a) @ fits[1].codes["h"].enc[:, :64]
    torch.testing.assert_close(code["zh"].double(), z, rtol=2 ** -10, atol=1e-3 * float(z.abs().max()))
    # the consumer's K/V are the aligner's estimate of H_in,B from that very code, through the
    # consumer's own projections: the same inputs on the same float32 path (no second rounding
    # to fp16 that a CPU's vector kernels could flip)
    ref_k, ref_v = consumer.recompute_kv(1, g(code["zh"].float()).detach())
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=1e-5)
    # on held-out calibration rows the aligner predicts H_in,B better than H_in,A itself does
    ha, hb = rows[1]["h"]
    assert fits[1].aligner_err[64] < float((ha - hb).pow(2).sum() / (hb - hb.mean(0)).pow(2).sum())


def test_int8_codes_halve_payload(pair):
    producer, consumer = pair
    fits, _ = fitted(producer, consumer)
    plan = Plan(tuple(LayerPlan(REUSE, 16, 16) for _ in range(2)))
    book = build_codebook(fits, {"scd": plan, "reuse": plan}, spec_of(producer), spec_of(consumer))
    c16 = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    c8 = codec.build("scd-int8", producer=producer, consumer=consumer, codebook=book)
    state = next(iter(producer.iter_prefill(prompts(1, 64, seed=2)[0][0], compute_logits=False)))[1]
    code16, code8 = c16.encode_layer(0, state), c8.encode_layer(0, state)
    assert code8["zk"].dtype == torch.int8 and code8["zk_scale"].shape == (16,)
    assert codec.payload_bytes(code8) == codec.payload_bytes(code16) // 2 + 2 * 16 * 2
    k16, v16 = c16.decode_layer(0, code16, consumer)
    k8, v8 = c8.decode_layer(0, code8, consumer)
    assert float((k8 - k16).norm() / k16.norm()) < 0.02
    assert float((v8 - v16).norm() / v16.norm()) < 0.02


def test_rows_are_kept_in_bfloat16_and_codes_fitted_on_them_predict_as_float32_rows_do(pair, monkeypatch):
    """Calibration holds its rows through the token prior's solve, its memory peak, so they are
    kept in bfloat16 (half of float32); the codes fitted on them leave the same share of the
    consumer's rows unexplained on prompts not fitted on as codes fitted on float32 rows."""
    from scd_serve.calibration import fit as fit_module
    from scd_serve.codec.lowrank import fit_code

    producer, consumer = pair
    fit_prompts = [p for p, _ in prompts(6, 40)]
    rows = collect_rows(producer, consumer, fit_prompts, max_rows=4096)
    monkeypatch.setattr(fit_module, "ROW_DTYPE", torch.float32)
    exact = collect_rows(producer, consumer, fit_prompts, max_rows=4096)
    held = collect_rows(producer, consumer, [p for p, _ in prompts(4, 40, seed=5)], max_rows=4096)  # scored exactly
    assert all(t.dtype == torch.bfloat16 for layer in rows for s, ab in layer.items() if s != "w" for t in ab)
    assert all(t.dtype == torch.float32 for layer in exact for s, ab in layer.items() if s != "w" for t in ab)

    def held_error(fit_rows, layer, s, rank):
        jc = fit_code(*fit_rows[layer][s], max_rank=rank)
        a, b = (t.double() for t in held[layer][s])
        pred = (a - jc.mu_a) @ jc.enc @ jc.decoder(rank) + jc.mu_b
        return float((pred - b).pow(2).sum() / (b - b.mean(0)).pow(2).sum())

    rank = spec_of(consumer).kv_width // 2
    for layer in range(len(rows)):
        for s in "kv":
            assert held_error(rows, layer, s, rank) == pytest.approx(held_error(exact, layer, s, rank), rel=0.02)
