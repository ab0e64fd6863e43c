"""A stream whose client left must run its body's `finally` at once (abort the engine request,
close the gateway's upstream), whichever way the server reports the leaving: a failed send
(ASGI spec 2.4, e.g. uvicorn with httptools) or an http.disconnect message (spec 2.3, h11)."""

import asyncio

import pytest

from scd_serve.api.sse import ClosingStreamingResponse


class Left(OSError):
    pass


def make_body(log):
    async def body():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0)
        finally:
            log.append("closed")
    return body()


@pytest.mark.parametrize("spec", ["2.4", "2.3"])
async def test_the_body_is_closed_when_the_client_leaves(spec):
    log, sent = [], []

    async def send(message):
        if message["type"] == "http.response.body" and len(sent) >= 3:
            raise Left("the client left")  # spec 2.4: the server's send fails
        sent.append(message)

    async def receive():
        if spec == "2.3":
            while len(sent) < 3:
                await asyncio.sleep(0)
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # spec 2.4: nobody listens; never returns
        return {}

    response = ClosingStreamingResponse(make_body(log), media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"spec_version": spec}}
    try:
        await asyncio.wait_for(response(scope, receive, send), 5)
    except Exception:  # spec 2.4: Starlette raises ClientDisconnect to the server
        pass
    assert log == ["closed"]  # at once, not when the generator is collected
    assert len(sent) >= 3


async def test_a_stream_that_ends_well_is_closed_once():
    log = []

    async def short():
        try:
            yield "data: 1\n\n"
        finally:
            log.append("closed")

    async def send(message):
        pass

    async def receive():
        await asyncio.Event().wait()

    await ClosingStreamingResponse(short())({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert log == ["closed"]
