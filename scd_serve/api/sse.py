"""OpenAI response shapes (completion / chat, whole and streamed) and the SSE stream.

A stream sends (chat: a role chunk per choice first) a chunk per text delta or logprob
record, a finish_reason chunk per choice, an optional usage chunk, then `data: [DONE]`; with
vLLM's `continuous_usage_stats` every chunk also carries its choice's usage so far. An
error after the stream started goes as one `data: {"error": ...}` event before `[DONE]`.
A request with `x-scd-usage: trailer` (the gateway sends it) also gets the stream's usage and
finish reasons as an SSE comment before `[DONE]`, which every SSE client skips and the gateway
strips: its vLLM-named token counters need them whether or not the client asked for usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from scd_serve.errors import ScdError

log = logging.getLogger("scd_serve.api")
USAGE_HEADER, USAGE_TRAILER = "x-scd-usage", "trailer"
USAGE_COMMENT = b": usage "  # how the trailer starts


class Shape:
    """Builds the JSON objects of one response; `chat` picks the chat.completion flavour."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool = False,
                 continuous_usage: bool = False):
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id  # vLLM's: the x-request-id, prefixed
        self.model, self.chat, self.include_usage = model, chat, include_usage
        self.continuous_usage = include_usage and continuous_usage  # vLLM: only with include_usage
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, finish_reason: str | None, stop_reason=None, logprobs=None,
               message: dict | None = None) -> dict:
        """`message`: a chat message other than the plain text (tool calls)."""
        body = {"message": message or {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": index} | body | {"logprobs": logprobs, "finish_reason": finish_reason,
                                          "stop_reason": stop_reason}

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return self._head("chat.completion" if self.chat else "text_completion") | {"choices": choices,
                                                                                    "usage": usage}

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, stop_reason=None,
              logprobs=None, role: bool = False, delta: dict | None = None, usage: dict | None = None) -> dict:
        """One stream chunk. `delta`: a chat delta other than text (tool calls); `usage`: the
        choice's so far (sent with continuous_usage)."""
        if self.chat:
            delta = delta if delta is not None else (
                ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {}))
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            out = self._head("text_completion")
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = usage if self.continuous_usage else None
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [],
                                                                                          "usage": usage}


def data(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse_stream(chunks: AsyncIterator[dict], request_id: str, on_end: Callable[[int], None],
                     trailer: Callable[[], dict] | None = None) -> AsyncIterator[str]:
    """`chunks`: the response's JSON objects (usage chunk included); errors after the first
    became HTTP statuses are sent as the last event. `on_end(status)` is called once;
    `trailer()`, when given, is sent as a comment after the last chunk of a stream that ended well."""
    status = 200
    try:
        async for obj in chunks:
            yield data(obj)
        if trailer is not None:
            yield f"{USAGE_COMMENT.decode()}{json.dumps(trailer())}\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        status = 499  # the client went away; nothing more to send
        raise
    except ScdError as exc:
        status = exc.http_status
        log.warning("request_id=%s stream ended with %s", request_id, exc.kind)
        yield data(exc.to_body(request_id))
    except Exception as exc:  # noqa: BLE001 - the client gets a clean error event, the log the details
        status = 500
        log.error("request_id=%s stream failed: %s", request_id, type(exc).__name__, exc_info=exc)
        yield data(ScdError("internal error").to_body(request_id))
    finally:
        await chunks.aclose()
        on_end(status)
    yield data("[DONE]")


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however the response ends. Under ASGI
    spec 2.4 (uvicorn) Starlette learns that the client left from a send that fails, and leaves
    the iterator suspended: its `finally` (abort the engine request, close the upstream stream)
    would run only once it is collected, which a reference cycle puts off, often past the end
    of the generation."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
