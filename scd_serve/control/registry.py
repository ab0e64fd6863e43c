"""The table of live workers (plain Python) and the JSON messages that keep it current.

Messages are JSON objects only (never pickle), size-capped and validated field by field:
  worker -> registry  {"type": "heartbeat", "role": "prefill"|"decode", "id": str,
                       "address": "HOST:PORT", "ready": bool, "load": {str: number}}
                      {"type": "bye", "id": str}
  registry -> worker  {"type": "peers", "workers": [worker record, ...]}
A worker silent for `ttl_s` is dropped.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field

ROLES = ("prefill", "decode")
MAX_ID = 128
MAX_ADDRESS = 256
MAX_LOAD_KEYS = 32


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()


def check_address(address) -> str:
    """`address` if it is HOST:PORT with a port in 1..65535, else ValueError."""
    if not isinstance(address, str) or not 0 < len(address) <= MAX_ADDRESS:
        raise ValueError("address must be a HOST:PORT string")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return address


def parse(raw: bytes, max_bytes: int) -> dict:
    """Decode and validate one worker message; ValueError names what is wrong."""
    if len(raw) > max_bytes:
        raise ValueError(f"message of {len(raw)} bytes exceeds {max_bytes}")
    msg = json.loads(raw)  # json.JSONDecodeError is a ValueError
    if not isinstance(msg, dict):
        raise ValueError("message must be a JSON object")
    kind, wid = msg.get("type"), msg.get("id")
    if not isinstance(wid, str) or not 0 < len(wid) <= MAX_ID:
        raise ValueError(f"id must be a string of 1..{MAX_ID} characters")
    if kind == "bye":
        return {"type": "bye", "id": wid}
    if kind != "heartbeat":
        raise ValueError(f"unknown message type {kind!r}")
    if msg.get("role") not in ROLES:
        raise ValueError(f"role must be one of {ROLES}")
    if not isinstance(msg.get("ready"), bool):
        raise ValueError("ready must be true or false")
    load = msg.get("load", {})
    if not isinstance(load, dict) or len(load) > MAX_LOAD_KEYS or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) for k, v in load.items()):
        raise ValueError(f"load must be an object of at most {MAX_LOAD_KEYS} finite numbers")
    return {"type": "heartbeat", "id": wid, "role": msg["role"], "address": check_address(msg.get("address")),
            "ready": msg["ready"], "load": load}


@dataclass
class WorkerRecord:
    id: str
    role: str
    address: str
    ready: bool
    load: dict = field(default_factory=dict)
    last_seen: float = 0.0

    def public(self) -> dict:
        d = asdict(self)
        d.pop("last_seen")
        return d


class Registry:
    def __init__(self, ttl_s: float, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._workers: dict[str, WorkerRecord] = {}

    def apply(self, msg: dict) -> None:
        """Apply one parsed message (heartbeat upserts, bye removes)."""
        if msg["type"] == "bye":
            self._workers.pop(msg["id"], None)
            return
        rec = self._workers.get(msg["id"])
        if rec is None:
            rec = self._workers[msg["id"]] = WorkerRecord(msg["id"], msg["role"], msg["address"], msg["ready"])
        rec.role, rec.address, rec.ready, rec.load = msg["role"], msg["address"], msg["ready"], msg["load"]
        rec.last_seen = self.clock()

    def expire(self) -> list[WorkerRecord]:
        """Drop workers silent for longer than ttl_s; returns them."""
        cutoff = self.clock() - self.ttl_s
        gone = [r for r in self._workers.values() if r.last_seen < cutoff]
        for r in gone:
            del self._workers[r.id]
        return gone

    def workers(self, role: str | None = None, ready_only: bool = False) -> list[WorkerRecord]:
        self.expire()
        return sorted((r for r in self._workers.values()
                       if (role is None or r.role == role) and (r.ready or not ready_only)),
                      key=lambda r: r.address)

    def peers_message(self) -> dict:
        return {"type": "peers", "workers": [r.public() for r in self.workers()]}
