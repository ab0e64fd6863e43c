"""Gateway: load-aware spreading, SSE passthrough, unreachable workers skipped, 503 when none."""

import asyncio
import socket

import httpx
import pytest
import uvicorn
from asgi_lifespan import LifespanManager
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.registry import Registry
from scd_serve.gateway.app import create_gateway_app

pytestmark = pytest.mark.timeout(30)


def stub_decode(name: str) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("stream"):
            async def events():
                for i in range(3):
                    yield f"data: {name}-{i}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"worker": name, "auth": request.headers.get("authorization")}

    return app


async def serve(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, f"127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def heartbeat(reg, wid, address, running=0, ready=True):
    reg.apply({"type": "heartbeat", "id": wid, "role": "decode", "address": address, "ready": ready,
               "load": {"running": running, "waiting": 0}})


async def test_spreads_by_load_streams_and_skips_dead_workers():
    (s1, t1, a1), (s2, t2, a2) = await serve(stub_decode("one")), await serve(stub_decode("two"))
    reg = Registry(ttl_s=30)
    heartbeat(reg, "d1", a1, running=5)
    heartbeat(reg, "d2", a2, running=0)
    heartbeat(reg, "d3", closed_port(), running=0, ready=False)  # not ready: never chosen
    app = create_gateway_app(GatewayConfig(port=0, api_key="gateway-key-1"), reg)
    try:
        async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw",
                                                           headers={"authorization": "Bearer gateway-key-1"}) as c:
            r = await c.post("/v1/completions", json={"prompt": "x"})
            assert r.json() == {"worker": "two", "auth": "Bearer gateway-key-1"}  # least loaded, auth forwarded
            r = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.text == "data: two-0\n\ndata: two-1\n\ndata: two-2\n\ndata: [DONE]\n\n"
            assert (await c.post("/v1/completions", json={}, headers={"authorization": "Bearer no"})).status_code == 401
            # the less loaded worker dies: its request goes to the other one, no error to the client
            heartbeat(reg, "d2", closed_port(), running=0)
            r = await c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 200 and r.json()["worker"] == "one"
            metrics = (await c.get("/metrics")).text
            assert f'scd_gateway_requests_total{{status="200",worker="{a1}"}} 1.0' in metrics
            assert "scd_gateway_worker_errors_total" in metrics
            assert (await c.get("/ready")).status_code == 200
            assert (await c.get("/health")).status_code == 200  # what load generators check first
            assert app.state.balancer.inflight == {}  # every slot released
    finally:
        for s, t in ((s1, t1), (s2, t2)):
            s.should_exit = True
            await t


async def test_no_decode_worker_is_a_clear_503():
    app = create_gateway_app(GatewayConfig(port=0), Registry(ttl_s=30))
    async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        assert (await c.get("/live")).status_code == 200
        for path in ("/ready", "/health"):
            r = await c.get(path)
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        r = await c.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 503 and "no decode worker" in r.json()["error"]["message"]


def expert(name: str) -> FastAPI:
    """A decode worker serving the model `name`: it answers with its name, lists its card."""
    app = stub_decode(name)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "scd-serve"}]}

    return app


async def test_several_experts_behind_one_gateway_each_model_to_its_own_workers():
    (s1, t1, a1), (s2, t2, a2), (s3, t3, a3) = [await serve(expert(n)) for n in ("base-chat", "coder", "coder")]
    reg = Registry(ttl_s=30)
    for wid, address, model, running in (("d1", a1, "base-chat", 0), ("d2", a2, "coder", 3), ("d3", a3, "coder", 0)):
        reg.apply({"type": "heartbeat", "id": wid, "role": "decode", "address": address, "ready": True,
                   "load": {"running": running, "waiting": 0}, "models": [model]})
    app = create_gateway_app(GatewayConfig(port=0), reg)
    try:
        async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                           base_url="http://gw") as c:
            assert (await c.post("/v1/completions", json={"model": "base-chat", "prompt": "x"})).json()["worker"] \
                == "base-chat"
            for _ in range(3):  # the less loaded coder worker each time: load-aware within the model
                r = await c.post("/v1/completions", json={"model": "coder", "prompt": "x"})
                assert r.status_code == 200 and r.json()["worker"] == "coder"
            assert app.state.balancer.inflight == {}
            r = await c.post("/v1/completions", json={"model": "poet", "prompt": "x"})
            err = r.json()["error"]
            assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
            assert "'base-chat', 'coder'" in err["message"]
            listed = (await c.get("/v1/models")).json()
            assert sorted(card["id"] for card in listed["data"]) == ["base-chat", "coder"]
            reg.apply({"type": "heartbeat", "id": "d1", "role": "decode", "address": a1, "ready": False,
                       "load": {}, "models": ["base-chat"]})
            r = await c.post("/v1/completions", json={"model": "base-chat", "prompt": "x"})
            assert r.status_code == 503 and "serving 'base-chat'" in r.json()["error"]["message"]  # not ready
    finally:
        for s, t in ((s1, t1), (s2, t2), (s3, t3)):
            s.should_exit = True
            await t
