"""Summaries of request timings: percentiles, throughput, goodput under an SLO; and timings of
code paths side by side (`alternated`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """Timestamps (time.perf_counter seconds) of one streamed request."""

    sent: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    done: float | None = None
    num_tokens: int = 0  # token events seen on the stream
    reported_tokens: int | None = None  # usage.completion_tokens, when the server sends it
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None and self.done is not None

    @property
    def tokens(self) -> int:
        return self.reported_tokens if self.reported_tokens is not None else self.num_tokens

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(frozen=True)
class Slo:
    """A request is 'good' if its TTFT and its mean inter-token latency are both within bounds."""

    ttft_s: float = 2.0
    itl_s: float = 0.25

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft > self.ttft_s:
            return False
        itl = r.itls
        return not itl or sum(itl) / len(itl) <= self.itl_s


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": (sum(values) / len(values)) if values else None, "n": len(values)}


def median(values: list[float]) -> float | None:
    return percentile(values, 50)


def median_s(fn, repeat: int, setup=lambda: None) -> float:
    """Median seconds of fn(setup()) over `repeat` calls, after one warm-up; setup is not timed."""
    fn(setup())  # warm-up (caches, allocator)
    times = []
    for _ in range(repeat):
        arg = setup()
        start = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - start)
    return median(times)


def summarize(results: list[RequestResult], wall_s: float, slo: Slo) -> dict:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if slo.met(r)]
    rate = lambda x: x / wall_s if wall_s > 0 else 0.0  # noqa: E731
    return {"requests": len(results), "completed": len(ok),
            "errors": sorted({r.error for r in results if r.error})[:5], "num_errors": len(results) - len(ok),
            "wall_s": wall_s, "ttft_s": dist([r.ttft for r in ok]),
            "itl_s": dist([x for r in ok for x in r.itls]), "e2e_s": dist([r.e2e for r in ok]),
            "throughput_tokens_per_s": rate(sum(r.tokens for r in ok)),
            "throughput_requests_per_s": rate(len(ok)), "goodput_requests_per_s": rate(len(good)),
            "goodput_tokens_per_s": rate(sum(r.tokens for r in good)),
            "slo": {"ttft_s": slo.ttft_s, "mean_itl_s": slo.itl_s, "met": len(good)}}


def alternated(paths: dict[str, Callable[[], object]], rounds: int, calls: int, warm: int = 0) -> dict[str, list[float]]:
    """Seconds of each call of each path, by name: in each of `rounds` rounds every path in turn,
    `warm` untimed calls then `calls` timed ones. Side by side, so that a shared machine's drifting
    load weighs on every path alike (compare medians)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            for _ in range(warm):
                fn()
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return times
