"""The prefill worker's Prometheus series and the small HTTP server that exposes them.

A prefill worker speaks gRPC only; `--metrics-port` adds GET /metrics (and /live) on its own
port, behind the worker token when there is one (Prometheus sends it as a bearer token).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scd_serve.api.auth import key_matches
from scd_serve.api.metrics import LATENCY_BUCKETS

class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.transfers = Counter("scd_prefill_transfers_total", "transfers by method and outcome",
                                 ["method", "outcome"], registry=r)
        self.prompt_tokens = Counter("scd_prefill_prompt_tokens_total", "prompt tokens of served transfers",
                                     ["method"], registry=r)
        self.sent_bytes = Counter("scd_prefill_sent_bytes_total", "bytes of chunk messages sent", ["method"],
                                  registry=r)
        self.seconds = Histogram("scd_prefill_transfer_seconds", "Prefill call, admitted to last chunk written",
                                 ["method", "cache"], buckets=LATENCY_BUCKETS, registry=r)

    def watch(self, load: Callable[[], dict]) -> None:
        """Gauges read from the servicer's load() at each scrape."""
        self.registry.register(_LoadCollector(load))

    def watch_calls(self, guard) -> None:
        """scd_prefill_refused_calls_total{reason} from the gRPC server's CallGuard, at each scrape."""
        self.registry.register(_RefusedCollector(guard))

    def observe(self, method: str, outcome: str, tokens: int, sent: int, seconds: float, cache_hit: bool) -> None:
        self.transfers.labels(method, outcome).inc()
        self.sent_bytes.labels(method).inc(sent)
        if outcome == "served":
            self.prompt_tokens.labels(method).inc(tokens)
            self.seconds.labels(method, "hit" if cache_hit else "miss").observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LoadCollector(Collector):
    def __init__(self, load: Callable[[], dict]):
        self._load = load

    def collect(self):
        now = self._load()
        for key, help_ in (("running", "transfers running"), ("capacity", "transfers at once (max_concurrent)"),
                           ("cache_entries", "prompts in the code cache"), ("cache_bytes", "bytes in the code cache")):
            yield GaugeMetricFamily(f"scd_prefill_{key}", help_, value=now[key])
        yield CounterMetricFamily("scd_prefill_cache_hits", "transfers served from the code cache",
                                  value=now["cache_hits"])


class _RefusedCollector(Collector):
    def __init__(self, guard):
        self._guard = guard

    def collect(self):
        family = CounterMetricFamily("scd_prefill_refused_calls", "gRPC calls refused before a handler ran, by reason",
                                     labels=["reason"])
        family.add_metric(["unauthenticated"], self._guard.num_unauthenticated)
        family.add_metric(["malformed"], self._guard.num_malformed)
        yield family


def metrics_app(metrics: PrefillMetrics, token: str):
    """GET /metrics (bearer `token` when set) and GET /live."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    async def scrape(request):
        if token and not key_matches(request.headers.get("authorization"), token):
            return PlainTextResponse("missing or wrong bearer token (the worker token)", status_code=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def live(request):
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/metrics", scrape), Route("/live", live)])
