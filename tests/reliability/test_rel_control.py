"""K10-K13. The control plane under attack from the cluster network: unsigned, replayed, stale,
wrongly signed and malformed frames change nothing and never end the registry; a decode worker
registered without the cluster secret never receives a request; an address the registry could
not reach is not routed to; the registry is bounded.

Real ZMQ sockets on 127.0.0.1, the real gateway app (httpx ASGI transport), real uvicorn stub
decode workers that count what reaches them. Every wait polls with a deadline."""

import asyncio
import time

import httpx
import pytest
import uvicorn
import zmq
import zmq.asyncio
from asgi_lifespan import LifespanManager
from fastapi import FastAPI, Request
from polls import eventually
from prometheus_client import CollectorRegistry, generate_latest

from scd_serve.config.control import ControlConfig
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.heartbeat import HeartbeatClient
from scd_serve.control.signing import encode
from scd_serve.control.server import DroppedCollector, RegistryServer
from scd_serve.control.signing import MAGIC, REGISTRY, WORKER, Envelope
from scd_serve.gateway.app import create_gateway_app

pytestmark = pytest.mark.timeout(90)
SECRET = "cluster-secret-for-tests-0123456789"
WAIT_S = 20  # how long a failure takes to show on a loaded 2-core machine, not how long a pass takes


def hb(wid: str, address: str, role: str = "decode", ready: bool = True, **load) -> dict:
    return {"type": "heartbeat", "id": wid, "role": role, "address": address, "ready": ready, "load": load}


def registry(**kw) -> RegistryServer:
    probe = kw.pop("probe", None)
    cfg = ControlConfig(**{"secret": SECRET, "heartbeat_s": 0.1, "worker_ttl_s": 30, **kw})
    server = RegistryServer("tcp://127.0.0.1:0", cfg, **({"probe": probe} if probe else {}))
    server.start()
    return server


async def _answered(address: str, timeout: float) -> bool:
    return True


class StubDecode:
    """A real HTTP server that looks like a decode worker and counts the requests it gets."""

    def __init__(self, name: str, live_status: int = 200):
        self.name, self.hits = name, 0
        app = FastAPI()

        @app.get("/live")
        async def live():
            from fastapi.responses import JSONResponse
            return JSONResponse({"status": "ok"}, status_code=live_status)

        @app.post("/v1/completions")
        async def completions(request: Request):
            self.hits += 1
            return {"worker": name, "auth": request.headers.get("authorization")}

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.server.install_signal_handlers = lambda: None

    async def start(self) -> "StubDecode":
        self.task = asyncio.create_task(self.server.serve())
        assert await eventually(lambda: self.server.started or self.task.done(), 30)
        self.address = f"127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 15)


async def test_k10_unsigned_replayed_stale_and_deep_frames_change_nothing():
    server = registry(probe=_answered)
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)  # one connection: frames are handled in the order they are sent
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.url)
    legit = Envelope(SECRET, WORKER, REGISTRY)
    try:
        captured = legit.seal(hb("decode-legit", "10.0.0.5:8001", running=3))
        await sock.send(captured)
        reply = await asyncio.wait_for(sock.recv(), WAIT_S)
        await sock.send(legit.seal(hb("decode-legit", "10.0.0.5:8001", running=7)))  # its newer state
        await asyncio.wait_for(sock.recv(), WAIT_S)
        assert await eventually(lambda: server.registry.workers(ready_only=True), WAIT_S)

        def table():
            return [(r.id, r.role, r.address, r.ready, r.load, r.verified) for r in server.registry.workers()]
        before = table()
        assert before == [("decode-legit", "decode", "10.0.0.5:8001", True, {"running": 7}, True)]
        stale = Envelope(SECRET, WORKER, REGISTRY, clock=lambda: time.time() - 120)
        wrong = Envelope("another-secret-0123456789", WORKER, REGISTRY)
        deep = b"[" * 5000
        attacks = [
            encode(hb("evil", "10.6.6.6:8001", running=-1000)),  # unsigned: a fake decode worker
            encode(hb("decode-legit", "10.6.6.6:8001", running=-1000)),  # unsigned: take over the id
            encode({"type": "bye", "id": "decode-legit"}),  # unsigned: remove a worker
            captured, captured,  # replayed byte for byte: would roll the load back to 3
            reply,  # a reply of the registry sent back in (other direction)
            stale.seal(hb("decode-legit", "10.0.0.5:8001", running=0)),  # signed 2 minutes ago
            wrong.seal(hb("evil", "10.6.6.6:8001")),  # signed with another secret
            deep,  # unsigned, 5000 "["
            MAGIC + legit._mac(WORKER, deep) + deep,  # correctly signed, 5000 "[" inside
            legit.seal(hb("decode-legit", "10.6.6.6:8001")),  # signed, but another address for the id
            b"\xff" * 40, b"",
        ]
        for frame in attacks:
            await sock.send(frame)
        await sock.send(legit.seal(hb("after", "10.0.0.6:8001")))  # handled only after every attack
        assert await eventually(lambda: server.registry.get("after") is not None, WAIT_S), server.dropped
        assert server.alive, "the registry task ended"
        assert [row for row in table() if row[0] != "after"] == before
        assert server.dropped == {"unsigned": 6, "replayed": 2, "bad_mac": 2, "stale": 1, "malformed": 1,
                                  "id_conflict": 1}, server.dropped
        metrics = CollectorRegistry()
        metrics.register(DroppedCollector(server))
        assert 'scd_control_dropped_messages_total{reason="unsigned"} 6.0' in generate_latest(metrics).decode()
    finally:
        sock.close(linger=0)
        await server.close()


