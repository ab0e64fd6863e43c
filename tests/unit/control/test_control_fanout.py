"""Heartbeats to every registry a control URL names (control/fanout.py): resolution, and a
rolling replacement of the gateway's registry over real ZMQ sockets."""

import pytest
from polls import eventually

from scd_serve.config.control import ControlConfig
from scd_serve.control.fanout import HeartbeatFanout, resolve
from scd_serve.control.server import RegistryServer


def test_resolve_expands_lists_and_names_to_one_endpoint_per_address():
    assert resolve("tcp://localhost:5555") == ["tcp://127.0.0.1:5555"]  # IPv4 first: one registry, not two
    assert resolve("tcp://127.0.0.1:2, tcp://127.0.0.1:1,tcp://127.0.0.1:2") == ["tcp://127.0.0.1:1",
                                                                               "tcp://127.0.0.1:2"]
    assert resolve("ipc:///tmp/registry") == ["ipc:///tmp/registry"]
    assert resolve("tcp://no-such-host.invalid:5555") == ["tcp://no-such-host.invalid:5555"]  # ZMQ retries it


@pytest.mark.timeout(60)
async def test_every_registry_holds_every_worker_through_a_rolling_replacement():
    cfg = ControlConfig(heartbeat_s=0.1, worker_ttl_s=3.0, resolve_s=0.2)
    old, new = RegistryServer("tcp://127.0.0.1:0", cfg), RegistryServer("tcp://127.0.0.1:0", cfg)
    old.start()
    new.start()
    live = [old.url]  # what the control URL resolves to right now (the headless Service's pods)
    seen = []
    prefill = HeartbeatFanout("tcp://gateway-control:5555", "prefill", "127.0.0.1:7001", lambda: True, lambda: {},
                              cfg, resolver=lambda _: list(live))
    decode = HeartbeatFanout("tcp://gateway-control:5555", "decode", "127.0.0.1:8001", lambda: True, lambda: {},
                             cfg, on_peers=seen.append, resolver=lambda _: list(live))
    prefill.start()
    decode.start()

    def roles(server):
        return sorted(r.role for r in server.registry.workers())

    try:
        assert await eventually(lambda: roles(old) == ["decode", "prefill"], 10)
        assert roles(new) == []
        live.append(new.url)  # the new replica starts: both resolve
        assert await eventually(lambda: roles(new) == ["decode", "prefill"], 10)
        assert roles(old) == ["decode", "prefill"]
        live.remove(old.url)  # the old one is gone from DNS: its clients say bye and close
        assert await eventually(lambda: roles(old) == [] and set(prefill.clients) == {new.url}, 10)
        seen.clear()
        assert await eventually(lambda: seen and {w["address"] for w in seen[-1]} == {"127.0.0.1:7001",
                                                                                    "127.0.0.1:8001"}, 10)
    finally:
        await prefill.close()
        await decode.close()
        await old.close()
        await new.close()
