"""Worker-to-worker auth: a shared token in metadata, checked before any message is read; mTLS.

`CallGuard` is every prefill server's interceptor. It decides from a call's metadata alone:
a call without the worker token gets UNAUTHENTICATED from a handler that never reads the
request (grpc reads a message only for a handler that takes one, and this one takes a stream
it never iterates), so an unauthenticated 63 MB message is neither received in full nor
parsed. Before, the denial handler took the method's request type: grpc received and parsed
up to the 64 MiB cap first (8 x 63 MB: RSS 975 -> 1,915 MB). grpc has no per-call receive
limit, so the server-wide cap (`max_message_bytes`) stays; unauthenticated calls get none
of it. For authenticated calls the guard parses the request itself: bytes that are not the
method's message get INVALID_ARGUMENT "malformed request message" and a counted warning at
most every LOG_EVERY_S, never grpc's parser details in the reply or a traceback per call.
"""

from __future__ import annotations

import inspect
import logging
import secrets
import time
from pathlib import Path

import grpc

from scd_serve.config.transport import TransportConfig

log = logging.getLogger("scd_serve.transport")
AUTH_KEY = "authorization"
# Health checks stay open: Docker's HEALTHCHECK and k8s probes carry no secret.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
LOG_EVERY_S = 10.0


async def _deny(request_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")


# request_streaming: grpc hands over an iterator instead of reading a message first
_DENIED = grpc.stream_stream_rpc_method_handler(_deny)


class CallGuard(grpc.aio.ServerInterceptor):
    """Token check from metadata (when `token` is set) and safe request parsing (see the module doc)."""

    def __init__(self, token: str = ""):
        self._expected = f"Bearer {token}".encode() if token else None
        self.num_unauthenticated = 0
        self.num_malformed = 0
        self._warned = -LOG_EVERY_S
        self._since = 0  # malformed requests since the last warning

    async def intercept_service(self, continuation, details):
        if self._expected is not None and details.method not in OPEN_METHODS:
            given = dict(details.invocation_metadata or ()).get(AUTH_KEY, "")
            given = given.encode("utf-8", "replace") if isinstance(given, str) else given
            if not secrets.compare_digest(given, self._expected):
                self.num_unauthenticated += 1
                return _DENIED
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        return self._parsing(handler, details.method)

    def _parsing(self, handler, method: str):
        parse, make = handler.request_deserializer, (grpc.unary_stream_rpc_method_handler if handler.response_streaming
                                                     else grpc.unary_unary_rpc_method_handler)
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

        async def request_of(raw: bytes, context):
            try:
                return parse(raw)
            except Exception:  # noqa: BLE001 - DecodeError and whatever else a parser raises on bytes
                self._malformed(method)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed request message")

        async def unary(raw, context):
            result = behavior(await request_of(raw, context), context)
            return await result if inspect.isawaitable(result) else result

        async def streaming(raw, context):
            result = behavior(await request_of(raw, context), context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            elif inspect.isawaitable(result):  # writes with context.write
                await result
            else:
                for item in result:
                    yield item

        return make(streaming if handler.response_streaming else unary, request_deserializer=None,
                    response_serializer=handler.response_serializer)

    def _malformed(self, method: str) -> None:
        self.num_malformed += 1
        self._since += 1
        now = time.monotonic()
        if now - self._warned >= LOG_EVERY_S:
            log.warning("grpc: refused %d request(s) that are not a valid message (last on %s; %d in all)",
                        self._since, method[:120], self.num_malformed)
            self._warned, self._since = now, 0


def auth_metadata(config: TransportConfig) -> tuple[tuple[str, str], ...]:
    return ((AUTH_KEY, f"Bearer {config.worker_token}"),) if config.worker_token else ()


def server_credentials(config: TransportConfig) -> grpc.ServerCredentials | None:
    if not config.tls:
        return None
    pair = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
    ca = Path(config.tls_ca).read_bytes() if config.tls_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(config: TransportConfig) -> grpc.ChannelCredentials | None:
    if not (config.tls or config.tls_ca):
        return None
    ca = Path(config.tls_ca).read_bytes() if config.tls_ca else None
    key = Path(config.tls_key).read_bytes() if config.tls_key else None
    cert = Path(config.tls_cert).read_bytes() if config.tls_cert else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
