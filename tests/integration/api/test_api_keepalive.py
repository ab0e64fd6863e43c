"""Checklist E4: idle keep-alive connections neither block service nor live forever."""

import socket
import time

import httpx
import pytest
from api_server import ServerThread, engine_app, stop_engine

from scd_serve.engine.toy import ToyRuntime

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def test_fifty_idle_connections():
    app, engine = engine_app(ToyRuntime())
    try:
        with ServerThread(app, timeout_keep_alive=1) as srv:
            host, port = srv.url.removeprefix("http://").split(":")
            idle = []
            for _ in range(50):
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
                assert b"200 OK" in s.recv(4096)
                idle.append(s)
            with httpx.Client(base_url=srv.url, timeout=5) as c:
                t0 = time.monotonic()
                assert c.get("/live").status_code == 200
                r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                elapsed = time.monotonic() - t0
                assert r.status_code == 200
                print(f"live + completion with 50 idle connections: {elapsed * 1e3:.0f} ms")
            time.sleep(2.0)  # past timeout_keep_alive
            assert sum(map(closed_by_server, idle)) == 50
    finally:
        stop_engine(engine)


def closed_by_server(s: socket.socket) -> bool:
    """Drain what is left of the response; True when the server has closed the connection."""
    s.settimeout(0.5)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False  # still open
    finally:
        s.close()
