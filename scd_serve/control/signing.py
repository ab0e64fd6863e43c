"""Signed control messages: each frame proves the cluster secret, is fresh, and is used once.

Wire form of one ZMQ frame (both directions):

    b"scd1" + mac (32 bytes) + body
    body = the JSON message with "ts" (sender's wall clock, seconds) and "nonce" (32 hex) added
    mac  = HMAC-SHA256(key, direction + b"\\n" + body),  key = HMAC-SHA256(secret, b"scd-serve control v1")

`direction` (b"worker" or b"registry") keeps a reply from being sent back in as a heartbeat.
The MAC is checked before a byte of JSON is parsed, then the timestamp (within
max_clock_skew_s) and the nonce (not seen within that window). Without a secret (loopback
development) frames are the bare JSON body.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import time
from collections import OrderedDict

MAGIC = b"scd1"
MAC_BYTES = 32
WORKER, REGISTRY = b"worker", b"registry"
MAX_NONCES = 1 << 16  # a legitimate cluster sends far fewer signed frames per skew window


class Rejected(ValueError):
    """A frame that is dropped; `reason` is the counter it is counted under."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _key(secret: str) -> bytes:
    return hmac.new(secret.encode(), b"scd-serve control v1", hashlib.sha256).digest()


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


class Envelope:
    """Signs outgoing frames and checks incoming ones for one direction pair."""

    def __init__(self, secret: str, send_direction: bytes, recv_direction: bytes, max_skew_s: float = 30.0,
                 clock=time.time):
        self._key = _key(secret) if secret else b""
        self.send_direction, self.recv_direction = send_direction, recv_direction
        self.max_skew_s, self.clock = max_skew_s, clock
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> when it was accepted

    @property
    def signed(self) -> bool:
        return bool(self._key)

    def _mac(self, direction: bytes, body: bytes) -> bytes:
        return hmac.new(self._key, direction + b"\n" + body, hashlib.sha256).digest()

    def seal(self, msg: dict) -> bytes:
        """The frame to send for `msg` (a JSON object)."""
        if not self.signed:
            return encode(msg)
        body = encode({**msg, "ts": self.clock(), "nonce": secrets.token_hex(16)})
        return MAGIC + self._mac(self.send_direction, body) + body

    def open(self, frame: bytes) -> dict:
        """The message in `frame`; Rejected (reason unsigned, bad_mac, stale, replayed, malformed)."""
        if not self.signed:
            return decode_json(frame)
        if not frame.startswith(MAGIC) or len(frame) < len(MAGIC) + MAC_BYTES + 2:
            raise Rejected("unsigned", "frame carries no signature")
        mac, body = frame[len(MAGIC):len(MAGIC) + MAC_BYTES], frame[len(MAGIC) + MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(self.recv_direction, body)):
            raise Rejected("bad_mac", "signature does not match the cluster secret")
        msg = decode_json(body)
        ts, nonce = msg.pop("ts", None), msg.pop("nonce", None)
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
            raise Rejected("malformed", "ts must be a number")
        if not isinstance(nonce, str) or not 16 <= len(nonce) <= 64:
            raise Rejected("malformed", "nonce must be a string of 16..64 characters")
        now = self.clock()
        if abs(now - ts) > self.max_skew_s:
            raise Rejected("stale", f"timestamp {now - ts:+.1f} s off this clock (max {self.max_skew_s:g})")
        self._forget(now)
        if nonce in self._nonces:
            raise Rejected("replayed", "nonce already seen")
        self._nonces[nonce] = now
        while len(self._nonces) > MAX_NONCES:
            self._nonces.popitem(last=False)
        return msg

    def _forget(self, now: float) -> None:
        """Drop nonces older than twice the skew window: their timestamps now fail as stale."""
        cutoff = now - 2 * self.max_skew_s
        while self._nonces:
            nonce, seen = next(iter(self._nonces.items()))
            if seen >= cutoff:
                break
            del self._nonces[nonce]
