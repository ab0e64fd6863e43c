"""Control plane settings: heartbeat timing, the cluster secret its CURVE keys come from, bounds."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from scd_serve.errors import ConfigError, check_range

SECRET_ENV = "SCD_CLUSTER_SECRET"
MIN_SECRET_CHARS = 16


@dataclass(frozen=True)
class ControlConfig:
    heartbeat_s: float = 0.5  # workers send a heartbeat this often
    worker_ttl_s: float = 3.0  # a worker silent this long is dropped from the registry
    max_message_bytes: int = 64 * 1024  # the registry's MAXMSGSIZE: a larger frame closes its connection
    # Shared cluster secret: the control plane's CURVE keys are derived from it (control/curve.py;
    # "" = plain ZMTP, allowed only on loopback or with --insecure).
    secret: str = field(default="", repr=False)
    max_workers: int = 256  # the registry's table; heartbeats of new workers beyond it are dropped
    verify_timeout_s: float = 2.0  # for a worker's address to answer the registry's handshake
    # Workers look up the control URL's host again this often: a name that resolves to several
    # gateways (a headless Service) gets heartbeats at every one, so each holds every worker.
    resolve_s: float = 5.0

    def __post_init__(self) -> None:
        check_range("control.heartbeat_s", self.heartbeat_s, 0, 60, open_low=True)
        if self.worker_ttl_s < 2 * self.heartbeat_s:
            raise ConfigError(f"control.worker_ttl_s ({self.worker_ttl_s}) must be at least twice "
                              f"heartbeat_s ({self.heartbeat_s})")
        if self.max_message_bytes < 1024:
            raise ConfigError("control.max_message_bytes must be >= 1024")
        if self.secret and len(self.secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"the cluster secret must have at least {MIN_SECRET_CHARS} characters "
                              f"(e.g. `openssl rand -hex 32`)")
        check_range("control.max_workers", self.max_workers, 1, 65536)
        check_range("control.verify_timeout_s", self.verify_timeout_s, 0, 60, open_low=True)
        check_range("control.resolve_s", self.resolve_s, 0, 3600, open_low=True)


def add_control_arguments(parser) -> None:
    """The control-plane and exposure flags every role shares; read back with `control_config_from_args`."""
    g = parser.add_argument_group("control plane and exposure")
    g.add_argument("--cluster-secret-file", default="",
                   help=f"file holding the cluster secret the control plane's keys come from (default: ${SECRET_ENV})")
    g.add_argument("--insecure", action="store_true",
                   help="start even with a non-loopback listener or control plane that has no authentication")


def control_config_from_args(args) -> ControlConfig:
    """The secret from --cluster-secret-file (surrounding whitespace removed), else $SCD_CLUSTER_SECRET."""
    path = getattr(args, "cluster_secret_file", "")
    if not path:
        return ControlConfig(secret=os.environ.get(SECRET_ENV, "").strip())
    try:
        secret = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--cluster-secret-file {path}: cannot read it ({type(exc).__name__})") from None
    if not secret:
        raise ConfigError(f"--cluster-secret-file {path} is empty")
    return ControlConfig(secret=secret)
