"""Gateway settings: the public HTTP listener, the control-plane bind, proxy limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from scd_serve.errors import ConfigError, check_range


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    control_bind: str = "tcp://127.0.0.1:5555"  # the registry workers join (ZMQ ROUTER)
    decode: tuple[str, ...] = ()  # decode workers (HOST:PORT) besides those that register
    api_key: str = field(default="", repr=False)  # clients must send it ("" = open); forwarded as is
    max_body_bytes: int = 1 << 20  # larger bodies get 413 before they are read in full
    # Seconds to connect to a decode worker, and for a whole proxied request.
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 300.0
    # A stream whose first event has not come from its decode worker within this many seconds goes
    # to another worker (nothing was sent yet). Above the workers' own worst first token: queue
    # (30 s) + a failed transfer (30 s) + the local prefill of the longest prompt.
    first_byte_timeout_s: float = 90.0
    # SIGTERM: streams still open this long after end with a `shutting_down` error event, then it exits
    shutdown_grace_s: float = 5.0
    # Request headers not complete this many seconds after a connection opened (or its last
    # response ended) close the connection: slow-header (slowloris) clients hold no slot for long.
    header_timeout_s: float = 10.0
    max_attempts: int = 2  # decode workers tried when one cannot be reached (before any byte)

    def __post_init__(self) -> None:
        check_range("gateway.port", self.port, 0, 65535)
        if not self.control_bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"gateway.control_bind must look like tcp://HOST:PORT, got {self.control_bind!r}")
        if self.max_body_bytes < 1024:
            raise ConfigError("gateway.max_body_bytes must be >= 1024")
        for name in ("connect_timeout_s", "request_timeout_s", "first_byte_timeout_s", "shutdown_grace_s",
                     "header_timeout_s"):
            if not (0 < getattr(self, name) <= 86400):
                raise ConfigError(f"gateway.{name} must be in (0, 86400] seconds")
        check_range("gateway.max_attempts", self.max_attempts, 1, 8)
