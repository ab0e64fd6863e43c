"""RequestGuard: ASGI middleware that runs before routing and before the body is parsed.

It gives the request its id (the client's `x-request-id` if it sent a sane one, as vLLM does,
else a new one), which the logs, the engine request, the prefill worker's gRPC call, the
response header and the body's `id` (`cmpl-<id>`) all carry; checks the API key on every path but
OPEN_PATHS, requires application/json bodies (415), reads the body with a hard cap (413,
chunked bodies too), so an oversized body is never held in memory, and refuses JSON nested
deeper than `max_json_depth` (400) before any parser sees it: a parser's recursion limit is a
500 otherwise (json's RecursionError), and every route would need its own catch.
Header bytes are read as latin-1, which decodes every byte: no header can raise here.
"""

from __future__ import annotations

import logging
import re
import uuid

import numpy as np
from starlette.responses import JSONResponse

from scd_serve.api.auth import OPEN_PATHS, key_matches
from scd_serve.config.api import ApiConfig
from scd_serve.errors import InvalidRequest, PayloadTooLarge, ScdError, Unauthorized, UnsupportedMediaType

log = logging.getLogger("scd_serve.api")
_NESTING = np.zeros(256, np.int8)  # byte -> change of nesting depth
_NESTING[[ord("["), ord("{")]], _NESTING[[ord("]"), ord("}")]] = 1, -1


def json_depth(body: bytes) -> int:
    """How deep `[` and `{` nest in a JSON text, brackets inside strings not counted; vectorized,
    so a 1 MiB body of brackets costs milliseconds (a Python loop over it would cost 100x more)."""
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")  # no escaped backslash or quote is left
    chars = np.frombuffer(text, np.uint8)
    outside = (np.cumsum(chars == ord('"'), dtype=np.int32) & 1) == 0  # odd count of quotes so far: in a string
    return int(np.cumsum(_NESTING[chars] * outside, dtype=np.int32).max(initial=0))


def check_json_depth(body: bytes, limit: int) -> None:
    """InvalidRequest naming the limit when `body` nests deeper than `limit`."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return  # cannot nest deeper: every request of normal shape stops here
    depth = json_depth(body)
    if depth > limit:
        raise InvalidRequest(f"JSON nesting depth {depth} exceeds the limit of {limit} (arrays and objects "
                             f"inside each other); flatten the request")


def error_response(exc: ScdError, request_id: str | None) -> JSONResponse:
    return JSONResponse(exc.to_body(request_id), status_code=exc.http_status, headers=exc.headers)


REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/=+-]{1,128}$")  # what a client's x-request-id may be (safe in logs)


def request_id_of(headers: dict[str, str]) -> str:
    """The client's x-request-id when it is a sane token (vLLM honours it too), else a new one."""
    given = headers.get("x-request-id", "")
    return given if REQUEST_ID.match(given) else uuid.uuid4().hex


class RequestGuard:
    def __init__(self, app, config: ApiConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        rid = request_id_of(headers)
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":  # one x-request-id: ours (a proxied one is the same)
                started = True
                message["headers"] = [*(h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"),
                                      (b"x-request-id", rid.encode())]
            await send(message)

        try:
            self._check_key(scope["path"], headers)
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = _replay(await self._read_body(headers, receive), receive)
        except ScdError as exc:
            return await error_response(exc, rid)(scope, receive, send_with_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 - unexpected: log it all, tell the client nothing internal
            log.error("request_id=%s unhandled %s", rid, type(exc).__name__, exc_info=exc)
            if started:
                raise
            await error_response(ScdError("internal error"), rid)(scope, receive, send_with_id)

    def _check_key(self, path: str, headers: dict[str, str]) -> None:
        key = self.config.api_key
        if key and path not in OPEN_PATHS and not key_matches(headers.get("authorization"), key):
            raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'",
                               headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, headers: dict[str, str], receive) -> bytes:
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise UnsupportedMediaType(f"Content-Type must be application/json, got {ctype or 'none'!r}")
        limit = self.config.max_body_bytes
        declared = headers.get("content-length")
        # isascii: "²".isdigit() is true and int("²") raises
        if declared is not None and (not (declared.isascii() and declared.isdigit()) or int(declared) > limit):
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        check_json_depth(body, self.config.max_json_depth)
        return body


def _replay(body: bytes, receive):
    done = False

    async def replayed():
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls see the client's disconnect

    return replayed
