"""API key check: `Authorization: Bearer <key>` compared in constant time, never logged."""

from __future__ import annotations

import secrets

# Routes a load balancer or orchestrator probes without credentials.
OPEN_PATHS = frozenset({"/live", "/ready", "/health"})


def key_matches(authorization: str | None, api_key: str) -> bool:
    """True when the header carries exactly `Bearer <api_key>`."""
    scheme, _, given = (authorization or "").partition(" ")
    ok_scheme = scheme.lower() == "bearer"
    # compare even on a bad scheme, so timing does not tell which part was wrong
    ok_key = secrets.compare_digest(given.encode("utf-8", "surrogatepass"), api_key.encode("utf-8"))
    return ok_scheme and ok_key
