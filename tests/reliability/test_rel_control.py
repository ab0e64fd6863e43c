"""K10-K14. The control plane under attack from the cluster network. With the cluster secret it is
CurveZMQ (control/curve.py): a peer without the secret (plain ZMTP, CURVE with another secret,
CURVE with the right registry key but another client key) is refused in the handshake and
counted, a captured session replayed byte for byte is refused the same way, and none of it
changes the table or ends the registry. An unauthenticated 500 MB multipart message leaves the
gateway's memory where it was (it was assembled in full before the HMAC check: 317 -> 1,064 MB
for 1 GB). A decode worker registered without the secret never receives a request; an address
the registry could not reach is not routed to; the registry is bounded.

Real ZMQ sockets on 127.0.0.1, raw TCP for the attacker's bytes, a real `scd-serve gateway`
process for the memory figure, the real gateway app (httpx ASGI transport) and real uvicorn
stub decode workers that count what reaches them. Every wait polls with a deadline."""

import asyncio
import os
import socket
import struct
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import uvicorn
import zmq
import zmq.asyncio
from asgi_lifespan import LifespanManager
from fastapi import FastAPI, Request
from polls import eventually
from prometheus_client import CollectorRegistry, generate_latest

from scd_serve.config.control import SECRET_ENV, ControlConfig
from scd_serve.config.gateway import GatewayConfig
from scd_serve.control.curve import CurveKeys, connect_curve, keys_from
from scd_serve.control.heartbeat import HeartbeatClient
from scd_serve.control.registry import encode
from scd_serve.control.server import DroppedCollector, RegistryServer
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


def dealer(url: str, keys: CurveKeys | None) -> zmq.asyncio.Socket:
    """A DEALER to `url`: a CURVE client with `keys`, or plain ZMTP (None)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        connect_curve(sock, keys)
    sock.connect(url)
    return sock


async def _answered(address: str, timeout: float) -> bool:
    return True


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def zmtp_null_flood(port: int, total_bytes: int, frame_bytes: int = 60_000) -> tuple[int, str]:
    """An attacker's raw ZMTP 3.1 session (NULL mechanism, a DEALER): one multipart message of
    `total_bytes` in frames of `frame_bytes`, never completed (a libzmq socket would keep the
    parts of an unfinished message to itself). -> (bytes the server took, how it ended)."""
    greeting = b"\xff" + b"\0" * 7 + b"\x01\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
    ready = b"\x05READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", 6) + b"DEALER"
    frame = b"\x03" + struct.pack(">Q", frame_bytes) + b"x" * frame_bytes  # MORE | LONG: the message goes on
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
            got = b""  # the server's greeting and READY: a message frame before them ends the handshake
            while b"READY" not in got:
                if not (chunk := s.recv(4096)):
                    return 0, "refused in the handshake"
                got += chunk
            while sent < total_bytes:
                s.sendall(frame)
                sent += len(frame)
        except OSError as exc:  # the server closed the connection
            return sent, type(exc).__name__
    return sent, "sent in full"


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


async def test_k10_peers_without_the_secret_are_refused_in_the_handshake():
    server = registry(probe=_answered)
    keys = keys_from(SECRET)
    legit = dealer(server.url, keys)  # one connection: messages are handled in the order they are sent
    # an attacker who even learned the registry's public key, with a client key of its own
    public, secret = zmq.curve_keypair()
    attackers = [dealer(server.url, None), dealer(server.url, keys_from("another-secret-0123456789")),
                 dealer(server.url, CurveKeys(keys.server_public, keys.server_secret, public, secret))]
    try:
        await legit.send(encode(hb("decode-legit", "10.0.0.5:8001", running=7)))
        await asyncio.wait_for(legit.recv(), WAIT_S)

        def table():
            return [(r.id, r.role, r.address, r.ready, r.load, r.verified) for r in server.registry.workers()]
        assert await eventually(lambda: server.registry.workers(ready_only=True), WAIT_S)
        before = table()
        assert before == [("decode-legit", "decode", "10.0.0.5:8001", True, {"running": 7}, True)]
        for sock in attackers:  # what each would send: a fake worker, a takeover of the id, a bye
            for msg in (hb("evil", "10.6.6.6:8001", running=-1000), hb("decode-legit", "10.6.6.6:8001"),
                        {"type": "bye", "id": "decode-legit"}):
                try:  # queued at most: no handshake completes, so nothing is ever delivered
                    await sock.send(encode(msg), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        # a holder of the secret sends garbage: dropped as malformed, the task lives
        for frame in (b"[" * 5000, b"\xff" * 40, b"", encode(hb("decode-legit", "10.6.6.6:8001"))):
            await legit.send(frame)
        await legit.send(encode(hb("after", "10.0.0.6:8001")))  # handled only after every frame above
        assert await eventually(lambda: server.registry.get("after") is not None, WAIT_S), server.dropped
        # the attackers' handshakes fail (and are retried every reconnect interval): counted by kind
        assert await eventually(lambda: server.dropped["handshake_failed"] >= 2 and server.dropped["unauthenticated"]
                                >= 1, WAIT_S), server.dropped
        assert server.alive, "the registry task ended"
        assert [row for row in table() if row[0] != "after"] == before
        assert server.dropped["malformed"] == 3 and server.dropped["id_conflict"] == 1, server.dropped
        for sock in attackers:
            assert not await sock.poll(0), "an attacker got an answer"
        metrics = CollectorRegistry()
        metrics.register(DroppedCollector(server))
        assert 'scd_control_dropped_messages_total{reason="handshake_failed"}' in generate_latest(metrics).decode()
    finally:
        for sock in (legit, *attackers):
            sock.close(linger=0)
        await server.close()


class Recorder:
    """A TCP relay in front of the registry that keeps every byte a worker sent through it."""

    def __init__(self, target_port: int):
        self.target_port, self.sent = target_port, bytearray()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src, dst, keep):
            while data := await src.read(65536):
                if keep:
                    self.sent += data
                dst.write(data)
                await dst.drain()
            dst.close()
        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False), return_exceptions=True)

    async def close(self):
        self.server.close()


async def test_k10_a_recorded_session_replayed_byte_for_byte_is_refused():
    """A worker's whole session captured on the wire and sent again (to roll its load back or keep
    a crashed worker listed) fails the handshake: CURVE's session keys are new per connection."""
    server = registry(worker_ttl_s=1.0, probe=_answered)
    recorder = Recorder(port_of(server.url))
    url = await recorder.start()
    worker = HeartbeatClient(url, "decode", "10.0.0.5:8001", lambda: True, lambda: {"running": 3}, server.config)
    worker.start()
    try:
        assert await eventually(lambda: worker.num_replies >= 3, WAIT_S), server.dropped
        worker.runner.task.cancel()  # it crashes: no bye
        assert await eventually(lambda: server.registry.workers() == [], WAIT_S), server.registry.workers()
        captured = bytes(recorder.sent)
        failed = server.dropped["handshake_failed"]
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port_of(server.url)), timeout=10) as s:
                s.sendall(captured)
                s.settimeout(10)
                try:
                    while s.recv(65536):
                        pass  # until the registry closes it
                except OSError:
                    pass
        assert await eventually(lambda: server.dropped["handshake_failed"] >= failed + 5, WAIT_S), server.dropped
        assert server.registry.workers() == [] and server.alive
    finally:
        await worker.close()
        await recorder.close()
        await server.close()


