"""`scd_method: "auto"` through a real gRPC prefill worker and a decode worker (DecodeBackend,
RemoteKVFill, engine, the HTTP app): it picks a transfer method within the quality budget,
says which and why (header, `scd` field, metrics), and learns from what it measured."""

import contextlib
import json
import time

import httpx
import pytest
import torch
from asgi_lifespan import LifespanManager

from scd_serve.calibration.assemble import build_codebook
from scd_serve.calibration.fit import collect_rows, fit_layer
from scd_serve.codec.plan import REUSE, LayerPlan, Plan
from scd_serve.codec.codec_spec import spec_of
from scd_serve.config.api import ApiConfig
from scd_serve.config.decode import ChooserConfig, DecodeConfig
from scd_serve.decode.main import resolve_method
from scd_serve.decode.worker import DecodeWorker
from scd_serve.testing.faults import FaultyServicer
from scd_serve.prefill.service import PrefillServicer

from serving_helpers import SlowRuntime, engine_config, prompts, start_prefill, tiny_runtime

pytestmark = pytest.mark.timeout(120)
PROMPT = list(range(3, 43))  # 40 tokens


class SlowPrefill:
    """The consumer runtime with a slow local prefill (`per_token_s` a prompt token), so that a
    transfer is the fastest option on loopback; everything else passes through."""

    def __init__(self, rt, per_token_s):
        self._rt = rt
        self._per_token_s = per_token_s

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def extend(self, pool, items, **kw):
        time.sleep(self._per_token_s * sum(len(tokens) for _, _, tokens in items))
        return self._rt.extend(pool, items, **kw)


@contextlib.asynccontextmanager
async def auto_worker(consumer, producer, methods, codebook="", budget=None, fallback="none", nodes=None,
                      servicer_cls=PrefillServicer, local_per_token_s=0.01):
    """A prefill worker offering `methods` and a decode worker whose default is auto; yields
    (HTTP client, the decode backend); `nodes`, a list, receives the prefill node; the local
    prefill takes `local_per_token_s` a prompt token."""
    book = None
    if codebook:
        from scd_serve.codec.codebook import Codebook

        book = Codebook.load(codebook, producer=producer)
    node = await start_prefill(producer, methods=methods, codebook=book, servicer_cls=servicer_cls)
    if nodes is not None:
        nodes.append(node)
    config = DecodeConfig(model="unused", codebook=codebook, prefill=(node.address,), method="auto", fallback=fallback,
                          chooser=ChooserConfig(quality_budget=budget))
    # without the prefix cache: these tests send one prompt again and again, which a local
    # prefill would then find cached (test_decode_chooser covers that choice)
    worker = DecodeWorker(consumer, config, engine_config(fallback_to_local=fallback == "local", prefix_caching=False),
                          ApiConfig(model_name="tiny", max_model_len=256, max_tokens_cap=64, default_method="auto"),
                          runtime_wrap=lambda rt: SlowPrefill(rt, local_per_token_s))
    try:
        await worker.start(health_loop=False)
        assert worker.peers.ready(), worker.peers.why_not_ready()
        async with LifespanManager(worker.app) as manager:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url="http://t",
                                         timeout=60) as client:
                yield client, worker.backend
    finally:
        await worker.stop(grace_s=1)
        await node.stop()


async def complete(client, **extra):
    r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                   "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r


