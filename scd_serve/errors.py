"""The one error table: every ScdError maps to an HTTP status, a gRPC code and a JSON body.

Raise the most specific subclass; the API, the gateway, the gRPC servicers and the CLI all
render errors through `http_status`, `grpc_code` and `to_body` so the same failure looks the
same everywhere (also as the last event of a stream). The body is OpenAI's
`{"error": {"message", "type", "param", "code"}}` - param and code always present, null when
there is none, as OpenAI clients read them - plus our `request_id`.

`type` is OpenAI's coarse class, which OpenAI/vLLM clients branch on (`invalid_request_error`,
`authentication_error`, `not_found_error`, `rate_limit_error`, `server_error`); `code` is
OpenAI's finer code where it has one (`context_length_exceeded`, `invalid_api_key`, ...), else
`kind`: this project's stable name of the failure (`transfer_failed`, `engine_dead`, ...), which
logs and gRPC trailing metadata carry too. Plain 400s (a bad field) have code null, as OpenAI's.
"""

from __future__ import annotations

from typing import Any


class ScdError(Exception):
    """Base class. `kind`: the stable name of the failure; `type`: OpenAI's class of it."""

    kind = "internal_error"
    type = "server_error"
    http_status = 500
    grpc_code = "INTERNAL"  # name of a grpc.StatusCode member; grpc stays out of this module
    code: str | None = None  # OpenAI's finer code; None: `kind` (see body_code)

    def __init__(self, message: str, *, field: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.field = message, field
        self.headers = headers or {}
        if code is not None:
            self.code = code

    def to_body(self, request_id: str | None = None) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.field,
                          "code": self.body_code, "request_id": request_id}}

    @property
    def body_code(self) -> str | None:
        if self.code is not None:
            return self.code
        return None if self.kind == InvalidRequest.kind else self.kind


class InvalidRequest(ScdError):
    """The client sent something we will not run (bad field, out-of-range parameter)."""

    kind, type, http_status, grpc_code = "invalid_request", "invalid_request_error", 400, "INVALID_ARGUMENT"


class ValidationFailed(InvalidRequest):
    """Body does not match the schema (wrong types, missing or unknown fields). 400, as OpenAI
    and vLLM answer, not FastAPI's 422: clients treat every 400 as "fix the request"."""

    kind, code = "invalid_request", None  # OpenAI's code is null for a schema error too


class PromptTooLong(InvalidRequest):
    kind = code = "context_length_exceeded"


class Unauthorized(ScdError):
    kind, type, http_status, grpc_code, code = "unauthorized", "authentication_error", 401, "UNAUTHENTICATED", \
        "invalid_api_key"


class NotFound(ScdError):
    kind, type, http_status, grpc_code = "not_found", "not_found_error", 404, "NOT_FOUND"


class PayloadTooLarge(ScdError):
    kind, type, http_status, grpc_code = "payload_too_large", "invalid_request_error", 413, "RESOURCE_EXHAUSTED"


class UnsupportedMediaType(ScdError):
    kind, type, http_status, grpc_code = "unsupported_media_type", "invalid_request_error", 415, "INVALID_ARGUMENT"


class Overloaded(ScdError):
    """Admission control said no; the client should retry later (Retry-After is set)."""

    kind, type, http_status, grpc_code, code = "overloaded", "rate_limit_error", 429, "RESOURCE_EXHAUSTED", \
        "rate_limit_exceeded"

    def __init__(self, message: str = "server is at capacity, retry later", *, retry_after_s: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class Unavailable(ScdError):
    """A peer or the engine is not ready (starting, draining, dead)."""

    kind, http_status, grpc_code = "unavailable", 503, "UNAVAILABLE"


class ShuttingDown(Unavailable):
    kind = "shutting_down"


class EngineDead(Unavailable):
    kind = "engine_dead"


class DeadlineExceeded(ScdError):
    kind, http_status, grpc_code = "deadline_exceeded", 504, "DEADLINE_EXCEEDED"


class StepFailed(ScdError):
    """The engine could not make this request's next token (non-finite logits, a failing step);
    the request ends with this error, the engine and the rest of the batch go on."""

    kind = "generation_failed"


class TransferCorrupt(ScdError):
    """A chunk failed its checksum or sequence check; it is never decoded."""

    kind, http_status, grpc_code = "transfer_corrupt", 502, "DATA_LOSS"


class TransferFailed(ScdError):
    """The transfer from the prefill worker broke off (peer died, stream cut)."""

    kind, http_status, grpc_code = "transfer_failed", 502, "UNAVAILABLE"


class TransferTimedOut(TransferFailed):
    """The prefill worker did not finish (or went silent during) a transfer within the
    transfer's own deadline, while the request still had time: retried or served locally."""

    kind, http_status, grpc_code = "transfer_timeout", 504, "DEADLINE_EXCEEDED"


class IncompatiblePeer(ScdError):
    """Handshake found a different codec version, dtype or model fingerprint."""

    kind, http_status, grpc_code = "incompatible_peer", 503, "FAILED_PRECONDITION"


class ModelLoadError(ScdError):
    """A model directory is missing, unsupported or inconsistent."""

    kind, http_status, grpc_code = "model_load_error", 500, "FAILED_PRECONDITION"


class CodebookError(ScdError):
    """A codebook is missing, truncated, of the wrong shapes or made for other models."""

    kind, http_status, grpc_code = "codebook_error", 500, "FAILED_PRECONDITION"


class ConfigError(ScdError):
    """A configuration value is invalid; raised at the entry point before anything starts."""

    kind, http_status, grpc_code = "config_error", 500, "INVALID_ARGUMENT"


def check_range(name: str, value, lo: float, hi: float, *, open_low: bool = False) -> None:
    """ConfigError `NAME must be in [LO, HI], got VALUE` ("(LO, HI]" with open_low) when value is outside."""
    if not (lo < value <= hi if open_low else lo <= value <= hi):
        raise ConfigError(f"{name} must be in {'(' if open_low else '['}{lo}, {hi}], got {value}")
