"""Metrics: the Prometheus series of one serving process, in its own registry.

The API records request latencies and outcomes, the transfer side what it moved
(`observe_transfer`); engine gauges are read from `stats()` at scrape. The request and
engine series carry vLLM's names and `model_name` label, so dashboards written for vLLM
work unchanged; `scd_*` series add latency by transfer method and the transfers themselves.
"""

from __future__ import annotations

from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_RATIO = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5)
# |predicted - actual| / actual TTFT of an `auto` choice (0.25 is a bound: the share at or below it is exact)
_ERROR = (0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0, 2.0, 5.0)


TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_MODEL = ["model_name"]


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = ""):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name  # create_app sets the served name when it is not given here
        r = self.registry
        latency = partial(Histogram, buckets=LATENCY_BUCKETS, registry=r)
        gap = partial(Histogram, buckets=TOKEN_GAP_BUCKETS, registry=r)
        tokens = partial(Histogram, buckets=TOKEN_BUCKETS, registry=r)
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        self.requests = counter("scd_requests_total", "HTTP generation requests by route and status",
                                ["route", "status"])
        # vLLM's names and labels (its docs: "Production Metrics")
        self.vllm_ttft = latency("vllm:time_to_first_token_seconds", "request received -> first token", _MODEL)
        self.vllm_inter_token = gap("vllm:inter_token_latency_seconds", "gap between consecutive tokens", _MODEL)
        # the older name of the same series; older dashboards query it
        self.vllm_per_output_token = gap("vllm:time_per_output_token_seconds", "gap between consecutive tokens", _MODEL)
        self.vllm_e2e = latency("vllm:e2e_request_latency_seconds", "request received -> last token", _MODEL)
        self.vllm_prompt_tokens = counter("vllm:prompt_tokens", "prompt tokens of finished requests", _MODEL)
        self.vllm_generation_tokens = counter("vllm:generation_tokens", "tokens generated", _MODEL)
        self.vllm_request_prompt = tokens("vllm:request_prompt_tokens", "prompt tokens per finished request", _MODEL)
        self.vllm_request_generation = tokens("vllm:request_generation_tokens", "generated tokens per finished request",
                                              _MODEL)
        self.vllm_max_generation = tokens("vllm:request_max_num_generation_tokens",
                                          "generated tokens per finished engine request (one per choice)", _MODEL)
        phases = (("queue", "arrival at the engine -> first admitted to the batch"),
                  ("prefill", "first admitted -> first token (prefill or KV transfer)"),
                  ("decode", "first token -> last token"), ("inference", "first admitted -> last token"))
        self.vllm_phase = {name: latency(f"vllm:request_{name}_time_seconds", why, _MODEL) for name, why in phases}
        self.vllm_success = counter("vllm:request_success", "finished requests by finish reason",
                                    _MODEL + ["finished_reason"])
        self.vllm_running = gauge("vllm:num_requests_running", "sequences in the decode batch", _MODEL)
        self.vllm_waiting = gauge("vllm:num_requests_waiting", "admitted requests waiting for KV blocks or a KV fill",
                                  _MODEL)
        self.vllm_kv_usage = gauge("vllm:kv_cache_usage_perc", "KV pool blocks in use (1 = full)", _MODEL)
        self.vllm_prefix_queries = counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                           _MODEL)
        self.vllm_prefix_hits = counter("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache", _MODEL)
        self.served = counter("scd_requests_served", "answered requests by where the prompt's K/V came from "
                              "(disaggregated: a prefill worker's transfer; local: this worker's own prefill)",
                              ["kv_source"])
        self.first_ahead = counter("scd_first_tokens_made_ahead", "first tokens sampled from logits made before the "
                                   "engine's step (decode_worker: a step run as the K/V landed; prefill_worker: "
                                   "the last row the prefill worker shipped)", ["by"])
        self._totals: dict[int, float] = {}  # id(counter child) -> the cumulative stat counted so far
        self.ttft = latency("scd_time_to_first_token_seconds", "request received -> first token", ["method"])
        self.inter_token = gap("scd_inter_token_latency_seconds", "gap between consecutive tokens", ["method"])
        self.e2e = latency("scd_e2e_request_latency_seconds", "request received -> last token", ["method"])
        self.free_blocks = gauge("scd_kv_blocks_free", "free KV pool blocks")
        self.total_blocks = gauge("scd_kv_blocks_total", "KV pool blocks")
        self.transfer_bytes = counter("scd_transfer_bytes_total", "payload bytes received for KV fills", ["method"])
        self.raw_kv_bytes = counter("scd_transfer_raw_kv_bytes_total", "raw KV bytes those payloads stand for",
                                    ["method"])
        self.payload_ratio = Histogram("scd_transfer_payload_ratio", "payload bytes / raw KV bytes per transfer",
                                       ["method"], buckets=_RATIO, registry=r)
        self.encode_seconds = latency("scd_transfer_encode_seconds", "producer-side encode time per transfer",
                                      ["method"])
        self.rebuild_seconds = latency("scd_transfer_rebuild_seconds", "consumer-side rebuild time per transfer",
                                       ["method"])
        self.transfer_seconds = latency("scd_transfer_seconds", "fill start -> last layer written", ["method"])
        self.transfers = counter("scd_transfers_total", "KV fills by outcome (ok, failed, fallback)",
                                 ["method", "outcome"])
        # exposed as scd_auto_choice_total
        self.auto_choices = counter("scd_auto_choice", "methods the `auto` method picked (local = no transfer)",
                                    ["method"])
        self.auto_error = Histogram("scd_auto_prediction_error_ratio",
                                    "|predicted - actual| / actual time to first token of an `auto` choice "
                                    "(from the choice; fixed-method requests are not counted)",
                                    ["method"], buckets=_ERROR, registry=r)

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

    def observe_auto_choice(self, method: str) -> None:
        self.auto_choices.labels(method).inc()

    def observe_auto_prediction(self, method: str, error_ratio: float) -> None:
        self.auto_error.labels(method).observe(error_ratio)

    def observe_first_token(self, method: str, seconds: float) -> None:
        self.ttft.labels(method).observe(seconds)
        self.vllm_ttft.labels(self.model_name).observe(seconds)

    def observe_token_gap(self, method: str, seconds: float) -> None:
        self.inter_token.labels(method).observe(seconds)
        self.vllm_inter_token.labels(self.model_name).observe(seconds)
        self.vllm_per_output_token.labels(self.model_name).observe(seconds)

    def observe_finished(self, method: str, seconds: float, first_token_s: float, finish_reason: str,
                         prompt_tokens: int | None, generated_tokens: int | None,
                         queue_s: float | None = None) -> None:
        """One engine request's last token, `seconds` and `first_token_s` after it was received
        (`*_tokens` None when the event carried no usage; `queue_s` as the engine measured it)."""
        model = self.model_name
        self.e2e.labels(method).observe(seconds)
        self.vllm_e2e.labels(model).observe(seconds)
        self.vllm_success.labels(model, finish_reason).inc()
        self.vllm_phase["decode"].labels(model).observe(seconds - first_token_s)
        if queue_s is not None:
            queue_s = min(queue_s, first_token_s)  # two clocks: never a negative prefill
            self.vllm_phase["queue"].labels(model).observe(queue_s)
            self.vllm_phase["prefill"].labels(model).observe(first_token_s - queue_s)
            self.vllm_phase["inference"].labels(model).observe(seconds - queue_s)
        if prompt_tokens is not None and generated_tokens is not None:
            self.vllm_prompt_tokens.labels(model).inc(prompt_tokens)
            self.vllm_generation_tokens.labels(model).inc(generated_tokens)
            self.vllm_request_prompt.labels(model).observe(prompt_tokens)
            self.vllm_request_generation.labels(model).observe(generated_tokens)
            self.vllm_max_generation.labels(model).observe(generated_tokens)

    def update_from_stats(self, stats: dict) -> None:
        model = self.model_name
        for gauge, key in ((self.free_blocks, "num_free_blocks"), (self.total_blocks, "num_total_blocks")):
            if key in stats:
                gauge.set(stats[key])
        if "num_running" in stats:
            self.vllm_running.labels(model).set(stats["num_running"])
        self.vllm_waiting.labels(model).set(stats.get("num_waiting", 0) + stats.get("num_filling", 0))
        total = stats.get("num_total_blocks", 0)
        if total:
            self.vllm_kv_usage.labels(model).set(1.0 - stats.get("num_free_blocks", total) / total)
        counted = [(self.vllm_prefix_queries.labels(model), stats.get("prefix_cache_queried_tokens")),
                   (self.vllm_prefix_hits.labels(model), stats.get("prefix_cache_hit_tokens")),
                   (self.first_ahead.labels("decode_worker"), stats.get("num_steps_ahead")),
                   (self.first_ahead.labels("prefill_worker"), stats.get("num_last_rows")),
                   *((self.served.labels(k), n) for k, n in stats.get("served", {}).items())]
        for child, now in counted:
            if now is not None:
                before = self._totals.get(id(child), 0)
                child.inc(max(0, now - before))
                self._totals[id(child)] = max(before, now)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