async def test_auto_explores_then_picks_a_lossless_transfer_and_says_so(tmp_path):
    rt = tiny_runtime(tmp_path / "model")  # producer == consumer: raw and identity are lossless
    # local prefill 2 s for the 40 tokens, ~100x a transfer on an idle machine: twice on CI (at 2 and
    # 10 ms a token) transfers were predicted slower than local; a failure prints the estimates
    async with auto_worker(rt, rt, ("identity", "raw"), local_per_token_s=0.05) as (client, backend):
        seen = [await complete(client) for _ in range(6)]
        fields = [r.json()["scd"] for r in seen]
        assert [(f["method"], f["reason"]) for f in fields[:2]] == [("raw", "explore"), ("identity", "explore")]
        assert fields[2]["method"] == "local"  # measured once (its first estimate is the producer's speed)
        for r, f in zip(seen[3:], fields[3:]):  # local prefill is slow here: a transfer is the fastest
            assert f["reason"] == "fastest" and f["method"] in ("raw", "identity") and f["requested"] == "auto", \
                (fields, backend.stats()["auto"])
            assert r.headers["x-scd-method"] == f["method"]
            assert r.headers["x-scd-method-reason"].startswith("fastest; ") and "local" in f["detail"]
            assert f["predicted_ttft_ms"] > 0
        assert backend.fill.stats.num_transfers == 5  # every choice but local transferred
        assert backend.served == {"disaggregated": 5, "local": 1}  # "did it disaggregate at all?"
        assert 'scd_requests_served_total{kv_source="local"} 1.0' in (await client.get("/metrics")).text
        assert backend.stats()["auto"]["link_mbit_s"]  # it measured the link

        fixed = await complete(client, scd_method="identity")  # a named method is reported as such
        scd = fixed.json()["scd"]
        assert scd.pop("transfer")["payload_bytes"] > 0  # what the transfer carried
        assert scd == {"method": "identity", "requested": "identity", "reason": "fixed"}

        async with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True,
                                                                  "temperature": 0, "ignore_eos": True}) as r:
            assert r.headers["x-scd-method"] in ("raw", "identity")
            events = [json.loads(line[5:]) for line in [x async for x in r.aiter_lines()]
                      if line.startswith("data:") and line != "data: [DONE]"]
        assert events[0]["scd"]["method"] == r.headers["x-scd-method"]
        assert len(events) > 1 and all("scd" not in e for e in events[1:])  # the first chunk says it, once

        metrics = (await client.get("/metrics")).text
        assert 'scd_auto_choice_total{method="local"} 1.0' in metrics
        picked = sum(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("scd_auto_choice_total{") and "local" not in line)
        assert picked == 6
        errors = [line for line in metrics.splitlines() if line.startswith("scd_auto_prediction_error_ratio_count")]
        assert errors and sum(float(line.split()[-1]) for line in errors) >= 3  # the "fastest" ones were predicted
        assert backend._live == {}  # each request's Transfer ended with it


