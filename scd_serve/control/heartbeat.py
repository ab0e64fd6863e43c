"""A worker's side of the control plane: register, send load every period, learn peers."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable

import zmq
import zmq.asyncio

from scd_serve.config.control import ControlConfig
from scd_serve.control.registry import encode

log = logging.getLogger("scd_serve.control")


class HeartbeatClient:
    """Sends {"type": "heartbeat", ...} every heartbeat_s; calls on_peers(list) on each reply."""

    def __init__(self, url: str, role: str, address: str, ready: Callable[[], bool],
                 load: Callable[[], dict], config: ControlConfig,
                 on_peers: Callable[[list[dict]], None] | None = None):
        self.url, self.role, self.address = url, role, address
        self.ready_fn, self.load_fn, self.on_peers = ready, load, on_peers
        self.config = config
        self.id = f"{role}-{address}-{uuid.uuid4().hex[:8]}"
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a registry that is not there
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * 1024 * 1024)  # peer lists of many workers
        self.sock.connect(url)
        self._task: asyncio.Task | None = None
        self.num_replies = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.role}")

    def message(self) -> dict:
        return {"type": "heartbeat", "role": self.role, "id": self.id, "address": self.address,
                "ready": bool(self.ready_fn()), "load": self.load_fn()}

    async def _run(self) -> None:
        while True:
            try:
                await self.sock.send(encode(self.message()), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # registry not reachable yet: try again next period
            except Exception:  # a load() bug must not stop the heartbeats silently forever
                log.exception("control: heartbeat failed")
            deadline = asyncio.get_running_loop().time() + self.config.heartbeat_s
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                if not await self.sock.poll(timeout=int(left * 1000) + 1):
                    break
                self._on_reply(await self.sock.recv())

    def _on_reply(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
            workers = msg["workers"] if isinstance(msg, dict) and msg.get("type") == "peers" else None
            if not isinstance(workers, list):
                raise ValueError("not a peers message")
        except (ValueError, KeyError) as exc:
            log.warning("control: ignored a malformed reply (%s)", str(exc)[:200])
            return
        self.num_replies += 1
        if self.on_peers is not None:
            self.on_peers([w for w in workers if isinstance(w, dict)])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:  # tell the registry at once instead of waiting for the ttl
            await self.sock.send(encode({"type": "bye", "id": self.id}), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self.sock.close(linger=100)
