"""In-process HTTP (httpx ASGITransport + lifespan) on the real engine and a tiny random llama."""

import asyncio

import httpx
import pytest
from api_server import engine_app
from asgi_lifespan import LifespanManager

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def client(tiny_runtime):
    app, engine = engine_app(tiny_runtime, {"max_num_seqs": 16, "max_concurrent": 32})
    async with LifespanManager(app) as manager:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url="http://t") as c:
            c.engine = engine
            yield c
    await engine.stop(1)


def greedy_text(rt, text, n):
    return rt.tokenizer.decode(rt.generate_greedy(rt.tokenizer.encode(text), n), skip_special_tokens=True)


async def test_sixteen_concurrent_http_requests_equal_solo_greedy(client, tiny_runtime):
    prompts = [f"request {i}: " + "abc" * i for i in range(16)]
    body = dict(max_tokens=8, temperature=0)
    rs = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": p, **body}) for p in prompts))
    assert [r.status_code for r in rs] == [200] * 16
    assert [r.json()["choices"][0]["text"] for r in rs] == [greedy_text(tiny_runtime, p, 8) for p in prompts]
    s = client.engine.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    metrics = (await client.get("/metrics")).text
    assert 'scd_requests_total{route="/v1/completions",status="200"} 16.0' in metrics


async def test_stop_sequence_and_seed_over_http(client, tiny_runtime):
    full = greedy_text(tiny_runtime, "stop here", 24)
    stop = full[6:8]
    r = await client.post("/v1/completions", json={"prompt": "stop here", "max_tokens": 24, "temperature": 0,
                                                   "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["text"] == full[:full.find(stop)] and choice["finish_reason"] == "stop"
    body = {"prompt": "seeded", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 11}
    a, b = [(await client.post("/v1/completions", json=body)).json()["choices"][0]["text"] for _ in range(2)]
    assert a == b


async def test_unknown_method_is_400_before_anything_runs(client):
    steps = client.engine.num_steps
    r = await client.post("/v1/completions", json={"prompt": "x", "scd_method": "carrier-pigeon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "scd_method"
    assert client.engine.num_steps == steps and client.engine.stats()["num_requests"] == 0
