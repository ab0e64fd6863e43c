"""create_gateway_app: proxy OpenAI routes (SSE included) to the least-loaded decode worker
that serves the request's `model`.

Decode workers come from the control-plane registry (ready ones only, each with the model names
it serves: several experts behind one gateway) and a static list (serving any name asked).
A `model` no worker serves is a 404 naming those that are; /v1/models lists every one.
One that cannot be reached is skipped for the next before any byte went back; a client
that leaves closes the upstream request at any point (gateway/relay.py), so the worker
aborts it. The gateway answers /version itself, serves the workers' OpenAPI schema, and
gives its own errors the workers' shape.
"""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager, nullcontext
from functools import partial

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from scd_serve import __version__
from scd_serve.api.app import add_version_and_live, create_app
from scd_serve.api.guard import RequestGuard, error_response
from scd_serve.api.handlers import install_error_handlers
from scd_serve.api.sse import USAGE_HEADER, USAGE_TRAILER, ClosingStreamingResponse
from scd_serve.config.api import ApiConfig
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.choice import Candidate, LoadBalancer
from scd_serve.control.registry import Registry
from scd_serve.errors import NotFound, Unavailable
from scd_serve.gateway.metrics import MISSING, GatewayMetrics, RequestClock
from scd_serve.gateway.relay import ClientWatch, Closing, NoFirstByte, Upstream, relay, shutting_down_or_silent, until

log = logging.getLogger("scd_serve.gateway")
# raw header bytes go on as they came: httpx would encode a str value as ASCII, and one byte
# over 0x7f in Authorization or a content-type charset was a UnicodeEncodeError (500)
FORWARD_HEADERS = (b"authorization", b"content-type", b"accept")
RETURN_HEADERS = ("content-type", "retry-after", "x-request-id", "cache-control", "x-scd-method",
                  "x-scd-method-reason", "x-scd-warning")
# (method, path, timed): the routes passed to a decode worker; `timed` ones feed the latency histograms
PROXIED = (("POST", "/v1/completions", True), ("POST", "/v1/chat/completions", True),
           ("POST", "/tokenize", False), ("POST", "/detokenize", False))


