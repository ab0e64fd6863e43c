"""Child processes of a benchmark: start, wait until ready (with a deadline), stop by pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import httpx

from scd_serve.errors import DeadlineExceeded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Start `cmd` niced, single-threaded by default, output to `log`."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    fh = open(log, "ab")
    return subprocess.Popen(["nice", "-n", "5", *cmd], stdout=fh, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen, deadline_s: float, log: Path | None = None) -> None:
    """Poll GET `url` until 200; raise if the process dies or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise DeadlineExceeded(f"process exited with {proc.returncode} before {url} was ready{log_tail(log)}")
        with suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.3)
    raise DeadlineExceeded(f"{url} not ready after {deadline_s:.0f}s{log_tail(log)}")


def wait_tcp(host: str, port: int, proc: subprocess.Popen, deadline_s: float, prefix: list[str] | None = None,
             log: Path | None = None) -> None:
    """Until something accepts on host:port (probed from inside the namespace when `prefix` is set)."""
    end = time.monotonic() + deadline_s
    probe = [*(prefix or []), sys.executable, "-c",
             f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"]
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise DeadlineExceeded(f"process exited with {proc.returncode} before {host}:{port} listened"
                                   f"{log_tail(log)}")
        if subprocess.run(probe, capture_output=True, timeout=20).returncode == 0:
            return
        time.sleep(0.5)
    raise DeadlineExceeded(f"{host}:{port} not listening after {deadline_s:.0f}s{log_tail(log)}")


def stop(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGTERM the child's own process group (it was started in a new session), then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(grace_s)
    except ProcessLookupError:
        pass


def log_tail(log: Path | None, n: int = 1200) -> str:
    return "" if log is None or not log.exists() else "; log tail:\n" + log.read_text(errors="replace")[-n:]
