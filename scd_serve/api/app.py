"""create_app(config, backend) -> FastAPI: OpenAI routes, health, metrics, one error shape.

Every error - raised by a route, by validation, by the guard, or unexpected - leaves as
`{"error": {"type", "message", "request_id", ...}}` with the status from scd_serve.errors;
unexpected ones are logged with their traceback and answered with a bare 500 (no paths,
no reprs). /live answers as soon as HTTP is up; /ready only while the backend (engine
loop and peers) is ready and the app is not draining.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from scd_serve import __version__
from scd_serve.api.backend import Backend
from scd_serve.api.guard import RequestGuard, error_response
from scd_serve.api.metrics import Metrics
from scd_serve.api.routes import router
from scd_serve.api.schemas import ERROR_RESPONSES
from scd_serve.config.api import ApiConfig
from scd_serve.errors import InvalidRequest, NotFound, ScdError, Unavailable, ValidationFailed

log = logging.getLogger("scd_serve.api")


def create_app(config: ApiConfig, backend: Backend, metrics: Metrics | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.draining = False
        yield
        app.state.draining = True  # the server stops: refuse what still arrives

    docs = config.enable_docs
    app = FastAPI(title="scd-serve", version=__version__, lifespan=lifespan, redoc_url=None,
                  docs_url="/docs" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.config = config
    app.state.backend = backend
    app.state.metrics = metrics or Metrics()
    app.state.model_name = config.model_name or backend.model_name
    app.state.draining = False
    app.add_middleware(RequestGuard, config=config)
    _add_error_handlers(app)
    app.include_router(router)

    @app.get("/live")
    async def live() -> dict:
        return {"status": "ok"}

    @app.get("/health", responses={503: ERROR_RESPONSES[503]})
    async def health(request: Request) -> Any:
        """vLLM's probe, which load generators check before they start: 200 while the engine
        works (its loop runs and is not stalled), whatever the prefill workers do."""
        if not backend.engine_ready():
            return error_response(Unavailable("engine loop not running"), request.state.request_id)
        return {}

    @app.get("/ready", responses={503: ERROR_RESPONSES[503]})
    async def ready(request: Request) -> Any:
        if app.state.draining:
            return error_response(Unavailable("draining"), request.state.request_id)
        if not backend.ready():
            return error_response(Unavailable("engine or peers not ready"), request.state.request_id)
        return {"status": "ready"} | backend.ready_detail()

    @app.get("/metrics", responses={401: ERROR_RESPONSES[401]})
    async def metrics_route() -> Response:
        app.state.metrics.update_from_stats(backend.stats())
        payload, content_type = app.state.metrics.render()
        return Response(payload, media_type=content_type)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    def rid(request: Request) -> str | None:
        return request.scope.get("state", {}).get("request_id")

    def count(request: Request, status: int) -> None:
        route = request.scope.get("route")
        app.state.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()

    @app.exception_handler(ScdError)
    async def scd_error(request: Request, exc: ScdError) -> JSONResponse:
        count(request, exc.http_status)
        log.log(logging.WARNING if exc.http_status >= 500 else logging.INFO, "request_id=%s route=%s status=%d type=%s",
                rid(request), request.url.path, exc.http_status, exc.type)
        return error_response(exc, rid(request))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            err: ScdError = InvalidRequest("request body is not valid JSON", field="body")
        else:
            parts = [f"{_where(e['loc'])}: {e['msg']}" for e in errors[:3]]
            more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
            err = ValidationFailed("; ".join(parts) + more, field=_where(errors[0]["loc"]) if errors else None)
        count(request, err.http_status)
        return error_response(err, rid(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err: ScdError = NotFound(f"no route {request.url.path}")
        else:
            err = ScdError(str(exc.detail))
            err.type, err.http_status = "http_error", exc.status_code
        return JSONResponse(err.to_body(rid(request)), status_code=exc.status_code, headers=exc.headers)


def _where(loc: tuple) -> str:
    """('body', 'messages', 0, 'content') -> 'messages.0.content'; the body itself -> 'body'."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"