async def test_k10_unauthenticated_loopback_registry_survives_deep_nesting():
    """Without a secret (loopback development) a deep frame reaches json: it must not end the task."""
    server = registry(secret="", probe=_answered)
    sock = dealer(server.url, None)
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
        # no secret (plain ZMTP), with a load that would win every choice
        HeartbeatClient(server.url, "decode", impostor.address, lambda: True, lambda: {"running": -1000},
                        ControlConfig(heartbeat_s=0.1, worker_ttl_s=30)),
        # a guessed secret
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
                return r.status_code == 200 and server.dropped["handshake_failed"] >= 4
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
    """A worker with the secret advertising an address that does not answer /live (a third party's
    service, a typo, a dead host) is never routed to; the gateway says no worker is ready."""
    imposter_site = await StubDecode("third-party", live_status=404).start()
    server = registry()
    sock = dealer(server.url, keys_from(SECRET))
    app = create_gateway_app(GatewayConfig(port=0), server.registry)
    try:
        async with LifespanManager(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                           base_url="http://gw") as client:
            for _ in range(3):  # heartbeats keep coming; each may start a new handshake attempt
                await sock.send(encode(hb("misadvertised", imposter_site.address)))
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
    sock = dealer(server.url, keys_from(SECRET))
    try:
        for i in range(40):  # even a holder of the secret cannot grow the table without bound
            await sock.send(encode(hb(f"w{i}", f"10.0.0.{i}:8001")))
        assert await eventually(lambda: server.dropped["registry_full"] == 36, WAIT_S), server.dropped
        assert len(server.registry.workers()) == 4 and server.alive
    finally:
        sock.close(linger=0)
        await server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_k14_unauthenticated_500_mb_multipart_leaves_the_gateways_memory_flat(tmp_path):
    """The issue's reproducer: one multipart message from a peer without the secret, never
    completed. Before, the registry assembled it before checking anything: 1 GB took the gateway
    from 317 to 1,064 MB RSS, kept after the disconnect. Now the handshake refuses the peer."""
    control = free_port()
    env = os.environ | {SECRET_ENV: SECRET, "SCD_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "gateway.log", "w")
    gw = subprocess.Popen([sys.executable, "-m", "scd_serve.cli", "gateway", "--port", "0",
                           "--control-bind", f"tcp://127.0.0.1:{control}"], stdout=subprocess.PIPE, stderr=log,
                          text=True, env=env, start_new_session=True)
    try:
        line = gw.stdout.readline()  # "gateway serving http://127.0.0.1:PORT, control plane tcp://..."
        assert "control plane" in line, (tmp_path / "gateway.log").read_text()[-2000:]
        proc = psutil.Process(gw.pid)
        time.sleep(1.0)
        before = proc.memory_info().rss
        t0 = time.monotonic()
        sent, ended = zmtp_null_flood(control, 500 * 2**20)
        took = time.monotonic() - t0
        time.sleep(1.0)  # the IO thread has read what it was going to read
        after = proc.memory_info().rss
        print(f"\nunauthenticated multipart: {sent / 2**20:.1f} MiB of 500 MiB taken ({ended}, {took:.2f} s); "
              f"gateway RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
        assert after - before < 50 * 2**20, f"RSS grew {(after - before) / 2**20:.0f} MiB"
        assert gw.poll() is None, "the gateway died"
        assert "handshake_failed" in (tmp_path / "gateway.log").read_text() or sent < 500 * 2**20
    finally:
        gw.terminate()
        try:
            gw.wait(20)
        except subprocess.TimeoutExpired:
            gw.kill()
            gw.wait(5)
        gw.stdout.close()
        log.close()
