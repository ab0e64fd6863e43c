"""Gateway relay against raw TCP upstreams: a client that leaves before the response headers
closes the upstream connection; an upstream that breaks mid-body ends an SSE stream with an
error event (a half-sent event is dropped), and cuts any other body off."""

import asyncio
import json
import time

import httpx
import pytest
import uvicorn

from polls import eventually
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.registry import Registry
from scd_serve.gateway.app import create_gateway_app

pytestmark = pytest.mark.timeout(30)


class RawUpstream:
    """An HTTP/1.1 'decode worker' on 127.0.0.1:0 that answers with `reply` bytes (None: never
    answers) and then drops the connection; `closed` is set when the gateway closed its side."""

    def __init__(self, reply: bytes | None):
        self.reply = reply
        self.requests = 0
        self.closed = asyncio.Event()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.requests += 1
        if self.reply is not None:
            writer.write(self.reply)
            await writer.drain()
            writer.transport.abort()  # the worker dies: no last chunk
            return
        while await reader.read(1024):  # hold the request; b"" once the gateway closed the connection
            pass
        self.closed.set()
        writer.close()

    async def stop(self) -> None:
        self.server.close()


def chunked(content_type: str, *parts: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


async def gateway(address: str):
    app = create_gateway_app(GatewayConfig(port=0, decode=(address,), max_attempts=1), Registry(ttl_s=30))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    assert await eventually(lambda: server.started or task.done(), 10)
    return app, server, task, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


async def stop(server, task) -> None:
    server.should_exit = True
    await asyncio.wait_for(task, 10)


async def test_client_leaving_before_the_headers_closes_the_upstream_request():
    upstream = RawUpstream(None)
    app, server, task, base = await gateway(await upstream.start())
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            req = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "x"}))
            assert await eventually(lambda: upstream.requests == 1, 10)
            req.cancel()
            await asyncio.gather(req, return_exceptions=True)
            left = time.monotonic()
            await asyncio.wait_for(upstream.closed.wait(), 5)  # without the watch: never (read timeout 300 s)
            assert time.monotonic() - left < 5
            assert await eventually(lambda: app.state.balancer.inflight == {}, 5), app.state.balancer.inflight
            assert 'status="499"' in (await http.get("/metrics")).text
    finally:
        await stop(server, task)
        await upstream.stop()


async def test_upstream_breaking_mid_stream_ends_with_an_error_event():
    event = b'data: {"choices": [{"text": "a"}]}\n\n'
    upstream = RawUpstream(chunked("text/event-stream", event, event + b'data: {"choi'))  # dies mid-event
    address = await upstream.start()
    app, server, task, base = await gateway(address)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            async with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line]
            assert lines[:2] == [event.decode().strip()] * 2  # whole events through, the half one dropped
            assert lines[-1] == "data: [DONE]" and len(lines) == 4, lines
            error = json.loads(lines[2].removeprefix("data: "))["error"]
            assert error["code"] == "unavailable" and address in error["message"]
            assert error["request_id"] == r.headers["x-request-id"]
            assert await eventually(lambda: app.state.balancer.inflight == {}, 5), app.state.balancer.inflight
            assert f'scd_gateway_upstream_broken_total{{worker="{address}"}} 1.0' in (await http.get("/metrics")).text
    finally:
        await stop(server, task)
        await upstream.stop()


async def test_upstream_breaking_mid_json_body_is_cut_off_not_ended_cleanly():
    upstream = RawUpstream(chunked("application/json", b'{"choices": [{"te'))
    app, server, task, base = await gateway(await upstream.start())
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            with pytest.raises(httpx.RemoteProtocolError):  # a truncated body is never a clean 200
                await http.post("/v1/completions", json={"prompt": "x"})
            assert await eventually(lambda: app.state.balancer.inflight == {}, 5), app.state.balancer.inflight
    finally:
        await stop(server, task)
        await upstream.stop()
