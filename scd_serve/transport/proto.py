"""The generated protobuf and gRPC modules (committed in scd_serve/_proto; `make proto`
regenerates them from proto/scd/v1/scd.proto, see scripts/gen_proto.py)."""

from __future__ import annotations

from scd_serve._proto.scd.v1 import scd_pb2 as pb
from scd_serve._proto.scd.v1 import scd_pb2_grpc as pb_grpc

SERVICE_NAME = "scd.v1.PrefillService"  # the name grpc.health.v1 reports on
PROTOCOL_VERSION = 4  # 2: PrefillSession, PrefillRequest.timeout_ms; 3: without PrefillSession; 4: start

__all__ = ["pb", "pb_grpc", "SERVICE_NAME", "PROTOCOL_VERSION"]
