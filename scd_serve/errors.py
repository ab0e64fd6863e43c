"""The one error table: every ScdError maps to an HTTP status, a gRPC code and a JSON body.

Raise the most specific subclass; the API, the gateway, the gRPC servicers and the CLI all
render errors through `http_status`, `grpc_code` and `to_body` so the same failure looks the
same everywhere (also as the last event of a stream). The body is OpenAI's
`{"error": {"message", "type", "param", "code"}}` - param and code always present, null when
there is none, as OpenAI clients read them - plus our `request_id`.
"""

from __future__ import annotations

from typing import Any


class ScdError(Exception):
    """Base class. `type` is the stable machine-readable name in the JSON body."""

    type = "internal_error"
    http_status = 500
    grpc_code = "INTERNAL"  # name of a grpc.StatusCode member; grpc stays out of this module
    code: str | None = None  # OpenAI's finer machine-readable code where it has one, else null

    def __init__(self, message: str, *, field: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.field = message, field
        self.headers = headers or {}
        if code is not None:
            self.code = code

    def to_body(self, request_id: str | None = None) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.field, "code": self.code,
                          "request_id": request_id}}


class InvalidRequest(ScdError):
    """The client sent something we will not run (bad field, out-of-range parameter)."""

    type, http_status, grpc_code = "invalid_request_error", 400, "INVALID_ARGUMENT"


class ValidationFailed(InvalidRequest):
    """Body does not match the schema (wrong types, missing or unknown fields). 400, as OpenAI
    and vLLM answer, not FastAPI's 422: clients treat every 400 as "fix the request"."""

    type = "validation_error"


class PromptTooLong(InvalidRequest):
    type, code = "context_length_exceeded", "context_length_exceeded"


class Unauthorized(ScdError):
    type, http_status, grpc_code, code = "authentication_error", 401, "UNAUTHENTICATED", "invalid_api_key"


class NotFound(ScdError):
    type, http_status, grpc_code = "not_found", 404, "NOT_FOUND"


class PayloadTooLarge(ScdError):
    type, http_status, grpc_code = "payload_too_large", 413, "RESOURCE_EXHAUSTED"


class UnsupportedMediaType(ScdError):
    type, http_status, grpc_code = "unsupported_media_type", 415, "INVALID_ARGUMENT"


class Overloaded(ScdError):
    """Admission control said no; the client should retry later (Retry-After is set)."""

    type, http_status, grpc_code, code = "overloaded", 429, "RESOURCE_EXHAUSTED", "rate_limit_exceeded"

    def __init__(self, message: str = "server is at capacity, retry later", *, retry_after_s: int = 1):
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class Unavailable(ScdError):
    """A peer or the engine is not ready (starting, draining, dead)."""

    type, http_status, grpc_code = "unavailable", 503, "UNAVAILABLE"


class ShuttingDown(Unavailable):
    type = "shutting_down"


class EngineDead(Unavailable):
    type = "engine_dead"


class DeadlineExceeded(ScdError):
    type, http_status, grpc_code = "deadline_exceeded", 504, "DEADLINE_EXCEEDED"


class StepFailed(ScdError):
    """The engine could not make this request's next token (non-finite logits, a failing step);
    the request ends with this error, the engine and the rest of the batch go on."""

    type = "generation_failed"


class TransferCorrupt(ScdError):
    """A chunk failed its checksum or sequence check; it is never decoded."""

    type, http_status, grpc_code = "transfer_corrupt", 502, "DATA_LOSS"


class TransferFailed(ScdError):
    """The transfer from the prefill worker broke off (peer died, stream cut)."""

    type, http_status, grpc_code = "transfer_failed", 502, "UNAVAILABLE"


class TransferTimedOut(TransferFailed):
    """The prefill worker did not finish (or went silent during) a transfer within the
    transfer's own deadline, while the request still had time: retried or served locally."""

    type, http_status, grpc_code = "transfer_timeout", 504, "DEADLINE_EXCEEDED"


class IncompatiblePeer(ScdError):
    """Handshake found a different codec version, dtype or model fingerprint."""

    type, http_status, grpc_code = "incompatible_peer", 503, "FAILED_PRECONDITION"


class ModelLoadError(ScdError):
    """A model directory is missing, unsupported or inconsistent."""

    type, http_status, grpc_code = "model_load_error", 500, "FAILED_PRECONDITION"


class CodebookError(ScdError):
    """A codebook is missing, truncated, of the wrong shapes or made for other models."""

    type, http_status, grpc_code = "codebook_error", 500, "FAILED_PRECONDITION"


class ConfigError(ScdError):
    """A configuration value is invalid; raised at the entry point before anything starts."""

    type, http_status, grpc_code = "config_error", 500, "INVALID_ARGUMENT"


def check_range(name: str, value, lo: float, hi: float, *, open_low: bool = False) -> None:
    """ConfigError `NAME must be in [LO, HI], got VALUE` ("(LO, HI]" with open_low) when value is outside."""
    if not (lo < value <= hi if open_low else lo <= value <= hi):
        raise ConfigError(f"{name} must be in {'(' if open_low else '['}{lo}, {hi}], got {value}")
