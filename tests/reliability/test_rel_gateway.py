"""The gateway in front of real decode workers (issue 16, item 4): a client that leaves before the
first response byte aborts the work upstream, and a decode worker that dies mid-stream ends the
client's stream with an SSE error event instead of a cut connection.

The gateway is a real uvicorn server on 127.0.0.1:0 with the decode worker as its static upstream;
the worker is a LocalStack served over HTTP (KV blocks visible) or a `scd-serve decode` process
(killed with SIGKILL)."""

import asyncio
import json
import time
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn

from rel_checks import CLEAN_TIMEOUT_S, Baseline, assert_clean, eventually
from rel_procs import Proc
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.registry import Registry
from scd_serve.testing.faults import FaultyProducer, FaultyRuntime, FaultyServicer
from scd_serve.gateway.app import create_gateway_app
from scd_serve.testing.soak import completion

pytestmark = pytest.mark.timeout(120)
GONE_S = 2.0  # the bound: the worker's KV blocks are back this long after the client left


@asynccontextmanager
async def gateway(*decode: str):
    """A gateway HTTP server whose only decode workers are `decode` (HOST:PORT); yields (base URL, app)."""
    app = create_gateway_app(GatewayConfig(port=0, decode=decode), Registry(ttl_s=30))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    try:
        assert await eventually(lambda: server.started or task.done(), 30), "gateway did not start"
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", app
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def leave_while_waiting(gw: str, body: dict, upstream_busy) -> float:
    """Send `body` through the gateway, close the connection once upstream_busy() holds; the time it left."""
    async with httpx.AsyncClient(base_url=gw, timeout=30) as http:
        if body.get("stream"):
            async def request():
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    raise AssertionError(f"the response started ({r.status_code}); the test needs it not to")
        else:
            async def request():
                r = await http.post("/v1/completions", json=body)
                raise AssertionError(f"the request finished ({r.status_code}) before the client left")
        task = asyncio.ensure_future(request())
        busy = await eventually(lambda: upstream_busy() or task.done(), 20)
        assert busy and not task.done(), task.result() if task.done() else "upstream never got busy"
        task.cancel()  # the client goes away: its connection to the gateway closes
        await asyncio.gather(task, return_exceptions=True)
        return time.monotonic()


async def warm_through(gw: str) -> None:
    async with httpx.AsyncClient(base_url=gw, timeout=30) as http:
        r = await http.post("/v1/completions", json=completion("warm the gateway", 2, scd_method="local"))
        assert r.status_code == 200, r.text


async def test_client_leaving_a_non_streaming_request_frees_the_worker_kv(make_stack):
    slow = {}
    stack, _ = await make_stack(runtime_wrap=lambda rt: slow.setdefault("rt", FaultyRuntime(rt)),
                                api={"max_tokens_cap": 200})
    url = await stack.serve_http()
    async with gateway(url.removeprefix("http://")) as (gw, app):
        await warm_through(gw)
        base = Baseline()  # with both HTTP listeners running
        slow["rt"].stall_after_steps, slow["rt"].stall_s = 0, 0.05  # 200 tokens would take ~10 s
        n0 = stack.engine.num_generated_tokens
        left = await leave_while_waiting(gw, completion("leave before the answer", 200, scd_method="local"),
                                         lambda: stack.engine.num_generated_tokens >= n0 + 3)
        assert await eventually(lambda: not stack.leaks(), GONE_S), \
            f"{time.monotonic() - left:.1f} s after the client left: {stack.leaks()}"
        assert stack.engine.num_generated_tokens - n0 < 150, "generation ran on"
        assert await eventually(lambda: app.state.balancer.inflight == {}, CLEAN_TIMEOUT_S), app.state.balancer.inflight
        slow["rt"].stall_after_steps = None
        await assert_clean(stack, base)


async def test_client_leaving_a_stream_before_its_first_token_aborts_the_transfer(make_stack):
    slow = {}
    stack, _ = await make_stack(producer_wrap=lambda rt: slow.setdefault("p", FaultyProducer(rt)),
                                servicer_wrap=lambda sv: FaultyServicer(sv))
    url = await stack.serve_http()
    async with gateway(url.removeprefix("http://")) as (gw, app):
        await warm_through(gw)
        base = Baseline()
        slow["p"].layer_delay_s = 2.0  # the transfer (2 layers) takes ~4 s: no token, no headers before that
        body = completion("leave during the transfer", 8, stream=True, scd_method="identity")
        left = await leave_while_waiting(gw, body, lambda: bool(stack.servicer.transfers))
        assert await eventually(lambda: not stack.leaks(), GONE_S), \
            f"{time.monotonic() - left:.1f} s after the client left: {stack.leaks()}"
        assert stack.served.cancelled or stack.served.aborts  # the prefill worker was told
        assert await eventually(lambda: app.state.balancer.inflight == {}, CLEAN_TIMEOUT_S), app.state.balancer.inflight
        slow["p"].layer_delay_s = 0.0
        await assert_clean(stack, base)


@pytest.mark.slow
async def test_decode_worker_dying_mid_stream_ends_the_stream_with_an_error_event(model_dir, tmp_path):
    worker = Proc(tmp_path, ["decode", "--model", str(model_dir), "--codebook", "", "--method", "local", "--port", "0"],
                  ["--decode-step-delay", "0.05"])  # 200 tokens would take ~10 s
    try:
        address = f"127.0.0.1:{await worker.started()}"
        async with gateway(address) as (gw, app), httpx.AsyncClient(base_url=gw, timeout=30) as http:
            ready = lambda: http.get(f"http://{address}/ready")  # noqa: E731
            assert await eventually(lambda: _status(ready, 200), 30), "decode worker not ready"
            events, done = [], False
            async with http.stream("POST", "/v1/completions",
                                   json=completion("the worker dies mid stream", 200, stream=True)) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():  # a cut stream raises here (incomplete chunked read)
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        events.append(json.loads(line[6:]))
                        if len(events) == 3:
                            worker.p.kill()  # SIGKILL: no drain, no last event from the worker
            assert done, events[-2:]
            assert 3 <= len(events) < 200 and all("choices" in e for e in events[:-1]), events[-2:]
            error = events[-1].get("error", {})
            assert error.get("code") == "unavailable" and address in error.get("message", ""), events[-1]
            assert set(error) >= {"type", "message", "request_id"}  # the error table's body (errors.to_body)
            assert await eventually(lambda: app.state.balancer.inflight == {}, CLEAN_TIMEOUT_S)
            metrics = (await http.get("/metrics")).text
            assert f'scd_gateway_upstream_broken_total{{worker="{address}"}} 1.0' in metrics
    finally:
        worker.stop()


async def _status(get, code: int) -> bool:
    try:
        return (await get()).status_code == code
    except httpx.TransportError:
        return False
