"""E. Backpressure: bounded admission with fast 429 + Retry-After, flat memory under a flood of
rejections, RESOURCE_EXHAUSTED from a full prefill worker
waited for (until the deadline), never a 500, idle keep-alives."""

import asyncio
import os
import socket
import time
import warnings

import psutil
import pytest

from rel_checks import Baseline, assert_clean, eventually
from scd_serve.testing.faults import FaultyProducer, FaultyRuntime, FaultyServicer
from scd_serve.testing.soak import completion

pytestmark = pytest.mark.timeout(90)


def latency_budget_applies() -> bool:
    """The client-side latency budgets (E1 median 100 ms, E2 p50 50 ms) are checked only when the
    machine is not oversubscribed: at a load average of 5x the cores every figure is starvation,
    not the server. They are medians, so a test process that loses the CPU for a few hundred ms
    does not fail them; the generous bounds next to them always apply. The figures are printed
    either way (docs/reliability.md)."""
    busy = os.getloadavg()[0] > 2 * (os.cpu_count() or 1)
    if busy:
        warnings.warn(f"load average {os.getloadavg()[0]:.1f}: latency bounds not checked in this run")
    return not busy


async def _timed_post(client, body):
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json=body)
    return r, time.monotonic() - t0


async def _saturate(stack, n, slow, stall_s=0.02):
    """n long requests (40 steps of `stall_s`) holding every admission slot."""
    slow.stall_after_steps, slow.stall_s = 0, stall_s
    busy = [asyncio.ensure_future(_timed_post(stack.client, completion(f"busy {i}", 40))) for i in range(n)]
    assert await eventually(lambda: stack.engine.stats()["num_requests"] >= n, 30, step=0.005), stack.engine.stats()
    return busy


