"""The feature prior's vocabulary table: the contexts of computing each prompt's own tokens,
made per mode, kept and read back, and shared by every method a decode worker builds."""

import types

import pytest
import torch

from scd_serve.codec import prior_table
from scd_serve.codec.codebook import Codebook
from scd_serve.config.decode import DecodeConfig
from scd_serve.decode.consumer_codecs import ConsumerCodecs
from scd_serve.errors import ConfigError
from scd_serve.model import ModelRuntime

DEMO = "models/demo-pair"


@pytest.fixture(scope="module")
def consumer():
    return ModelRuntime.load(f"{DEMO}/consumer")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCD_CACHE_DIR", str(tmp_path))


def fresh_prior():
    return Codebook.load(f"{DEMO}/codebook").context_prior()


class Counting:
    """The consumer, counting the tokens whose states it computes."""

    def __init__(self, runtime):
        self.runtime, self.computed = runtime, []

    def token_inputs(self, ids):
        return self.runtime.token_inputs(ids)

    def token_states(self, ids, layers=None):
        self.computed += ids.tolist()
        return self.runtime.token_states(ids, layers=layers)


def test_the_table_gives_each_prompt_the_same_context_and_computes_no_token(consumer):
    prompt = torch.randint(0, consumer.spec.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    want = fresh_prior().context(prompt, consumer)
    prior = fresh_prior()
    said = prior_table.fill(prior, consumer, "k1", "on")
    assert "made in" in said and prior_table.cache_path("k1").exists(), said
    counting = Counting(consumer)
    torch.testing.assert_close(prior.context(prompt, counting), want, atol=1e-5, rtol=1e-5)
    assert counting.computed == []
    restarted = fresh_prior()  # a restart reads the table back instead of making it again
    said = prior_table.fill(restarted, consumer, "k1", "auto", clock=lambda: pytest.fail("made it again"))
    assert "read from" in said and restarted.has_table(consumer.device)
    torch.testing.assert_close(restarted.context(prompt, counting), want, atol=1e-5, rtol=1e-5)
    assert counting.computed == []


def test_auto_gives_up_when_its_first_chunk_predicts_more_than_the_budget(consumer, monkeypatch):
    monkeypatch.setattr(prior_table, "CHUNK", 256)  # several chunks of the demo vocabulary
    ticks = iter([0.0, 10.0])  # the first chunk takes 10 s: the whole vocabulary over a minute
    prior = fresh_prior()
    said = prior_table.fill(prior, consumer, "k2", "auto", budget_s=30, clock=lambda: next(ticks))
    assert "not made, predicted" in said and "--prior-table on" in said, said
    assert not prior.has_table(consumer.device) and not prior_table.cache_path("k2").exists()
    assert "off" in prior_table.fill(prior, consumer, "k2", "off") and not prior.has_table(consumer.device)
    with pytest.raises(ValueError, match="auto, on, off"):
        prior_table.fill(prior, consumer, "k2", "sometimes")
    with pytest.raises(ConfigError, match="prior_table must be one of auto, on, off"):
        DecodeConfig(prior_table="sometimes")


def test_a_damaged_cache_file_is_made_again(consumer):
    path = prior_table.cache_path("k3")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a table")
    prior = fresh_prior()
    assert "made in" in prior_table.fill(prior, consumer, "k3", "on")
    assert prior.has_table(consumer.device)


def test_a_decode_workers_methods_share_one_prior_and_its_table(consumer):
    spec = Codebook.load(f"{DEMO}/codebook").side_spec("producer")
    info = types.SimpleNamespace(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                                 num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                 rope_theta=spec.rope_theta, producer_fingerprint=spec.fingerprint)
    codecs = ConsumerCodecs(consumer, f"{DEMO}/codebook")
    assert "made in" in codecs.fill_prior_table("auto", 60.0)
    scd, int8 = codecs.get(info, "scd"), codecs.get(info, "scd-int8")
    assert scd.codebook is int8.codebook is codecs.loaded_codebook()
    assert codecs.loaded_codebook().context_prior().has_table(consumer.device)
    assert ConsumerCodecs(consumer, "").fill_prior_table("on", 60.0) is None  # no codebook, no table
    # rows computed in another dtype are another table
    book = codecs.loaded_codebook()
    in_bf16 = ModelRuntime.load(f"{DEMO}/consumer", dtype=torch.bfloat16)
    assert prior_table.table_key(book, in_bf16) != prior_table.table_key(book, consumer)
