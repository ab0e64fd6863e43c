"""`scd-serve gateway`: the HTTP entry point plus the control-plane registry workers join."""

from __future__ import annotations

import argparse
import os
from contextlib import asynccontextmanager

from scd_serve.config.control import ControlConfig, add_control_arguments
from scd_serve.config.decode import split_peers
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.lifecycle import run_role, start_http, stop_event


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port)")
    parser.add_argument("--control-bind", default="tcp://127.0.0.1:5555", help="registry bind address for workers")
    parser.add_argument("--decode", default="", help="static decode worker(s): HOST:PORT[,HOST:PORT]")
    parser.add_argument("--api-key", default=os.environ.get("SCD_API_KEY", ""),
                        help="bearer token clients must send (default: $SCD_API_KEY)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--first-byte-timeout-s", type=float, default=90.0,
                        help="a stream with no first event from its decode worker this soon goes to another worker")
    parser.add_argument("--header-timeout-s", type=float, default=10.0,
                        help="a connection whose request headers are not complete this soon is closed")
    parser.add_argument("--shutdown-grace-s", type=float, default=5.0,
                        help="on SIGTERM, streams still open after this end with a shutting_down error event")
    add_control_arguments(parser)


def config_from_args(args) -> GatewayConfig:
    return GatewayConfig(host=args.host, port=args.port, control_bind=args.control_bind,
                         decode=split_peers(args.decode), api_key=args.api_key,
                         request_timeout_s=args.request_timeout_s, first_byte_timeout_s=args.first_byte_timeout_s,
                         header_timeout_s=args.header_timeout_s, shutdown_grace_s=args.shutdown_grace_s)


def check_exposure(config: GatewayConfig, control: ControlConfig, insecure: bool) -> None:
    from scd_serve.control.exposure import control_plane, listener, refuse_open

    refuse_open("gateway", [listener("HTTP API", config.host, bool(config.api_key), "set $SCD_API_KEY or --api-key"),
                            control_plane(config.control_bind, control.secret)], insecure)


async def serve(config: GatewayConfig, control_config: ControlConfig | None = None) -> None:
    import uvicorn

    from scd_serve.api.http_server import http_config
    from scd_serve.control.preflight import check_port, check_zmq_bind
    from scd_serve.control.server import DroppedCollector, RegistryServer
    from scd_serve.gateway.app import create_gateway_app

    check_port(config.host, config.port)
    check_zmq_bind(config.control_bind, "--control-bind")
    stop = stop_event()
    control = RegistryServer(config.control_bind, control_config or ControlConfig())

    @asynccontextmanager
    async def hooks(app):
        control.start()
        yield
        await control.close()

    app = create_gateway_app(config, control.registry, hooks)
    app.state.metrics.registry.register(DroppedCollector(control))  # scd_control_dropped_messages_total
    # uvicorn waits a little longer than the grace: the streams it ends get their error event out first
    server = uvicorn.Server(http_config(app, config.host, config.port, header_timeout_s=config.header_timeout_s,
                                        timeout_graceful_shutdown=int(config.shutdown_grace_s) + 2))
    http, port = await start_http(server)
    print(f"gateway serving http://{config.host}:{port}, control plane {control.url}", flush=True)
    await stop.wait()
    app.state.closing.begin(config.shutdown_grace_s)
    server.should_exit = True
    await http


def run(args) -> int:
    run_role("gateway", args, config_from_args, check_exposure, serve)
