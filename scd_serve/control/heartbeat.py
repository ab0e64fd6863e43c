"""A worker's side of the control plane: register, send load every period, learn peers.

With a cluster secret the socket is a CURVE client (curve.py): the registry admits it only with
the workers' key, and it talks only to a registry holding the registry's key, so a peer list
comes from the real registry or not at all. A reply that is not a peers message is dropped and
counted. MAXMSGSIZE and the receive high-water mark bound what a registry can make it hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import suppress

import zmq
import zmq.asyncio

from scd_serve.config.control import ControlConfig
from scd_serve.control.curve import connect_curve, keys_from
from scd_serve.control.lifecycle import Restarting
from scd_serve.control.registry import Rejected, decode_json, encode

log = logging.getLogger("scd_serve.control")
SILENT_WARN_S = 10.0  # no valid reply for this long: say so once (wrong secret, registry down)
MAX_REPLY_BYTES = 4 * 1024 * 1024  # a peer list of many workers
RCVHWM = 8  # replies queued; one comes per heartbeat


class HeartbeatClient:
    """Sends {"type": "heartbeat", ...} every heartbeat_s; calls on_peers(list) on each reply."""

    def __init__(self, url: str, role: str, address: str, ready: Callable[[], bool],
                 load: Callable[[], dict], config: ControlConfig,
                 on_peers: Callable[[list[dict]], None] | None = None, models: tuple[str, ...] = ()):
        self.url, self.role, self.address, self.models = url, role, address, tuple(models)
        self.ready_fn, self.load_fn, self.on_peers = ready, load, on_peers
        self.config = config
        self.id = f"{role}-{address}-{uuid.uuid4().hex[:8]}"
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a registry that is not there
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        if config.secret:
            connect_curve(self.sock, keys_from(config.secret))
        self.sock.connect(url)
        # heartbeats until close(); a task that dies anyway is logged and started again
        self.runner = Restarting(lambda: self._run(), f"heartbeat-{role}")
        self.num_replies = 0
        self.num_dropped = 0  # replies that were not a peers message
        self._last_reply = time.monotonic()
        self._warned_silent = False

    def start(self) -> None:
        self.runner.start()

    def message(self) -> dict:
        msg = {"type": "heartbeat", "role": self.role, "id": self.id, "address": self.address,
               "ready": bool(self.ready_fn()), "load": self.load_fn()}
        return msg | {"models": list(self.models)} if self.models else msg

    async def _run(self) -> None:
        while True:
            try:
                await self.sock.send(encode(self.message()), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # registry not reachable yet: try again next period
            except Exception:  # a load() bug must not stop the heartbeats silently forever
                log.exception("control: heartbeat failed")
            silent = time.monotonic() - self._last_reply
            if silent > max(SILENT_WARN_S, 10 * self.config.heartbeat_s) and not self._warned_silent:
                self._warned_silent = True
                log.warning("control: no answer from the registry at %s for %.0f s (is it up, and does it have "
                            "the same cluster secret?)", self.url, silent)
            deadline = asyncio.get_running_loop().time() + self.config.heartbeat_s
            try:
                while (left := deadline - asyncio.get_running_loop().time()) > 0:
                    if not await self.sock.poll(timeout=int(left * 1000) + 1):
                        break
                    self._on_reply(await self.sock.recv())
            except zmq.ZMQError as exc:  # the socket failed: try again next period, never stop
                log.warning("control: receiving from the registry failed: %s", exc)
                await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))

    def _on_reply(self, raw: bytes) -> None:
        try:
            msg = decode_json(raw)
            workers = msg["workers"] if msg.get("type") == "peers" else None
            if not isinstance(workers, list):
                raise Rejected("malformed", "not a peers message")
        except Rejected as exc:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 100 == 0:
                log.warning("control: dropped a reply from the registry (%s: %s; %d so far)", exc.reason,
                            str(exc)[:200], self.num_dropped)
            return
        self.num_replies += 1
        self._last_reply = time.monotonic()
        self._warned_silent = False
        if self.on_peers is not None:
            try:
                self.on_peers([w for w in workers if isinstance(w, dict)])
            except Exception:  # a bug in the consumer must not stop the heartbeats
                log.exception("control: applying the peer list failed")

    async def close(self) -> None:
        await self.runner.stop()
        with suppress(zmq.ZMQError):  # tell the registry at once instead of waiting for the ttl
            await self.sock.send(encode({"type": "bye", "id": self.id}), flags=zmq.NOBLOCK)
        self.sock.close(linger=100)