def create_gateway_app(config: GatewayConfig, registry: Registry, lifespan_hooks=None) -> FastAPI:
    balancer = LoadBalancer()
    metrics = GatewayMetrics(registry)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
        state["client"] = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=512))
        async with lifespan_hooks(app) if lifespan_hooks is not None else nullcontext():
            yield
        await state["client"].aclose()

    app = FastAPI(title="scd-serve gateway", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.openapi = lambda: worker_openapi(app)
    app.add_middleware(RequestGuard, config=ApiConfig(api_key=config.api_key, max_body_bytes=config.max_body_bytes))
    install_error_handlers(app)
    app.state.metrics = metrics
    app.state.balancer = balancer
    app.state.closing = Closing()  # gateway/main begins it on SIGTERM

    def candidates(model: str | None = None) -> list[Candidate]:
        """Ready decode workers serving `model` (any, for None; a static one serves every name)."""
        cands = {r.address: Candidate(r.address, int(r.load.get("running", 0)), int(r.load.get("waiting", 0)),
                                      int(r.load.get("capacity", 0)))
                 for r in registry.workers(role="decode", ready_only=True)
                 if model is None or not r.models or model in r.models}
        for address in config.decode:
            cands.setdefault(address, Candidate(address))
        return list(cands.values())

    def served_models() -> list[str]:
        return sorted({m for r in registry.workers(role="decode") for m in r.models})

    def unknown_model(model: str | None) -> NotFound | None:
        """A 404 for a `model` that no decode worker serves (None where one does, may, or none is
        known: then the worker says, or the request waits for one to be ready)."""
        if model is None or config.decode:
            return None
        known = served_models()
        if not known or model in known:
            return None
        names = ", ".join(repr(m) for m in known)
        return NotFound(f"model {model!r} does not exist; this server serves {names}", field="model",
                        code="model_not_found")

    async def proxy(request: Request, method: str, path: str, timed: bool = False) -> Response:
        rid = request.scope.get("state", {}).get("request_id")
        body = await request.body()
        headers = forwarded(request)
        headers.append((b"x-request-id", rid.encode()))  # the worker takes it: one id in logs, body and header
        msg = peek(body) if method == "POST" else {}
        asked = msg.get("model", MISSING)
        model = asked if isinstance(asked, str) else None
        if (missing := unknown_model(model)) is not None:  # counted, answered here
            metrics.requests.labels("", str(missing.http_status)).inc()
            if timed:
                clock = metrics.clock(asked)
                clock.bind((), missing.http_status)
                clock.end()
            return error_response(missing, rid)
        stream = timed and msg.get("stream") is True
        if timed and stream:
            headers.append((USAGE_HEADER.encode(), USAGE_TRAILER.encode()))  # token counts for the vLLM series
        watch = ClientWatch(request.receive)  # the body was read: the next message is the disconnect
        try:
            clock = metrics.clock(asked) if timed else None
            return await forward(watch, rid, method, path, body, headers, clock, stream, model)
        finally:
            await watch.close()

    async def forward(watch: ClientWatch, rid, method: str, path: str, body: bytes, headers: list,
                      clock: RequestClock | None, stream: bool, model: str | None = None) -> Response:
        tried: list[str] = []
        for _ in range(config.max_attempts):
            pick = balancer.choose(candidates(model), exclude=tried)
            if pick is None or watch.gone:
                break
            tried.append(pick.address)
            upstream = state["client"].build_request(method, f"http://{pick.address}{path}", content=body,
                                                     headers=headers)
            balancer.acquire(pick.address)
            silent = partial(registry.silent, pick.address)
            # a stream's first event comes with its headers (the workers await it before they answer);
            # a non-streamed answer comes whole, so only a silent worker ends that wait early
            first_byte_s = config.first_byte_timeout_s if stream else None
            try:
                resp = await watch.run(until(state["client"].send(upstream, stream=True),
                                             lambda: "it stopped heartbeating" if silent() else None, first_byte_s))
            except BaseException as exc:
                balancer.release(pick.address)
                if isinstance(exc, NoFirstByte):
                    metrics.first_byte_timeouts.labels(pick.address).inc()
                    log.warning("request_id=%s decode worker %s sent no first byte (%s); trying another", rid,
                                pick.address, exc)
                    continue
                if not isinstance(exc, httpx.TransportError):
                    raise
                metrics.unreachable.labels(pick.address).inc()
                log.warning("request_id=%s decode worker %s unreachable: %s", rid, pick.address, type(exc).__name__)
                continue
            if resp is None:  # the client left first; the cancelled send closed the upstream connection
                balancer.release(pick.address)
                break
            metrics.requests.labels(pick.address, str(resp.status_code)).inc()
            if clock is not None:
                clock.bind(models_at(pick.address), resp.status_code)
            done = Upstream(resp, lambda a=pick.address: balancer.release(a))
            broken = metrics.broken.labels(pick.address).inc
            stop = shutting_down_or_silent(app.state.closing, silent, pick.address)
            # background: also runs when the client left before the body started streaming
            return ClosingStreamingResponse(relay(resp, done, pick.address, rid, broken, clock, stop),
                                     status_code=resp.status_code, background=BackgroundTask(done),
                                     headers={k: v for k, v in resp.headers.items() if k.lower() in RETURN_HEADERS})
        if watch.gone:
            log.info("request_id=%s client left before the response started (tried %s)", rid, ", ".join(tried))
            metrics.requests.labels(tried[-1] if tried else "", "499").inc()
            return Response(status_code=499)  # nobody reads it
        why = f"tried {', '.join(tried)}" if tried else "none registered and ready"
        serving = f" serving {model!r}" if model is not None else ""
        return error_response(Unavailable(f"no decode worker{serving} available ({why})"), rid)

    def models_at(address: str) -> tuple[str, ...]:
        return next((r.models for r in registry.workers(role="decode") if r.address == address), ())

    def proxied(method: str, path: str, timed: bool):
        async def route(request: Request) -> Response:
            return await proxy(request, method, path, timed)
        return route

    for method, path, timed in PROXIED:
        app.add_api_route(path, proxied(method, path, timed), methods=[method])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """Every model the ready decode workers serve: one worker of each set of names is asked
        for its cards (vLLM's shape), and the lists are merged."""
        rid = request.scope.get("state", {}).get("request_id")
        headers = forwarded(request)
        by_names = {r.models: r.address for r in registry.workers(role="decode", ready_only=True)}
        addresses = list(dict.fromkeys([*by_names.values(), *config.decode]))
        cards: dict[str, dict] = {}
        for address in addresses:
            try:
                resp = await state["client"].get(f"http://{address}/v1/models", headers=headers)
            except httpx.TransportError:
                continue
            if resp.status_code != 200:  # the worker's own error (401: a wrong key) is the answer
                return Response(resp.content, status_code=resp.status_code,
                                headers={k: v for k, v in resp.headers.items() if k.lower() in RETURN_HEADERS})
            for card in resp.json().get("data", []):
                cards.setdefault(card.get("id"), card)
        if not cards:
            return error_response(Unavailable("no ready decode worker"), rid)
        return JSONResponse({"object": "list", "data": list(cards.values())})

    add_version_and_live(app)

    def when_ready(request: Request, body) -> Response:
        """`body(number of ready decode workers)` while there is one, else 503."""
        ready = len(candidates())
        if ready:
            return JSONResponse(body(ready))
        return error_response(Unavailable("no ready decode worker"), request.scope["state"].get("request_id"))

    @app.get("/health")
    async def health(request: Request) -> Response:
        """vLLM's probe (load generators check it first): 200 while a decode worker is ready."""
        return when_ready(request, lambda n: {})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        return when_ready(request, lambda n: {"status": "ready", "decode_workers": n})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        content, media_type = metrics.render()
        return Response(content, media_type=media_type)

    return app


def forwarded(request: Request) -> list[tuple[bytes, bytes]]:
    """The client's headers a decode worker is sent, as raw bytes (FORWARD_HEADERS)."""
    return [(k, v) for k, v in request.scope["headers"] if k.lower() in FORWARD_HEADERS]


def peek(body: bytes) -> dict:
    """The JSON object of a request body, {} for anything else (the worker answers that one);
    the guard has bounded its size and depth."""
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return msg if isinstance(msg, dict) else {}


def worker_openapi(app: FastAPI) -> dict:
    """The decode workers' schema (request and error bodies of every route the gateway serves),
    titled as the gateway; built once, from an app that is never started."""
    if app.openapi_schema is None:
        class NoBackend:  # the schema needs the routes, never a backend
            model_name = "gateway"

        schema = create_app(ApiConfig(), NoBackend()).openapi()  # type: ignore[arg-type]
        schema["info"]["title"] = app.title
        app.openapi_schema = schema
    return app.openapi_schema
