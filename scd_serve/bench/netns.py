"""A real shaped link: two network namespaces joined by a veth pair, `tc tbf` on both ends.

Every byte of a transfer crosses the veth and its token-bucket filter, as between two hosts.
Needs root and iproute2. `down()` (also at exit) removes both namespaces, and with them the
veth pair and its qdiscs. `HostLink` puts only the producer in a namespace: the consumer's end
stays in this one, so a whole cluster (gateway, decode, client) runs here unchanged.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys

from scd_serve.planner.units import tc_rate
from scd_serve.errors import Unavailable

MIN_BURST = 16 * 1024  # bytes; tbf splits larger GSO packets itself
_SEND = """
import socket, sys
s = socket.create_server(({host!r}, 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytes(1 << 20); left = {n}
while left > 0:
    c.sendall(buf[:min(left, len(buf))]); left -= len(buf)
c.close()
"""
_RECV = """
import socket, time
c = socket.create_connection(({host!r}, {port}), timeout=30); n = 0; t = None
while b := c.recv(1 << 20):
    t = t or time.perf_counter(); n += len(b)
print(n / (time.perf_counter() - t))
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _no_slow_start(ns: str) -> None:
    """A kept-alive channel must not fall back to slow start between requests."""
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"],
                   capture_output=True, timeout=10)


class NetnsLink:
    """Producer namespace `<tag>p` (addr .1) <-veth-> consumer namespace `<tag>c` (addr .2)."""

    kind = "netns+veth+tc-tbf"

    def __init__(self, tag: str | None = None):
        n = os.getpid() % 250 + 1
        self.tag = tag or f"scdb{os.getpid()}"
        self.producer_ns, self.consumer_ns = f"{self.tag}p", f"{self.tag}c"
        self._veth = (f"vp{os.getpid()}"[:15], f"vc{os.getpid()}"[:15])
        self.producer_host, self.consumer_host = f"10.213.{n}.1", f"10.213.{n}.2"
        self.burst_bytes = 0
        self._up = False

    @staticmethod
    def available() -> str | None:
        """None if namespaces can be made here, else the reason why not."""
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "iproute2 (ip, tc) is not installed"
        if os.geteuid() != 0:
            return "network namespaces need root"
        return None

    def up(self):
        if reason := self.available():
            raise Unavailable(f"cannot create network namespaces: {reason}")
        atexit.register(self.down)
        self._up = True
        try:
            self._plumb(*self._veth)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            err = getattr(exc, "stderr", "") or str(exc)
            self.down()
            raise Unavailable(f"cannot create network namespaces: {err.strip()}") from exc
        return self

    def _plumb(self, a: str, b: str) -> None:
        """Both namespaces, the veth a <-> b between them, addresses, links up."""
        _ip("netns", "add", self.producer_ns)
        _ip("netns", "add", self.consumer_ns)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for ns, dev, host in ((self.producer_ns, a, self.producer_host), (self.consumer_ns, b, self.consumer_host)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _no_slow_start(ns)

    def _ends(self) -> list[tuple[list[str], str]]:
        """(tc command prefix, device) of each end of the veth."""
        return [(["tc", "-n", self.producer_ns], self._veth[0]), (["tc", "-n", self.consumer_ns], self._veth[1])]

    def set_rate(self, bytes_per_s: float | None) -> None:
        """Token bucket at `bytes_per_s` on both directions; None removes shaping."""
        for tc, dev in self._ends():
            if bytes_per_s is None:
                subprocess.run([*tc, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=10)
                continue
            # burst ~1 ms of traffic: small enough that a transfer of a few ms is still shaped
            burst = max(MIN_BURST, int(bytes_per_s * 0.001))
            limit = burst + int(bytes_per_s * 0.05)  # queue up to 50 ms before dropping
            cmd = [*tc, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", tc_rate(bytes_per_s),
                   "burst", str(burst), "limit", str(limit)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            if res.returncode != 0:
                raise Unavailable(f"tc could not shape the link: {res.stderr.strip()}")
            self.burst_bytes = burst

    def measure_throughput(self, nbytes: int = 8 << 20) -> float | None:
        """Bytes/s of a plain-socket stream producer -> consumer through the shaped veth (None on failure)."""
        host = self.producer_host
        send = [*self.exec_prefix("producer"), sys.executable, "-c", _SEND.format(host=host, n=nbytes)]
        sender = subprocess.Popen(send, stdout=subprocess.PIPE, text=True)
        try:
            recv = _RECV.format(host=host, port=int(sender.stdout.readline()))
            out = subprocess.run([*self.exec_prefix("consumer"), sys.executable, "-c", recv],
                                 capture_output=True, text=True, timeout=120)
            return float(out.stdout.strip())
        except (ValueError, subprocess.TimeoutExpired):
            return None
        finally:
            sender.kill()
            sender.wait()

    def exec_prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.producer_ns if side == "producer" else self.consumer_ns]

    def producer_addr(self, port: int) -> str:
        """Where the consumer connects to reach a producer listening on `port`."""
        return f"{self.producer_host}:{port}"

    def producer_bind(self) -> str:
        return self.producer_host

    def down(self) -> None:
        if not self._up:
            return
        for ns in (self.producer_ns, self.consumer_ns):
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self._veth[0], check=False)  # only left if it never moved into a namespace
        self._up = False

    def describe(self) -> dict:
        return {"kind": self.kind, "producer_ns": self.producer_ns, "consumer_ns": self.consumer_ns,
                "burst_bytes": self.burst_bytes, "shaped_in_kernel": True}


class HostLink(NetnsLink):
    """The producer's namespace `<tag>p` (addr .1) <-veth-> this namespace (addr .2): only what the
    producer sends and receives crosses the shaped veth; everything else runs here as usual."""

    kind = "netns+veth+tc-tbf (producer namespace)"

    def __init__(self, tag: str | None = None):
        super().__init__(tag or f"scdh{os.getpid()}")
        n = os.getpid() % 250 + 1  # 10.214: not NetnsLink's subnet, whose both ends are in namespaces
        self.producer_host, self.consumer_host = f"10.214.{n}.1", f"10.214.{n}.2"
        self._veth = (f"hp{os.getpid()}"[:15], f"hc{os.getpid()}"[:15])

    def _plumb(self, a: str, b: str) -> None:
        """The producer's namespace, the veth a (there) <-> b (here), addresses, links up."""
        _ip("netns", "add", self.producer_ns)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("link", "set", a, "netns", self.producer_ns)
        _ip("-n", self.producer_ns, "addr", "add", f"{self.producer_host}/24", "dev", a)
        _ip("-n", self.producer_ns, "link", "set", a, "up")
        _ip("-n", self.producer_ns, "link", "set", "lo", "up")
        _ip("addr", "add", f"{self.consumer_host}/24", "dev", b)
        _ip("link", "set", b, "up")
        _no_slow_start(self.producer_ns)

    def _ends(self) -> list[tuple[list[str], str]]:
        return [(["tc", "-n", self.producer_ns], self._veth[0]), (["tc"], self._veth[1])]

    def exec_prefix(self, side: str) -> list[str]:
        return super().exec_prefix(side) if side == "producer" else []

    def down(self) -> None:
        if not self._up:
            return
        _ip("netns", "del", self.producer_ns, check=False)  # takes the veth pair (both ends) with it
        _ip("link", "del", self._veth[1], check=False)  # only left if its peer never moved
        self._up = False

    def describe(self) -> dict:
        return {"kind": self.kind, "producer_ns": self.producer_ns, "burst_bytes": self.burst_bytes,
                "shaped_in_kernel": True}
