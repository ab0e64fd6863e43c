"""The gateway's Prometheus series: what it proxied, to whom, and what its clients waited.

Two families: `scd_gateway_*` (by decode worker and status) and vLLM's names (`vllm:*` by
`model_name`, as the decode workers export them), so a dashboard written for vLLM reads the
gateway, the only port a cluster publishes, as it reads a worker. Latencies are measured where
the client sits, in front of every hop; a non-streamed response has no first event and counts
toward end to end only. Token counts and finish reasons come from the response: a JSON body's
`usage` and `choices`, or the usage trailer a decode worker ends a stream with when the gateway
asks (api/sse.py). Running and waiting are the decode workers' heartbeat loads.

No label value is taken from a client as it is: `model_name` is a name a decode worker serves
(a registered one lists its names in its heartbeats; a static `--decode` worker has answered a
request for it with a 2xx, which it does only for names it serves), printable ASCII, among the
first MAX_MODEL_LABELS such names; anything else is `unknown`. Before, a lone surrogate in `model` made every later
scrape a 500 (UnicodeEncodeError) and 1,000 unique names grew /metrics to 69.6 MB.
"""

from __future__ import annotations

import json
import re
import time
from contextlib import suppress
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from scd_serve.api.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, TOKEN_GAP_BUCKETS
from scd_serve.control.registry import Registry

UNKNOWN = "unknown"
MAX_MODEL_LABELS = 32  # distinct model_name values ever; a cluster serves a handful
SAFE_LABEL = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII: renders in any exposition
FINISH_REASONS = frozenset({"stop", "length", "abort", "tool_calls"})
MAX_USAGE_BODY = 8 << 20  # a longer non-streamed body is relayed but not read for its usage
MISSING = object()  # a request body without `model`
_MODEL = ["model_name"]


class ModelLabels:
    """model_name values: only served names (see the module doc), at most `limit` of them."""

    def __init__(self, registry: Registry, limit: int = MAX_MODEL_LABELS):
        self.registry, self.limit = registry, limit
        self.used: set[str] = set()

    def __call__(self, name: object, answered: bool = False) -> str:
        """`name`'s label; `answered`: a decode worker just served a request that asked for it."""
        if not isinstance(name, str) or not SAFE_LABEL.fullmatch(name):
            return UNKNOWN
        if name in self.used:
            return name
        if len(self.used) >= self.limit or not (answered or any(name in r.models
                                                                  for r in self.registry.workers(role="decode"))):
            return UNKNOWN
        self.used.add(name)
        return name


