"""A transfer after the decode side's cached prefix (PrefillRequest.start): rows start.. decode
from their own codes to what a rebuild of the whole prompt gives those rows (the embedded pair's
codebook: token priors over the tokens before each row, a patch layer), and a codec whose rows
do not decode alone says so."""

import pytest
import torch

from scd_serve import codec
from scd_serve.codec.base import wants_residuals
from scd_serve.codec.rebuild import begin, decodes_from
from scd_serve.model import ModelRuntime

DEMO = "models/demo-pair"
START = 24


@pytest.fixture(scope="module")
def pair():
    return ModelRuntime.load(f"{DEMO}/producer"), ModelRuntime.load(f"{DEMO}/consumer")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCD_CACHE_DIR", str(tmp_path))


# quantized codes (scd-int8, quant4) are scaled over the rows shipped: the same up to the
# quantization's error, far below what keys rotated for the wrong positions are off by
@pytest.mark.parametrize("method,quantized", [("identity", 0), ("raw", 0), ("droidspeak", 0), ("reuse", 0),
                                              ("scd", 0), ("scd-int8", 0.02), ("quant4", 0.1)])
def test_rows_after_a_cached_prefix_decode_as_in_a_rebuild_of_the_whole_prompt(pair, method, quantized):
    producer, consumer = pair
    c = codec.build(method, producer=producer, consumer=consumer, codebook=f"{DEMO}/codebook")
    assert decodes_from(c, START) == START  # no run: its rows decode alone
    ids = torch.randint(0, producer.spec.vocab_size, (40,), generator=torch.Generator().manual_seed(7))
    whole, rest = begin(c, ids, consumer), begin(c, ids, consumer, START)
    whole.prepare(), rest.prepare()
    residuals = wants_residuals(c, producer.spec.num_layers)
    for layer, state in producer.iter_prefill(ids, compute_logits=False, residuals=residuals):
        k, v = whole.decode_layer(layer, c.encode_layer(layer, state))
        k_rest, v_rest = rest.decode_layer(layer, c.encode_layer(layer, state.rows_from(START)))
        assert k_rest.shape == k[START:].shape
        if quantized:
            for got, want in ((k_rest, k[START:]), (v_rest, v[START:])):
                assert (got - want).abs().mean() / want.abs().mean() < quantized, layer
        else:
            torch.testing.assert_close(k_rest, k[START:], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v_rest, v[START:], atol=1e-5, rtol=1e-4)
