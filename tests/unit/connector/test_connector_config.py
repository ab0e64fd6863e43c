"""The vLLM connector's settings (config/connector.py): what kv_connector_extra_config may say,
each mistake refused with a message that names the key and what to write instead."""

import pytest

from scd_serve import codec as codec_registry
from scd_serve.codec.codebook import Codebook
from scd_serve.config.connector import ConnectorConfig
from scd_serve.errors import ConfigError


def test_defaults_and_transport_keys():
    cfg = ConnectorConfig.from_extra({"prefill": ["10.0.0.5:50051"], "prefill_timeout_s": 12,
                                      "worker_token": "s3cret"})
    assert cfg.prefill == ("10.0.0.5:50051",) and cfg.method == "scd" and cfg.min_prompt_tokens == 16
    assert cfg.transport.prefill_timeout_s == 12 and cfg.transport.worker_token == "s3cret"
    assert ConnectorConfig.from_extra({"prefill": "a:1,b:2"}).prefill == ("a:1", "b:2")


def test_worker_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("SCD_WORKER_TOKEN", "from-env")
    assert ConnectorConfig.from_extra({"prefill": ["h:1"]}).transport.worker_token == "from-env"


@pytest.mark.parametrize("extra, match", [
    ({}, "name at least one scd-serve prefill worker"),
    ({"prefill": ["nohost"]}, "not HOST:PORT"),
    ({"prefill": 5}, "must be a list of HOST:PORT"),
    ({"prefill": ["h:1"], "method": "local"}, "method must be one of identity, raw"),
    ({"prefill": ["h:1"], "method": "auto"}, "method must be one of"),
    ({"prefill": ["h:1"], "codebook": "/no/such/dir"}, "no such directory"),
    ({"prefill": ["h:1"], "min_prompt_tokens": 1}, "min_prompt_tokens must be an integer >= 2"),
    ({"prefill": ["h:1"], "min_prompt_tokens": True}, "min_prompt_tokens"),
    ({"prefill": ["h:1"], "prefil_timeout_s": 3}, r"unknown key\(s\) prefil_timeout_s \(known: .*prefill_timeout_s"),
    ({"prefill": ["h:1"], "prefill_timeout_s": 0}, r"prefill_timeout_s must be in \(0, 3600\]"),
    ({"prefill": ["h:1"], "prior_table": "always"}, "prior_table must be one of auto, on, off"),
    ({"prefill": ["h:1"], "prior_table_budget_s": -1}, r"prior_table_budget_s must be in \[0, 86400\]"),
])
def test_mistakes_are_refused_by_name(extra, match):
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra(extra)


@pytest.mark.parametrize("method, plans, want", [
    ("scd", {"scd": {}}, 24), ("scd-int8", {"scd": {}}, 24), ("prior-only", {"scd": {}}, 24),
    ("reuse", {"scd": {}, "reuse": {}}, 0), ("raw", {"scd": {}}, 0), ("identity", {"scd": {}}, 0),
])
def test_replayed_tail_read_from_the_manifest_alone(method, plans, want):
    """The scheduler side counts the tail vLLM computes from the manifest, as the codec does."""
    book = Codebook({"replay_tokens": 24, "plans": plans}, {})
    assert codec_registry.replayed(method, book) == want
    assert codec_registry.replayed(method, None) == 0
