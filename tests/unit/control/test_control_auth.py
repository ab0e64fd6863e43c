"""The control plane's credentials: CURVE keys from the cluster secret, message checks without
sockets, load clamping, the bounded registry, address verification, CURVE over real ZMQ sockets
(a wrong or missing secret never connects), open-bind refusal, secret settings."""

import argparse
import asyncio

import pytest
import zmq

from scd_serve.cli import main as cli_main
from scd_serve.cluster.up import cluster_env
from scd_serve.config.control import SECRET_ENV, ControlConfig, add_control_arguments, control_config_from_args
from scd_serve.control.choice import Candidate, LoadBalancer
from scd_serve.control.curve import keys_from
from scd_serve.control.exposure import control_plane, is_loopback, listener, refuse_open, url_is_local
from scd_serve.control.heartbeat import HeartbeatClient
from scd_serve.control.registry import MAX_LOAD, Registry, Rejected, decode_json, encode, validate
from scd_serve.control.server import RegistryServer
from scd_serve.errors import ConfigError

SECRET = "s" * 32


def hb(wid="w1", role="decode", address="127.0.0.1:8001", ready=True, **load):
    return {"type": "heartbeat", "id": wid, "role": role, "address": address, "ready": ready, "load": load}


def reason(fn, *args) -> str:
    with pytest.raises(Rejected) as e:
        fn(*args)
    return e.value.reason


def test_curve_keys_come_from_the_secret_one_pair_per_role():
    keys = keys_from(SECRET)
    assert keys == keys_from(SECRET)  # every role that holds the secret derives the same keys
    assert all(len(k) == 40 for k in (keys.server_public, keys.server_secret, keys.client_public, keys.client_secret))
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert zmq.curve_public(keys.client_secret) == keys.client_public
    assert keys.server_secret != keys.client_secret
    other = keys_from("t" * 32)
    assert {other.server_public, other.client_public}.isdisjoint({keys.server_public, keys.client_public})


def test_malformed_messages_are_rejected_not_raised():
    for raw in (b"[" * 5000, b"{" * 5000, b"\xff" * 40, b"", b"[1]"):
        assert reason(decode_json, raw) == "malformed"  # RecursionError inside json is caught
    for bad in ({"type": "heartbeat"}, {**hb(), "role": "boss"}, {"type": "exec", "id": "x"},
                {**hb(), "load": {"Running\u00e9": 1}}, {**hb(), "load": {"x" * 40: 1}},
                {**hb(), "models": "m"}, {**hb(), "models": ["m"] * 17}, {**hb(), "models": [""]},
                {**hb(), "address": "\ud800:8001"}, {**hb(), "address": "h\n:8001"}, {**hb(), "address": "h:\u00b2"}):
        assert reason(validate, bad) == "malformed", bad
    assert validate({**hb(), "models": ["m1", "m2"]})["models"] == ("m1", "m2")


def test_loads_are_clamped():
    msg = validate({**hb(), "load": {"running": -1000, "waiting": -1e308, "capacity": 1e30, "ok": 3}})
    assert msg["load"] == {"running": 0, "waiting": 0, "capacity": MAX_LOAD, "ok": 3}
    lb = LoadBalancer()  # and a negative load that reaches the chooser some other way is no bonus
    assert lb.score(Candidate("a:1", running=-50, waiting=-50)) == 0
    assert lb.score(Candidate("a:1", running=4, capacity=-2)) == 4


def test_registry_is_bounded_and_expiry_makes_room():
    now = [0.0]
    reg = Registry(ttl_s=3, clock=lambda: now[0], max_workers=2)
    reg.apply(hb("a", address="h:1"))
    reg.apply(hb("b", address="h:2"))
    assert reason(reg.apply, hb("c", address="h:3")) == "registry_full"
    reg.apply(hb("a", address="h:1", running=1))  # known workers still update
    now[0] = 2.0
    reg.apply(hb("a", address="h:1"))
    now[0] = 3.5  # b expired
    reg.apply(hb("c", address="h:3"))
    assert [r.id for r in reg.workers()] == ["a", "c"]


