"""The generated protobuf and gRPC modules, built on first import (see proto_build)."""

from __future__ import annotations

from scd_serve.transport.proto_build import ensure_built

ensure_built()

from scd_serve._proto.scd.v1 import scd_pb2 as pb  # noqa: E402
from scd_serve._proto.scd.v1 import scd_pb2_grpc as pb_grpc  # noqa: E402

SERVICE_NAME = "scd.v1.PrefillService"  # the name grpc.health.v1 reports on
PROTOCOL_VERSION = 3  # 2: PrefillSession, PrefillRequest.timeout_ms; 3: without PrefillSession

__all__ = ["pb", "pb_grpc", "SERVICE_NAME", "PROTOCOL_VERSION"]
