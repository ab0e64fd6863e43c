"""Checklist C3, D1, E1, E2, F5, G2, H1 through HTTP on the engine (toy runtime, fault hooks)."""

import asyncio
import json
import os
import threading
import time

import httpx
import psutil
import pytest
from api_server import ServerThread, engine_app, stop_engine
from asgi_lifespan import LifespanManager
from polls import eventually, eventually_sync

from scd_serve.engine.engine import MAX_FAILED_STEPS
from scd_serve.testing.fake_runtime import FakeRuntime

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def app_client():
    started = []

    async def make(engine_kw=None, api_kw=None):
        app, engine = engine_app(FakeRuntime(), engine_kw, api_kw)
        manager = LifespanManager(app)
        await manager.__aenter__()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url="http://test")
        started.append((engine, manager, client))
        return client, engine

    yield make
    for engine, manager, client in started:
        await client.aclose()
        await manager.__aexit__(None, None, None)
        await engine.stop(0.5)


def is_clean(engine) -> bool:
    s = engine.stats()
    return s["num_free_blocks"] == s["num_total_blocks"] and s["num_requests"] == 0 \
        and not engine.scheduler.has_unfinished()


async def clean(engine, within=10.0):
    """Blocks free, nothing queued or running, within `within` s (a leak never clears)."""
    return await eventually(lambda: is_clean(engine), within, step=0.01)


async def test_overload_gives_exactly_m_fast_429s_and_n_successes(app_client):
    n, m = 4, 3
    client, engine = await app_client({"max_concurrent": n, "max_num_seqs": n})
    engine.runtime.step_delay_s = 0.05
    body = {"prompt": "hello", "max_tokens": 50, "temperature": 0, "ignore_eos": True}  # ~2.5 s each

    async def one():
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=body)
        return r, time.monotonic() - t0

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    assert await eventually(lambda: engine.stats()["num_requests"] >= n, 10), engine.stats()  # every slot held
    rejected = await asyncio.gather(*(one() for _ in range(m)))
    assert all(r.status_code == 429 and r.headers["retry-after"] == "1" for r, _ in rejected), rejected
    # fast: a rejection that waited for a slot would take the busy requests' ~2.5 s (or the 30 s queue timeout)
    assert all(dt < 1.0 for _, dt in rejected), [dt for _, dt in rejected]
    assert all(r.status_code == 200 for r, _ in await asyncio.gather(*tasks))
    assert await clean(engine)


async def test_rejections_stay_cheap(app_client):
    client, engine = await app_client({"max_concurrent": 1, "max_num_seqs": 1})
    engine.runtime.step_delay_s = 0.1  # the one slot stays busy for ~12 s (cancelled below)
    hold = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 120,
                                                                      "ignore_eos": True}))
    assert await eventually(lambda: engine.stats()["num_requests"] >= 1, 10), engine.stats()
    rss0 = psutil.Process(os.getpid()).memory_info().rss
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        r = await client.post("/v1/completions", json={"prompt": "y"})
        times.append(time.perf_counter() - t0)
        assert r.status_code == 429
    times.sort()
    print(f"rejection p50={times[150] * 1e3:.1f} ms p99={times[296] * 1e3:.1f} ms")
    assert psutil.Process(os.getpid()).memory_info().rss - rss0 < 50 << 20  # latency: printed, not asserted
    hold.cancel()
    assert await clean(engine)


async def test_queue_timeout_is_504_in_time(app_client):
    # one big request holds the whole pool; the next waits for blocks and times out
    client, engine = await app_client({"num_blocks": 8, "block_size": 4, "max_model_len": 32, "queue_timeout_s": 1.0},
                                      {"max_tokens_cap": 32})
    engine.runtime.step_delay_s = 0.6  # the hog's 9 steps hold the pool for ~5.4 s
    hog = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a" * 24, "max_tokens": 8,
                                                                     "ignore_eos": True}))
    assert await eventually(lambda: engine.stats()["num_free_blocks"] < engine.stats()["num_total_blocks"], 10)
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"prompt": "b" * 24, "max_tokens": 8})
    elapsed = time.monotonic() - t0
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    # not before the 1 s queue timeout (load only makes it later); one that fired late, or only once
    # the hog frees its blocks (~5.4 s), fails
    assert 1.0 <= elapsed <= 1.0 + 3.0, elapsed
    assert (await hog).status_code == 200
    assert await clean(engine)


