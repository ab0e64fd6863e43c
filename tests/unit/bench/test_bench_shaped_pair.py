"""`scd-serve make-shaped-pair` on a shrunken Qwen2.5-0.5B config: exact shapes, a consumer that
differs with another rope_theta, both loadable by ModelRuntime, text files for --data (seconds)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from scd_serve.planner.shapes import CONFIG_DIR, load_shape
from scd_serve.cli import main
from scd_serve.model import ModelRuntime
from scd_serve.model.weights import expected_shapes

# the shipped config with its widths cut; what varies is only size, so the code path is the real one
SHRINK = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=1000, max_window_layers=2)


def test_shipped_config_is_qwen2_5_0_5b():
    s = load_shape("qwen2.5-0.5b")
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (24, 896, 14, 2, 64)
    assert (s.intermediate_size, s.vocab_size, s.tie_word_embeddings) == (4864, 151936, True)
    cfg = json.loads((CONFIG_DIR / "qwen2.5-0.5b.json").read_text())
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 1e6 and cfg["max_position_embeddings"] == 32768


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("shaped")
    cfg = json.loads((CONFIG_DIR / "qwen2.5-0.5b.json").read_text()) | SHRINK | {"head_dim": 16}
    (root / "tiny.json").write_text(json.dumps(cfg))
    rc = main(["make-shaped-pair", "--config", str(root / "tiny.json"), "--out", str(root / "pair"),
               "--rope-theta-consumer", "10000", "--vocab-tokens", "400", "--tokenizer-chars", "100000",
               "--records", "3", "--record-chars", "2000"])
    assert rc == 0
    return root / "pair", cfg


def test_pair_has_the_config_shapes_in_bfloat16(pair):
    out, cfg = pair
    rt = {side: ModelRuntime.load(out / side) for side in ("producer", "consumer")}
    for side in ("producer", "consumer"):
        spec = rt[side].spec
        assert (spec.family, spec.num_layers, spec.hidden_size, spec.intermediate_size) == ("qwen2", 2, 64, 96)
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (4, 2, 16, 1000)
        assert spec.attention_bias and spec.tie_word_embeddings and spec.rms_norm_eps == 1e-6
        assert spec.max_position_embeddings == 32768 and spec.sliding_window is None
        with safe_open(str(out / side / "model.safetensors"), framework="pt") as f:
            stored = {name: f.get_slice(name) for name in f.keys()}
            assert {n: tuple(s.get_shape()) for n, s in stored.items()} == expected_shapes(spec)
            assert {s.get_dtype() for s in stored.values()} == {"BF16"}
    assert rt["producer"].spec.rope_theta == 1e6 and rt["consumer"].spec.rope_theta == 1e4


def test_consumer_is_a_small_perturbation_of_the_producer(pair):
    out, _ = pair
    a, b = (ModelRuntime.load(out / side) for side in ("producer", "consumer"))
    assert a.fingerprint != b.fingerprint
    for wa, wb in ((a.weights.embed, b.weights.embed), (a.weights.layers[1].wkv, b.weights.layers[1].wkv),
                   (a.weights.layers[0].bkv, b.weights.layers[0].bkv)):
        rel = float((wb - wa).norm() / wa.norm())
        assert 0.01 < rel < 0.2  # --perturb 0.05 of each tensor's RMS: moved, not replaced
    ids = a.tokenizer("def f(x):\n    return x\n", return_tensors="pt").input_ids[0]
    assert int(ids.max()) < 400 and a.tokenizer.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x\n"
    la, lb = a.prefill(ids, capture=False).logits, b.prefill(ids, capture=False).logits
    assert la.shape == (len(ids), 1000) and not torch.allclose(la, lb)


def test_text_files_feed_data_and_report_says_random(pair):
    out, _ = pair
    for name in ("calibration", "heldout"):
        lines = (out / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == 3 and all(len(json.loads(line)["text"]) >= 1000 for line in lines)
    report = json.loads((out / "report.json").read_text())
    assert "random weights" in report["note"] and report["rope_theta"] == {"producer": 1e6, "consumer": 1e4}
    assert 2 * report["params"] < report["weight_bytes"]["consumer"] < 2.5 * report["params"]  # bfloat16


def test_qa_records_end_with_a_short_answer(pair):
    out, _ = pair
    texts = [json.loads(line)["text"] for line in (out / "calibration.jsonl").read_text().splitlines()]
    qa = [json.loads(line) for line in (out / "calibration-qa.jsonl").read_text().splitlines()]
    for text, rec in zip(texts, qa, strict=True):
        assert 0 < len(rec["answer"]) <= 48 and rec["answer"].strip()
        assert text.startswith(rec["prompt"] + rec["answer"])


def test_a_config_the_runtime_cannot_load_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert main(["make-shaped-pair", "--config", str(tmp_path / "gpt2.json"), "--out", str(tmp_path / "o")]) == 2
    assert "model_type 'gpt2'" in capsys.readouterr().err and not (tmp_path / "o").exists()
