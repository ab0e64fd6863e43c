"""Registry table, message validation, load-aware choice, and heartbeats over real ZMQ sockets."""

import json

import pytest
from polls import eventually

from scd_serve.config.control import ControlConfig
from scd_serve.control.choice import Candidate, LoadBalancer
from scd_serve.control.heartbeat import HeartbeatClient
from scd_serve.control.registry import Registry, decode_json, encode, validate
from scd_serve.control.server import RegistryServer


def parse(raw: bytes, max_bytes: int) -> dict:
    """One unsigned worker message checked as the registry checks it; ValueError names what is wrong."""
    if len(raw) > max_bytes:
        raise ValueError(f"message of {len(raw)} bytes exceeds {max_bytes}")
    return validate(decode_json(raw))


def hb(wid, role="prefill", address="127.0.0.1:1", ready=True, **load):
    return {"type": "heartbeat", "id": wid, "role": role, "address": address, "ready": ready, "load": load}


def test_registry_drops_silent_workers():
    now = [0.0]
    reg = Registry(ttl_s=3.0, clock=lambda: now[0])
    reg.apply(parse(encode(hb("a", address="h:1")), 4096))
    now[0] = 2.0
    reg.apply(parse(encode(hb("b", role="decode", address="h:2")), 4096))
    assert [r.id for r in reg.workers()] == ["a", "b"]
    now[0] = 3.5
    assert [r.id for r in reg.workers()] == ["b"]
    assert [r.id for r in reg.workers(role="prefill")] == []
    reg.apply({"type": "bye", "id": "b"})
    assert reg.workers() == []


@pytest.mark.parametrize("raw,match", [
    (b"\x80\x04pickle", "Expecting value|utf-8|codec"),
    (b"[1,2]", "JSON object"),
    (encode({"type": "heartbeat", "id": "x", "role": "boss", "address": "h:1", "ready": True}), "role"),
    (encode(hb("x", address="nohost")), "HOST:PORT"),
    (encode({**hb("x"), "load": {"running": "many"}}), "finite numbers"),
    (encode({"type": "exec", "id": "x"}), "unknown message type"),
    (b"{" + b" " * 5000 + b"}", "exceeds"),
])
def test_parse_rejects_bad_messages(raw, match):
    with pytest.raises(ValueError, match=match):
        parse(raw, 4096)


def test_choice_prefers_least_loaded_and_counts_inflight():
    lb = LoadBalancer()
    a, b = Candidate("a:1", running=2), Candidate("b:1", running=0)
    assert lb.choose([a, b]).address == "b:1"
    with lb.track("b:1"), lb.track("b:1"), lb.track("b:1"):
        assert lb.choose([a, b]).address == "a:1"  # 2 < 0 + 3 in flight
    assert lb.inflight == {}
    assert lb.choose([a, b], exclude=["b:1"]).address == "a:1"
    assert lb.choose([a], exclude=["a:1"]) is None
    tied = [Candidate("x:1"), Candidate("y:1")]
    assert {lb.choose(tied).address for _ in range(4)} == {"x:1", "y:1"}  # round-robin on ties


async def test_heartbeats_register_share_peers_and_expire():
    ttl = 3.0  # 30 heartbeats: a live worker outlasts a test process that lost the CPU for a while
    cfg = ControlConfig(heartbeat_s=0.1, worker_ttl_s=ttl)
    server = RegistryServer("tcp://127.0.0.1:0", cfg)
    server.start()
    seen = []
    p = HeartbeatClient(server.url, "prefill", "127.0.0.1:7001", lambda: True, lambda: {"running": 1}, cfg)
    d = HeartbeatClient(server.url, "decode", "127.0.0.1:8001", lambda: False, lambda: {}, cfg,
                        on_peers=seen.append)
    p.start()
    d.start()
    try:
        assert await eventually(lambda: len(server.registry.workers()) == 2 and seen and len(seen[-1]) == 2, 10)
        roles = {r.role: r for r in server.registry.workers()}
        assert roles["prefill"].load == {"running": 1} and roles["decode"].ready is False
        assert {w["address"] for w in seen[-1]} == {"127.0.0.1:7001", "127.0.0.1:8001"}
        # a crashed worker (no bye) disappears after the ttl
        p.runner.task.cancel()  # as if the worker crashed (no restart: a cancelled task is not a death)
        assert await eventually(lambda: [r.role for r in server.registry.workers()] == ["decode"], ttl + 4.0), \
            server.registry.workers()  # one that never expires fails
        # a garbage frame is counted and dropped, the registry keeps serving
        import zmq
        raw = server.ctx.socket(zmq.DEALER)
        raw.connect(server.url)
        await raw.send(b"not json")
        assert await eventually(lambda: sum(server.dropped.values()) >= 1, 10)
        raw.close(linger=0)
        assert len(server.registry.workers()) == 1
        # a clean close says bye, which removes it; with expiry switched off nothing else could
        # (a bound of ttl / 2 told the bye from the ttl by the clock, and a loaded machine can exceed it)
        server.registry.ttl_s = float("inf")
        await d.close()
        assert await eventually(lambda: server.registry.workers() == [], 10), server.registry.workers()
    finally:
        await p.close()
        await server.close()
    assert json.loads(encode(server.registry.peers_message())) == {"type": "peers", "workers": []}


def dies_the_first_time(real, why: str):
    """A task body that raises on its first run and is `real` after that."""
    runs = []

    async def body():
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError(why)
        await real()
    return body


async def test_a_dead_registry_or_heartbeat_task_is_logged_and_started_again(caplog):
    """Supervision: before, a registry task that died left every worker registered forever (no
    expiry) while the gateway kept routing to them, and a dead heartbeat was never noticed."""
    cfg = ControlConfig(heartbeat_s=0.1, worker_ttl_s=3.0)
    server = RegistryServer("tcp://127.0.0.1:0", cfg)
    server._serve = dies_the_first_time(server._serve, "registry bug")
    server.start()
    hb_client = HeartbeatClient(server.url, "prefill", "127.0.0.1:7001", lambda: True, lambda: {}, cfg)
    hb_client._run = dies_the_first_time(hb_client._run, "heartbeat bug")
    hb_client.start()
    try:
        assert await eventually(lambda: server.runner.num_restarts == 1 and hb_client.runner.num_restarts == 1
                                and len(server.registry.workers()) == 1, 10), \
            (server.runner.num_restarts, hb_client.runner.num_restarts, server.registry.workers())
        assert server.alive
        assert "background task control-registry died" in caplog.text
        assert "background task heartbeat-prefill died" in caplog.text
    finally:
        await hb_client.close()
        await server.close()