def test_decode_records_count_as_ready_only_after_verification():
    reg = Registry(ttl_s=30, verify_roles=("decode",))
    reg.apply(hb("d", address="h:1"))
    reg.apply(hb("p", role="prefill", address="h:2"))
    assert [r.id for r in reg.workers(ready_only=True)] == ["p"]
    assert [r.id for r in reg.workers() if not r.verified] == ["d"]
    assert not reg.mark_verified("d", "h:9")  # a handshake at another address proves nothing
    assert reg.mark_verified("d", "h:1")
    assert [r.id for r in reg.workers(role="decode", ready_only=True)] == ["d"]
    reg.apply(hb("d", address="h:3"))  # a new address needs a new handshake
    assert reg.workers(role="decode", ready_only=True) == []
    assert "verified" not in reg.peers_message()["workers"][0]


async def test_server_handles_every_frame_without_raising():
    server = RegistryServer("inproc://auth-unit", ControlConfig(secret=SECRET), probe=_always(True))
    try:
        reply = server.handle([b"id", encode(hb("w1", address="h:1", running=2))])
        assert decode_json(reply)["workers"][0]["id"] == "w1"
        bad = [[b"id"], [b"id", b"x", b"y"], [b"id", b"{" * 70000], [b"id", encode(hb("w1", address="h:2"))],
               [b"id", encode(hb("w1", role="prefill", address="h:1"))], [b"id", b"[" * 5000]]
        reasons = [reason(server.handle, frames) for frames in bad]
        assert reasons == ["malformed", "malformed", "malformed", "id_conflict", "id_conflict", "malformed"]
        rec = server.registry.get("w1")
        assert (rec.address, rec.role, rec.load) == ("h:1", "decode", {"running": 2})
        assert await _eventually(lambda: server.registry.get("w1").verified, 5)
        assert server.handle([b"id", encode({"type": "bye", "id": "w1"})]) is None
        assert server.registry.get("w1") is None
    finally:
        await server.close()


async def test_server_retries_a_failed_handshake_and_never_trusts_it_meanwhile():
    answers = [False, False, True]
    calls = []

    async def probe(address, timeout):
        calls.append(address)
        return answers[min(len(calls), len(answers)) - 1]

    cfg = ControlConfig(secret=SECRET, heartbeat_s=0.1, worker_ttl_s=30)
    server = RegistryServer("inproc://auth-retry", cfg, probe=probe)
    try:
        async def verified():
            server.handle([b"id", encode(hb("w1", address="h:1"))])
            await asyncio.sleep(0.05)
            rec = server.registry.get("w1")
            assert rec.verified or server.registry.workers(ready_only=True) == []
            return rec.verified
        assert await _eventually(verified, 20)
        assert len(calls) == 3 and server.num_handshake_failures == 2
    finally:
        await server.close()


async def test_curve_heartbeats_over_zmq_and_a_wrong_or_missing_secret_never_connects():
    cfg = ControlConfig(heartbeat_s=0.1, worker_ttl_s=3, secret=SECRET)
    server = RegistryServer("tcp://127.0.0.1:0", cfg, probe=_always(True))
    server.start()
    seen = []
    good = HeartbeatClient(server.url, "decode", "127.0.0.1:8001", lambda: True, lambda: {"running": -5}, cfg,
                           on_peers=seen.append)
    wrong = HeartbeatClient(server.url, "decode", "127.0.0.1:8002", lambda: True, lambda: {},
                            ControlConfig(heartbeat_s=0.1, worker_ttl_s=3, secret="t" * 32))
    unsigned = HeartbeatClient(server.url, "prefill", "127.0.0.1:7001", lambda: True, lambda: {},
                               ControlConfig(heartbeat_s=0.1, worker_ttl_s=3))
    for c in (good, wrong, unsigned):
        c.start()
    try:
        # both fail the CURVE handshake (another secret derives another registry key; none speaks plain
        # ZMTP), so no message of theirs is read; a handshake is retried every reconnect interval
        assert await _eventually(lambda: seen and server.dropped["handshake_failed"] >= 4, 10), server.dropped
        assert [(r.address, r.load) for r in server.registry.workers()] == [("127.0.0.1:8001", {"running": 0})]
        assert await _eventually(lambda: server.registry.workers(ready_only=True), 10)
        assert wrong.num_replies == 0 and unsigned.num_replies == 0 and good.num_dropped == 0
        # the signed bye removes it: with expiry switched off, nothing else could (a bound of half
        # the 3 s ttl told the two apart by the clock, and a loaded machine can exceed it)
        server.registry.ttl_s = float("inf")
        await good.close()
        assert await _eventually(lambda: server.registry.workers() == [], 10), server.registry.workers()
    finally:
        for c in (good, wrong, unsigned):
            await c.close()
        await server.close()


