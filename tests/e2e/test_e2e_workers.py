"""One prefill and one decode process started with the exact flags the compose file uses:
readiness follows the peer (F1-F3), a dead prefill gives fast 503s with --fallback none,
a restarted one is picked up again, SIGTERM exits cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from scd_serve.model.tiny import save_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start(*argv) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "scd_serve.cli", *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def wait_status(url: str, want: int, timeout: float) -> float:
    """Seconds until GET url answered `want` (fails the test after timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if status(url) == want:
            return time.monotonic() - t0
        time.sleep(0.1)
    pytest.fail(f"{url} did not answer {want} within {timeout} s (last {status(url)})")


def complete(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "abc def", "max_tokens": 4, "temperature": 0})


def test_readiness_follows_the_prefill_worker(tmp_path):
    model = str(save_tiny_model(tmp_path / "tiny", "llama", seed=0))
    gport, hport = free_port(), free_port()
    base = f"http://127.0.0.1:{hport}"
    prefill_argv = ["prefill", "--model", model, "--codebook", "", "--host", "127.0.0.1", "--port", str(gport),
                    "--device", "cpu"]
    decode = start("decode", "--model", model, "--codebook", "", "--host", "127.0.0.1", "--port", str(hport),
                   "--prefill", f"127.0.0.1:{gport}", "--method", "identity", "--fallback", "none", "--device", "cpu")
    prefill = None
    try:
        wait_status(f"{base}/live", 200, 300)
        assert status(f"{base}/ready") == 503  # F1: up, but no prefill worker yet
        assert complete(base).status_code == 503
        prefill = start(*prefill_argv)
        wait_status(f"{base}/ready", 200, 300)
        assert complete(base).status_code == 200
        prefill.send_signal(signal.SIGKILL)  # F2
        prefill.wait(10)
        assert wait_status(f"{base}/ready", 503, 15) < 2 * 1.0 + 5  # 2 health periods of 1 s, + room
        assert status(f"{base}/live") == 200
        t0 = time.monotonic()
        r = complete(base)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        assert time.monotonic() - t0 < 5  # fast: one that waited for the dead worker would take the 30 s prefill deadline
        prefill = start(*prefill_argv)  # F3: same address, reconnect with backoff
        wait_status(f"{base}/ready", 200, 300)
        assert complete(base).status_code == 200
        for proc in (decode, prefill):  # SIGTERM: drain and exit 0
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
    finally:
        for proc in (decode, prefill):
            if proc is not None and proc.poll() is None:
                proc.kill()
