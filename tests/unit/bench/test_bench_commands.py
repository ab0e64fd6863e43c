"""`bench ttft` and `bench serve` run end to end on tiny random models and write well-formed output.

Real processes (prefill worker, probe, decode worker, baseline server), so marked slow.
No timing is asserted: benchmarks print figures, tests only check that they are produced.
"""

import json

import pytest

from scd_serve.cli import main
from scd_serve.model.tiny import save_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    shape = dict(max_position_embeddings=1024)
    return (str(save_tiny_model(root / "producer", "llama", seed=1, **shape)),
            str(save_tiny_model(root / "consumer", "llama", seed=2, **shape)))


def test_bench_ttft_quick_writes_results_and_plot(pair, tmp_path):
    out, png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    rc = main(["bench", "ttft", "--quick", "--json", str(out), "--plot", str(png), "--producer", pair[0],
               "--consumer", pair[1], "--codebook", "", "--prompt-tokens", "32",
               "--methods", "oracle", "raw", "quant4", "--bandwidths", "1gbit", "--worker"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["link"]["kind"] in ("netns+veth+tc-tbf", "userspace-token-bucket (fallback)")
    rows = doc["sweep"][0]["rows"]
    assert {r["method"] for r in rows} == {"oracle", "raw", "quant4"}
    raw = next(r for r in rows if r["method"] == "raw")
    assert raw["payload_bytes"] == 2 * 31 * 2 * 32 * 2  # layers * (T-1) * (K+V) * kv width * fp16
    assert raw["cache_hits"] == raw["reps"]  # warm: served from the producer's code cache
    for key in ("ttft_s", "rebuild_s", "first_step_s", "lower_bound_s", "ratio_to_lower_bound"):
        assert raw[key] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    # --worker: the real decode worker over HTTP, each transfer method beside its own local prefill
    worker = {r["method"]: r for r in doc["sweep"][0]["worker_rows"]}
    assert set(worker) == {"raw", "quant4", "local"}
    assert all(r["ttft_s"] > 0 and len(r["ttft_samples_s"]) == 1 for r in worker.values())
    assert worker["raw"]["lower_bound_s"] == raw["lower_bound_s"] and worker["raw"]["speedup_vs_worker_local"] > 0


def test_bench_serve_quick_compares_engine_and_baseline(pair, tmp_path):
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--quick", "--json", str(out), "--consumer", pair[1]]) == 0
    doc = json.loads(out.read_text())
    for name in ("engine", "baseline"):
        t = doc["targets"][name]
        assert t["rates"][0]["completed"] == t["rates"][0]["requests"] == 3
        assert t["concurrent"]["throughput_tokens_per_s"] > 0
        assert t["concurrent"]["ttft_s"]["p50"] is not None
    assert doc["batching_speedup_tokens_per_s"] > 0
