"""OpenAI response shapes (completion / chat, whole and streamed) and the SSE stream.

A stream sends one chunk per non-empty text delta, a last chunk with finish_reason, an
optional usage chunk (stream_options.include_usage), then `data: [DONE]`. An error after
the stream started is sent as one `data: {"error": ...}` event (the same body as an HTTP
error) before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from scd_serve.engine.request import TokenEvent
from scd_serve.errors import ScdError

log = logging.getLogger("scd_serve.api")


class Shape:
    """Builds the JSON objects of one response; `chat` picks the chat.completion flavour."""

    def __init__(self, request_id: str, model: str, chat: bool, include_usage: bool = False):
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id.removeprefix("req-")
        self.model = model
        self.chat = chat
        self.include_usage = include_usage
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._head("chat.completion") | {"choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._head("text_completion") | {"choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk") | {"choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = self._head("text_completion") | {"choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [],
                                                                                          "usage": usage}


def data(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse_stream(shape: Shape, first: TokenEvent, events: AsyncIterator[TokenEvent], request_id: str,
                     on_end: Callable[[int], None]) -> AsyncIterator[str]:
    """`first` was already pulled (errors before it became HTTP statuses); `on_end(status)` once."""
    status = 200
    try:
        if shape.chat:
            yield data(shape.chunk(None, None, role=True))
        event, usage = first, None
        while event is not None:
            if event.text_delta or event.finish_reason:
                yield data(shape.chunk(event.text_delta, event.finish_reason))
            usage = event.usage or usage
            event = await anext(events, None)
        if shape.include_usage and usage is not None:
            yield data(shape.usage_chunk(usage.to_dict()))
    except (asyncio.CancelledError, GeneratorExit):
        status = 499  # the client went away; nothing more to send
        raise
    except ScdError as exc:
        status = exc.http_status
        log.warning("request_id=%s stream ended with %s", request_id, exc.type)
        yield data(exc.to_body(request_id))
    except Exception as exc:  # noqa: BLE001 - the client gets a clean error event, the log the details
        status = 500
        log.error("request_id=%s stream failed: %s", request_id, type(exc).__name__, exc_info=exc)
        yield data(ScdError("internal error").to_body(request_id))
    finally:
        await events.aclose()
        on_end(status)
    yield data("[DONE]")
