"""The load generator's reading of a stream: a response whose text all came at the end still
counts its tokens (the server's usage) and completes."""

import asyncio
import json

import httpx

from scd_serve.bench.loadgen import stream_completion


def sse(*events) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def run(body: bytes):
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body,
                                                                   headers={"content-type": "text/event-stream"}))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_completion(client, "http://t", {"prompt": [1]}, timeout_s=5)

    return asyncio.run(go())


def test_text_held_to_the_end_still_completes_with_the_reported_tokens():
    final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 7}}
    res = run(sse(final))
    assert res.ok and res.tokens == 7 and res.first_token == res.done


def test_streamed_tokens_are_timed_one_by_one():
    tok = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 2}}
    res = run(sse(tok, tok, final))
    assert res.ok and res.num_tokens == 2 and res.tokens == 2 and res.first_token <= res.done


def test_an_error_event_fails_the_request():
    res = run(sse({"error": {"type": "deadline_exceeded"}}))
    assert not res.ok and res.error == "deadline_exceeded"
