"""gRPC server construction shared by workers: size caps, auth, TLS, health service."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from scd_serve.config.transport import TransportConfig
from scd_serve.config.address import join_host_port
from scd_serve.errors import ConfigError
from scd_serve.transport.security import CallGuard, server_credentials


def make_server(config: TransportConfig, max_concurrent_rpcs: int | None = None, guard: CallGuard | None = None
                ) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A grpc.aio server with message caps, `guard` (token auth, safe parsing; by default one for
    the config's token) and grpc.health.v1 added."""
    interceptors = [guard or CallGuard(config.worker_token)]
    options = [("grpc.max_send_message_length", config.max_message_bytes),
               ("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.so_reuseport", 0)]  # port 0 must give a port nobody else holds
    server = grpc.aio.server(interceptors=interceptors, options=options, maximum_concurrent_rpcs=max_concurrent_rpcs)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


def bind(server: grpc.aio.Server, host: str, port: int, config: TransportConfig) -> int:
    """Listen on host:port (port 0 = OS picks) and return the bound port."""
    address = join_host_port(host, port)
    creds = server_credentials(config)
    try:
        bound = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind": the port taken or the host not ours
        bound = 0
    if bound == 0:
        raise ConfigError(f"could not listen on {address} (port in use, or not an address of this machine); "
                          f"pass another --port (0 = any free port) or --host")
    return bound


async def set_serving(health_servicer, service: str, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set(service, status)
    await health_servicer.set("", status)  # overall health, what probes ask by default
