"""The eval harness on a seconds-sized pair made by the real make-demo-pair code."""

import json
from dataclasses import replace

import pytest

from scd_serve.cli import main
from scd_serve.config.pair import PairConfig
from scd_serve.errors import ConfigError
from scd_serve.model import ModelRuntime
from scd_serve.pair.make_pair import make_pair
from scd_serve.quality.harness import evaluate, format_table


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    make_pair(PairConfig(seed=1).shrunk(), out, probe_n=0, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def runtimes(pair):
    return ModelRuntime.load(pair / "producer"), ModelRuntime.load(pair / "consumer")


def test_identity_on_one_model_equals_its_oracle_exactly(runtimes):
    rt_a, _ = runtimes
    oracle = evaluate(rt_a, rt_a, "oracle", limit=4, text_limit=2, split="smoke")
    same = evaluate(rt_a, rt_a, "identity", limit=4, text_limit=2, split="smoke")
    for key in ("f1", "em", "agreement", "ppl"):
        assert same[key] == oracle[key], key
    assert same["kl"] == 0.0 and same["tv"] == 0.0 and same["agreement"] == 1.0
    assert same["payload_bytes_per_token"] == 2 * same["raw_kv_bytes_per_token"]  # float32 vs 16-bit
    assert oracle["payload_bytes_per_token"] == 0 and oracle["num_examples"] == 4


def test_raw_on_one_model_matches_its_oracle(runtimes):
    rt_a, _ = runtimes
    oracle = evaluate(rt_a, rt_a, "oracle", limit=4, text_limit=2, split="smoke")
    raw = evaluate(rt_a, rt_a, "raw", limit=4, text_limit=2, split="smoke")
    assert (raw["f1"], raw["em"], raw["agreement"]) == (oracle["f1"], oracle["em"], 1.0)
    assert raw["kl"] < 1e-4 and abs(raw["ppl"] - oracle["ppl"]) < 1e-2 * oracle["ppl"]  # 16-bit rounding only
    assert raw["payload_bytes_per_token"] == raw["raw_kv_bytes_per_token"]


def test_cross_model_raw_differs_from_oracle(runtimes):
    rt_a, rt_b = runtimes
    raw = evaluate(rt_a, rt_b, "raw", limit=4, text_limit=2, split="smoke")
    assert raw["kl"] > 0 and raw["tv"] > 0  # the real pair is measured by scd-serve eval


def test_mismatched_architectures_fail_before_any_compute(tmp_path, runtimes):
    cfg = PairConfig(seed=1).shrunk()
    make_pair(replace(cfg, num_layers=3), tmp_path, probe_n=0, log=lambda _: None)
    other = ModelRuntime.load(tmp_path / "consumer")
    rt_a, _ = runtimes

    def boom(*args, **kwargs):
        raise AssertionError("computed before checking the architectures")

    other.iter_prefill = boom
    with pytest.raises(ConfigError, match="layers 2 vs 3"):
        evaluate(rt_a, other, "raw", limit=2, text_limit=1, split="smoke")


def test_cli_writes_json(pair, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(["eval", "--producer", str(pair / "producer"), "--consumer", str(pair / "consumer"),
               "--method", "raw", "--split", "smoke", "--limit", "2", "--text-limit", "1", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    row = doc["methods"][0]
    assert row["method"] == "raw" and row["num_examples"] == 2
    for key in ("f1", "em", "kl", "tv", "ppl", "agreement", "payload_bytes_per_token", "raw_kv_bytes_per_token"):
        assert key in row


def test_a_value_wider_than_its_column_stays_apart_from_the_next():
    # a random-weight model's perplexity is about its vocabulary: 191,551 once ran into TV's column
    table = format_table([{"method": "oracle", "tv": 0.0, "ppl": 191551.11, "top1": 1.0}])
    assert table.splitlines()[-1].split() == ["oracle", "0.000", "191551.11", "1.000"]
