"""Gateway settings: the public HTTP listener, the control-plane bind, proxy limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from scd_serve.errors import ConfigError


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # The registry workers join (ZMQ ROUTER bind address).
    control_bind: str = "tcp://127.0.0.1:5555"
    # Decode workers to use besides those that register (HOST:PORT, HTTP).
    decode: tuple[str, ...] = ()
    # Bearer token clients must send ("" = open); forwarded to decode workers as is.
    api_key: str = field(default="", repr=False)
    # Largest request body forwarded (bytes); larger gets 413 before it is read in full.
    max_body_bytes: int = 1 << 20
    # Seconds to connect to a decode worker, and for a whole proxied request.
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 300.0
    # Decode workers tried when one cannot be reached (before any response byte).
    max_attempts: int = 2

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"gateway.port must be in [0, 65535], got {self.port}")
        if not self.control_bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"gateway.control_bind must look like tcp://HOST:PORT, got {self.control_bind!r}")
        if self.max_body_bytes < 1024:
            raise ConfigError("gateway.max_body_bytes must be >= 1024")
        for name in ("connect_timeout_s", "request_timeout_s"):
            if not (0 < getattr(self, name) <= 86400):
                raise ConfigError(f"gateway.{name} must be in (0, 86400] seconds")
        if not 1 <= self.max_attempts <= 8:
            raise ConfigError(f"gateway.max_attempts must be in [1, 8], got {self.max_attempts}")
