"""`scd-serve plan`: shapes, cost rules and the printed/JSON projection."""

import json

import pytest

from scd_serve.planner.costs import METHODS, RankPlan, method_cost
from scd_serve.planner.shapes import available, load_shape
from scd_serve.planner.units import parse_bandwidth
from scd_serve.cli import main
from scd_serve.errors import ConfigError


def test_shipped_configs_have_public_parameter_counts():
    assert {"mistral-7b", "llama-3-8b", "qwen2.5-32b"} <= set(available())
    assert load_shape("Mistral-7B").num_params == pytest.approx(7.24e9, rel=0.01)
    assert load_shape("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert load_shape("qwen2.5-32b").num_params == pytest.approx(32.5e9, rel=0.02)


def test_raw_payload_is_16bit_kv_of_every_layer():
    s = load_shape("mistral-7b")
    raw = method_cost("raw", s, 1025, RankPlan())
    assert raw.payload_bytes == 32 * 1024 * 2 * 1024 * 2  # layers * (T-1) * (K+V) * width * 2 bytes
    # quant4 carries 4 bits plus an fp16 scale and min per 32 elements
    q4 = method_cost("quant4", s, 1025, RankPlan())
    assert q4.payload_bytes == pytest.approx(raw.payload_bytes * (0.5 + 4 / 32) / 2)
    assert method_cost("oracle", s, 1025, RankPlan()).payload_bytes == 0


def test_scd_int8_halves_scd_codes():
    s = load_shape("llama-3-8b")
    scd, int8 = (method_cost(m, s, 2048, RankPlan()) for m in ("scd", "scd-int8"))
    assert int8.payload_bytes < 0.51 * scd.payload_bytes


@pytest.mark.parametrize("text,bps", [("100mbit", 12.5e6), ("10Gbps", 1.25e9), ("1500MB/s", 1.5e9), ("8kbit", 1e3)])
def test_parse_bandwidth(text, bps):
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("bad", ["fast", "-1gbit", "0mbit", ""])
def test_parse_bandwidth_rejects(bad):
    with pytest.raises(ConfigError):
        parse_bandwidth(bad)


def test_plan_cli_prints_formula_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model-config", "qwen2.5-32b", "--bandwidth", "10gbit", "100gbit",
               "--prompt-tokens", "256", "1024", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "warm TTFT   = max(wire, rebuild) + first step" in text
    doc = json.loads(out.read_text())
    assert len(doc["results"]) == 4
    for res in doc["results"]:
        assert [r["method"] for r in res["rows"]] == list(METHODS)
        raw = next(r for r in res["rows"] if r["method"] == "raw")
        assert raw["wire_s"] == pytest.approx(raw["payload_bytes"] / res["bandwidth_bytes_per_s"])


def test_plan_cli_unknown_model_is_a_clear_error(capsys):
    assert main(["plan", "--model-config", "gpt-9", "--bandwidth", "1gbit"]) == 2
    assert "mistral-7b" in capsys.readouterr().err


def test_rank_ratios_come_from_the_codebook_manifest(tmp_path, capsys):
    spec = {"num_layers": 4, "hidden_size": 64, "num_kv_heads": 2, "head_dim": 16, "rope_theta": 1e4}
    plans = {"scd": [{"mode": "reuse", "r_k": 8, "r_v": 16}] * 3 + [{"mode": "patch", "r_h": 32}],
             "reuse": [{"mode": "reuse", "r_k": 16, "r_v": 16}] * 4}
    (tmp_path / "manifest.json").write_text(json.dumps({"producer": spec, "consumer": spec, "plans": plans,
                                                        "droidspeak_layers": [0]}))
    from scd_serve.planner.ranks import rank_plan_from_codebook

    rp = rank_plan_from_codebook(tmp_path)
    assert (rp.k_ratio, rp.v_ratio, rp.patch_fraction, rp.h_ratio) == (0.25, 0.5, 0.25, 0.5)
    assert (rp.reuse_k_ratio, rp.droidspeak_fraction) == (0.5, 0.25)
    s = load_shape("mistral-7b")
    reuse = method_cost("reuse", s, 1025, rp)
    assert reuse.payload_bytes == 32 * 1024 * (512 + 512) * 2
    assert main(["plan", "--model-config", "mistral-7b", "--bandwidth", "1gbit", "--codebook", str(tmp_path)]) == 0
    assert "patch layers 8/32" in capsys.readouterr().out


def test_a_run_ships_one_residual_code_and_costs_its_layers_on_the_decode_side(tmp_path, capsys):
    spec = {"num_layers": 4, "hidden_size": 64, "num_kv_heads": 2, "head_dim": 16, "rope_theta": 1e4}
    plans = {"scd": [{"mode": "reuse", "r_k": 8, "r_v": 16}] * 2 + [{"mode": "run", "r_h": 64},
                                                                    {"mode": "run", "r_h": 0}]}
    (tmp_path / "manifest.json").write_text(json.dumps({"producer": spec, "consumer": spec, "plans": plans}))
    from scd_serve.planner.ranks import rank_plan_from_codebook

    rp = rank_plan_from_codebook(tmp_path)
    assert (rp.run_fraction, rp.run_ratio, rp.patch_fraction) == (0.5, 1.0, 0.0)
    s = load_shape("mistral-7b")  # 32 layers: 16 reuse, a run of 16 from a 4096-wide residual code
    scd = method_cost("scd", s, 1025, rp)
    assert scd.payload_bytes == 1024 * (16 * (256 + 512) + 4096) * 2
    assert scd.rebuild_flops > 16 * s.layer_flops(1024) > method_cost("scd", s, 1025, RankPlan()).rebuild_flops
    assert main(["plan", "--model-config", "mistral-7b", "--bandwidth", "1gbit", "--codebook", str(tmp_path)]) == 0
    assert "the consumer runs 16 layers itself" in capsys.readouterr().out


def test_bad_codebook_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "manifest.json").write_text("{}")
    assert main(["plan", "--model-config", "mistral-7b", "--bandwidth", "1gbit", "--codebook", str(tmp_path)]) == 2
    assert "lacks plan or spec" in capsys.readouterr().err


def test_crossover_is_the_bandwidth_at_which_a_warm_transfer_ties_the_local_prefill(tmp_path, capsys):
    from scd_serve.planner.project import Rates, crossover, project

    shape, rates = load_shape("llama-3-8b"), Rates(150.0, 150.0, 1500.0, "given")
    at = crossover(shape, 1024, RankPlan(), rates)
    assert set(at) == set(METHODS) - {"oracle"} and at["scd-int8"] < at["scd"] < at["raw"]
    for method in ("raw", "scd-int8"):  # at the crossover the projected warm TTFT equals the oracle's
        rows = {r.method: r for r in project(shape, 1024, at[method], RankPlan(), rates, ["oracle", method])}
        assert rows[method].warm_ttft_s == pytest.approx(rows["oracle"].warm_ttft_s, rel=1e-9)
    slow_rebuild = Rates(150.0, 1e-6, 1500.0, "given")  # a rebuild slower than the whole prefill
    assert crossover(shape, 1024, RankPlan(), slow_rebuild)["scd"] is None
    assert main(["plan", "--model-config", "llama-3-8b", "--bandwidth", "1gbit", "--prompt-tokens", "1024",
                 "--json", str(tmp_path / "p.json")]) == 0
    assert "where a transfer pays off" in capsys.readouterr().out
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["crossover_bytes_per_s"]["1024"]["scd"] == pytest.approx(at["scd"])
