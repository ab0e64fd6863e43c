"""Client for one prefill worker: handshake, transfers (a blocking stream read in the
caller's thread, or an aio Prefill call), Abort, health."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scd_serve.config.transport import TransportConfig
from scd_serve.transport.channel import make_channel, make_stream_channel
from scd_serve.transport.proto import SERVICE_NAME, pb, pb_grpc


_PREFILL = f"/{SERVICE_NAME}/Prefill"
_INFO = f"/{SERVICE_NAME}/Info"
REQUEST_ID_KEY = "x-request-id"  # Prefill call metadata: the HTTP request's id (the message has it too)


class PrefillClient:
    """One channel to HOST:PORT. Every call passes an explicit timeout (seconds)."""

    def __init__(self, address: str, config: TransportConfig, strict_deadlines: bool = False):
        self.address, self.config = address, config
        self.channel, self.deadlines = make_channel(address, config, strict_deadlines)
        self._stub = pb_grpc.PrefillServiceStub(self.channel)
        self._stream_channel = make_stream_channel(address, config)
        self._stream_stub = pb_grpc.PrefillServiceStub(self._stream_channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def info(self, timeout: float | None = None) -> pb.InfoReply:
        return await self._stub.Info(pb.InfoRequest(), timeout=timeout or self.config.rpc_timeout_s)

    async def connect_streams(self, timeout: float) -> bool:
        """Connect the stream channel now (an Info call on it that waits for the connection);
        False if that fails within timeout. After a worker restart this second channel may sit
        in its reconnect backoff while Info succeeds on the first, and a stream call then
        fails at once with UNAVAILABLE; the call also proves its credentials are accepted."""
        self.deadlines.timeouts.append((_INFO, timeout))
        try:
            await asyncio.to_thread(self._stream_stub.Info, pb.InfoRequest(), timeout=timeout, wait_for_ready=True,
                                    metadata=self.deadlines.metadata)
            return True
        except (grpc.RpcError, ValueError):  # ValueError: the channel was closed meanwhile
            return False

    def prefill(self, request: pb.PrefillRequest, timeout: float):
        """One Prefill call: an async iterator of PrefillChunk (call .cancel() to stop)."""
        return self._stub.Prefill(request, timeout=timeout, metadata=((REQUEST_ID_KEY, request.request_id),))

    def stream(self, request: pb.PrefillRequest, timeout: float):
        """One Prefill call as a blocking iterator of PrefillChunk, for a worker thread: the
        request leaves now; iterate in ONE thread; .cancel() from any thread. Errors are
        grpc.RpcError with .code() and .details(), like the aio calls'."""
        if timeout is None:  # the aio calls' interceptor enforces the same rule
            raise ValueError("Prefill stream made without a deadline")
        self.deadlines.timeouts.append((_PREFILL, timeout))
        return self._stream_stub.Prefill(request, timeout=timeout, metadata=(*self.deadlines.metadata,
                                                                             (REQUEST_ID_KEY, request.request_id)))

    async def abort(self, request_id: str, reason: str, timeout: float | None = None) -> bool:
        reply = await self._stub.Abort(pb.AbortRequest(request_id=request_id, reason=reason),
                                       timeout=timeout or self.config.rpc_timeout_s)
        return reply.was_running

    async def serving(self, timeout: float | None = None) -> bool:
        """True iff grpc.health.v1 says SERVING for the prefill service; False on any error."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                             timeout=timeout or self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        self._stream_channel.close()
        await self.channel.close(grace=None)
