"""Load-generator arithmetic: percentiles, goodput, Poisson arrivals."""

import pytest

from scd_serve.bench.loadgen import poisson_arrivals
from scd_serve.bench.stats import RequestResult, Slo, alternated, percentile, summarize


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([], 50) is None


def test_summary_counts_goodput_against_slo():
    fast = RequestResult(sent=0.0, first_token=0.1, token_times=[0.1, 0.2, 0.3], done=0.3, num_tokens=3)
    slow = RequestResult(sent=0.0, first_token=5.0, token_times=[5.0, 5.1], done=5.1, num_tokens=2)
    failed = RequestResult(sent=0.0, error="HTTP 429")
    s = summarize([fast, slow, failed], wall_s=10.0, slo=Slo(ttft_s=1.0, itl_s=0.5))
    assert s["completed"] == 2 and s["num_errors"] == 1
    assert s["throughput_tokens_per_s"] == pytest.approx(0.5)
    assert s["goodput_requests_per_s"] == pytest.approx(0.1)
    assert s["ttft_s"]["p50"] == pytest.approx(2.55)


def test_reported_usage_overrides_event_count():
    r = RequestResult(sent=0.0, first_token=0.1, token_times=[0.1], done=0.2, num_tokens=1, reported_tokens=4)
    assert summarize([r], 1.0, Slo())["throughput_tokens_per_s"] == 4


def test_poisson_arrivals_are_increasing_with_the_right_mean_rate():
    ts = poisson_arrivals(rate=10.0, num=2000, seed=1)
    assert all(b > a for a, b in zip(ts, ts[1:]))
    assert 2000 / ts[-1] == pytest.approx(10.0, rel=0.1)


def test_alternated_takes_turns_warms_each_round_and_times_only_the_timed_calls():
    order = []
    times = alternated({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=2, calls=2, warm=1)
    assert order == ["a"] * 3 + ["b"] * 3 + ["a"] * 3 + ["b"] * 3
    assert {name: len(ts) for name, ts in times.items()} == {"a": 4, "b": 4}
    assert all(t >= 0 for ts in times.values() for t in ts)
