"""The gateway's metrics: client-side latencies and token counts under vLLM's names, a vLLM-style
dashboard's queries answered by the gateway alone, and label values only from served names.

A real uvicorn stub decode worker behind the gateway app (httpx ASGI transport); the stub
answers with OpenAI usage and, when the gateway asks for it, a stream's usage trailer."""

import asyncio
import json
import re

import httpx
import pytest
import uvicorn
from asgi_lifespan import LifespanManager
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from scd_serve.api.sse import USAGE_HEADER, USAGE_TRAILER
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.registry import Registry
from scd_serve.gateway.app import create_gateway_app
from scd_serve.gateway.metrics import MAX_MODEL_LABELS, UNKNOWN, ModelLabels

pytestmark = pytest.mark.timeout(60)
SERVED = "m1"
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}

# Queries of the kind vLLM's Grafana dashboard runs (examples/online_serving/prometheus_grafana),
# with $model_name as Grafana substitutes it: the gateway must answer each one.
DASHBOARD = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[5m])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[5m]) / '
    'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[5m])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[5m])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[5m])',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[5m])))',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}[5m])))',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'avg(vllm:kv_cache_usage_perc{model_name="$model_name"})',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[5m])))',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[5m]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[5m]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[5m]))',
]
SELECTOR = re.compile(r"(vllm:[a-z0-9_:]+)\{([^}]*)\}")


def stub_decode() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        model = body.get("model", SERVED)
        if body.get("stream"):
            trailer = request.headers.get(USAGE_HEADER) == USAGE_TRAILER

            async def events():
                for i in range(3):
                    yield f'data: {{"model": "{model}", "choices": [{{"text": "t{i}"}}]}}\n\n'
                if trailer:
                    yield f": usage {json.dumps(USAGE | {'finish_reasons': ['length']})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"model": model, "choices": [{"text": "abc", "finish_reason": "stop"}], "usage": USAGE}

    return app


async def serve(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, f"127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def registered(address: str, *models: str) -> Registry:
    reg = Registry(ttl_s=30)
    reg.apply({"type": "heartbeat", "id": "d1", "role": "decode", "address": address, "ready": True,
               "load": {"running": 2, "waiting": 1, "free_blocks": 30, "total_blocks": 40}, "models": models})
    return reg


def samples(text: str) -> dict[str, list]:
    """metric sample name -> [(labels, value)]"""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(found: dict, name: str, **labels) -> float:
    return sum(v for lab, v in found.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


async def traffic() -> tuple[str, str]:
    """(the gateway's /metrics after a stream, a non-streamed request and one without `model`, the stream)"""
    server, task, address = await serve(stub_decode())
    app = create_gateway_app(GatewayConfig(port=0), registered(address, SERVED, "m1-alias"))
    try:
        async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                           base_url="http://gw") as c:
            stream = (await c.post("/v1/completions", json={"model": SERVED, "prompt": "x", "stream": True})).text
            await c.post("/v1/completions", json={"model": SERVED, "prompt": "x"})
            await c.post("/v1/completions", json={"prompt": "x"})  # the worker's default name: the first served
            await c.get("/v1/models")  # not a generation: not timed
            return (await c.get("/metrics")).text, stream
    finally:
        server.should_exit = True
        await task


async def test_latencies_and_tokens_under_vllm_and_scd_names():
    text, stream = await traffic()
    assert ": usage" not in stream and stream.count("data: ") == 4  # the trailer is the gateway's, not relayed
    found = samples(text)
    m = {"model_name": SERVED}
    assert value(found, "scd_gateway_time_to_first_token_seconds_count", **m) == 1
    assert value(found, "vllm:time_to_first_token_seconds_count", **m) == 1
    assert value(found, "vllm:inter_token_latency_seconds_count", **m) == 2  # 3 events; [DONE] is no token
    assert value(found, "vllm:time_per_output_token_seconds_count", **m) == 2
    assert value(found, "scd_gateway_e2e_request_latency_seconds_count", status="200", **m) == 3
    assert value(found, "vllm:e2e_request_latency_seconds_count", **m) == 3
    assert value(found, "vllm:prompt_tokens_total", **m) == 15 and value(found, "vllm:generation_tokens_total", **m) == 9
    assert value(found, "vllm:request_success_total", finished_reason="stop", **m) == 2  # from the JSON bodies
    assert value(found, "vllm:request_success_total", finished_reason="length", **m) == 1  # from the trailer
    assert value(found, "vllm:num_requests_running", **m) == 2 and value(found, "vllm:num_requests_waiting", **m) == 1
    assert value(found, "vllm:kv_cache_usage_perc", **m) == pytest.approx(0.25)
    assert {lab["model_name"] for name, rows in found.items() if name.startswith("vllm:") for lab, _ in rows} == {SERVED}


async def test_a_vllm_dashboard_reads_the_gateway():
    text, _ = await traffic()
    found = samples(text)
    for query in DASHBOARD:
        selectors = SELECTOR.findall(query.replace("$model_name", SERVED))
        assert selectors, query
        for name, matchers in selectors:
            wanted = dict(re.findall(r'(\w+)="([^"]*)"', matchers))
            rows = [lab for lab, v in found.get(name, []) if all(lab.get(k) == x for k, x in wanted.items())]
            assert rows, f"{query}: no {name} with {wanted} in the gateway's /metrics"
        for label in re.findall(r"by\((\w+)\)", query):
            assert any(label in lab for n, _ in selectors for lab, _ in found.get(n, [])), (query, label)


def test_label_values_come_only_from_served_names():
    reg = Registry(ttl_s=30)
    served = [f"model-{i}" for i in range(MAX_MODEL_LABELS + 8)] + ["\ud800", "caf\u00e9", "a b"]
    for i in range(0, len(served), 16):
        reg.apply({"type": "heartbeat", "id": f"d{i}", "role": "decode", "address": f"h:{i + 1}", "ready": True,
                   "load": {}, "models": tuple(served[i:i + 16])})
    labels = ModelLabels(reg)
    assert labels("model-0") == "model-0"
    for asked in ("\ud800", "caf\u00e9", "a b", "not-served", "x" * 4000, None, 7, ["model-0"]):
        assert labels(asked) == UNKNOWN, asked  # served or not: never a label that is not printable ASCII
    got = {labels(name) for name in served}
    assert len(got - {UNKNOWN}) == MAX_MODEL_LABELS  # bounded even if workers serve more names
    assert labels("static", answered=True) == UNKNOWN  # bounded whatever the source
    fresh = ModelLabels(Registry(ttl_s=30))
    assert fresh("static", answered=True) == "static"  # a static worker answered 2xx for it: it serves it
    assert fresh("\ud800", answered=True) == UNKNOWN and fresh("other") == UNKNOWN
