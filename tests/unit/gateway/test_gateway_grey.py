"""Grey failures at the gateway, against real uvicorn stub decode workers: a worker that sends
no first byte (the first-byte deadline, or it stopped heartbeating) loses the request to another
worker before anything reached the client; a worker that stops heartbeating mid-stream, and a
gateway whose shutdown grace is over, end the stream with an SSE error event."""

import asyncio
import json
import time

import httpx
import pytest
import uvicorn
from asgi_lifespan import LifespanManager
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from polls import eventually
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.registry import Registry
from scd_serve.gateway.app import create_gateway_app

pytestmark = pytest.mark.timeout(60)


def stub(name: str, hang: asyncio.Event | None = None, events: int = 3, gap_s: float = 0.0) -> FastAPI:
    """A decode worker that answers at once, or (hang) only after `hang` is set."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if hang is not None:
            await hang.wait()
        if body.get("stream"):
            async def stream():
                for i in range(events):
                    yield f'data: {{"worker": "{name}", "i": {i}}}\n\n'
                    await asyncio.sleep(gap_s)
                yield "data: [DONE]\n\n"
            return StreamingResponse(stream(), media_type="text/event-stream")
        return {"worker": name}

    return app


async def serve(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    assert await eventually(lambda: server.started or task.done(), 10)
    return server, task, f"127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def beat(reg: Registry, wid: str, address: str, running: int) -> None:
    reg.apply({"type": "heartbeat", "id": wid, "role": "decode", "address": address, "ready": True,
               "load": {"running": running}, "models": ("m",)})


def events_of(text: str) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ")]


async def test_no_first_byte_sends_the_request_to_another_worker():
    frozen, fine = asyncio.Event(), None
    (s1, t1, stuck), (s2, t2, good) = await serve(stub("stuck", frozen)), await serve(stub("good", fine))
    clock = Clock()
    reg = Registry(ttl_s=3, clock=clock)
    beat(reg, "d-stuck", stuck, running=0)  # the least loaded: chosen first
    beat(reg, "d-good", good, running=5)
    app = create_gateway_app(GatewayConfig(port=0, first_byte_timeout_s=0.5), reg)
    try:
        async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw",
                                                           timeout=20) as c:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
            took = time.monotonic() - t0
            assert r.status_code == 200 and [e["worker"] for e in events_of(r.text)[:-1]] == ["good"] * 3, r.text
            assert 0.5 <= took < 10, took  # the deadline, then the other worker
            # a non-streamed answer has no first byte before its last: only a silent worker ends the wait
            task = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "x"}))
            assert await eventually(lambda: app.state.balancer.inflight.get(stuck), 10)
            await asyncio.sleep(1.0)
            assert not task.done(), "a slow non-streamed answer was given up on"
            clock.now += 4  # no heartbeat from `stuck` for longer than the ttl; `good` still beats
            beat(reg, "d-good", good, running=5)
            r = await asyncio.wait_for(task, 10)
            assert r.status_code == 200 and r.json() == {"worker": "good"}
            metrics = (await c.get("/metrics")).text
            assert f'scd_gateway_first_byte_timeouts_total{{worker="{stuck}"}} 2.0' in metrics
            assert await eventually(lambda: app.state.balancer.inflight == {}, 10), app.state.balancer.inflight
    finally:
        frozen.set()
        for s, t in ((s1, t1), (s2, t2)):
            s.should_exit = True
            await t


async def test_streams_end_with_an_error_event_when_the_worker_goes_silent_or_the_gateway_stops():
    (s1, t1, slow) = await serve(stub("slow", events=1000, gap_s=0.05))
    clock = Clock()
    reg = Registry(ttl_s=3, clock=clock)
    beat(reg, "d-slow", slow, running=0)
    app = create_gateway_app(GatewayConfig(port=0), reg)
    gw, gw_task, gw_address = await serve(app)  # a real server: httpx's ASGI transport buffers a whole response
    try:
        async with httpx.AsyncClient(base_url=f"http://{gw_address}", timeout=20) as c:
            for stop in ("silent", "closing"):
                seen = []
                async with c.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            seen.append(line[6:])
                        if len(seen) == 3:
                            if stop == "silent":
                                clock.now += 4  # the worker stopped heartbeating
                            else:
                                app.state.closing.begin(0.2)  # SIGTERM; its grace ends in 0.2 s
                assert seen[-1] == "[DONE]", seen[-3:]
                error = json.loads(seen[-2])["error"]
                assert error["type"] == "server_error", error
                assert error["code"] == ("unavailable" if stop == "silent" else "shutting_down"), error
                assert 3 <= len(seen) < 1000
                beat(reg, "d-slow", slow, running=0)  # back for the next round
    finally:
        for s, t in ((gw, gw_task), (s1, t1)):
            s.should_exit = True
            await t
