"""ScdError <-> gRPC status, both directions, through the one error table in errors.py."""

from __future__ import annotations

import grpc

from scd_serve import errors

ERROR_TYPE_KEY = "scd-error-type"  # trailing metadata: the ScdError.kind behind a status

# What the decode side raises for a status from the prefill side.
_FROM_CODE: dict[grpc.StatusCode, type[errors.ScdError]] = {
    grpc.StatusCode.DATA_LOSS: errors.TransferCorrupt, grpc.StatusCode.RESOURCE_EXHAUSTED: errors.Overloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.FAILED_PRECONDITION: errors.IncompatiblePeer,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest}
# Worth another try on another worker: the next one may be up, idle or intact.
RETRYABLE = frozenset(getattr(grpc.StatusCode, name) for name in (
    "UNAVAILABLE", "RESOURCE_EXHAUSTED", "DATA_LOSS", "INTERNAL", "UNKNOWN", "CANCELLED"))


async def abort_with(context: grpc.aio.ServicerContext, err: errors.ScdError) -> None:
    """End the RPC with the status the error table gives (raises, like context.abort)."""
    context.set_trailing_metadata(((ERROR_TYPE_KEY, err.kind),))
    await context.abort(getattr(grpc.StatusCode, err.grpc_code), err.message)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A client-side RPC error made locally (a fake transport), shaped like a real channel's."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def from_rpc_error(exc: grpc.aio.AioRpcError, peer: str) -> errors.ScdError:
    """An RPC failure seen by the decode side -> the ScdError to raise."""
    code = exc.code()
    detail = exc.details() or code.name
    cls = _FROM_CODE.get(code, errors.TransferFailed)
    if cls is errors.Overloaded:
        return errors.Overloaded(f"prefill worker {peer} is full: {detail}")
    err = cls(f"prefill worker {peer}: {code.name}: {detail}")
    err.retryable = code in RETRYABLE
    return err


def is_retryable(err: errors.ScdError) -> bool:
    """Statuses from the wire say it themselves; locally found breakage (a corrupt chunk, a
    stream cut short) is worth another worker; everything else is not."""
    default = isinstance(err, (errors.Overloaded, errors.TransferCorrupt, errors.TransferFailed))
    return bool(getattr(err, "retryable", default))
