"""create_app(config, backend) -> FastAPI: OpenAI routes, health, metrics, one error shape.

/live answers as soon as HTTP is up; /ready only while the backend (engine loop and peers)
is ready and the app is not draining.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from scd_serve import __version__
from scd_serve.api.backend import Backend
from scd_serve.api.guard import RequestGuard, error_response
from scd_serve.api.handlers import install_error_handlers
from scd_serve.api.metrics import Metrics
from scd_serve.api.routes import router
from scd_serve.api.responses import Empty, Status, Version, ok
from scd_serve.api.schemas import ERROR_RESPONSES
from scd_serve.api.tokenize import router as tokenize_router
from scd_serve.config.api import ApiConfig
from scd_serve.errors import Unavailable


def create_app(config: ApiConfig, backend: Backend, metrics: Metrics | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.draining = False
        yield
        app.state.draining = True  # the server stops: refuse what still arrives

    docs = config.enable_docs
    app = FastAPI(title="scd-serve", version=__version__, lifespan=lifespan, redoc_url=None,
                  docs_url="/docs" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.config, app.state.backend = config, backend
    app.state.metrics = metrics or Metrics()
    app.state.model_names = list(config.served_model_names or (config.model_name or backend.model_name,))
    app.state.model_name = app.state.model_names[0]
    app.state.metrics.model_name = app.state.metrics.model_name or app.state.model_name
    app.state.draining = False
    app.state.started = int(time.time())  # /v1/models' `created`
    app.add_middleware(RequestGuard, config=config)

    def count(request: Request, status: int) -> None:
        route = request.scope.get("route")
        app.state.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()

    install_error_handlers(app, count)
    app.include_router(router)
    app.include_router(tokenize_router)
    add_version_and_live(app)

    @app.get("/health", response_model=None, responses=ok(Empty, (503,)))
    async def health(request: Request) -> Any:
        """vLLM's probe, which load generators check before they start: 200 while the engine
        works (its loop runs and is not stalled), whatever the prefill workers do."""
        if not backend.engine_ready():
            return error_response(Unavailable("engine loop not running"), request.state.request_id)
        return {}

    @app.get("/ready", response_model=None, responses=ok(Status, (503,)))
    async def ready(request: Request) -> Any:
        if app.state.draining:
            return error_response(Unavailable("draining"), request.state.request_id)
        if not backend.ready():
            return error_response(Unavailable("engine or peers not ready"), request.state.request_id)
        return {"status": "ready"} | backend.ready_detail()

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format"}, 401: ERROR_RESPONSES[401]})
    async def metrics_route() -> Response:
        app.state.metrics.update_from_stats(backend.stats())
        payload, content_type = app.state.metrics.render()
        return Response(payload, media_type=content_type)

    return app


def add_version_and_live(app: FastAPI) -> None:
    """/version and /live, answered alike by a worker and the gateway (HTTP is up: alive)."""
    @app.get("/version", response_model=None, responses=ok(Version, ()))
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/live", response_model=None, responses=ok(Status, ()))
    async def live() -> dict:
        return {"status": "ok"}
