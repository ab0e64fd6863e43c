"""A10. The whole sampling-parameter space through the HTTP API, extremes included: a legal
request is served (200), an illegal one is refused (400 naming the field), never a 5xx; the
engine stays alive and a request decoding in the same batches throughout is unaffected.

The issue's one-request denial of service was top_p 1e-138: float32 rounded it to 0, the
sampler dropped every token, torch.multinomial raised on NaN and the engine loop died."""

import json
import threading
import time

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from scd_serve.api.app import create_app
from scd_serve.api.backend import EngineBackend
from scd_serve.config.api import ApiConfig
from scd_serve.config.engine import EngineConfig
from scd_serve.engine.engine import Engine
from scd_serve.engine.request import MAX_SEED

pytestmark = pytest.mark.timeout(240)
TINY, HUGE = 5e-324, 1.7976931348623157e308  # the smallest and largest positive doubles

# each: legal values (extremes first), then illegal ones
temperatures = st.one_of(st.just(0), st.sampled_from([TINY, 1e-300, 1e-30, 1e30, 1e300, HUGE]),
                         st.floats(min_value=0, max_value=HUGE),
                         st.sampled_from([-TINY, -1.0, float("inf"), float("nan")]))
top_ps = st.one_of(st.sampled_from([TINY, 1e-138, 1e-8, 1.0]), st.floats(min_value=TINY, max_value=1),
                   st.sampled_from([0.0, -1.0, 1.0000001, float("nan")]))
top_ks = st.one_of(st.sampled_from([-1, 1, 2, MAX_SEED]), st.integers(1, 2**64),
                   st.sampled_from([0, -2, -(2**63)]))
seeds = st.one_of(st.none(), st.sampled_from([0, MAX_SEED]), st.integers(0, MAX_SEED),
                  st.sampled_from([MAX_SEED + 1, -1]))


def legal(field: str, value) -> bool:
    if field == "temperature":
        return value == value and 0 <= value < float("inf")
    if field == "top_p":
        return 0 < value <= 1
    if field == "top_k":
        return value == -1 or 1 <= value
    return value is None or 0 <= value <= MAX_SEED


@pytest.fixture(scope="module")
def server(rt):
    engine = Engine(rt, EngineConfig(num_blocks=128, block_size=8, max_model_len=256, max_num_seqs=8,
                                     max_concurrent=16, idle_poll_s=0.01))
    engine.start()
    app = create_app(ApiConfig(max_model_len=256, max_tokens_cap=8), EngineBackend(engine, "tiny"))
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    end = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < end and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", engine
    uv.should_exit = True
    thread.join(10)


class Neighbour:
    """A greedy request decoding over and over in another thread: every answer must be the same."""

    BODY = {"model": "tiny", "prompt": "a neighbour in the same batch", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}

    def __init__(self, url: str):
        self.url, self.texts, self.statuses = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                r = c.post("/v1/completions", json=self.BODY)
                self.statuses.append(r.status_code)
                if r.status_code == 200:
                    self.texts.append(r.json()["choices"][0]["text"])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)


def test_a10_sampling_parameter_space_never_5xx_and_the_batch_goes_on(server):
    url, engine = server
    seen = {"cases": 0, "served": 0}
    with Neighbour(url) as neighbour, httpx.Client(base_url=url, timeout=30) as client:
        @seed(2026)
        @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(temperature=temperatures, top_p=top_ps, top_k=top_ks, seed_=seeds, stream=st.booleans(),
               max_tokens=st.integers(1, 4))
        def case(temperature, top_p, top_k, seed_, stream, max_tokens):
            params = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed_}
            body = {"model": "tiny", "prompt": "x", "max_tokens": max_tokens, "stream": stream, **params}
            # NaN and Infinity as the literals Python's json writes (and its parser reads)
            r = client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
            seen["cases"] += 1
            bad = [f for f, v in params.items() if not legal(f, v)]
            if bad:
                assert r.status_code in (400, 422), (body, r.status_code, r.text)
                assert r.json()["error"].get("param") in bad, (body, r.text)
            else:
                assert r.status_code == 200, (body, r.status_code, r.text)
                assert "error" not in r.text, (body, r.text)  # a stream's error event would be a failure too
                seen["served"] += 1
            assert engine.ready(), (body, "the engine stopped being ready")

        case()
    assert seen["served"] >= 60, seen  # the strategies reach the legal extremes, not only refusals
    assert engine._dead is None and engine.ready()
    assert neighbour.statuses and set(neighbour.statuses) == {200}, neighbour.statuses
    assert len(set(neighbour.texts)) == 1, set(neighbour.texts)
