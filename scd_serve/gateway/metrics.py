"""The gateway's Prometheus series: what it proxied, to whom, and what its clients waited.

The latency histograms are measured where the client sits, in front of every hop (the only
latency a user sees when compose publishes just the gateway); a non-streamed response has
no first event and counts toward end to end only.
"""

from __future__ import annotations

import json
import time
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from scd_serve.api.metrics import LATENCY_BUCKETS, TOKEN_GAP_BUCKETS
from scd_serve.control.registry import Registry


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        latency = partial(Histogram, buckets=LATENCY_BUCKETS, registry=r)
        self.requests = counter("scd_gateway_requests_total", "requests proxied, by decode worker and status",
                                ["worker", "status"])
        self.unreachable = counter("scd_gateway_worker_errors_total", "decode workers that could not be reached",
                                   ["worker"])
        self.broken = counter("scd_gateway_upstream_broken_total", "responses whose upstream broke mid-body",
                              ["worker"])
        self.workers = gauge("scd_gateway_workers", "registered workers by role and readiness", ["role", "ready"])
        self.load = gauge("scd_worker_load", "load each worker reported in its last heartbeat",
                          ["role", "worker", "key"])
        self.ttft = latency("scd_gateway_time_to_first_token_seconds",
                            "request received at the gateway -> first streamed event relayed", ["model_name"])
        self.inter_token = Histogram("scd_gateway_inter_token_latency_seconds",
                                     "gap between consecutive streamed events relayed", ["model_name"],
                                     buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = latency("scd_gateway_e2e_request_latency_seconds",
                           "request received at the gateway -> last byte relayed, by status", ["model_name", "status"])

    def refresh(self, registry: Registry) -> None:
        self.workers.clear()
        self.load.clear()
        for rec in registry.workers():
            self.workers.labels(rec.role, str(rec.ready).lower()).inc()
            for key, value in rec.load.items():
                self.load.labels(rec.role, rec.address, key).set(value)

    def clock(self, body: bytes) -> "RequestClock":
        return RequestClock(self, model_of(body))

    def render(self, registry: Registry) -> tuple[bytes, str]:
        self.refresh(registry)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def model_of(body: bytes) -> str:
    """The request's `model` field, for the model_name label ("" when the body has none)."""
    try:
        model = json.loads(body).get("model", "")
    except (ValueError, AttributeError):
        return ""
    return model if isinstance(model, str) else ""


class RequestClock:
    """Times one proxied request from the moment the gateway received it."""

    def __init__(self, metrics: GatewayMetrics, model: str):
        self.metrics, self.model, self.status = metrics, model, "499"
        self.start = self.last = time.perf_counter()
        self.events = 0

    def event(self) -> None:
        """One server-sent event with content relayed to the client (not the closing [DONE])."""
        now = time.perf_counter()
        hist = self.metrics.ttft if self.events == 0 else self.metrics.inter_token
        hist.labels(self.model).observe(now - self.last)
        self.events += 1
        self.last = now

    def end(self) -> None:
        self.metrics.e2e.labels(self.model, self.status).observe(time.perf_counter() - self.start)
