"""The table of live workers (plain Python) and the JSON messages that keep it current.

Messages are JSON objects only (never pickle), size-capped, authenticated by the transport
(curve.py) and validated field by field:
  worker -> registry  {"type": "heartbeat", "role": "prefill"|"decode", "id": str,
                       "address": "HOST:PORT", "ready": bool, "load": {str: number},
                       "models": [str, ...] (decode: the served model names, optional)}
                      {"type": "bye", "id": str}
  registry -> worker  {"type": "peers", "workers": [worker record, ...]}
Loads are clamped to [0, MAX_LOAD] (a negative load would win every routing choice); load keys
are short lowercase words, as they become metric labels at the gateway. A
worker silent for `ttl_s` is dropped and its address remembered as silent (`silent`: the
gateway stops waiting for it) until it heartbeats again; one that said bye is not. Roles in
`verify_roles` count as ready only once a handshake reached their address (`mark_verified`).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass, field

from scd_serve.config.address import check_address

ROLES = ("prefill", "decode")
MAX_ID = 128
MAX_LOAD_KEYS = 32
MAX_LOAD = 1e6
MAX_MODELS = 16
LOAD_KEY = re.compile(r"[a-z_]{1,32}")


class Rejected(ValueError):
    """A message that is dropped; `reason` is the counter it is counted under."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()


def decode_json(raw: bytes) -> dict:
    """A JSON object from bytes; Rejected("malformed") for anything else, deep nesting included."""
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # 5000 "[" overflow the decoder's recursion limit
        raise Rejected("malformed", f"not JSON: {type(exc).__name__}: {str(exc)[:120]}") from None
    if not isinstance(msg, dict):
        raise Rejected("malformed", "message must be a JSON object")
    return msg


def validate(msg: dict) -> dict:
    """The worker message `msg` (a decoded JSON object) checked field by field, loads clamped;
    Rejected("malformed") names what is wrong."""
    kind, wid = msg.get("type"), msg.get("id")
    if not isinstance(wid, str) or not 0 < len(wid) <= MAX_ID:
        raise Rejected("malformed", f"id must be a string of 1..{MAX_ID} characters")
    if kind == "bye":
        return {"type": "bye", "id": wid}
    if kind != "heartbeat":
        raise Rejected("malformed", f"unknown message type {kind!r}")
    if msg.get("role") not in ROLES:
        raise Rejected("malformed", f"role must be one of {ROLES}")
    if not isinstance(msg.get("ready"), bool):
        raise Rejected("malformed", "ready must be true or false")
    load = msg.get("load", {})
    if not isinstance(load, dict) or len(load) > MAX_LOAD_KEYS or not all(
            isinstance(k, str) and LOAD_KEY.fullmatch(k) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) for k, v in load.items()):
        raise Rejected("malformed", f"load must be an object of at most {MAX_LOAD_KEYS} finite numbers "
                                    f"under lowercase keys")
    models = msg.get("models", [])
    if not isinstance(models, list) or len(models) > MAX_MODELS or not all(
            isinstance(m, str) and 0 < len(m) <= MAX_ID for m in models):
        raise Rejected("malformed", f"models must be a list of at most {MAX_MODELS} names of 1..{MAX_ID} characters")
    try:
        address = check_address(msg.get("address"))
    except ValueError as exc:
        raise Rejected("malformed", str(exc)) from None
    return {"type": "heartbeat", "id": wid, "role": msg["role"], "address": address, "ready": msg["ready"],
            "load": {k: min(max(v, 0), MAX_LOAD) for k, v in load.items()}, "models": tuple(models)}


@dataclass
class WorkerRecord:
    id: str
    role: str
    address: str
    ready: bool
    load: dict = field(default_factory=dict)
    models: tuple[str, ...] = ()  # a decode worker's served model names
    last_seen: float = 0.0
    # a handshake reached `address` (always True for roles the registry does not verify)
    verified: bool = True

    def public(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("last_seen", "verified")}


class Registry:
    def __init__(self, ttl_s: float, clock=time.monotonic, max_workers: int = 256,
                 verify_roles: tuple[str, ...] = ()):
        self.ttl_s, self.clock, self.max_workers = ttl_s, clock, max_workers
        self.verify_roles = frozenset(verify_roles)
        self._workers: dict[str, WorkerRecord] = {}
        self._silent: dict[str, float] = {}  # address -> when its worker expired
        self.expired_at = clock()

    def get(self, wid: str) -> WorkerRecord | None:
        return self._workers.get(wid)

    def apply(self, msg: dict) -> None:
        """Apply one parsed message (heartbeat upserts, bye removes). A heartbeat of a new
        worker when `max_workers` are registered raises Rejected("registry_full")."""
        if msg["type"] == "bye":
            self._workers.pop(msg["id"], None)
            return
        rec = self._workers.get(msg["id"])
        if rec is None:
            if len(self._workers) >= self.max_workers and not self.expire():
                raise Rejected("registry_full", f"registry holds {self.max_workers} workers already")
            rec = self._workers[msg["id"]] = WorkerRecord(msg["id"], msg["role"], msg["address"], msg["ready"],
                                                          verified=msg["role"] not in self.verify_roles)
        elif rec.address != msg["address"] or rec.role != msg["role"]:
            rec.verified = msg["role"] not in self.verify_roles  # a new address is trusted after a new handshake
        self._silent.pop(msg["address"], None)
        rec.role, rec.address, rec.ready, rec.load = msg["role"], msg["address"], msg["ready"], msg["load"]
        rec.models = tuple(msg.get("models", ()))
        rec.last_seen = self.clock()

    def mark_verified(self, wid: str, address: str) -> bool:
        """A handshake reached `address`: trust worker `wid` if it still advertises it."""
        rec = self._workers.get(wid)
        if rec is None or rec.address != address:
            return False
        rec.verified = True
        return True

    def expire(self) -> list[WorkerRecord]:
        now = self.expired_at = self.clock()
        gone = [r for r in self._workers.values() if r.last_seen < now - self.ttl_s]
        for r in gone:
            del self._workers[r.id]
            self._silent[r.address] = now
        while len(self._silent) > 2 * self.max_workers:
            del self._silent[next(iter(self._silent))]
        return gone

    def silent(self, address: str) -> bool:
        """The worker at `address` stopped heartbeating (expired; a bye does not count) and has not
        come back. Cheap enough to ask every fraction of a second per request in flight."""
        if self.clock() - self.expired_at > 0.1:
            self.expire()
        return address in self._silent

    def workers(self, role: str | None = None, ready_only: bool = False) -> list[WorkerRecord]:
        """Live workers; ready_only: those that say they are ready and whose address is verified."""
        self.expire()
        return sorted((r for r in self._workers.values()
                       if (role is None or r.role == role) and ((r.ready and r.verified) or not ready_only)),
                      key=lambda r: r.address)

    def peers_message(self) -> dict:
        return {"type": "peers", "workers": [r.public() for r in self.workers()]}
