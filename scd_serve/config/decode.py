"""Decode worker settings: consumer model, HTTP listener, prefill peers, transfer policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from scd_serve.config.transport import TransportConfig
from scd_serve.control.registry import check_address
from scd_serve.errors import ConfigError

DEFAULT_CONSUMER = "models/demo-pair/consumer"
DEFAULT_CODEBOOK = "models/demo-pair/codebook"
FALLBACKS = ("local", "none")


def split_peers(value: str) -> tuple[str, ...]:
    """'h1:p1,h2:p2' -> ('h1:p1', 'h2:p2'), each checked to be HOST:PORT."""
    peers = tuple(p.strip() for p in value.split(",") if p.strip())
    for p in peers:
        try:
            check_address(p)
        except ValueError:
            raise ConfigError(f"peer {p!r} is not HOST:PORT") from None
    return peers


@dataclass(frozen=True)
class DecodeConfig:
    model: str = DEFAULT_CONSUMER
    codebook: str = DEFAULT_CODEBOOK  # "" or missing directory = codebook-free methods only
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 8100  # HTTP; 0 = the OS picks
    control_url: str = ""  # "" = no control plane (static peers only)
    advertise: str = ""  # HOST:PORT the gateway should dial; "" = host:bound port
    prefill: tuple[str, ...] = ()  # static prefill peers (HOST:PORT), besides those the registry names
    # Server default transfer method ("local" = no transfer); requests override with scd_method.
    method: str = "scd"
    # When a transfer fails: "local" prefills on this worker, "none" fails the request (503).
    fallback: str = "local"
    # Prefill workers tried per request before giving up (each a different worker).
    max_attempts: int = 2
    # Circuit breaker per prefill peer: consecutive failed transfers that open it, and the first
    # cool-down before one probe transfer (doubling on each failed probe, up to 30 s).
    breaker_failures: int = 3
    breaker_cooldown_s: float = 2.0
    # Health check / reconnect period for prefill peers (seconds). /ready follows within ~2 periods.
    health_period_s: float = 1.0
    # Accept a prefill peer whose handshake differs (escape hatch; logged loudly).
    allow_incompatible: bool = False
    # Refuse producers with another fingerprint ("" = take the codebook's, or accept any).
    expect_producer: str = ""
    shutdown_grace_s: float = 10.0
    transport: TransportConfig = field(default_factory=TransportConfig)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("decode.model must name a model directory")
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"decode.port must be in [0, 65535], got {self.port}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"decode.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"decode.fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if not 1 <= self.max_attempts <= 8:
            raise ConfigError(f"decode.max_attempts must be in [1, 8], got {self.max_attempts}")
        if not 1 <= self.breaker_failures <= 100:
            raise ConfigError(f"decode.breaker_failures must be in [1, 100], got {self.breaker_failures}")
        if not 0.01 <= self.breaker_cooldown_s <= 30:
            raise ConfigError(f"decode.breaker_cooldown_s must be in [0.01, 30], got {self.breaker_cooldown_s}")
        if not 0.05 <= self.health_period_s <= 60:
            raise ConfigError(f"decode.health_period_s must be in [0.05, 60], got {self.health_period_s}")
        if not self.method:
            raise ConfigError("decode.method must name a transfer method (or 'local')")
        if self.control_url and not self.control_url.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"decode.control_url must look like tcp://HOST:PORT, got {self.control_url!r}")
        split_peers(",".join(self.prefill))