def _always(result):
    async def probe(address, timeout):
        return result
    return probe


async def _eventually(cond, timeout):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got or loop.time() >= end:
            return bool(got)
        await asyncio.sleep(0.02)


# ---- exposure: a non-loopback listener without auth is refused unless --insecure ---------------

def test_loopback_detection():
    for host in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "*", "10.0.0.7", "gateway", "example.com"):
        assert not is_loopback(host), host
    assert url_is_local("tcp://127.0.0.1:5555") and url_is_local("ipc:///tmp/x") and url_is_local("inproc://x")
    assert not url_is_local("tcp://0.0.0.0:5555") and not url_is_local("tcp://gateway:5555")
    assert not url_is_local("tcp://*:5555")


def test_refuse_open_names_each_open_listener(caplog):
    open_http = listener("HTTP API", "0.0.0.0", False, "set $SCD_API_KEY")
    open_control = control_plane("tcp://0.0.0.0:5555", "")
    with pytest.raises(ConfigError) as e:
        refuse_open("gateway", [open_http, open_control], insecure=False)
    assert "HTTP API on 0.0.0.0" in e.value.message and "tcp://0.0.0.0:5555" in e.value.message
    assert SECRET_ENV in e.value.message and "--insecure" in e.value.message
    refuse_open("gateway", [open_http, open_control], insecure=True)  # the operator said so: warnings only
    assert "no authentication (--insecure)" in caplog.text
    refuse_open("gateway", [listener("HTTP API", "0.0.0.0", True, ""), control_plane("tcp://10.0.0.1:5555", SECRET),
                            listener("gRPC", "127.0.0.1", False, ""), control_plane("", "")], insecure=False)
    caplog.clear()
    refuse_open("decode", [control_plane("tcp://127.0.0.1:5555", "")], insecure=False)
    assert "unauthenticated" in caplog.text  # loopback development: allowed, with a warning


@pytest.mark.parametrize("argv,needle", [
    (["gateway", "--host", "0.0.0.0", "--port", "0"], "HTTP API on 0.0.0.0"),
    (["gateway", "--control-bind", "tcp://0.0.0.0:0", "--port", "0"], "control plane on tcp://0.0.0.0:0"),
    (["decode", "--host", "0.0.0.0", "--model", "/nonexistent"], "HTTP API on 0.0.0.0"),
    (["decode", "--control-url", "tcp://gateway:5555", "--model", "/nonexistent"], "control plane"),
    (["prefill", "--host", "0.0.0.0", "--model", "/nonexistent"], "gRPC on 0.0.0.0"),
    (["prefill", "--control-url", "tcp://10.1.2.3:5555", "--model", "/nonexistent"], "control plane"),
])
def test_each_role_refuses_an_open_bind(argv, needle, capsys, monkeypatch):
    for var in (SECRET_ENV, "SCD_API_KEY", "SCD_WORKER_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    assert cli_main(argv) == 2  # before any model is loaded or port bound
    err = capsys.readouterr().err
    assert needle in err and "--insecure" in err


def test_secret_from_env_or_file(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    add_control_arguments(parser)
    monkeypatch.setenv(SECRET_ENV, " from-env-0123456789 \n")
    assert control_config_from_args(parser.parse_args([])).secret == "from-env-0123456789"
    f = tmp_path / "secret"
    f.write_text("from-file-0123456789\n")
    cfg = control_config_from_args(parser.parse_args(["--cluster-secret-file", str(f)]))
    assert cfg.secret == "from-file-0123456789" and "from-file" not in repr(cfg)
    f.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        control_config_from_args(parser.parse_args(["--cluster-secret-file", str(f)]))
    with pytest.raises(ConfigError, match="cannot read"):
        control_config_from_args(parser.parse_args(["--cluster-secret-file", str(tmp_path / "missing")]))
    with pytest.raises(ConfigError, match="at least 16"):
        ControlConfig(secret="short")


def test_up_makes_secrets_unless_given():
    env = cluster_env({"PATH": "/bin"})
    assert len(env[SECRET_ENV]) == 64 and len(env["SCD_WORKER_TOKEN"]) == 64
    assert cluster_env({"PATH": "/bin"})[SECRET_ENV] != env[SECRET_ENV]
    given = cluster_env({SECRET_ENV: "mine-0123456789abcdef", "SCD_WORKER_TOKEN": "tok"})
    assert given[SECRET_ENV] == "mine-0123456789abcdef" and given["SCD_WORKER_TOKEN"] == "tok"