async def test_e1_overload_4x_gets_fast_429_with_retry_after(make_stack):
    n, m = 4, 12  # 16 concurrent requests on capacity 4
    holder = {}
    stack, base = await make_stack(engine={"max_concurrent": n, "max_num_seqs": n},
                                   runtime_wrap=lambda rt: holder.setdefault("rt", FaultyRuntime(rt)))
    busy = await _saturate(stack, n, holder["rt"], stall_s=0.1)  # the slots stay taken for ~4 s
    extra = [await _timed_post(stack.client, completion(f"extra {i}", 4)) for i in range(m)]  # each alone
    assert [r.status_code for r, _ in extra] == [429] * m
    took = sorted(t for _, t in extra)
    print(f"E1: {m} rejections, median {took[m // 2] * 1e3:.1f} ms, slowest {took[-1] * 1e3:.1f} ms")
    for r, _ in extra:
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "rate_limit_exceeded"
    # a rejection that waited for a slot would take the busy requests' ~4 s (or the 30 s queue timeout)
    assert took[-1] < 2.0, took
    assert took[m // 2] < 0.1 or not latency_budget_applies(), took
    done = await asyncio.gather(*busy)
    assert [r.status_code for r, _ in done] == [200] * n
    holder["rt"].stall_after_steps = None
    await assert_clean(stack, base)


async def test_e2_two_thousand_rejections_flat_rss_fast(make_stack):
    holder = {}
    stack, base = await make_stack(engine={"max_concurrent": 2, "max_num_seqs": 2},
                                   runtime_wrap=lambda rt: holder.setdefault("rt", FaultyRuntime(rt)))
    busy = await _saturate(stack, 2, holder["rt"])
    holder["rt"].stall_s = 1.0  # keep the slots busy for the whole flood
    proc, lat, rss = psutil.Process(), [], []
    body = completion("rejected", 4)
    stop_at = time.monotonic() + 60

    async def flood(k):
        for _ in range(k):
            if time.monotonic() > stop_at:
                return
            r, took = await _timed_post(stack.client, body)
            assert r.status_code == 429
            lat.append(took)
            if len(lat) in (200, 2000):
                rss.append(proc.memory_info().rss)

    await asyncio.gather(*(flood(1000) for _ in range(2)))
    assert len(lat) == 2000, f"only {len(lat)} rejections in 60 s"
    lat.sort()
    p99 = lat[int(0.99 * len(lat))]
    print(f"E2: 2000 rejections, p50 {lat[1000] * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
          f"RSS growth {(rss[-1] - rss[0]) / 2**20:.1f} MiB")
    assert (rss[-1] - rss[0]) < 50 * 2**20
    assert p99 < 0.5, p99  # rejections that waited for the engine's 1 s steps would put p99 near 1 s
    assert lat[1000] < 0.05 or not latency_budget_applies(), lat[1000]  # p50
    holder["rt"].stall_after_steps = None
    for t in busy:
        t.cancel()
    await asyncio.gather(*busy, return_exceptions=True)
    await assert_clean(stack, base)


async def test_e3_full_prefill_worker_is_waited_for_never_500(make_stack):
    """The prefill worker's gRPC limit answers RESOURCE_EXHAUSTED: the decode worker waits for a
    slot (as when its own count says every worker is busy) and serves every request."""
    slow = {}
    stack, base = await make_stack(engine={"fallback_to_local": False}, max_concurrent_rpcs=2,
                                   producer_wrap=lambda rt: slow.setdefault("p", FaultyProducer(rt)),
                                   servicer_wrap=lambda sv: FaultyServicer(sv))
    slow["p"].layer_delay_s = 0.4
    rs = await asyncio.gather(*(stack.client.post("/v1/completions", json=completion(f"e3 {i}", 2, scd_method="identity"))
                                for i in range(6)))
    codes = sorted(r.status_code for r in rs)
    # 503 only where the limit also refused the health checks and the peer was marked down
    assert all(c in (200, 503) for c in codes), [r.text for r in rs]
    assert stack.fill.stats.num_full_waits > 0  # the limit was actually hit
    assert codes.count(200) >= 2, codes
    slow["p"].layer_delay_s = 0.0
    await eventually(stack.peers.ready, 15, step=0.05)  # assert_clean's fresh request needs the peer
    await assert_clean(stack, base)


async def test_e3_full_prefill_worker_past_the_deadline_is_504_never_500(make_stack):
    slow = {}
    stack, base = await make_stack(engine={"fallback_to_local": False}, api={"request_timeout_s": 2.0},
                                   max_concurrent_rpcs=1,
                                   producer_wrap=lambda rt: slow.setdefault("p", FaultyProducer(rt)),
                                   servicer_wrap=lambda sv: FaultyServicer(sv))
    slow["p"].layer_delay_s = 1.0  # the first request holds the only slot past the second's deadline
    first = asyncio.create_task(stack.client.post("/v1/completions", json=completion("e3 long", 2, scd_method="identity")))
    await eventually(lambda: stack.fill.num_inflight > 0, 10, step=0.01)
    r = await stack.client.post("/v1/completions", json=completion("e3 short", 2, scd_method="identity"))
    assert r.status_code in (503, 504), r.text
    assert r.json()["error"]["message"], r.text
    assert stack.fill.stats.num_full_waits > 0  # it waited on the full worker, then its deadline passed
    slow["p"].layer_delay_s = 0.0
    assert (await first).status_code in (200, 503, 504)  # the first one's own deadline may pass too
    await eventually(stack.peers.ready, 15, step=0.05)
    await assert_clean(stack, base)


async def test_e4_idle_keepalive_connections(make_stack):
    keep_alive = 2
    stack, _ = await make_stack(api={"timeout_keep_alive_s": keep_alive})
    url = await stack.serve_http()
    base = Baseline()
    port = int(url.rsplit(":", 1)[1])
    loop = asyncio.get_running_loop()

    def open_idle():  # in a thread: the server runs on this loop
        socks = []
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(s)
        for s in socks:
            s.settimeout(3)
            got = b""
            while not got.endswith(b'{"status":"ok"}'):  # headers and body may come apart
                got += s.recv(4096)
            assert b" 200 " in got
        return socks

    first = time.monotonic()  # no idle connection can be closed before first + keep_alive
    socks = await loop.run_in_executor(None, open_idle)
    opened = time.monotonic()
    import httpx
    # both are answered while all 50 idle connections are still open: a server stuck behind them
    # would answer only once they close, keep_alive s after their replies
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        t0 = time.monotonic()
        assert (await http.get("/live")).status_code == 200
        print(f"E4: /live {(time.monotonic() - t0) * 1e3:.1f} ms with 50 idle connections")
        assert time.monotonic() - first < keep_alive
        t0 = time.monotonic()
        assert (await http.post("/v1/completions", json=completion("alive", 2))).status_code == 200
        print(f"E4: completion {(time.monotonic() - t0) * 1e3:.1f} ms with 50 idle connections")
        assert time.monotonic() - first < keep_alive

    def closed_by_server(s):
        s.settimeout(keep_alive + 4)  # never closed: False after that
        try:
            return s.recv(1) == b""
        except ConnectionResetError:
            return True  # closed by the server, abruptly
        except TimeoutError:
            return False

    closed = await asyncio.gather(*(loop.run_in_executor(None, closed_by_server, s) for s in socks[:10]))
    # closed by the 2 s setting: uvicorn's default 5 s would mean the setting was ignored
    assert all(closed) and time.monotonic() - opened < keep_alive + 2.5, closed
    for s in socks:
        s.close()
    await asyncio.sleep(0.2)
    await assert_clean(stack, base)
