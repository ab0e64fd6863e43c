"""Refuse to start with a listener reachable beyond this host that has no authentication.

A listener or control plane off loopback with no credential (API key, worker token or mTLS,
cluster secret) stops the start with a ConfigError naming the setting, unless --insecure.
Loopback without credentials is the development default (a warning for an unauthenticated control plane).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

from scd_serve.config.control import SECRET_ENV
from scd_serve.errors import ConfigError

log = logging.getLogger("scd_serve.security")
SECRET_HINT = f"set ${SECRET_ENV} or --cluster-secret-file"


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost, "*", "" or 0.0.0.0: reachable from elsewhere


def url_is_local(url: str) -> bool:
    """tcp://HOST:PORT on loopback, or an ipc:// / inproc:// endpoint (never leaves the host)."""
    if url.startswith(("ipc://", "inproc://")):
        return True
    host = url.split("://", 1)[-1].rpartition(":")[0]
    return is_loopback(host)


@dataclass(frozen=True)
class Exposure:
    """One listener or connection: what it is, where, and whether it is authenticated."""

    what: str
    where: str
    local: bool
    authenticated: bool
    hint: str

    @property
    def open(self) -> bool:
        return not self.local and not self.authenticated


def listener(what: str, host: str, authenticated: bool, hint: str) -> Exposure:
    return Exposure(what, host, is_loopback(host), authenticated, hint)


def control_plane(url: str, secret: str) -> Exposure | None:
    """The control plane a role binds or joins (None when it has none)."""
    return Exposure("control plane", url, url_is_local(url), bool(secret), SECRET_HINT) if url else None


def refuse_open(role: str, exposures: list[Exposure | None], insecure: bool) -> None:
    """ConfigError if any exposure is open beyond loopback without auth and not --insecure."""
    found = [e for e in exposures if e is not None]
    open_ = [e for e in found if e.open]
    if open_ and not insecure:
        lines = "; ".join(f"{e.what} on {e.where} has no authentication ({e.hint})" for e in open_)
        raise ConfigError(f"{role}: {lines}; or pass --insecure to run it open anyway")
    for e in open_:
        log.warning("%s: %s on %s has no authentication (--insecure)", role, e.what, e.where)
    for e in found:
        if e.what == "control plane" and e.local and not e.authenticated:
            log.warning("%s: control plane %s is unauthenticated (no cluster secret); fine on loopback for development",
                        role, e.where)
