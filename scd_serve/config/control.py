"""Control plane timing: heartbeat period and how long silence means a worker is gone."""

from __future__ import annotations

from dataclasses import dataclass

from scd_serve.errors import ConfigError


@dataclass(frozen=True)
class ControlConfig:
    # Workers send a heartbeat this often (seconds).
    heartbeat_s: float = 0.5
    # A worker silent for this long is dropped from the registry (seconds).
    worker_ttl_s: float = 3.0
    # Largest control message accepted (bytes); larger ones are dropped unread.
    max_message_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if not (0 < self.heartbeat_s <= 60):
            raise ConfigError(f"control.heartbeat_s must be in (0, 60], got {self.heartbeat_s}")
        if self.worker_ttl_s < 2 * self.heartbeat_s:
            raise ConfigError(f"control.worker_ttl_s ({self.worker_ttl_s}) must be at least twice "
                              f"heartbeat_s ({self.heartbeat_s})")
        if self.max_message_bytes < 1024:
            raise ConfigError("control.max_message_bytes must be >= 1024")
