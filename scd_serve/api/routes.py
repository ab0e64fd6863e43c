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
from fastapi.responses import JSONResponse, Response, StreamingResponse

from scd_serve.api.choices import Outcome, all_or_none, best, child_seed, first_event, merged, rest
from scd_serve.api.logprobs import TokenText, chat_logprobs, completion_logprobs, merge_completion
from scd_serve.api.prompt import chat_prompt_ids, completion_prompts
from scd_serve.api.sampling import MAX_CHOICES, Plan, check_length, check_logit_bias, sampling_params
from scd_serve.api.schemas import ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest
from scd_serve.api.sse import USAGE_HEADER, USAGE_TRAILER, Shape, sse_stream
from scd_serve.control.lifecycle import cancel_all
from scd_serve.engine.request import GenerationRequest, TokenEvent, Usage
from scd_serve.errors import InvalidRequest, NotFound, ShuttingDown

log = logging.getLogger("scd_serve.api")
router = APIRouter()
T = TypeVar("T")


@router.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
async def models(request: Request) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "scd-serve",
                                        "max_model_len": request.app.state.config.max_model_len}
                                       for name in request.app.state.model_names]}


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _serve(request, body, chat=False, max_tokens=body.max_tokens)


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
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
    if chat:
        prompts = [(None, await asyncio.to_thread(chat_prompt_ids, body.messages, backend.tokenizer))]
    else:
        prompts = await asyncio.to_thread(completion_prompts, body.prompt, backend.tokenizer, vocab)
    if len(prompts) * plan.best_of > MAX_CHOICES:
        raise InvalidRequest(f"{len(prompts)} prompts x best_of {plan.best_of} = {len(prompts) * plan.best_of} "
                             f"generations; at most {MAX_CHOICES} per request", field="prompt")
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
                                          method, deadline=deadline))
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
            await _close(streams)
    if firsts is None:
        on_end(499)
        return Response(status_code=499)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    render = Render(Shape(rid, model, chat, include_usage=include_usage), plan, prompts, backend.tokenizer,
                    body.return_tokens_as_token_ids)
    picked = method_choice(backend, method, [r.request_id for r in reqs])  # known now: the first tokens are in
    served.update(picked or {})
    if body.stream:
        chunks = render.stream(firsts, streams)
        trailer = render.summary if request.headers.get(USAGE_HEADER) == USAGE_TRAILER else None
        return StreamingResponse(sse_stream(_first_with(chunks, picked) if picked else chunks, rid, on_end, trailer),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          **choice_headers(picked)})
    outcomes = [Outcome(k // plan.best_of) for k in range(len(reqs))]
    try:  # errors: counted by the app's handler
        done = await _unless_gone(request, all_or_none([rest(f, s, o) for f, s, o in zip(firsts, streams, outcomes)]))
    finally:
        await _close(streams)
    on_end(200 if done is not None else 499)
    if done is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return JSONResponse(render.whole(best(done, plan.n, plan.best_of)) | ({SCD_FIELD: picked} if picked else {}),
                        headers=choice_headers(picked))


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


class Render:
    """Outcomes and events -> OpenAI choices: echo, max_tokens 0, logprobs in either shape."""

    def __init__(self, shape: Shape, plan: Plan, prompts: list[tuple[str | None, list[int]]], tokenizer,
                 as_ids: bool):
        self.shape, self.plan, self.prompts, self.tokenizer = shape, plan, prompts, tokenizer
        self.text = TokenText(tokenizer, as_ids)
        self._echo: dict[int, str] = {}

    def echo_text(self, p: int) -> str:
        if p not in self._echo:
            text, ids = self.prompts[p]
            self._echo[p] = text if text is not None else self.tokenizer.decode(ids)
        return self._echo[p]

    def whole(self, outcomes: list[Outcome]) -> dict:
        choices = []
        for i, o in enumerate(outcomes):
            text, logprobs, _ = self._piece(o.prompt_index, o.token_ids, o.records, o.prompt_records, o.text,
                                            echo=self.plan.echo, offset=0)
            finish, stop = (o.finish_reason, o.stop_reason) if self.plan.generate else ("length", None)
            choices.append(self.shape.choice(i, text, finish, stop, logprobs))
        return self.shape.whole(choices, self._usage(outcomes).to_dict())

    async def stream(self, firsts: list[TokenEvent], streams: list) -> AsyncIterator[dict]:
        outcomes = self.outcomes = [Outcome(k // self.plan.best_of) for k in range(len(streams))]
        offsets = [0] * len(streams)
        events = merged(firsts, streams)
        try:
            if self.shape.chat:
                for i in range(len(streams)):
                    yield self.shape.chunk(i, None, role=True)
            async for i, ev in events:
                o = outcomes[i]
                first = not o.parts
                o.add(ev)
                ids, recs = ([ev.token_id], [ev.logprob]) if ev.token_id is not None else ([], [])
                text, logprobs, offsets[i] = self._piece(o.prompt_index, ids, recs, ev.prompt_logprobs,
                                                         ev.text_delta, echo=self.plan.echo and first,
                                                         offset=offsets[i])
                finish, stop = ev.finish_reason, ev.stop_reason
                if finish is not None and not self.plan.generate:
                    finish, stop = "length", None
                if text or logprobs or finish:
                    yield self.shape.chunk(i, text, finish, stop, logprobs)
            if self.shape.include_usage:
                yield self.shape.usage_chunk(self._usage(outcomes).to_dict())
        finally:
            await events.aclose()
            await _close(streams)

    def _piece(self, p: int, ids, records, prompt_records, generated: str, *, echo: bool, offset: int):
        """-> (text, logprobs or None, the next text offset) of a choice or one stream chunk."""
        text, lp = "", None
        want = self.plan.logprobs is not None
        if echo:
            text = self.echo_text(p)
            if want and not self.shape.chat:
                lp = completion_logprobs(self.prompts[p][1], prompt_records or [None] * len(self.prompts[p][1]),
                                         self.text, offset)
            offset += len(text)
        if self.plan.generate:
            text += generated
            if want and self.shape.chat:
                lp = chat_logprobs(ids, records, self.text) if ids else None
            elif want:
                part = completion_logprobs(ids, records, self.text, offset)
                lp = merge_completion(lp, part) if ids else lp
                offset += sum(len(t) for t in part["tokens"])
        return text, lp, offset

    def summary(self) -> dict:
        """A streamed response's usage and finish reasons, once it ended (the usage trailer)."""
        done = best(self.outcomes, self.plan.n, self.plan.best_of)
        return self._usage(self.outcomes).to_dict() | {"finish_reasons": [o.finish_reason for o in done]}

    def _usage(self, outcomes: list[Outcome]) -> Usage:
        prompt = sum(len(ids) for _, ids in self.prompts)
        done = best(outcomes, self.plan.n, self.plan.best_of) if self.plan.best_of != self.plan.n else outcomes
        generated = sum(o.usage.completion_tokens for o in done if o.usage) if self.plan.generate else 0
        return Usage(prompt, generated)


async def _close(streams: list[AsyncIterator]) -> None:
    for s in streams:
        await s.aclose()


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