async def test_engine_death_and_stall_flip_readiness(app_client):
    client, engine = await app_client({"stall_timeout_s": 0.5})
    assert (await client.get("/ready")).status_code == 200
    engine.runtime.step_delay_s = 4.0  # one step stalls
    slow = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}))

    async def not_ready():
        return (await client.get("/ready")).status_code != 200

    # 503 0.5 s (stall_timeout_s) into the 4 s stall, + room; watched only while the step still stalls
    assert await eventually(not_ready, 0.5 + 3.0, step=0.05), "/ready still 200 while the engine loop is stuck"
    assert (await client.get("/live")).status_code == 200
    assert (await slow).status_code == 200
    engine.runtime.step_delay_s = 0
    engine.runtime.fail_after_steps = engine.runtime.num_steps + 2  # the forward now raises, for good
    for _ in range(MAX_FAILED_STEPS - 1):  # each failing step fails its request; the engine goes on
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20})
        assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed", r.text
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert (await client.get("/ready")).status_code == 503
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={"prompt": "x"})
    # fails fast: one queued on the dead engine would hang until a timeout (30 s+)
    assert r.status_code == 503 and time.monotonic() - t0 < 2.0


def test_client_disconnect_mid_stream_aborts_generation():
    rt = FakeRuntime()
    rt.step_delay_s = 0.05  # the 120 tokens would take ~6 s
    app, engine = engine_app(rt)
    try:
        with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
            body = {"prompt": "x", "max_tokens": 120, "stream": True, "ignore_eos": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                got = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append(line)
                    if len(got) == 3:
                        break
            # blocks freed once the server sees the disconnect; a generation that went on would
            # hold them for the rest of its ~6 s
            assert eventually_sync(lambda: is_clean(engine), 4.0), engine.stats()
            generated = engine.stats()["num_generated_tokens"]
            time.sleep(0.2)  # a stopped generation stays stopped (nothing to poll for)
            assert engine.stats()["num_generated_tokens"] == generated < 120  # it stopped generating
            assert engine.stats()["num_requests"] == 0 and not engine.scheduler.has_unfinished()
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})  # a fresh request works
            assert r.status_code == 200
    finally:
        stop_engine(engine)


def test_shutdown_ends_a_long_stream_with_an_error_event():
    rt = FakeRuntime()
    rt.step_delay_s = 0.05  # the 120-token stream would run ~6 s
    app, engine = engine_app(rt)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"prompt": "x", "max_tokens": 120, "stream": True, "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            events = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    t0 = time.monotonic()
                    stopper = threading.Thread(target=asyncio.run, args=(engine.stop(grace_s=0.2),))
                    stopper.start()
            stopper.join(10)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert time.monotonic() - t0 < 0.2 + 3.0  # the 0.2 s grace + room; not the stream's ~6 s


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_during_a_slow_fill_aborts_it_at_once(stream):
    """Checklist D2 at the API: the client leaves before the first token; the fill is cancelled."""
    from scd_serve.api.app import create_app
    from scd_serve.api.backend import EngineBackend
    from scd_serve.config.api import ApiConfig
    from scd_serve.config.engine import EngineConfig
    from scd_serve.engine.engine import Engine

    cancelled = threading.Event()

    async def slow_fill(req, sink):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    engine = Engine(FakeRuntime(), EngineConfig(num_blocks=64, block_size=4, max_model_len=128, idle_poll_s=0.01))
    engine.start()
    app = create_app(ApiConfig(max_model_len=128, max_tokens_cap=64), EngineBackend(engine, "toy", {"raw": slow_fill}))
    try:
        with ServerThread(app) as srv:
            body = {"prompt": "a long enough prompt", "max_tokens": 4, "scd_method": "raw", "stream": stream}  # raw: the slow fill
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
            # well before the fill's own 30 s end
            assert cancelled.wait(10.0), "the fill kept running after the client left"
            assert eventually_sync(lambda: not engine.stats()["num_requests"]
                                   and engine.stats()["num_free_blocks"] == 64, 10), engine.stats()
    finally:
        stop_engine(engine)
