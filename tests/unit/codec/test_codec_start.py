"""A transfer after the decode side's cached prefix (PrefillRequest.start): rows start.. decode
from their own codes to what a rebuild of the whole prompt gives those rows (the embedded pair's
codebook: token priors over the tokens before each row, a patch layer), and a codec whose rows
do not decode alone says so. And a codec's head (codec/rebuild.py): the consumer computes the
prompt's first S tokens itself, their rows exactly its own prefill's, and the codes carry the
rows after them only, which decode as they do without a head (a head set in the manifest)."""

import pytest
import torch

from scd_serve import codec
from scd_serve.codec.base import payload_bytes, wants_residuals
from scd_serve.codec.codebook import Codebook
from scd_serve.codec.rebuild import HeadRebuild, Rebuild, begin, codes_from, decodes_from, head_rows
from scd_serve.errors import CodebookError
from scd_serve.model import ModelRuntime
from scd_serve.quality.transfer import transfer

DEMO = "models/demo-pair"
START = 24
HEAD = 10


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


def build(pair, method: str, head: int):
    producer, consumer = pair
    book = Codebook.load(f"{DEMO}/codebook", producer=producer, consumer=consumer)
    book.manifest["head_tokens"] = head
    return codec.build(method, producer=producer, consumer=consumer, codebook=book)


def ids_of(n: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def own_states(consumer, ids):
    return [s for _, s in consumer.iter_prefill(ids, compute_logits=False)]


@pytest.mark.parametrize("method", ["scd", "prior-only"])
def test_head_rows_are_the_consumers_own_and_the_codes_carry_only_the_rest(pair, method):
    producer, consumer = pair
    headed, plain = build(pair, method, HEAD), build(pair, method, 0)
    assert (headed.head_tokens, plain.head_tokens) == (HEAD, 0)
    assert build(pair, "reuse", HEAD).head_tokens == 0  # the ablation is the plan alone
    ids = ids_of(40)
    assert (codes_from(headed, 0, 40), codes_from(plain, 0, 40)) == (HEAD, 0)
    with_head, without = begin(headed, ids, consumer), begin(plain, ids, consumer)
    assert isinstance(with_head, HeadRebuild) and not isinstance(without, HeadRebuild)
    with_head.prepare(), without.prepare()
    own = own_states(consumer, ids)
    shipped = {"headed": 0, "plain": 0}
    for layer, state in producer.iter_prefill(ids, compute_logits=False,
                                              residuals=wants_residuals(plain, producer.spec.num_layers)):
        code = headed.encode_layer(layer, state.rows_from(HEAD))
        plain_code = plain.encode_layer(layer, state)
        shipped["headed"] += payload_bytes(code)
        shipped["plain"] += payload_bytes(plain_code)
        k, v = with_head.decode_layer(layer, code)
        k_plain, v_plain = without.decode_layer(layer, plain_code)
        assert k.shape == k_plain.shape == (40, *k.shape[1:])
        torch.testing.assert_close(k[:HEAD], own[layer].keys[:HEAD].to(k.dtype))
        torch.testing.assert_close(v[:HEAD], own[layer].values[:HEAD].to(v.dtype))
        torch.testing.assert_close(k[HEAD:], k_plain[HEAD:], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v[HEAD:], v_plain[HEAD:], atol=1e-5, rtol=1e-4)
        assert not torch.allclose(k_plain[:HEAD], own[layer].keys[:HEAD].to(k.dtype), atol=1e-3)  # a lossy pair
    # fp16 codes per row: the head's rows are not shipped
    assert shipped["headed"] * 40 == shipped["plain"] * (40 - HEAD)


def test_after_a_cached_prefix_the_head_covers_only_what_the_decode_side_lacks(pair):
    producer, consumer = pair
    c, ids = build(pair, "scd", HEAD), ids_of(40)
    own = own_states(consumer, ids)
    states = list(producer.iter_prefill(ids, compute_logits=False))
    # the decode side holds rows ..3: rows 4..9 are the head's, the codes start at 10
    rebuild = begin(c, ids, consumer, 4)
    assert codes_from(c, 4, 40) == HEAD and isinstance(rebuild, HeadRebuild)
    k, v = rebuild.decode_layer(1, c.encode_layer(1, states[1][1].rows_from(HEAD)))
    assert k.shape[0] == 36
    torch.testing.assert_close(v[:HEAD - 4], own[1].values[4:HEAD].to(v.dtype))
    # it holds rows past the head: no head, the codes start where its cache ends
    assert codes_from(c, 24, 40) == 24 and not isinstance(begin(c, ids, consumer, 24), HeadRebuild)


def test_a_prompt_no_longer_than_the_head_still_ships_its_last_row(pair):
    producer, consumer = pair
    c, ids = build(pair, "scd", HEAD), ids_of(6)
    assert head_rows(c, 6) == 5 and codes_from(c, 0, 6) == 5 and head_rows(c, 0) == 0
    rebuild = begin(c, ids, consumer)
    own = own_states(consumer, ids)
    for layer, state in producer.iter_prefill(ids, compute_logits=False):
        k, v = rebuild.decode_layer(layer, c.encode_layer(layer, state.rows_from(5)))
        assert k.shape[0] == 6
        torch.testing.assert_close(k[:5], own[layer].keys[:5].to(k.dtype))


class SentEveryRow:
    """A codec whose rows do not decode alone (as a run): it decodes every row to zeros."""
    head_tokens, rows_decode_alone = 3, False

    def decode_layer(self, layer, code, consumer, tokens=None, start=0):
        kvh, hd = consumer.spec.num_kv_heads, consumer.spec.head_dim
        return torch.zeros(len(tokens), kvh, hd), torch.zeros(len(tokens), kvh, hd)


def test_a_codec_sent_every_row_has_its_first_rows_replaced_by_the_head(pair):
    _, consumer = pair
    c, ids = SentEveryRow(), ids_of(12)
    assert codes_from(c, 0, 12) == 0  # sent every row
    rebuild = begin(c, ids, consumer)
    k, v = rebuild.decode_layer(0, {})
    own = own_states(consumer, ids)[0]
    assert k.shape[0] == 12 and torch.equal(k[3:], torch.zeros_like(k[3:]))
    torch.testing.assert_close(k[:3], own.keys[:3].to(k.dtype))
    assert type(begin(type("NoHead", (), {"decode_layer": SentEveryRow.decode_layer})(), ids, consumer)) is Rebuild


def test_eval_sends_the_head_nothing_and_the_manifest_refuses_a_bad_head(pair):
    producer, consumer = pair
    prefix = ids_of(30)
    headed = transfer("scd", build(pair, "scd", HEAD), producer, consumer, prefix, 4)
    plain = transfer("scd", build(pair, "scd", 0), producer, consumer, prefix, 4)
    assert headed.payload_bytes * 30 == plain.payload_bytes * (30 - HEAD)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(CodebookError, match="head_tokens"):
            Codebook({"head_tokens": bad}, {}).head_tokens
    assert Codebook({}, {}).head_tokens == 0  # codebooks from before it
