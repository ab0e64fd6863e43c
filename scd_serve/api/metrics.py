"""Metrics: the Prometheus series of one serving process, in its own registry.

The API records request latencies (TTFT, inter-token, end to end) and outcomes; the
transfer side records what it moved through `observe_transfer` (bytes, ratio to raw
KV, encode / rebuild / transfer time); engine gauges are read from `stats()` at scrape.
Pass one Metrics object to `create_app(..., metrics=m)` and to the transfer client.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_RATIO = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("scd_requests_total", "HTTP generation requests by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("scd_time_to_first_token_seconds", "request received -> first token",
                              ["method"], buckets=_LATENCY, registry=r)
        self.inter_token = Histogram("scd_inter_token_latency_seconds", "gap between consecutive tokens",
                                     ["method"], buckets=_TOKEN_GAP, registry=r)
        self.e2e = Histogram("scd_e2e_request_latency_seconds", "request received -> last token",
                             ["method"], buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("scd_prompt_tokens_total", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("scd_generation_tokens_total", "tokens generated", registry=r)
        self.running = Gauge("scd_num_requests_running", "sequences in the decode batch", registry=r)
        self.waiting = Gauge("scd_num_requests_waiting", "admitted requests waiting for KV blocks or a fill",
                             registry=r)
        self.free_blocks = Gauge("scd_kv_blocks_free", "free KV pool blocks", registry=r)
        self.total_blocks = Gauge("scd_kv_blocks_total", "KV pool blocks", registry=r)
        self.transfer_bytes = Counter("scd_transfer_bytes_total", "payload bytes received for KV fills",
                                      ["method"], registry=r)
        self.raw_kv_bytes = Counter("scd_transfer_raw_kv_bytes_total", "raw KV bytes those payloads stand for",
                                    ["method"], registry=r)
        self.payload_ratio = Histogram("scd_transfer_payload_ratio", "payload bytes / raw KV bytes per transfer",
                                       ["method"], buckets=_RATIO, registry=r)
        self.encode_seconds = Histogram("scd_transfer_encode_seconds", "producer-side encode time per transfer",
                                        ["method"], buckets=_LATENCY, registry=r)
        self.rebuild_seconds = Histogram("scd_transfer_rebuild_seconds", "consumer-side rebuild time per transfer",
                                         ["method"], buckets=_LATENCY, registry=r)
        self.transfer_seconds = Histogram("scd_transfer_seconds", "fill start -> last layer written",
                                          ["method"], buckets=_LATENCY, registry=r)
        self.transfers = Counter("scd_transfers_total", "KV fills by outcome (ok, failed, fallback)",
                                 ["method", "outcome"], registry=r)

    def observe_transfer(self, method: str, *, payload_bytes: int, raw_bytes: int | None = None,
                         encode_s: float | None = None, rebuild_s: float | None = None,
                         transfer_s: float | None = None, outcome: str = "ok") -> None:
        """Called by the transfer side once per request fill. Thread-safe."""
        self.transfers.labels(method, outcome).inc()
        self.transfer_bytes.labels(method).inc(payload_bytes)
        if raw_bytes:
            self.raw_kv_bytes.labels(method).inc(raw_bytes)
            self.payload_ratio.labels(method).observe(payload_bytes / raw_bytes)
        for hist, value in ((self.encode_seconds, encode_s), (self.rebuild_seconds, rebuild_s),
                            (self.transfer_seconds, transfer_s)):
            if value is not None:
                hist.labels(method).observe(value)

    def update_from_stats(self, stats: dict) -> None:
        for gauge, key in ((self.running, "num_running"), (self.free_blocks, "num_free_blocks"),
                           (self.total_blocks, "num_total_blocks")):
            if key in stats:
                gauge.set(stats[key])
        self.waiting.set(stats.get("num_waiting", 0) + stats.get("num_filling", 0))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
