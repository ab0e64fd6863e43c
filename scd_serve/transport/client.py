"""Client for one prefill worker: handshake, transfers (over sessions, or one Prefill call),
Abort, health."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scd_serve.config.transport import TransportConfig
from scd_serve.transport.channel import make_channel
from scd_serve.transport.proto import SERVICE_NAME, pb, pb_grpc
from scd_serve.transport.session import SessionPool, SessionTransfer


class PrefillClient:
    """One channel to HOST:PORT. Every call passes an explicit timeout (seconds)."""

    def __init__(self, address: str, config: TransportConfig, strict_deadlines: bool = False):
        self.address = address
        self.config = config
        self.channel, self.deadlines = make_channel(address, config, strict_deadlines)
        self._stub = pb_grpc.PrefillServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.sessions = SessionPool(lambda timeout: self._stub.PrefillSession(timeout=timeout),
                                    config.session_lifetime_s, config.max_idle_sessions)

    async def info(self, timeout: float | None = None) -> pb.InfoReply:
        return await self._stub.Info(pb.InfoRequest(), timeout=timeout or self.config.rpc_timeout_s)

    def prefill(self, request: pb.PrefillRequest, timeout: float):
        """One Prefill call: an async iterator of PrefillChunk (call .cancel() to stop)."""
        return self._stub.Prefill(request, timeout=timeout)

    def transfer(self, request: pb.PrefillRequest, timeout: float) -> SessionTransfer:
        """The same transfer over a pooled session (no per-call setup): an async iterator of
        PrefillChunk that ends after the last chunk; .cancel() stops it."""
        return self.sessions.transfer(request, timeout)

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
        self.sessions.close()
        await self.channel.close(grace=None)
