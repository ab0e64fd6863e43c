"""`bench ttft` bookkeeping on synthetic probe samples: medians, lower bound, targets, plots."""

from types import SimpleNamespace

import pytest

from scd_serve.bench import plot
from scd_serve.bench.report import check_targets, summarize_rows
from scd_serve.bench.ttft import choose_sweep

ARGS = SimpleNamespace(reps=1, producer="p", consumer="c", codebook=None)


def _sample(ttft, payload, rebuild=0.01, first=0.005):
    return {"ttft_s": ttft, "payload_bytes": payload, "cache_hit": True, "producer_s": 0.0, "first_chunk_s": 0.001,
            "recv_s": ttft - first, "wire_s": ttft - first - 0.001, "rebuild_s": rebuild, "rebuild_tail_s": 0.0,
            "first_step_s": first}


def _doc():
    calib = [{"method": "oracle", "prompt_tokens": 1024, "mode": "local", "samples": [{"ttft_s": 0.3}]},
             {"method": "identity", "prompt_tokens": 1024, "mode": "cold", "samples": [{"ttft_s": 0.4, "producer_s": 0.28}]}]
    points = []
    for bw in (1e9, 1e8):  # bytes/s
        rows = []
        for method, payload in (("raw", 2e7), ("quant4", 6e6), ("droidspeak", 2.2e7), ("scd", 1e6)):
            rows.append({"method": method, "prompt_tokens": 1024, "mode": "warm",
                         "samples": [_sample(payload / bw + 0.006, payload)]})
        points.append({"bandwidth_bytes_per_s": bw, "bandwidth": f"{bw * 8 / 1e9:g}Gbit", "rows": rows, "elapsed_s": 1})
    return summarize_rows(calib, points, {"kind": "test"}, 1024, ARGS)


def test_rows_carry_lower_bound_and_ratio():
    doc = _doc()
    scd = next(r for r in doc["sweep"][1]["rows"] if r["method"] == "scd")
    assert scd["lower_bound_s"] == pytest.approx(max(1e6 / 1e8, 0.01) + 0.005)
    assert scd["ratio_to_lower_bound"] == pytest.approx(scd["ttft_s"] / scd["lower_bound_s"])
    assert scd["pipelined_floor_s"] == pytest.approx(0.01 + 0.005)  # rebuild + step, one thread
    raw = next(r for r in doc["sweep"][1]["rows"] if r["method"] == "raw")  # the wire dominates
    assert raw["lower_bound_s"] == pytest.approx(2e7 / 1e8 + 0.005)
    assert raw["pipelined_floor_s"] == pytest.approx(2e7 / 1e8)  # the step hides in the wait for bytes
    assert raw["ratio_to_pipelined_floor"] == pytest.approx(raw["ttft_s"] / raw["pipelined_floor_s"])
    assert scd["speedup_vs_oracle"] == pytest.approx(0.3 / scd["ttft_s"])


def test_targets_use_the_raw_dominant_bandwidth_and_f1():
    f1 = {"oracle": 0.8, "raw": 0.3, "quant4": 0.1, "droidspeak": 0.7, "scd": 0.78}
    t = check_targets(_doc(), f1, 1024)
    assert t["scd_vs_oracle_and_raw"]["bandwidth"] == "0.8Gbit"  # raw wire: 20 ms at 8 Gbit, 200 ms at 0.8 (oracle 300)
    assert t["scd_vs_oracle_and_raw"]["met"] is True
    assert t["scd_pareto_dominates_quant4_droidspeak"]["at"] == ["8Gbit", "0.8Gbit"]
    worse = dict(f1, scd=0.5)
    assert check_targets(_doc(), worse, 1024)["scd_pareto_dominates_quant4_droidspeak"]["met"] is False


def test_the_sweep_point_at_half_the_oracle_counts_as_raw_dominant_despite_rounding():
    raw_bytes, oracle = 1047552.0, 0.05963465199602069  # a run where the rounding dropped it
    bws = choose_sweep(oracle, raw_bytes)
    calib = [{"method": "oracle", "prompt_tokens": 1024, "mode": "local", "samples": [{"ttft_s": oracle}]}]
    points = [{"bandwidth_bytes_per_s": bw, "bandwidth": f"p{i}", "elapsed_s": 1,
               "rows": [{"method": m, "prompt_tokens": 1024, "mode": "warm",
                         "samples": [_sample(p / bw + 0.006, p)]} for m, p in (("raw", raw_bytes), ("scd", 3e5))]}
              for i, bw in enumerate(bws)]
    doc = summarize_rows(calib, points, {"kind": "test"}, 1024, ARGS)
    assert check_targets(doc, None, 1024)["scd_vs_oracle_and_raw"]["bandwidth"] == "p2"  # shares .05, .25, .5


def test_plots_are_pngs(tmp_path):
    doc = _doc()
    a = plot.ttft_vs_bandwidth(doc, tmp_path / "t.png", 1024)
    b = plot.pareto(doc, {"scd": 0.8, "raw": 0.3, "oracle": 0.81}, tmp_path / "p.png", 1024)
    for p in (a, b):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_spans_raw_negligible_to_dominant():
    bws = choose_sweep(oracle_s=0.2, raw_bytes=4e6)
    shares = [4e6 / bw / 0.2 for bw in bws]
    assert min(shares) <= 0.05 + 1e-9 and max(shares) >= 4 - 1e-9
    assert bws == sorted(bws, reverse=True)


def test_f1_is_read_from_the_eval_harness_json(tmp_path):
    import json

    from scd_serve.bench.report import f1_by_method

    doc = {"methods": [{"method": "oracle", "f1": 0.8}, {"method": "scd", "f1": 0.75},
                       {"method": "reuse", "skipped": "needs --codebook"}]}
    (tmp_path / "q.json").write_text(json.dumps(doc))
    assert f1_by_method(tmp_path / "q.json") == {"oracle": 0.8, "scd": 0.75}
