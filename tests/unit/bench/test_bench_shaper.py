"""The shaped links: the userspace token-bucket proxy, and the netns link where root allows."""

import socket
import subprocess
import sys
import threading
import time

import pytest

from scd_serve.bench.netns import NetnsLink
from scd_serve.bench.tbproxy import ProxyLink, TokenBucket


def _sink_server(nbytes: int):
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        conn.sendall(b"x" * nbytes)
        conn.close()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def test_token_bucket_paces_to_rate():
    tb = TokenBucket(rate=1e6, burst=10_000)
    t0 = time.monotonic()
    for _ in range(30):
        tb.take(10_000)  # 300 kB at 1 MB/s, 10 kB of credit
    assert time.monotonic() - t0 >= 0.25


def test_proxy_forwards_every_byte_and_is_labelled():
    port = _sink_server(200_000)
    link = ProxyLink("test").up()
    try:
        link.set_rate(4e6)
        host, pport = link.producer_addr(port).split(":")
        got = 0
        with socket.create_connection((host, int(pport)), timeout=10) as c:
            while chunk := c.recv(65536):
                got += len(chunk)
        assert got == 200_000
        assert link.describe()["shaped_in_kernel"] is False
        assert "fallback" in link.describe()["kind"]
    finally:
        link.down()


@pytest.mark.skipif(NetnsLink.available() is not None, reason="needs root and iproute2")
def test_netns_link_carries_traffic_and_tears_down():
    link = NetnsLink(tag=f"scdt{time.time_ns() % 100000}")
    try:
        link.up()
        link.set_rate(50e6)
        ping = subprocess.run([*link.exec_prefix("consumer"), sys.executable, "-c",
                               f"import socket,sys; s=socket.socket(); s.settimeout(2);"
                               f"r=s.connect_ex(({link.producer_host!r}, 9)); sys.exit(0 if r in (111, 0) else 1)"],
                              capture_output=True, timeout=20)
        assert ping.returncode == 0  # connection refused = the peer host answered over the veth
        qd = subprocess.run(["tc", "-n", link.producer_ns, "qdisc", "show"], capture_output=True, text=True)
        assert "tbf" in qd.stdout
    finally:
        link.down()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert link.producer_ns not in names and link.consumer_ns not in names


@pytest.mark.skipif(NetnsLink.available() is not None, reason="needs root and iproute2")
def test_host_link_shapes_the_producer_namespace_only_and_tears_down():
    from scd_serve.bench.netns import HostLink

    link = HostLink(tag=f"scdh{time.time_ns() % 100000}")
    try:
        link.up()
        link.set_rate(2e6)
        assert link.exec_prefix("consumer") == []  # the consumer side is this namespace
        rate = link.measure_throughput(1 << 20)
        assert rate is not None and rate < 4e6  # shaped (2 MB/s; generous for a loaded machine)
        qd = subprocess.run(["tc", "-n", link.producer_ns, "qdisc", "show"], capture_output=True, text=True)
        assert "tbf" in qd.stdout
    finally:
        link.down()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert link.producer_ns not in names and link._veth[1] not in links
