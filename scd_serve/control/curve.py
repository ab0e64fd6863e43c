"""The control plane's transport security: ZeroMQ CURVE, keyed by the cluster secret, checked by ZAP.

With a cluster secret every control-plane socket speaks CURVE (CurveZMQ: X25519 key agreement,
then every frame encrypted and authenticated, fresh session keys per connection, so a frame
cannot be replayed or sent back the other way). Both long-term key pairs, the registry's and
the workers', are derived from the secret (HMAC-SHA256 under a label per role): whatever has
the secret (`scd-serve up`, compose, the Kubernetes Secret) has the keys, and no key file has
to reach any role. The registry's ROUTER is the CURVE server; pyzmq's ZAP authenticator admits
a client only with the workers' public key.

Authentication happens in the handshake, before any message: a peer without the secret (a
plain ZMTP client, or CURVE with another key) is disconnected there and nothing it sends is
assembled (the HELLO is a fixed 200 bytes; MAXMSGSIZE bounds any frame). Before, an unsigned
multipart message was assembled in full before its HMAC was checked: 1 GB never completed
held 750 MB of the gateway's memory. That HMAC layer is gone: with CURVE it proved nothing
more (integrity, freshness and direction are the session's) and read every frame first.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

DOMAIN = "scd-control"


@dataclass(frozen=True)
class CurveKeys:
    """Z85 keys (40 characters each) of the registry (server) and of every worker (client)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def keys_from(secret: str) -> CurveKeys:
    def pair(role: bytes) -> tuple[bytes, bytes]:
        private = z85.encode(hmac.new(secret.encode(), b"scd-serve control curve v1 " + role, hashlib.sha256).digest())
        return zmq.curve_public(private), private

    (server_public, server_secret), (client_public, client_secret) = pair(b"registry"), pair(b"worker")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def serve_curve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before bind) the CURVE server; with ZAP enforced, no handler means no peer."""
    sock.curve_server = True
    sock.curve_secretkey, sock.curve_publickey = keys.server_secret, keys.server_public
    sock.zap_domain = DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def connect_curve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before connect) a CURVE client of the registry."""
    sock.curve_secretkey, sock.curve_publickey = keys.client_secret, keys.client_public
    sock.curve_serverkey = keys.server_public


class Gatekeeper:
    """The ZAP handler of one context: admits the workers' public key only, counts the rest."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys, on_denied: Callable[[], None]):
        self.allowed, self.on_denied = keys.client_public, on_denied
        self.auth = AsyncioAuthenticator(ctx, log=logging.getLogger("scd_serve.control.zap"))
        self.auth.configure_curve_callback(DOMAIN, self)

    def callback(self, domain: str, key: bytes) -> bool:  # pyzmq's credentials-provider interface
        ok = hmac.compare_digest(key, self.allowed)
        if not ok:
            self.on_denied()
        return ok

    def start(self) -> None:
        self.auth.start()

    def stop(self) -> None:
        self.auth.stop()
