"""Transport settings shared by the prefill server and the decode-side client."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from scd_serve.errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True)
class TransportConfig:
    # Largest gRPC message either side sends or accepts (bytes). One chunk holds one
    # layer's code, so this bounds codes per layer, not per request.
    max_message_bytes: int = 64 * MiB
    rpc_timeout_s: float = 5.0  # deadline of unary RPCs (Info, Abort, health)
    prefill_timeout_s: float = 30.0  # deadline of a whole Prefill stream (set per call)
    # Longest the decode side waits for the next message of a Prefill stream (the first one
    # included) before it gives the worker up as hung and retries elsewhere or falls back.
    stall_timeout_s: float = 10.0
    worker_token: str = field(default="", repr=False)  # sent as `authorization: Bearer`; "" = no auth
    # mTLS, PEM files: cert+key = TLS on; ca = peers must present a cert it signed.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""  # expected in the server certificate (for connections by IP)

    def __post_init__(self) -> None:
        if not (1024 <= self.max_message_bytes <= 1 << 31):
            raise ConfigError(f"max_message_bytes must be in [1024, 2^31], got {self.max_message_bytes}")
        for name in ("rpc_timeout_s", "prefill_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if not (0 < value <= 3600):
                raise ConfigError(f"{name} must be in (0, 3600] seconds, got {value}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key must be given together")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{name}: no such file {path!r}")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


def add_transport_arguments(parser) -> None:
    """The flags both worker roles share; read back with `transport_config_from_args`."""
    g = parser.add_argument_group("transport")
    g.add_argument("--max-message-mb", type=int, default=64, help="gRPC message size cap (MiB)")
    g.add_argument("--worker-token", default=os.environ.get("SCD_WORKER_TOKEN", ""),
                   help="shared secret between workers (default: $SCD_WORKER_TOKEN)")
    g.add_argument("--tls-cert", default="", help="PEM certificate for mTLS between workers")
    g.add_argument("--tls-key", default="", help="PEM private key for --tls-cert")
    g.add_argument("--tls-ca", default="", help="PEM CA that signs peer certificates")
    g.add_argument("--tls-server-name", default="", help="name expected in the prefill worker's certificate")
    g.add_argument("--rpc-timeout-s", type=float, default=5.0, help="deadline of handshake/abort/health RPCs")
    g.add_argument("--prefill-timeout-s", type=float, default=30.0, help="deadline of one whole transfer")
    g.add_argument("--stall-timeout-s", type=float, default=10.0,
                   help="decode side: longest wait for the next message of a transfer before the worker counts as hung")


def transport_config_from_args(args) -> TransportConfig:
    flags = {f.name: getattr(args, f.name) for f in fields(TransportConfig) if hasattr(args, f.name)}
    return TransportConfig(**flags | {"max_message_bytes": args.max_message_mb * MiB})
