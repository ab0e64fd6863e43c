"""OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models.

Everything is validated before the backend sees the request (schema 422, ranges 400,
prompt length 400 naming both numbers). The first token event is awaited before the
response starts, so admission errors (429, 503, 504) are HTTP statuses, not stream events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from scd_serve.api.prompt import chat_prompt_ids, completion_prompt_ids
from scd_serve.api.sampling import check_length, sampling_params
from scd_serve.api.schemas import ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest
from scd_serve.api.sse import Shape, sse_stream
from scd_serve.engine.request import GenerationRequest, TokenEvent
from scd_serve.errors import InvalidRequest, NotFound, ScdError, ShuttingDown

log = logging.getLogger("scd_serve.api")
router = APIRouter()
T = TypeVar("T")


@router.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
async def models(request: Request) -> dict:
    name = request.app.state.model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "scd-serve"}]}


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    if body.echo:
        raise InvalidRequest("echo is not supported", field="echo")
    if body.logprobs is not None:
        raise InvalidRequest("logprobs is not supported", field="logprobs")
    return await _serve(request, body, chat=False, max_tokens=body.max_tokens)


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    if body.logprobs:
        raise InvalidRequest("logprobs is not supported", field="logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await _serve(request, body, chat=True, max_tokens=max_tokens)


async def _serve(request: Request, body, *, chat: bool, max_tokens: int | None) -> Response:
    t0 = time.perf_counter()
    state, rid = request.app.state, request.state.request_id
    config, backend = state.config, state.backend
    if state.draining:
        raise ShuttingDown("server is shutting down")
    if body.model is not None and body.model != state.model_name:
        raise NotFound(f"model {body.model!r} does not exist; this server serves {state.model_name!r}", field="model")
    params = sampling_params(body, config, max_tokens)
    if chat:
        ids = await asyncio.to_thread(chat_prompt_ids, body.messages, backend.tokenizer)
    else:
        vocab = getattr(backend, "vocab_size", None) or len(backend.tokenizer)
        ids = await asyncio.to_thread(completion_prompt_ids, body.prompt, backend.tokenizer, vocab)
    room = config.max_model_len - len(ids)
    if max_tokens is None and 1 <= room < params.max_tokens:  # omitted: the default, or what still fits
        params = dataclasses.replace(params, max_tokens=room)
    check_length(len(ids), params.max_tokens, config.max_model_len)
    method = body.scd_method or config.default_method
    req = GenerationRequest(rid, ids, params, method, deadline=time.monotonic() + config.request_timeout_s)
    events = _timed(backend.generate(req), state.metrics, method, t0)
    route = request.url.path

    def on_end(status: int) -> None:
        state.metrics.requests.labels(route, str(status)).inc()
        log.info("request_id=%s route=%s status=%d prompt_tokens=%d max_tokens=%d method=%s seconds=%.3f",
                 rid, route, status, len(ids), params.max_tokens, method, time.perf_counter() - t0)

    first = None
    try:
        first = await _unless_gone(request, anext(events))  # a transfer may run first: watch the client
    except StopAsyncIteration:
        raise ScdError("the backend ended the request without a result") from None
    finally:
        if first is None:  # error or client gone: abort now, do not wait for the transfer
            await events.aclose()
    if first is None:
        on_end(499)
        return Response(status_code=499)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    shape = Shape(rid, state.model_name, chat, include_usage=include_usage)
    if body.stream:
        return StreamingResponse(sse_stream(shape, first, events, rid, on_end), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        done = await _unless_gone(request, _collect(first, events))  # errors: counted by the app's handler
    finally:
        await events.aclose()
    on_end(200 if done is not None else 499)
    if done is None:  # the client left; nobody reads this
        return Response(status_code=499)
    text, last = done
    return JSONResponse(shape.whole(text, last.finish_reason, last.usage.to_dict()))


async def _timed(events: AsyncIterator[TokenEvent], metrics, method: str, t0: float) -> AsyncIterator[TokenEvent]:
    last = None
    try:
        async for event in events:
            now = time.perf_counter()
            if last is None:
                metrics.ttft.labels(method).observe(now - t0)
            else:
                metrics.inter_token.labels(method).observe(now - last)
            last = now
            if event.finish_reason is not None:
                metrics.e2e.labels(method).observe(now - t0)
                if event.usage is not None:
                    metrics.prompt_tokens.inc(event.usage.prompt_tokens)
                    metrics.generation_tokens.inc(event.usage.completion_tokens)
            yield event
    finally:
        await events.aclose()


async def _collect(first: TokenEvent, events: AsyncIterator[TokenEvent]) -> tuple[str, TokenEvent]:
    parts, event = [first.text_delta], first
    while event.finish_reason is None:
        event = await anext(events)
        parts.append(event.text_delta)
    return "".join(parts), event


async def _unless_gone(request: Request, work: Awaitable[T]) -> T | None:
    """The result of `work`, or None when the client disconnects first (work is cancelled)."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
