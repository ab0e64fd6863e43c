"""A serving runtime on a CPU with native bfloat16 packs its linear weights for oneDNN once
(ModelRuntime.pack_linears): the same logits as the plain weights, prefill and decode."""

import pytest
import torch

from scd_serve.model import ModelRuntime, loader
from scd_serve.model.layers import PackedWeight
from scd_serve.model.tiny import save_tiny_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("packed"), "llama", seed=2)


@pytest.mark.skipif(not (loader.cpu_has_native_bf16() and torch.backends.mkldnn.is_available()),
                    reason="this CPU has no native bfloat16 (or torch runs below AVX-512): nothing is packed")
def test_packed_weights_give_the_plain_weights_logits(path):
    plain, packed = ModelRuntime.load(path, dtype="bfloat16"), ModelRuntime.load(path, dtype="bfloat16")
    assert packed.pack_linears() and isinstance(packed.weights.layers[0].wkv, PackedWeight)
    ids = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(1))
    blocks = list(range(4))
    pools = [rt.new_kv_pool(4, 16) for rt in (plain, packed)]
    first = [rt.extend(pool, [(blocks, 0, ids)], logits="all")[0] for rt, pool in zip((plain, packed), pools)]
    torch.testing.assert_close(first[1], first[0], atol=0, rtol=0)
    steps = [rt.decode_step(pool, [(blocks, 40, 7)] * 3) for rt, pool in zip((plain, packed), pools)]
    torch.testing.assert_close(steps[1], steps[0], atol=0, rtol=0)


def test_nothing_is_packed_where_it_would_not_pay(path, monkeypatch):
    assert not ModelRuntime.load(path, dtype="float32").pack_linears()  # float32: not this path
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    rt = ModelRuntime.load(path, dtype="bfloat16")
    assert not rt.pack_linears() and isinstance(rt.weights.layers[0].wkv, torch.Tensor)
