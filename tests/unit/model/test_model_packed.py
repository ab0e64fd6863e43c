"""A serving runtime on a CPU packs its linear weights for oneDNN once (ModelRuntime.pack_linears):
bfloat16 (native only) gives the plain weights' logits exactly, float32 to its rounding."""

import pytest
import torch

from scd_serve.model import ModelRuntime, loader
from scd_serve.model.layers import PackedWeight
from scd_serve.model.tiny import save_tiny_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("packed"), "llama", seed=2)


def compare_plain_and_packed(path, dtype: str, tol: float) -> tuple[ModelRuntime, ModelRuntime, torch.Tensor]:
    """A prefill and a decode step of 3 rows on the plain and the packed weights, their logits
    within `tol`. -> (plain, packed, prompt ids)"""
    plain, packed = ModelRuntime.load(path, dtype=dtype), ModelRuntime.load(path, dtype=dtype)
    assert packed.pack_linears() and isinstance(packed.weights.layers[0].wkv, PackedWeight)
    assert isinstance(packed.weights.lm_head, PackedWeight) and isinstance(packed.weights.embed, torch.Tensor)
    ids = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(1))
    blocks = list(range(4))
    pools = [rt.new_kv_pool(4, 16) for rt in (plain, packed)]
    first = [rt.extend(pool, [(blocks, 0, ids)], logits="all")[0] for rt, pool in zip((plain, packed), pools)]
    torch.testing.assert_close(first[1], first[0], atol=tol, rtol=tol)
    steps = [rt.decode_step(pool, [(blocks, 40, 7)] * 3) for rt, pool in zip((plain, packed), pools)]
    torch.testing.assert_close(steps[1], steps[0], atol=tol, rtol=tol)
    return plain, packed, ids


@pytest.mark.skipif(not (loader.cpu_has_native_bf16() and torch.backends.mkldnn.is_available()),
                    reason="this CPU has no native bfloat16 (or torch runs below AVX-512): nothing is packed")
def test_packed_weights_give_the_plain_weights_logits(path):
    compare_plain_and_packed(path, "bfloat16", tol=0)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_packed_float32_weights_give_the_plain_logits_to_float32_rounding(tmp_path):
    path = save_tiny_model(tmp_path, "llama", seed=2, hidden_size=512, intermediate_size=768, num_attention_heads=8,
                           num_key_value_heads=2)
    plain, packed, ids = compare_plain_and_packed(path, "float32", tol=1e-3)  # the same sums in another order
    assert plain.generate_greedy(ids, 12) == packed.generate_greedy(ids, 12)


def test_nothing_is_packed_where_it_would_not_pay(path, monkeypatch):
    assert not ModelRuntime.load(path, dtype="float32").pack_linears()  # float32 below hidden 512: BLAS is faster
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    rt = ModelRuntime.load(path, dtype="bfloat16")
    assert not rt.pack_linears() and isinstance(rt.weights.layers[0].wkv, torch.Tensor)
