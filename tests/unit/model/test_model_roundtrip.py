"""K/V handoff: extract from prefill, inject into a fresh pool, keep decoding; recompute; rotary."""

from __future__ import annotations

import pytest
import torch

from scd_serve.errors import InvalidRequest
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model

from model_tol import cross_path_tol


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def rt(request, tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param, tokenizer=False, num_hidden_layers=3)
    return ModelRuntime.load(path)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def continue_from_pool(rt, pool, blocks, num_cached: int, first: int, n: int) -> list[int]:
    """The decode side's loop: the last prompt token is its first decode step."""
    tokens, token = [], first
    for i in range(n):
        token = int(rt.decode_step(pool, [(blocks, num_cached + i, token)])[0].argmax())
        tokens.append(token)
    return tokens


def test_injected_prefill_kv_decodes_like_uninterrupted_run(rt):
    ids = prompt(21, 1)
    reference = rt.generate_greedy(ids, 32)
    out = rt.prefill(ids[:-1])  # the handoff ships positions 0..T-2
    pool, blocks = rt.new_kv_pool(16, 4), [9, 3, 14, 0, 7, 1, 12, 5, 2, 11, 6, 15, 4, 10]
    for layer in range(rt.spec.num_layers):
        rt.write_kv(pool, blocks, layer, out.keys[layer], out.values[layer])
    assert continue_from_pool(rt, pool, blocks, 20, int(ids[-1]), 32) == reference


def test_layer_by_layer_injection_in_chunks(rt):
    """Streamed like the transfer: each layer as iter_prefill yields it, written in two
    position ranges (start=0 and start=8) into a shared pool."""
    ids = prompt(17, 2)
    reference = rt.generate_greedy(ids, 32)
    pool, blocks = rt.new_kv_pool(20, 4), list(range(19, 6, -1))
    for layer, state in rt.iter_prefill(ids[:-1], compute_logits=False):
        rt.write_kv(pool, blocks, layer, state.keys[:8], state.values[:8], start=0)
        rt.write_kv(pool, blocks, layer, state.keys[8:], state.values[8:], start=8)
    assert continue_from_pool(rt, pool, blocks, 16, int(ids[-1]), 32) == reference


def test_write_kv_stores_what_extend_stores(rt):
    ids = prompt(13, 3)
    a, b = rt.new_kv_pool(4, 4), rt.new_kv_pool(4, 4)
    rt.extend(a, [([2, 0, 3, 1], 0, ids)])
    out = rt.prefill(ids)
    for layer in range(rt.spec.num_layers):
        rt.write_kv(b, [2, 0, 3, 1], layer, out.keys[layer], out.values[layer])
    # extend's K/V come from its own forward, write_kv's from prefill's: two paths (model_tol)
    assert (a.k - b.k).abs().max() <= cross_path_tol(b.k) and (a.v - b.v).abs().max() <= cross_path_tol(b.v)
    assert a.k.abs().sum() > 0  # something was written


def test_kv_writer_stores_exactly_what_write_kv_stores_and_checks_its_length(rt):
    ids = prompt(13, 4)
    a, b = rt.new_kv_pool(5, 4), rt.new_kv_pool(5, 4)
    out = rt.prefill(ids)
    writer = rt.kv_writer(b, [4, 2, 0, 3], 13, start=2)  # one request: slots and tables made once
    for layer in range(rt.spec.num_layers):
        rt.write_kv(a, [4, 2, 0, 3], layer, out.keys[layer], out.values[layer], start=2)
        writer.write(layer, out.keys[layer], out.values[layer])
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and a.k.abs().sum() > 0
    with pytest.raises(InvalidRequest, match="12 positions; this writer covers 13"):
        writer.write(0, out.keys[0][:12], out.values[0][:12])
    with pytest.raises(InvalidRequest, match="layer"):
        writer.write(rt.spec.num_layers, out.keys[0], out.values[0])


def test_recompute_kv_reproduces_layer_exactly(rt):
    out = rt.prefill(prompt(19, 4))
    for layer in range(rt.spec.num_layers):
        k, v = rt.recompute_kv(layer, out.attn_inputs[layer])
        assert torch.equal(k, out.keys[layer]) and torch.equal(v, out.values[layer])


