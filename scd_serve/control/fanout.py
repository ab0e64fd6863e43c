"""Heartbeats to every registry a control URL names.

A control URL may resolve to several gateways (a headless Service in front of replicas) or
list several (`tcp://a:5555,tcp://b:5555`). A worker heartbeats each (one HeartbeatClient
each) and looks the names up again every `resolve_s`, so every gateway holds every worker
and a rolling update loses nothing. A decode worker's prefill peers are the union of what
the registries report.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from scd_serve.config.control import ControlConfig
from scd_serve.control.heartbeat import HeartbeatClient
from scd_serve.control.lifecycle import Restarting

log = logging.getLogger("scd_serve.control")


def resolve(url: str) -> list[str]:
    """Each tcp:// endpoint of a comma-separated URL list, one per address its host resolves to
    (IPv4 when it has any, so `localhost` is one registry, not two); other schemes as given.
    A host that does not resolve now stays as written (ZMQ retries it)."""
    out: list[str] = []
    for part in (p.strip() for p in url.split(",") if p.strip()):
        split = urlsplit(part)
        if split.scheme != "tcp" or not split.hostname or split.port is None:
            out.append(part)
            continue
        try:
            infos = socket.getaddrinfo(split.hostname, split.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            out.append(part)
            continue
        v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
        hosts = v4 or [f"[{a}]" for a in sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})]
        out += [f"tcp://{h}:{split.port}" for h in hosts] or [part]
    return sorted(dict.fromkeys(out))


class HeartbeatFanout:
    """HeartbeatClient's interface over every registry `url` resolves to (see the module doc)."""

    def __init__(self, url: str, role: str, address: str, ready: Callable[[], bool], load: Callable[[], dict],
                 config: ControlConfig, on_peers: Callable[[list[dict]], None] | None = None,
                 resolver: Callable[[str], list[str]] = resolve, models: tuple[str, ...] = ()):
        self.url, self.role, self.address, self.models = url, role, address, models
        self.ready, self.load, self.on_peers, self.config = ready, load, on_peers, config
        self.resolver = resolver
        self.clients: dict[str, HeartbeatClient] = {}
        self._lists: dict[str, list[dict]] = {}  # endpoint -> its registry's last peer list
        self.runner = Restarting(self._run, f"resolve-{role}")

    @property
    def num_replies(self) -> int:
        return sum(c.num_replies for c in self.clients.values())

    def start(self) -> None:
        self._sync(self.resolver(self.url))
        self.runner.start()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.resolve_s)
            endpoints = await asyncio.get_running_loop().run_in_executor(None, self.resolver, self.url)
            self._sync(endpoints)
            for endpoint in [e for e in self.clients if e not in endpoints]:
                log.info("control: the registry at %s is gone from %s", endpoint, self.url)
                self._lists.pop(endpoint, None)
                await self.clients.pop(endpoint).close()

    def _sync(self, endpoints: list[str]) -> None:
        for endpoint in endpoints:
            if endpoint not in self.clients:
                log.info("control: heartbeats to the registry at %s", endpoint)
                client = HeartbeatClient(endpoint, self.role, self.address, self.ready, self.load, self.config,
                                         on_peers=lambda workers, e=endpoint: self._peers_from(e, workers),
                                         models=self.models)
                self.clients[endpoint] = client
                client.start()

    def _peers_from(self, endpoint: str, workers: list[dict]) -> None:
        self._lists[endpoint] = workers
        if self.on_peers is not None:
            merged = {}
            for listed in self._lists.values():
                for w in listed:
                    merged.setdefault((w.get("role"), w.get("address")), w)
            self.on_peers(list(merged.values()))

    async def close(self) -> None:
        await self.runner.stop()
        await asyncio.gather(*(c.close() for c in self.clients.values()))
        self.clients.clear()
