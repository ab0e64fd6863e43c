"""Worker-to-worker auth: a shared token in metadata, and optional mTLS."""

from __future__ import annotations

import secrets
from pathlib import Path

import grpc

from scd_serve.config.transport import TransportConfig

AUTH_KEY = "authorization"
# Health checks stay open: Docker's HEALTHCHECK and k8s probes carry no secret.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


async def _deny_async(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker token")


async def _deny_stream(request, context):
    await _deny_async(request, context)
    yield  # pragma: no cover - makes this an async generator like the real handler


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` before any handler runs."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        if details.method in OPEN_METHODS:
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get(AUTH_KEY, "")
        if secrets.compare_digest(given.encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        make, deny = ((grpc.unary_stream_rpc_method_handler, _deny_stream) if handler.response_streaming
                      else (grpc.unary_unary_rpc_method_handler, _deny_async))
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


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
