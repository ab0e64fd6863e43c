"""OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models.

Everything is validated before the backend sees the request (400 naming the field). One
request may become several engine requests (choices.py); the first event of each is awaited
before the response starts, so admission errors (429, 503, 504) are HTTP statuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from scd_serve.api.choices import Outcome, all_or_none, best, child_seed, first_event, rest
from scd_serve.api.render import Render, close_all
from scd_serve.api.prompt import chat_prompt_ids, completion_prompts, unknown_warning
from scd_serve.api.sampling import MAX_CHOICES, Plan, check_length, check_logit_bias, sampling_params
from scd_serve.api.responses import ChatCompletionResponse, CompletionResponse, ModelList, ok
from scd_serve.api.schemas import ChatCompletionRequest, CompletionRequest
from scd_serve.api.sse import USAGE_HEADER, USAGE_TRAILER, ClosingStreamingResponse, Shape, sse_stream
from scd_serve.api.structured import compile_grammar, one_spec, requested_specs
from scd_serve.api.tools import tool_plan
from scd_serve.control.lifecycle import cancel_all
from scd_serve.engine.request import GenerationRequest, TokenEvent, Usage
from scd_serve.errors import InvalidRequest, NotFound, ShuttingDown

log = logging.getLogger("scd_serve.api")
router = APIRouter()
T = TypeVar("T")


@router.get("/v1/models", response_model=None, responses=ok(ModelList, (401,)))
async def models(request: Request) -> dict:
    """vLLM's model cards: every served name, its root (the model directory), max_model_len."""
    state = request.app.state
    root = state.config.model_root or state.model_name
    permission = [{"id": f"modelperm-{state.started}", "object": "model_permission", "created": state.started,
                   "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                   "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                   "organization": "*", "group": None, "is_blocking": False}]
    return {"object": "list", "data": [{"id": name, "object": "model", "created": state.started,
                                        "owned_by": "scd-serve", "root": root, "parent": None,
                                        "max_model_len": state.config.max_model_len, "permission": permission}
                                       for name in state.model_names]}


@router.post("/v1/completions", responses=ok(CompletionResponse, stream=True))
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _serve(request, body, chat=False, max_tokens=body.max_tokens)


@router.post("/v1/chat/completions", responses=ok(ChatCompletionResponse, stream=True))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await _serve(request, body, chat=True, max_tokens=max_tokens)


def served_name(state, asked: str | None) -> str:
    """The name a response reports: the one asked for, when this server serves it (404 otherwise)."""
    if asked is None:
        return state.model_name
    if asked not in state.model_names:
        served = ", ".join(repr(n) for n in state.model_names)
        raise NotFound(f"model {asked!r} does not exist; this server serves {served}", field="model",
                       code="model_not_found")
    return asked


