"""`scd-serve calibrate --data FILE` through the CLI on a tiny pair made on the fly (each JSONL
shape and plain text), --dtype, and the up-front memory refusal before any model loads."""

import json
import re
from pathlib import Path

import pytest

from scd_serve.cli import main
from scd_serve.codec.codebook import Codebook
from scd_serve.model import ModelRuntime, loader
from scd_serve.model.tiny import save_tiny_model

WORDS = "the quick brown fox jumps over a lazy dog near one tall green tree".split()


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(n))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A qwen2 pair (q/k/v biases, byte tokenizer): the consumer has other weights and rope_theta."""
    root = tmp_path_factory.mktemp("cal")
    a = save_tiny_model(root / "producer", "qwen2", seed=0, rope_theta=1e4)
    b = save_tiny_model(root / "consumer", "qwen2", seed=1, rope_theta=1e6)
    data = root / "data"
    data.mkdir()
    shapes = {
        "text.jsonl": lambda i: {"text": sentence(i, 5)},
        "prompt.jsonl": lambda i: {"prompt": sentence(i, 4), **({"answer": sentence(i, 1)} if i % 2 else {})},
        "messages.jsonl": lambda i: {"messages": [{"role": "user", "content": sentence(i, 2)}]
                                     + ([{"role": "assistant", "content": sentence(i, 1)}] if i % 2 else [])},
    }
    for name, make in shapes.items():
        (data / name).write_text("\n".join(json.dumps(make(i)) for i in range(6)) + "\n")
    (data / "plain.txt").write_text("\n\n".join(sentence(i, 3) + "\n" + sentence(i + 1, 2) for i in range(6)))
    return a, b, data


def calibrate_args(a, b, data, out, *more):
    return ["calibrate", "--producer", str(a), "--consumer", str(b), "--data", str(data), "--kl-budget", "2",
            "--num-prompts", "4", "--probe-prompts", "1", "--max-rows", "64", "--aligner-steps", "0",
            "--max-patches", "1", "--max-tokens", "24", "--greedy-tokens", "4", "--distill-steps", "10",
            "--out", str(out), *more]


@pytest.mark.parametrize("name", ["text.jsonl", "prompt.jsonl", "messages.jsonl", "plain.txt"])
def test_calibrate_on_each_shape(pair, tmp_path, capsys, name):
    a, b, data = pair
    assert main(calibrate_args(a, b, data / name, tmp_path / "book")) == 0
    out = capsys.readouterr().out
    assert f"data: {data / name}: 6 prompts" in out and "truncated to their last 24 tokens" in out
    assert "fit on 4, probe on 1, report on 1 (1 documents held out" in out and "codebook:" in out
    assert re.search(r"rebuild: \d+\.\d\d of the consumer's own prefill, timed on the probe prompts .* the "
                     r"consumer computes \d+ of its 2 layers' K/V itself", out), out
    assert "asked for 4 + 1 + 24 (fit + probe + report)" in out
    book = Codebook.load(tmp_path / "book")
    assert book.manifest["calibration"]["fit_prompts"] == 4 and book.plan("scd").layers
    assert book.manifest["calibration"]["data"] == {"source": str(data / name), "dtype": "float32"}


def test_calibrate_in_bfloat16_then_eval(pair, tmp_path, capsys):
    a, b, data = pair
    assert main(calibrate_args(a, b, data / "prompt.jsonl", tmp_path / "book", "--dtype", "bfloat16")) == 0
    out = tmp_path / "eval.json"
    assert main(["eval", "--producer", str(a), "--consumer", str(b), "--data", str(data / "text.jsonl"),
                 "--codebook", str(tmp_path / "book"), "--method", "scd", "--dtype", "bfloat16",
                 "--max-tokens", "24", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["methods"][0]
    # two random models of other seeds under a budget of 2 nats: the priors alone may do (payload 0)
    book = Codebook.load(tmp_path / "book")
    width = book.plan("scd").code_width() / (2 * book.side_spec("consumer").kv_width * len(book.plan("scd").layers))
    assert row["method"] == "scd" and row["kl"] >= 0 and row["ratio_to_raw16"] == pytest.approx(width, abs=1e-6)


def test_calibrate_measures_the_run_layers_asked_for_then_eval(pair, tmp_path, capsys):
    a, b, data = pair
    # counted: at this toy shape a timed run costs more than the prefill, and is not measured
    assert main(calibrate_args(a, b, data / "prompt.jsonl", tmp_path / "book", "--run-layers", "1",
                               "--rebuild-cost", "counted")) == 0
    assert "runs measured (probe KL by first layer): 1: " in capsys.readouterr().out
    cal = Codebook.load(tmp_path / "book").manifest["calibration"]
    run, tail = cal["run"], cal["replay"]
    # the run was measured, and the run or none was kept as calibration's joint choice says (calibration/probes.py)
    assert set(run["kl"]) == {"1"} and run["layer"] == tail["run"] and tail["run"] in (1, None)
    assert {o["run"] for o in tail["options"]} == {None, 1}
    out = tmp_path / "eval.json"
    assert main(["eval", "--producer", str(a), "--consumer", str(b), "--data", str(data / "text.jsonl"),
                 "--codebook", str(tmp_path / "book"), "--method", "scd", "--max-tokens", "24",
                 "--json", str(out), "--prior-table", "on"]) == 0
    assert json.loads(out.read_text())["methods"][0]["kl"] >= 0
    # eval times the rebuild as a decode worker does, its token prior's vocabulary table made first
    assert Codebook.load(tmp_path / "book").manifest["prior"]["kind"] == "features"
    assert re.search(r"feature prior table \[\d+ x \d+ x \d+\] \(\d+ MiB\): (made in|read from)",
                     capsys.readouterr().out)
    assert main(calibrate_args(a, b, data / "prompt.jsonl", tmp_path / "book2", "--run-layers", "99")) == 2
    err = capsys.readouterr().err
    assert "run layers must be in 1.." in err and "got [99]" in err and "Traceback" not in err


@pytest.fixture
def no_load(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(ModelRuntime, "load", boom)
    monkeypatch.setattr(loader, "load", boom)


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    """Two one-layer models with Qwen2.5's vocabulary (151,936): a dense 3-tap prior needs a
    [455,811 x 455,811] float64 Gram matrix, 1.66 TB."""
    root = tmp_path_factory.mktemp("big")
    shape = dict(vocab_size=151936, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                 intermediate_size=32, num_hidden_layers=1, tie_word_embeddings=True)
    return [save_tiny_model(root / n, "qwen2", seed=i, tokenizer=False, **shape) for i, n in enumerate("ab")]


@pytest.mark.parametrize("memory", [[], ["--max-memory-gb", "64"]])
def test_vocab_sized_prior_is_refused_before_loading(big_vocab, tmp_path, capsys, no_load, memory):
    a, b = big_vocab
    rc = main(["calibrate", "--producer", str(a), "--consumer", str(b), "--kl-budget", "0.05",
               "--prior", "dense", "--prior-taps", "3", "--out", str(tmp_path / "book"), *memory])
    assert rc == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "[455,811 x 455,811] float64 Gram matrix of 1.66 TB" in err and "4.99 TB" in err
    assert "--prior features" in err and not (tmp_path / "book").exists()
    if memory:
        assert "the --max-memory-gb given (64.00 GB)" in err


def test_model_too_big_is_refused_before_loading(big_vocab, tmp_path, capsys, no_load):
    a, b = big_vocab
    args = ["calibrate", "--producer", str(a), "--consumer", str(b), "--kl-budget", "0.05", "--prior-taps", "0",
            "--out", str(tmp_path / "book"), "--max-memory-gb", "0.005", "--dtype", "bfloat16"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "for the models" in err and "producer weights (bfloat16) 4.87 MB" in err and "Gram" not in err


def test_bad_data_is_refused_before_loading(pair, tmp_path, capsys, no_load):
    a, b, _ = pair
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n\n{"prompt": "y", "extra": 1}\n')
    assert main(calibrate_args(a, b, bad, tmp_path / "book")) == 2
    assert "bad.jsonl:3: unknown key(s) ['extra']" in capsys.readouterr().err
    assert main(calibrate_args(a, b, tmp_path / "missing.jsonl", tmp_path / "book")) == 2
    assert "no such file, and not a built-in split" in capsys.readouterr().err


def test_a_file_of_the_builtin_prompts_gives_the_builtin_calibration_prompts(tmp_path, capsys):
    """The file path and the built-in path agree: same fit prompts, same probe and report (prompt, answer)."""
    from types import SimpleNamespace

    from scd_serve.quality.calibration_data import builtin_prompts, user_prompts
    from scd_serve.config.codec import CalibrateConfig
    from scd_serve.model.loader import load_tokenizer
    from scd_serve.corpus.qa import load_split
    from scd_serve.quality.data import read_records

    tok = load_tokenizer(Path(__file__).parents[3] / "models" / "demo-pair" / "consumer")
    f = tmp_path / "cal.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": e["prompt"], "answer": e["answer"]})
                           for e in load_split("calibration", 7)) + "\n")
    cfg = CalibrateConfig(kl_budget=0.05, num_prompts=4, num_probe_prompts=2, num_report_prompts=1)
    got = user_prompts(SimpleNamespace(tokenizer=tok), str(f), read_records(f), cfg, 4000, 16, show_progress=False)
    want = builtin_prompts(tok, "calibration", cfg)
    assert [p.tolist() for p in got.fit] == [p.tolist() for p in want.fit]
    # distillation reads the fit records' answers as the built-in data gives them
    same = lambda xs, ys: [(p.tolist(), a.tolist()) for p, a in xs] == [(p.tolist(), a.tolist()) for p, a in ys]
    assert same(got.fit_pairs, want.fit_pairs) and same(got.probe, want.probe) and same(got.report, want.report)
    assert "fit on 4, probe on 2, report on 1 (1 documents held out" in capsys.readouterr().out


def test_the_run_and_replay_choice_reads_the_probe_prompts_scored_as_long_as_the_report(tmp_path):
    """A replay mends the tokens nearest the prompt: the choice scores the probe prompts as far as
    the report does (REPORT_SCORED_TOKENS), the plan search as far as PROBE_SCORED_TOKENS."""
    from types import SimpleNamespace

    from scd_serve.config.codec import CalibrateConfig
    from scd_serve.model.loader import load_tokenizer
    from scd_serve.quality.calibration_data import PROBE_SCORED_TOKENS, user_prompts
    from scd_serve.quality.data import read_records

    tok = load_tokenizer(Path(__file__).parents[3] / "models" / "demo-pair" / "consumer")
    f = tmp_path / "texts.jsonl"
    f.write_text("".join(json.dumps({"text": f"doc {i}: " + "the quick brown fox " * 150, "source": f"d{i}"}) + "\n"
                         for i in range(8)))
    cfg = CalibrateConfig(kl_budget=0.05, num_prompts=4, num_probe_prompts=2, num_report_prompts=2)
    got = user_prompts(SimpleNamespace(tokenizer=tok), str(f), read_records(f), cfg, 4000, 16, show_progress=False)
    assert [p.tolist() for p, _ in got.choice] == [p.tolist() for p, _ in got.probe]
    assert all(len(s) == PROBE_SCORED_TOKENS < len(c) and c[:PROBE_SCORED_TOKENS].tolist() == s.tolist()
               for (_, s), (_, c) in zip(got.probe, got.choice))


def test_measure_records_held_out_figures_that_auto_reads(pair, tmp_path, capsys):
    from scd_serve.codec.codebook import TENSORS
    from scd_serve.codec.figures import QualityFigures

    a, b, data = pair
    assert main(calibrate_args(a, b, data / "prompt.jsonl", tmp_path / "book")) == 0
    before = json.loads((tmp_path / "book" / "manifest.json").read_text())
    tensors = (tmp_path / "book" / TENSORS).read_bytes()
    capsys.readouterr()
    measure = ["measure", "--producer", str(a), "--consumer", str(b), "--codebook", str(tmp_path / "book"),
               "--data", str(data / "text.jsonl"), "--max-tokens", "24", "--min-top1", "0.5"]
    assert main(measure) == 0  # without --write: printed only
    out = capsys.readouterr().out
    assert "6 prompts of" in out and "prior-only" in out
    assert json.loads((tmp_path / "book" / "manifest.json").read_text()) == before
    assert main(measure + ["--write"]) == 0
    book = Codebook.load(tmp_path / "book", ModelRuntime.load(a), ModelRuntime.load(b))  # checksum still holds
    cal = book.manifest["calibration"]
    assert (tmp_path / "book" / TENSORS).read_bytes() == tensors
    assert cal["report"] == {"prompts": 6, "positions": cal["report"]["positions"], "held_out": True,
                             "source": str(data / "text.jsonl")} and cal["report"]["positions"] >= 6
    assert cal["calibrated_methods"] == before["calibration"]["methods"] and cal["min_top1"] == 0.5
    scd = cal["methods"]["scd"]
    assert cal["meets_budget"] == (scd["kl"] <= 2 and scd["top1"] >= 0.5)
    # the figures printed are the ones recorded, and auto reads them
    printed = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("scd "))
    assert float(printed[1]) == pytest.approx(scd["kl"], abs=1e-4)
    auto = QualityFigures.load(str(tmp_path / "book"))
    assert auto.top1["scd"] == scd["top1"] and auto.min_top1 == 0.5
    assert main(measure[:-4] + ["--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
