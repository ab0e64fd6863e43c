"""The registry's ZMQ endpoint: a ROUTER that takes heartbeats and answers with the peer list."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from scd_serve.config.control import ControlConfig
from scd_serve.control.registry import Registry, encode, parse

log = logging.getLogger("scd_serve.control")


class RegistryServer:
    def __init__(self, bind_url: str, config: ControlConfig, registry: Registry | None = None):
        self.config = config
        self.registry = registry or Registry(config.worker_ttl_s)
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # frames over the cap close the sender's connection instead of being buffered
        self.sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        self.sock.bind(bind_url)
        self.url = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # real port when bound to :0
        self._task: asyncio.Task | None = None
        self.num_rejected = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve(), name="control-registry")

    async def _serve(self) -> None:
        while True:
            if not await self.sock.poll(timeout=int(self.config.heartbeat_s * 1000)):
                self.registry.expire()
                continue
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                self.num_rejected += 1
                continue
            ident, raw = frames
            try:
                msg = parse(raw, self.config.max_message_bytes)
            except ValueError as exc:
                self.num_rejected += 1
                log.warning("control: dropped a malformed message (%s)", str(exc)[:200])
                continue
            before = {r.id for r in self.registry.workers()}
            self.registry.apply(msg)
            if msg["type"] == "heartbeat":
                if msg["id"] not in before:
                    log.info("control: %s worker %s joined at %s", msg["role"], msg["id"], msg["address"])
                await self.sock.send_multipart([ident, encode(self.registry.peers_message())])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(linger=0)
