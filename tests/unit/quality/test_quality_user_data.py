"""`scd-serve eval --data FILE` through the CLI on a tiny pair made on the fly: each JSONL shape
and plain text, truncation reported, bad input refused in one line before any model loads."""

import json
import re

import pytest

from scd_serve.cli import main
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model

WORDS = "the quick brown fox jumps over a lazy dog near one tall green tree".split()


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n))


def write_data(root):
    """Four files: one per JSONL shape (with and without answers) and plain text."""
    root.mkdir(parents=True, exist_ok=True)
    rows = {
        "text.jsonl": [{"text": sentence(i, 4 + i)} for i in range(6)],
        "prompt.jsonl": [{"prompt": sentence(i, 3 + i), **({"answer": sentence(i + 1, 1)} if i % 2 else {})}
                         for i in range(6)],
        "messages.jsonl": [{"messages": [{"role": "user", "content": sentence(i, 2 + i)}]
                            + ([{"role": "assistant", "content": sentence(i, 1)}] if i % 2 else [])}
                           for i in range(6)],
    }
    for name, lines in rows.items():
        (root / name).write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    (root / "plain.txt").write_text("\n\n".join(sentence(i, 3 + i) + "\n" + sentence(i + 2, 2) for i in range(6)))
    return root


def make_pair(root):
    """A qwen2 pair (q/k/v biases, byte tokenizer); the consumer uses another rope_theta."""
    a = save_tiny_model(root / "producer", "qwen2", seed=0, rope_theta=1e4)
    b = save_tiny_model(root / "consumer", "qwen2", seed=0, rope_theta=1e6)
    return a, b


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("ud")
    producer, consumer = make_pair(root)
    return producer, consumer, write_data(root / "data")


def eval_args(pair, data, *more):
    producer, consumer, _ = pair
    return ["eval", "--producer", str(producer), "--consumer", str(consumer), "--data", str(data), *more]


@pytest.mark.parametrize("name, answers", [("text.jsonl", 0), ("prompt.jsonl", 3), ("messages.jsonl", 3),
                                           ("plain.txt", 0)])
def test_eval_on_each_shape(pair, tmp_path, capsys, name, answers):
    out = tmp_path / "eval.json"
    rc = main(eval_args(pair, pair[2] / name, "--method", "raw", "--max-tokens", "24", "--greedy-tokens", "4",
                        "--json", str(out)))
    assert rc == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    row = doc["methods"][0]
    assert row["method"] == "raw" and row["num_examples"] == 6 and row["num_answers"] == answers
    assert f"{row['num_truncated']} truncated to their last 24 tokens" in printed
    assert 0 <= row["top1"] <= 1 and 0 <= row["match"] <= 1 and row["kl"] >= 0 and 0 <= row["tv"] <= 1
    assert (row["f1"] is None) == (answers == 0) and (row["em"] is None) == (answers == 0)
    # perplexity needs given references: texts' second halves or answers
    assert (row["ppl"] is None) == (answers == 0 and name.startswith(("prompt", "messages")))
    assert row["payload_bytes_per_token"] == row["raw_kv_bytes_per_token"] and row["greedy_tokens"] == 4


def test_truncation_is_counted_never_refused(pair, tmp_path, capsys):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 200, "answer": "yz"}) + "\n" + json.dumps({"prompt": "ab"}) + "\n")
    out = tmp_path / "eval.json"
    assert main(eval_args(pair, long, "--method", "oracle", "--max-tokens", "16", "--json", str(out))) == 0
    row = json.loads(out.read_text())["methods"][0]
    assert row["num_truncated"] == 1 and row["num_examples"] == 2
    assert "1 truncated to their last 16 tokens" in capsys.readouterr().out


def test_table_shows_the_data_columns(pair, capsys):
    rc = main(eval_args(pair, pair[2] / "prompt.jsonl", "--table", "--max-tokens", "24", "--greedy-tokens", "3",
                        "--dtype", "bfloat16"))
    assert rc == 0
    table = capsys.readouterr().out.split("method ")[-1]
    assert "top1" in table and "match" in table and "agree" not in table
    assert "scd  " in table and "skipped: needs --codebook" in table
    oracle = next(line for line in table.splitlines() if line.startswith("oracle"))
    assert oracle.split()[-2:] == ["1.000", "1.000"]  # top1 and match of the oracle against itself


@pytest.fixture
def no_load(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(ModelRuntime, "load", boom)


@pytest.mark.parametrize("content, match", [
    (None, "no such file"),
    ('{"text": "ok"}\n{"text": "broken"\n', r"bad\.jsonl:2: not valid JSON"),
    ("", "no records"),
    ('{"prompt": "p", "answers": ["a"]}\n', r"bad\.jsonl:1: unknown key\(s\) \['answers'\]"),
])
def test_bad_input_is_one_line_and_exit_2(pair, tmp_path, capsys, no_load, content, match):
    f = tmp_path / "bad.jsonl"
    if content is not None:
        f.write_text(content)
    assert main(eval_args(pair, f)) == 2
    err = capsys.readouterr().err
    assert err.startswith("scd-serve eval: error: --data ") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and re.search(match, err)


def test_models_too_big_are_refused_before_loading(pair, capsys, no_load):
    assert main(eval_args(pair, pair[2] / "text.jsonl", "--max-memory-gb", "0.0001")) == 2
    err = capsys.readouterr().err
    assert "for the models" in err and "consumer weights (float32)" in err and "--dtype" in err


@pytest.mark.parametrize("flags, match", [
    (["--device", "tpu"], "bad device 'tpu'"),
    (["--max-memory-gb", "-1"], "--max-memory-gb must be > 0"),
    (["--max-tokens", "2"], "--max-tokens must be >= 4"),
    (["--greedy-tokens", "0"], "--greedy-tokens must be >= 1"),
    (["--max-tokens", "600"], "exceed the models' context of 512"),
])
def test_bad_flags_are_one_line_and_exit_2(pair, capsys, flags, match):
    assert main(eval_args(pair, pair[2] / "text.jsonl", *flags)) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1