@pytest.fixture(scope="module")
def cross_pair(tmp_path_factory):
    """Producer != consumer with a codebook whose manifest calibrates scd within 0.05, reuse and raw not."""
    root = tmp_path_factory.mktemp("auto")
    a, b = tiny_runtime(root / "producer", seed=0), tiny_runtime(root / "consumer", seed=1)
    rows = collect_rows(a, b, [torch.tensor(p) for p in prompts(6, seed=11)], max_rows=4096)
    fits = [fit_layer(r, spec_of(b).kv_width, (8, 32), aligner_width=32) for r in rows]
    plan = Plan(tuple(LayerPlan(REUSE, 8, 16) for _ in range(spec_of(b).num_layers)))
    path = build_codebook(fits, {"scd": plan, "reuse": plan}, spec_of(a), spec_of(b)).save(root / "book")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["calibration"] = {"kl_budget": 0.05, "methods": {"scd": {"kl": 0.04, "payload_ratio": 0.3},
                                                              "reuse": {"kl": 0.09, "payload_ratio": 0.25},
                                                              "raw": {"kl": 5.0, "payload_ratio": 1.0}}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return a, b, str(path)


async def test_auto_keeps_to_the_codebooks_quality_budget(cross_pair):
    a, b, book = cross_pair
    assert resolve_method(b, book, "auto", explicit=False) == "auto"  # the default when a codebook loads
    assert resolve_method(b, None, "auto", explicit=False) == "raw"  # none: raw, as before
    assert resolve_method(b, None, "auto", explicit=True) == "auto"  # asked for: lossless methods and local
    # local prefill 2 s for the 40 tokens, as the lossless test's: at 10 ms a token (0.4 s) a fresh-clone
    # CI run once predicted the transfer slower than local; a failure prints the estimates
    async with auto_worker(b, a, ("scd", "reuse", "raw"), codebook=book, local_per_token_s=0.05) as (client, backend):
        assert backend.auto.chooser.budget == 0.05  # the manifest's own
        methods = [(await complete(client)).json()["scd"]["method"] for _ in range(5)]
        assert set(methods) <= {"scd", "local"} and methods[0] == "scd", methods  # reuse (0.09), raw (5.0) never
        assert methods[-1] == "scd", (methods, backend.stats()["auto"])
    async with auto_worker(b, a, ("scd", "raw"), codebook=book, budget=0.0) as (client, _):
        f = (await complete(client)).json()["scd"]
        assert (f["method"], f["reason"]) == ("local", "only") and "quality budget 0" in f["detail"]


async def test_codes_gone_at_the_peer_send_the_request_to_the_local_prefill(tmp_path):
    """The prefill worker lost its cached codes (a restart, an eviction): its first message says
    so, and since a cold transfer from this slow producer would lose to the local prefill, the
    decode worker stops the transfer and prefills here at once (fallback local)."""
    from scd_serve.prefill.code_cache import CodeCache

    rt = tiny_runtime(tmp_path / "model")
    nodes = []
    async with auto_worker(rt, SlowRuntime(rt, delay=0.15), ("identity", "raw"), fallback="local",
                           nodes=nodes) as (client, backend):
        fields = [(await complete(client)).json()["scd"] for _ in range(5)]
        assert fields[-1]["reason"] == "fastest" and fields[-1]["method"] in ("raw", "identity"), fields
        node = nodes[0]
        node.servicer.cache = CodeCache(node.servicer.config.cache_bytes, node.servicer.config.cache_entries)
        r = await complete(client)
        f = r.json()["scd"]
        assert (f["method"], f["reason"]) == ("local", "cold-switch") and r.headers["x-scd-method"] == "local"
        assert backend.fill.num_cold_switches == 1 and backend.fill.stats.num_failed == 0
        f = (await complete(client)).json()["scd"]  # it no longer counts on (at least) those codes being there
        assert f["method"] == "local", f  # a cold transfer from this producer loses to the local prefill
        metrics = (await client.get("/metrics")).text
        assert 'scd_transfers_total{method="%s",outcome="cold-local"} 1.0' % fields[-1]["method"] in metrics


async def test_a_failed_transfer_reports_the_local_prefill_that_served(tmp_path):
    """A transfer that fails (a corrupted chunk, on every attempt) with fallback local: the
    engine prefills here, and the response names `local` with reason "fallback" and the
    method that failed, not the method that was picked."""
    rt = tiny_runtime(tmp_path / "model")
    faulty = []

    def servicer(*args):
        faulty.append(FaultyServicer(PrefillServicer(*args), corrupt_seq=0))
        faulty[-1].armed = False
        return faulty[-1]

    async with auto_worker(rt, SlowRuntime(rt, delay=0.02), ("identity", "raw"), fallback="local",
                           servicer_cls=servicer) as (client, backend):
        fields = [(await complete(client)).json()["scd"] for _ in range(5)]
        picked = fields[-1]["method"]
        assert fields[-1]["reason"] == "fastest" and picked in ("raw", "identity"), fields
        faulty[0].armed = True
        r = await complete(client)
        f = r.json()["scd"]
        assert (f["method"], f["reason"]) == ("local", "fallback") and r.headers["x-scd-method"] == "local", f
        assert f["detail"].startswith(picked + "@") and "transfer_corrupt" in f["detail"], f
        assert backend.fill.stats.num_failed >= 1 and backend.engine.num_fallbacks == 1
        faulty[0].armed = False
        r = await complete(client, scd_method="identity")  # a named method that served says so
        scd = r.json()["scd"]
        assert scd.pop("transfer")["payload_bytes"] > 0
        assert scd == {"method": "identity", "requested": "identity", "reason": "fixed"}
        faulty[0].armed = True
        r = await complete(client, scd_method="identity")  # ... and one that failed names its fallback
        assert (r.json()["scd"]["method"], r.json()["scd"]["reason"]) == ("local", "fallback")
