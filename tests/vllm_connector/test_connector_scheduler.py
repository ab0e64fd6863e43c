"""SCDConnector's scheduler side, plain bookkeeping: what a prompt claims, when a claim is
committed, what a step's metadata carries. vLLM's own config class, the rest stand-ins (no engine)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

if os.environ.get("SCD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from scd_serve.codec.codebook import MANIFEST  # noqa: E402
from scd_serve.errors import ConfigError  # noqa: E402
from scd_serve.vllm.connector import SCDConnector  # noqa: E402

BLOCK = 16


def connector(extra=None, role="kv_consumer", groups=1, replay=None, tmp_path=None, tp=1, pp=1):
    extra = {"prefill": ["127.0.0.1:1"], "method": "identity", **(extra or {})}
    if replay is not None:
        (tmp_path / MANIFEST).write_text(f'{{"replay_tokens": {replay}, "plans": {{"scd": {{}}}}}}')
        extra |= {"method": "scd", "codebook": str(tmp_path)}
    config = SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector="SCDConnector", kv_role=role,
                                                                 kv_connector_extra_config=extra),
                             cache_config=SimpleNamespace(block_size=BLOCK),
                             parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    return SCDConnector(config, KVConnectorRole.SCHEDULER, SimpleNamespace(kv_cache_groups=[0] * groups))


def request(rid, n, params=None):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(100, 100 + n)), kv_transfer_params=params)


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def step(c):
    return c.build_connector_meta(SimpleNamespace()).loads


def test_claims_the_handoff_past_vllms_own_hit_less_the_replayed_tail(tmp_path):
    c = connector(replay=8, tmp_path=tmp_path)
    assert c.get_num_new_matched_tokens(request("a", 100), 0) == (100 - 1 - 8, True)
    assert c.get_num_new_matched_tokens(request("b", 100), 32) == (100 - 1 - 8 - 32, True)
    assert c.get_num_new_matched_tokens(request("c", 40), 32) == (0, False)  # vLLM holds all it would get
    plain = connector()
    assert plain.get_num_new_matched_tokens(request("d", 100), 0) == (99, True)
    assert plain.get_num_new_matched_tokens(request("e", 15), 0) == (0, False)  # under min_prompt_tokens
    assert plain.get_num_new_matched_tokens(request("f", 100, {"scd": False}), 0) == (0, False)


def test_a_step_carries_the_committed_load_once():
    c = connector()
    r = request("a", 50)
    n, _ = c.get_num_new_matched_tokens(r, BLOCK)
    c.update_state_after_alloc(r, blocks([7, 3, 9, 4]), n)
    (load,) = step(c)
    assert (load.request_id, load.start, load.tokens, load.block_ids) == ("a", BLOCK, r.prompt_token_ids[:49],
                                                                          [7, 3, 9, 4])
    assert step(c) == []


def test_a_claim_without_blocks_is_asked_again_a_committed_one_is_not():
    """No free blocks this step: vLLM asks again later and the claim stands. Asked again after a
    committed transfer (its load failed, or a preemption): vLLM computes the prompt itself."""
    c = connector()
    r = request("a", 50)
    assert c.get_num_new_matched_tokens(r, 0) == (49, True)  # no allocation followed
    assert c.get_num_new_matched_tokens(r, 0) == (49, True)
    c.update_state_after_alloc(r, blocks([1, 2, 3, 4]), 49)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.request_finished(r, [1, 2, 3, 4])
    assert c.get_num_new_matched_tokens(r, 0) == (49, True)  # a new request of the same id


def test_no_load_when_vllm_loads_nothing():
    c = connector()
    r = request("a", 50)
    c.get_num_new_matched_tokens(r, 0)
    c.update_state_after_alloc(r, blocks([1, 2, 3, 4]), 0)  # vLLM kept its own hit instead
    assert step(c) == []


@pytest.mark.parametrize("kw, match", [({"role": "kv_producer"}, "serves kv_role 'kv_consumer'"),
                                       ({"role": "kv_both"}, "serves kv_role 'kv_consumer'"),
                                       ({"groups": 2}, "one KV cache group; this one has 2"),
                                       ({"tp": 2}, "tensor_parallel_size 2, pipeline_parallel_size 1"),
                                       ({"pp": 2}, "single-worker vLLM engine"),
                                       ({"extra": {"method": "nope"}}, "method must be one of")])
def test_refused_at_start(kw, match):
    with pytest.raises(ConfigError, match=match):
        connector(**kw)


def test_stats_add_up_and_say_the_codes_share_of_raw():
    from scd_serve.vllm.stats import SCDConnectorStats

    a, b = SCDConnectorStats(), SCDConnectorStats()
    a.record(rows=100, code_bytes=2_000, raw_bytes=10_000, seconds=0.2)
    b.record(rows=300, code_bytes=6_000, raw_bytes=30_000, seconds=0.4)
    b.record(failed=True)
    assert SCDConnectorStats().is_empty() and not a.is_empty()
    total = SCDConnector.build_kv_connector_stats(a.aggregate(b).data)
    assert total.reduce() == {"scd_loads": 3, "scd_failed": 1, "scd_rows": 400, "scd_code_MB": 0.008,
                              "scd_vs_raw16": 0.2, "scd_mean_load_s": 0.3}