class GatewayMetrics:
    def __init__(self, registry: Registry):
        self.workers_registry = registry
        self.labels = ModelLabels(registry)
        r = self.registry = CollectorRegistry()
        counter, gauge = partial(Counter, registry=r), partial(Gauge, registry=r)
        latency = partial(Histogram, buckets=LATENCY_BUCKETS, registry=r)
        gap = partial(Histogram, buckets=TOKEN_GAP_BUCKETS, registry=r)
        tokens = partial(Histogram, buckets=TOKEN_BUCKETS, registry=r)
        self.requests = counter("scd_gateway_requests_total", "requests proxied, by decode worker and status",
                                ["worker", "status"])
        self.unreachable = counter("scd_gateway_worker_errors_total", "decode workers that could not be reached",
                                   ["worker"])
        self.broken = counter("scd_gateway_upstream_broken_total", "responses whose upstream broke mid-body",
                              ["worker"])
        self.first_byte_timeouts = counter("scd_gateway_first_byte_timeouts_total", "decode workers that sent no "
                                           "first byte within the first-byte deadline, or stopped heartbeating "
                                           "before they did (the request went on to another)", ["worker"])
        self.workers = gauge("scd_gateway_workers", "registered workers by role and readiness", ["role", "ready"])
        self.load = gauge("scd_worker_load", "load each worker reported in its last heartbeat",
                          ["role", "worker", "key"])
        self.ttft = latency("scd_gateway_time_to_first_token_seconds",
                            "request received at the gateway -> first streamed event relayed", _MODEL)
        self.inter_token = gap("scd_gateway_inter_token_latency_seconds",
                               "gap between consecutive streamed events relayed", _MODEL)
        self.e2e = latency("scd_gateway_e2e_request_latency_seconds",
                           "request received at the gateway -> last byte relayed, by status", _MODEL + ["status"])
        # vLLM's names, measured at the gateway (its docs: "Production Metrics")
        self.vllm_ttft = latency("vllm:time_to_first_token_seconds", "request received -> first token", _MODEL)
        self.vllm_inter_token = gap("vllm:inter_token_latency_seconds", "gap between consecutive tokens", _MODEL)
        self.vllm_per_output_token = gap("vllm:time_per_output_token_seconds", "gap between consecutive tokens",
                                         _MODEL)  # the older name; older dashboards query it
        self.vllm_e2e = latency("vllm:e2e_request_latency_seconds", "request received -> last token", _MODEL)
        self.vllm_prompt_tokens = counter("vllm:prompt_tokens", "prompt tokens of finished requests", _MODEL)
        self.vllm_generation_tokens = counter("vllm:generation_tokens", "tokens generated", _MODEL)
        self.vllm_request_prompt = tokens("vllm:request_prompt_tokens", "prompt tokens per finished request", _MODEL)
        self.vllm_request_generation = tokens("vllm:request_generation_tokens",
                                              "generated tokens per finished request", _MODEL)
        self.vllm_success = counter("vllm:request_success", "finished requests by finish reason (one per choice)",
                                    _MODEL + ["finished_reason"])
        self.vllm_running = gauge("vllm:num_requests_running", "sequences in the decode workers' batches", _MODEL)
        self.vllm_waiting = gauge("vllm:num_requests_waiting", "requests the decode workers hold waiting", _MODEL)
        self.vllm_kv_usage = gauge("vllm:kv_cache_usage_perc", "the decode workers' KV pool blocks in use (1 = full)",
                                   _MODEL)

    def refresh(self) -> None:
        for family in (self.workers, self.load, self.vllm_running, self.vllm_waiting, self.vllm_kv_usage):
            family.clear()
        blocks: dict[str, list[float]] = {}  # model -> [free, total] over its decode workers
        for rec in self.workers_registry.workers():
            self.workers.labels(rec.role, str(rec.ready).lower()).inc()
            for key, value in rec.load.items():
                self.load.labels(rec.role, rec.address, key).set(value)
            if rec.role == "decode":
                model = self.labels(rec.models[0] if rec.models else None)
                self.vllm_running.labels(model).inc(rec.load.get("running", 0))
                self.vllm_waiting.labels(model).inc(rec.load.get("waiting", 0))
                pair = blocks.setdefault(model, [0.0, 0.0])
                pair[0] += rec.load.get("free_blocks", 0)
                pair[1] += rec.load.get("total_blocks", 0)
        for model, (free, total) in blocks.items():
            if total:
                self.vllm_kv_usage.labels(model).set(max(0.0, 1.0 - free / total))

    def clock(self, asked: object) -> RequestClock:
        """The clock of a request whose body's `model` is `asked` (MISSING: none)."""
        return RequestClock(self, asked)

    def render(self) -> tuple[bytes, str]:
        self.refresh()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestClock:
    """Times one proxied request from the moment the gateway received it, and counts its tokens."""

    def __init__(self, metrics: GatewayMetrics, asked: object):
        self.metrics, self.asked, self.model, self.status = metrics, asked, UNKNOWN, "499"
        self.start = self.last = time.perf_counter()
        self.events = 0
        self.usage: dict | None = None  # {"prompt_tokens", "completion_tokens", "finish_reasons"}
        self._body: list[bytes] | None = []  # a non-streamed body, read at the end; None once too long
        self._size = 0

    def bind(self, served: tuple[str, ...], status: int) -> None:
        """A decode worker serving `served` (its heartbeats' names) answered `status`; its default
        name stands for a request that asked for none."""
        self.status = str(status)
        asked = self.asked is not MISSING
        name = self.asked if asked else (served or (None,))[0]
        self.model = self.metrics.labels(name, answered=asked and 200 <= status < 300)

    def event(self) -> None:
        """One server-sent event with content relayed to the client (not the closing [DONE])."""
        now = time.perf_counter()
        m = self.metrics
        if self.events == 0:
            m.ttft.labels(self.model).observe(now - self.last)
            m.vllm_ttft.labels(self.model).observe(now - self.last)
        else:
            for hist in (m.inter_token, m.vllm_inter_token, m.vllm_per_output_token):
                hist.labels(self.model).observe(now - self.last)
        self.events += 1
        self.last = now

    def body(self, chunk: bytes) -> None:
        """A piece of a non-streamed body (its usage is read once it is complete)."""
        if self._body is not None:
            self._size += len(chunk)
            if self._size > MAX_USAGE_BODY:
                self._body = None
            else:
                self._body.append(chunk)

    def trailer(self, text: bytes) -> None:
        """A stream's usage trailer (the comment's JSON)."""
        with suppress(ValueError):
            self.usage = json.loads(text)

    def _body_usage(self) -> dict | None:
        try:
            msg = json.loads(b"".join(self._body or ()))
            return msg["usage"] | {"finish_reasons": [c.get("finish_reason") for c in msg["choices"]]}
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
            return None  # not a completion (an error body, a tokenizer route) or cut off

    def end(self) -> None:
        m, elapsed = self.metrics, time.perf_counter() - self.start
        m.e2e.labels(self.model, self.status).observe(elapsed)
        if not self.status.startswith("2"):
            return
        m.vllm_e2e.labels(self.model).observe(elapsed)
        usage = self.usage if self.usage is not None else self._body_usage()
        if not isinstance(usage, dict):
            return
        for reason in usage.get("finish_reasons") or ():
            m.vllm_success.labels(self.model, reason if reason in FINISH_REASONS else UNKNOWN).inc()
        prompt, generated = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (prompt, generated)):
            m.vllm_prompt_tokens.labels(self.model).inc(prompt)
            m.vllm_generation_tokens.labels(self.model).inc(generated)
            m.vllm_request_prompt.labels(self.model).observe(prompt)
            m.vllm_request_generation.labels(self.model).observe(generated)
