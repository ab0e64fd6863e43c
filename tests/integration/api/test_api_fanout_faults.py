"""One request, several engine requests (n, a list of prompts): a client that leaves mid-stream
aborts all of them, and one refused engine request fails the whole response with nothing held."""

import httpx
import pytest
from api_server import ServerThread, engine_app, stop_engine
from polls import eventually_sync

from scd_serve.testing.fake_runtime import FakeRuntime

pytestmark = pytest.mark.timeout(60)


def is_clean(engine) -> bool:
    s = engine.stats()
    return s["num_free_blocks"] == s["num_total_blocks"] and s["num_requests"] == 0 \
        and not engine.scheduler.has_unfinished()


def test_client_leaving_a_stream_of_six_choices_aborts_all_of_them():
    rt = FakeRuntime()
    rt.step_delay_s = 0.05  # 120 tokens would take ~6 s
    app, engine = engine_app(rt)
    try:
        with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
            body = {"prompt": ["x", "y"], "n": 3, "max_tokens": 120, "stream": True, "ignore_eos": True,
                    "temperature": 1.0, "seed": 1}
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = set()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        seen.add(line.split('"index": ')[1][0])
                    if len(seen) == 6:
                        break
            assert eventually_sync(lambda: is_clean(engine), 4.0), engine.stats()
            assert engine.stats()["num_generated_tokens"] < 6 * 120
    finally:
        stop_engine(engine)


def test_one_refused_choice_fails_the_request_and_frees_the_others():
    app, engine = engine_app(FakeRuntime(), {"max_num_seqs": 2, "max_concurrent": 2})
    try:
        with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=10) as c:
            r = c.post("/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": 4})
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert eventually_sync(lambda: is_clean(engine), 4.0), engine.stats()
            r = c.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 4})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
    finally:
        stop_engine(engine)