def test_recompute_kv_uses_this_models_projection(rt, tmp_path):
    """Same input through another model's weights gives other K/V (the check can fail)."""
    other = ModelRuntime.load(save_tiny_model(tmp_path, rt.spec.family, seed=1, tokenizer=False, num_hidden_layers=3))
    x = rt.prefill(prompt(7, 5)).attn_inputs[1]
    assert not torch.allclose(rt.recompute_kv(1, x)[0], other.recompute_kv(1, x)[0])
    assert rt.fingerprint != other.fingerprint and rt.fingerprint.startswith(rt.spec.family + "-")


def test_unrotate_inverts_rotate_and_theta_matters(rt, tmp_path):
    k, pos = torch.randn(30, rt.spec.num_kv_heads, rt.spec.head_dim), torch.arange(100, 130)
    rotated = rt.rotate_keys(k, pos)
    assert (rt.unrotate_keys(rotated, pos) - k).abs().max() <= 1e-5  # float32 cos^2 + sin^2 = 1 within a few ulp of |k| ~ 4
    assert torch.equal(rt.rotate_keys(k[:1], pos[:1] * 0), k[:1])  # position 0 is the identity
    far = ModelRuntime.load(save_tiny_model(tmp_path, rt.spec.family, tokenizer=False, num_hidden_layers=3, rope_theta=1e6))
    assert far.spec.rope_theta == 1e6 and far.spec.rope_theta != rt.spec.rope_theta
    assert (far.rotate_keys(k, pos) - rotated).abs().max() > 1e-2


def test_rotations_keep_a_few_requests_tables_bit_for_bit():
    from scd_serve.model.rope import KEPT_TABLES, Rotary, apply

    rot = Rotary(1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16), 1.0, "cpu", torch.float32)
    k, pos = torch.randn(40, 2, 16), torch.arange(7, 47)
    first = rot.kept_tables(pos)
    # each layer's rotation of one request reads the tables computed once, as tables() computes them
    assert rot.kept_tables(pos.clone()) is first
    assert torch.equal(rot.rotate(k, pos), apply(k, *rot.tables(pos)))
    # the same key (shape, first and last position) but other positions between: computed anew
    other = pos.clone()
    other[5] = 3
    assert rot.kept_tables(other) is not first and torch.equal(rot.kept_tables(other)[0], rot.tables(other)[0])
    for start in range(KEPT_TABLES):  # more requests than are kept: the oldest goes
        rot.kept_tables(torch.arange(100 + start, 140 + start))
    assert rot.kept_tables(pos) is not first and len(rot._kept) == KEPT_TABLES


def test_fingerprint_is_stable_across_loads_and_dtypes(rt):
    again = ModelRuntime.load(rt.path, dtype=torch.bfloat16)
    assert again.fingerprint == rt.fingerprint and len(rt.fingerprint.split("-")[1]) == 16
    assert again.dtype == torch.bfloat16 and again.new_kv_pool(2, 4).k.dtype == torch.bfloat16
    logits = again.prefill(prompt(9, 6), capture=False).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert (logits - rt.prefill(prompt(9, 6), capture=False).logits).abs().max() < 0.5  # bf16 is close


def test_decode_step_batch_equals_single_steps(rt):
    """Batching must not change any sequence's logits (padding and masks are right)."""
    prompts = [prompt(3, 7), prompt(26, 8), prompt(9, 9), prompt(14, 10)]
    pool = rt.new_kv_pool(40, 4)
    blocks = [list(range(i, 40, 4)) for i in range(4)]
    rt.extend(pool, [(b, 0, p[:-1]) for b, p in zip(blocks, prompts)])
    items = [(b, len(p) - 1, int(p[-1])) for b, p in zip(blocks, prompts)]
    batched = rt.decode_step(pool, items)
    singles = torch.cat([rt.decode_step(pool, [item]) for item in items])
    # a batch of 4 and 4 single rows run different GEMM shapes: up to 1.01e-5 here (AVX2, 2 threads)
    assert (batched - singles).abs().max() <= cross_path_tol(singles)