async def _serve(request: Request, body, *, chat: bool, max_tokens: int | None) -> Response:
    t0 = time.perf_counter()
    state, rid = request.app.state, request.state.request_id
    config, backend = state.config, state.backend
    if state.draining:
        raise ShuttingDown("server is shutting down")
    model = served_name(state, body.model)
    params, plan = sampling_params(body, config, max_tokens, chat=chat,
                                   defaults=getattr(backend, "sampling_defaults", None))
    vocab = getattr(backend, "vocab_size", None) or len(backend.tokenizer)
    check_logit_bias(params, vocab)
    tools = tool_plan(body) if chat else None
    specs = requested_specs(body) + ([spec] if tools is not None and (spec := tools.spec()) is not None else [])
    grammar = await compile_grammar(backend, one_spec(specs))
    if chat:
        prompts = [(None, await asyncio.to_thread(chat_prompt_ids, body.messages, backend.tokenizer,
                                                  tools=tools.template_tools if tools else None,
                                                  chat_template=config.chat_template or None))]
    else:
        prompts = await asyncio.to_thread(completion_prompts, body.prompt, backend.tokenizer, vocab)
    if len(prompts) * plan.best_of > MAX_CHOICES:
        raise InvalidRequest(f"{len(prompts)} prompts x best_of {plan.best_of} = {len(prompts) * plan.best_of} "
                             f"generations; at most {MAX_CHOICES} per request", field="prompt")
    warning = unknown_warning(prompts, backend.tokenizer)
    if warning:  # the log names counts, never the prompt's text
        log.warning("request_id=%s %s", rid, warning)
    headers = {"x-scd-warning": warning} if warning else {}
    method = body.scd_method or config.default_method
    deadline = time.monotonic() + config.request_timeout_s
    reqs = []
    for p, (_, ids) in enumerate(prompts):
        room = config.max_model_len - len(ids)
        own = params
        if max_tokens is None and 1 <= room < params.max_tokens:  # omitted: the default, or what still fits
            own = dataclasses.replace(params, max_tokens=room)
        check_length(len(ids), own.max_tokens, config.max_model_len)
        for j in range(plan.best_of):
            k = p * plan.best_of + j
            child_id = rid if len(prompts) * plan.best_of == 1 else f"{rid}-{k}"
            reqs.append(GenerationRequest(child_id, ids, dataclasses.replace(own, seed=child_seed(own.seed, j)),
                                          method, deadline=deadline, grammar=grammar))
    streams = [_timed(backend.generate(r), state.metrics, method, t0) for r in reqs]
    route = request.url.path
    num_prompt_tokens = sum(len(ids) for _, ids in prompts)
    served: dict = {}  # the `scd` field once known (the method `auto` picked)

    def on_end(status: int) -> None:
        state.metrics.requests.labels(route, str(status)).inc()
        shown = method if served.get("method", method) == method else f"{method}->{served['method']}"
        log.info("request_id=%s route=%s status=%d prompts=%d prompt_tokens=%d choices=%d max_tokens=%d method=%s "
                 "seconds=%.3f", rid, route, status, len(prompts), num_prompt_tokens, len(reqs), params.max_tokens,
                 shown, time.perf_counter() - t0)

    firsts = None
    try:  # a transfer may run first: watch the client
        firsts = await _unless_gone(request, all_or_none([first_event(s) for s in streams]))
    finally:
        if firsts is None:  # error or client gone: abort now, do not wait for the transfers
            await close_all(streams)
    if firsts is None:
        on_end(499)
        return Response(status_code=499)
    opts = body.stream_options
    shape = Shape(rid, model, chat, include_usage=bool(opts and opts.include_usage),
                  continuous_usage=bool(opts and opts.continuous_usage_stats))
    render = Render(shape, plan, prompts, backend.tokenizer, body.return_tokens_as_token_ids, tools)
    picked = method_choice(backend, method, [r.request_id for r in reqs])  # known now: the first tokens are in
    served.update(picked or {})
    if body.stream:
        chunks = render.stream(firsts, streams)
        trailer = render.summary if request.headers.get(USAGE_HEADER) == USAGE_TRAILER else None
        return ClosingStreamingResponse(sse_stream(_first_with(chunks, picked) if picked else chunks, rid, on_end, trailer),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          **choice_headers(picked), **headers})
    outcomes = [Outcome(k // plan.best_of) for k in range(len(reqs))]
    try:  # errors: counted by the app's handler
        done = await _unless_gone(request, all_or_none([rest(f, s, o) for f, s, o in zip(firsts, streams, outcomes)]))
    finally:
        await close_all(streams)
    on_end(200 if done is not None else 499)
    if done is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return JSONResponse(render.whole(best(done, plan.n, plan.best_of)) | ({SCD_FIELD: picked} if picked else {}),
                        headers=choice_headers(picked) | headers)


SCD_FIELD = "scd"  # response extension: how the prompt's KV reached the decode worker


def method_choice(backend, requested: str, request_ids: list[str]) -> dict | None:
    """The response's `scd` field: the method that served (for `auto`, the one picked, and
    why; several engine requests' differing methods joined by commas), or None."""
    choice_of = getattr(backend, "choice_of", None)
    picked = [c for c in (choice_of(r) for r in request_ids) if c is not None] if choice_of else []
    if not picked:
        return None
    first = picked[0]
    field = {"method": ",".join(dict.fromkeys(c.method for c in picked)), "requested": requested,
             "reason": first.reason}
    if first.detail:
        field["detail"] = first.detail
    if first.predicted_s is not None:
        field["predicted_ttft_ms"] = round(first.predicted_s * 1e3, 2)
    transfer_of = getattr(backend, "transfer_of", None)
    moved = [t for t in (transfer_of(r) for r in request_ids) if t] if transfer_of else []
    if moved:  # copies of another request's transfer (n > 1) carried nothing more over the wire
        own = [t for t in moved if not t.get("shared")]
        field["transfer"] = {"payload_bytes": sum(t.get("payload_bytes", 0) for t in moved),
                             "raw_kv_bytes": sum(t.get("raw_kv_bytes", 0) for t in own),
                             "rebuild_ms": round(sum(t.get("rebuild_s", 0.0) for t in own) * 1e3, 2),
                             "cache_hit": any(t.get("cache_hit") for t in own)}
    return field


def choice_headers(picked: dict | None) -> dict[str, str]:
    """x-scd-method: the method that served; x-scd-method-reason: why (ASCII, bounded)."""
    if not picked:
        return {}
    why = picked["reason"] + (f"; {picked['detail']}" if picked.get("detail") else "")
    return {"x-scd-method": picked["method"],
            "x-scd-method-reason": why.encode("ascii", "replace").decode()[:300]}


async def _first_with(chunks: AsyncIterator[dict], picked: dict) -> AsyncIterator[dict]:
    """The stream's chunks, the first carrying the `scd` field."""
    first = True
    try:
        async for chunk in chunks:
            if first:
                chunk, first = chunk | {SCD_FIELD: picked}, False
            yield chunk
    finally:
        await chunks.aclose()


async def _timed(events: AsyncIterator[TokenEvent], metrics, method: str, t0: float) -> AsyncIterator[TokenEvent]:
    first = last = None
    try:
        async for event in events:
            now = time.perf_counter()
            if last is None:
                first = now
                metrics.observe_first_token(method, now - t0)
            else:
                metrics.observe_token_gap(method, now - last)
            last = now
            if event.finish_reason is not None:
                usage = event.usage
                metrics.observe_finished(method, now - t0, first - t0, event.finish_reason,
                                         usage.prompt_tokens if usage else None,
                                         usage.completion_tokens if usage else None, event.queue_s)
            yield event
    finally:
        await events.aclose()


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
        await cancel_all(task, watch)
