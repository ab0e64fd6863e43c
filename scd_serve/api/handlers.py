"""install_error_handlers(app): every error leaves a FastAPI app (worker or gateway) in one shape.

A route's ScdError, a body that does not match the schema (400 naming the first field, as
OpenAI and vLLM answer), an unknown route or method (404 / 405): all rendered by
scd_serve.errors' `to_body`. Unexpected exceptions are the RequestGuard's (a bare 500).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scd_serve.api.guard import error_response
from scd_serve.errors import InvalidRequest, NotFound, ScdError, ValidationFailed

log = logging.getLogger("scd_serve.api")


def install_error_handlers(app: FastAPI, count: Callable[[Request, int], None] = lambda request, status: None) -> None:
    """`count(request, status)` is told of every error answered (the worker's request counter)."""

    @app.exception_handler(ScdError)
    async def scd_error(request: Request, exc: ScdError) -> JSONResponse:
        count(request, exc.http_status)
        log.log(logging.WARNING if exc.http_status >= 500 else logging.INFO, "request_id=%s route=%s status=%d type=%s",
                request_id(request), request.url.path, exc.http_status, exc.kind)
        return error_response(exc, request_id(request))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc.errors())
        count(request, err.http_status)
        return error_response(err, request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err: ScdError = NotFound(f"no route {request.url.path}")
        else:
            err = ScdError(str(exc.detail))
            err.kind, err.type, err.http_status = "http_error", "invalid_request_error", exc.status_code
        return JSONResponse(err.to_body(request_id(request)), status_code=exc.status_code, headers=exc.headers)


def request_id(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def validation_error(errors: list[dict]) -> InvalidRequest:
    """pydantic's error list -> one 400 naming the first field (and how many more there are)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return InvalidRequest("request body is not valid JSON", field="body")
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:  # OpenAI's wording, so a client's message reads the same as there
        where = _where(unknown[0]["loc"])
        return ValidationFailed(f"Unrecognized request argument supplied: {where} (this server does not "
                                f"implement it; see docs/api.md)", field=where, code="unrecognized_argument")
    parts = [f"{_where(e['loc'])}: {e['msg']}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return ValidationFailed("; ".join(parts) + more, field=_where(errors[0]["loc"]) if errors else None)


# pydantic names the member of a union it tried ('stop', 'str'); the client's field is 'stop'
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|function-[a-z]+|constrained-[a-z]+)(\[.*\])?$")


def _where(loc: tuple) -> str:
    """('body', 'messages', 0, 'content') -> 'messages.0.content'; the body itself -> 'body'."""
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _TYPE_TAG.match(p))]
    return ".".join(parts) or "body"