async def test_k10_replays_cannot_keep_a_dead_worker_listed():
    server = registry(worker_ttl_s=1.0, probe=_answered)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.url)
    try:
        captured = Envelope(SECRET, WORKER, REGISTRY).seal(hb("crashed", "10.0.0.5:8001"))
        await sock.send(captured)
        assert await eventually(lambda: server.registry.get("crashed") is not None, WAIT_S)
        end = time.monotonic() + 2.5  # the worker is dead; an attacker replays its last heartbeat
        replays = 0
        while time.monotonic() < end or replays < 10:  # past the 1 s ttl, and at least 10 of them
            await sock.send(captured)
            replays += 1
            await asyncio.sleep(0.1)
        assert await eventually(lambda: server.registry.workers() == [], 5), server.registry.workers()
        # every replay is counted as one, once the registry has read them all (it may lag the sends)
        assert await eventually(lambda: server.dropped["replayed"] == replays, WAIT_S), (server.dropped, replays)
        assert server.alive
    finally:
        sock.close(linger=0)
        await server.close()


async def test_k10_unsigned_loopback_registry_survives_deep_nesting():
    """Without a secret (loopback development) a deep frame reaches json: it must not end the task."""
    server = registry(secret="", probe=_answered)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.url)
    try:
        for frame in (b"[" * 5000, b"{" * 5000, b'{"a":' * 3000, b"[1," * 20000):
            await sock.send(frame)
        await sock.send(encode(hb("after", "127.0.0.1:8001")))
        assert await eventually(lambda: server.registry.get("after") is not None, WAIT_S), server.dropped
        assert server.alive and server.dropped == {"malformed": 4}, server.dropped
    finally:
        sock.close(linger=0)
        await server.close()


async def test_k11_decode_worker_without_the_secret_never_gets_a_request():
    honest, impostor, other = await StubDecode("honest").start(), await StubDecode("impostor").start(), \
        await StubDecode("other").start()
    server = registry()  # the real handshake: GET /live at the advertised address
    cfg = server.config
    workers = [
        HeartbeatClient(server.url, "decode", honest.address, lambda: True, lambda: {"running": 50}, cfg),
        # unsigned, with a load that would win every choice
        HeartbeatClient(server.url, "decode", impostor.address, lambda: True, lambda: {"running": -1000},
                        ControlConfig(heartbeat_s=0.1, worker_ttl_s=30)),
        # signed with a guessed secret
        HeartbeatClient(server.url, "decode", other.address, lambda: True, lambda: {"running": 0},
                        ControlConfig(heartbeat_s=0.1, worker_ttl_s=30, secret="guessed-secret-0123456789")),
    ]
    for w in workers:
        w.start()
    app = create_gateway_app(GatewayConfig(port=0), server.registry)
    try:
        async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                           base_url="http://gw") as client:
            async def ready():
                r = await client.get("/ready")
                return r.status_code == 200 and server.dropped["unsigned"] >= 5 and server.dropped["bad_mac"] >= 5
            assert await eventually(ready, WAIT_S), (server.dropped, server.registry.workers())
            assert (await client.get("/ready")).json()["decode_workers"] == 1
            for i in range(20):
                r = await client.post("/v1/completions", json={"prompt": f"secret prompt {i}"},
                                      headers={"authorization": "Bearer users-key"})
                assert r.status_code == 200 and r.json()["worker"] == "honest", r.text
        assert (honest.hits, impostor.hits, other.hits) == (20, 0, 0)
        assert [r.address for r in server.registry.workers()] == [honest.address]
        assert workers[1].num_replies == 0 and workers[2].num_replies == 0  # they learn no peer list either
    finally:
        for w in workers:
            await w.close()
        await server.close()
        for s in (honest, impostor, other):
            await s.stop()


async def test_k12_address_is_trusted_only_after_the_handshake_reached_it():
    """A signed worker advertising an address that does not answer /live (a third party's
    service, a typo, a dead host) is never routed to; the gateway says no worker is ready."""
    imposter_site = await StubDecode("third-party", live_status=404).start()
    server = registry()
    sender = Envelope(SECRET, WORKER, REGISTRY)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.url)
    app = create_gateway_app(GatewayConfig(port=0), server.registry)
    try:
        async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                           base_url="http://gw") as client:
            for _ in range(3):  # heartbeats keep coming; each may start a new handshake attempt
                await sock.send(sender.seal(hb("misadvertised", imposter_site.address)))
                await asyncio.wait_for(sock.recv(), WAIT_S)
            assert await eventually(lambda: server.num_handshake_failures >= 1, WAIT_S), server.registry.workers()
            assert server.registry.get("misadvertised") is not None
            assert (await client.get("/ready")).status_code == 503
            r = await client.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503
        assert imposter_site.hits == 0
    finally:
        sock.close(linger=0)
        await server.close()
        await imposter_site.stop()


async def test_k13_registry_is_bounded():
    server = registry(max_workers=4, probe=_answered)
    sender = Envelope(SECRET, WORKER, REGISTRY)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.url)
    try:
        for i in range(40):  # even a holder of the secret cannot grow the table without bound
            await sock.send(sender.seal(hb(f"w{i}", f"10.0.0.{i}:8001")))
        assert await eventually(lambda: server.dropped["registry_full"] == 36, WAIT_S), server.dropped
        assert len(server.registry.workers()) == 4 and server.alive
    finally:
        sock.close(linger=0)
        await server.close()
