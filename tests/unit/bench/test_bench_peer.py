"""`bench peer`'s ratios: each scd-serve target's speed over vLLM's (above 1.0 is faster)."""

from scd_serve.bench.peer import paired_summary, ratios


def result(tokens_per_s, tpot_ms, ttft_s):
    return {"streams": {"8": {"wall_s": 1.0, "tokens_per_s": tokens_per_s, "ttft_p50_s": 0.1, "tpot_p50_ms": tpot_ms}},
            "ttft": {"1024": {"p50_s": ttft_s, "p90_s": ttft_s * 1.2}}}


def test_speed_over_vllm_and_pd_over_local():
    got = ratios({"bfloat16": {"vllm": result(100.0, 50.0, 0.5), "scd": result(50.0, 100.0, 1.0),
                               "pd": result(40.0, 100.0, 1.1)}})["bfloat16"]
    assert got["scd_over_vllm"] == {"tokens_per_s@8": 0.5, "tpot@8": 0.5, "ttft_p50@1024": 0.5}
    assert got["pd_over_vllm"]["ttft_p50@1024"] == round(0.5 / 1.1, 3)
    assert got["pd_ttft_over_local"] == {"1024": 1.1}


def test_without_vllm_only_pd_over_local():
    assert ratios({"float32": {"scd": result(1.0, 1.0, 1.0), "pd": result(1.0, 1.0, 2.0)}}) == \
        {"float32": {"pd_ttft_over_local": {"1024": 2.0}}}


def test_pd_over_local_from_paired_rounds_is_the_median_of_their_ratios():
    rounds = [{"local": 1.0, "pd": 1.1}, {"local": 2.0, "pd": 2.0}, {"local": 1.0, "pd": 1.3}]
    assert paired_summary(rounds) == {"local_p50_s": 1.0, "pd_p50_s": 1.3, "pd_over_local": 1.1}
    # the ratios prefer the paired figure to the two targets' own TTFTs (timed apart: 2.0 here)
    by = {"float32": {"scd": result(1.0, 1.0, 1.0), "pd": result(1.0, 1.0, 2.0)}}
    assert ratios(by, {"float32": {"1024": paired_summary(rounds)}})["float32"]["pd_ttft_over_local"] == {"1024": 1.1}
