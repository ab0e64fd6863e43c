"""Fallback shaper when namespaces cannot be made: a token-bucket TCP proxy in this process.

The consumer connects to the proxy on 127.0.0.1, which forwards to the producer and paces
each direction through a token bucket. Results say "userspace-token-bucket (fallback)": the
kernel does not shape it, and its copies share the CPU with the workers.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import suppress

CHUNK = 64 * 1024


class TokenBucket:
    """`rate` bytes/s with `burst` bytes of credit; take() blocks until the bytes may pass."""

    def __init__(self, rate: float | None, burst: int):
        self.rate, self.burst = rate, burst
        self._tokens, self._t = float(burst), time.monotonic()
        self._lock = threading.Lock()

    def set_rate(self, rate: float | None, burst: int) -> None:
        with self._lock:
            self.rate, self.burst, self._tokens, self._t = rate, burst, float(burst), time.monotonic()

    def take(self, n: int) -> None:
        while True:
            with self._lock:
                if self.rate is None:
                    return
                now = time.monotonic()
                self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
                self._t = now
                if self._tokens >= n or self._tokens >= self.burst:
                    self._tokens -= n  # may go negative for n > burst: repaid before the next send
                    return
                wait = (min(n, self.burst) - self._tokens) / self.rate
            time.sleep(min(wait, 0.05))


class TokenBucketProxy:
    """Listens on 127.0.0.1:<port>, forwards to `target`, shapes both directions."""

    kind = "userspace-token-bucket (fallback)"

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.down_bucket = TokenBucket(None, CHUNK)  # producer -> consumer (the payload)
        self.up_bucket = TokenBucket(None, CHUNK)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="tbproxy-accept").start()

    def set_rate(self, bytes_per_s: float | None) -> None:
        burst = max(CHUNK, int((bytes_per_s or 0) * 0.002))
        self.down_bucket.set_rate(bytes_per_s, burst)
        self.up_bucket.set_rate(bytes_per_s, burst)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            self._conns += [client, upstream]
            for src, dst, bucket in ((client, upstream, self.up_bucket), (upstream, client, self.down_bucket)):
                threading.Thread(target=self._pump, args=(src, dst, bucket), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, bucket: TokenBucket) -> None:
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        for s in self._conns:
            s.close()


class ProxyLink:
    """Same surface as NetnsLink, for when the kernel route is not available."""

    kind = TokenBucketProxy.kind

    def __init__(self, reason: str):
        self.reason = reason
        self.proxy: TokenBucketProxy | None = None
        self.rate_bytes_per_s: float | None = None

    def up(self) -> "ProxyLink":
        return self

    def set_rate(self, bytes_per_s: float | None) -> None:
        self.rate_bytes_per_s = bytes_per_s
        if self.proxy:
            self.proxy.set_rate(bytes_per_s)

    def exec_prefix(self, side: str) -> list[str]:
        return []

    def measure_throughput(self, nbytes: int = 8 << 20) -> float | None:
        return None  # the proxy is only attached to the producer's port

    def producer_bind(self) -> str:
        return "127.0.0.1"

    def producer_addr(self, port: int) -> str:
        """The proxy's address; it starts on the first call, once the producer listens on `port`."""
        if self.proxy is None:
            self.proxy = TokenBucketProxy(("127.0.0.1", port))
            self.proxy.set_rate(self.rate_bytes_per_s)
        return f"127.0.0.1:{self.proxy.port}"

    def describe(self) -> dict:
        return {"kind": self.kind, "why_fallback": self.reason, "shaped_in_kernel": False}

    def down(self) -> None:
        if self.proxy:
            self.proxy.close()
            self.proxy = None
