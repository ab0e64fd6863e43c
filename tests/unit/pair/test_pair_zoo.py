"""`scd-serve make-pair-zoo --shrunk`: the same code path as the real zoo on tiny models. Each
pair's consumer starts from its producer and moves along its axis (a new rotary base, a merged
LoRA adapter, an instruction format); calibration and held-out texts never share a document."""

import json

import pytest
import torch

from scd_serve.cli import main
from scd_serve.config.zoo import ZooConfig
from scd_serve.errors import ConfigError
from scd_serve.pair import zoo_corpus

PAIRS = ["llama-lora-code", "qwen-rope", "qwen-instruct"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo")
    assert main(["make-pair-zoo", "--out", str(out), "--shrunk", "--only", *PAIRS]) == 0
    return out


def weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_every_pair_is_a_producer_and_its_fine_tuned_consumer(zoo):
    for name in PAIRS:
        pair = zoo / name
        info = json.loads((pair / "pair.json").read_text())
        assert (pair / "producer" / "zoo.json").exists() and (pair / "consumer" / "zoo.json").exists()
        a, b = weights(pair / "producer"), weights(pair / "consumer")
        assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
        assert info["raw_reuse"]["kl"] >= 0 and 0 <= info["raw_reuse"]["top1"] <= 1
    rope = json.loads((zoo / "qwen-rope" / "consumer" / "config.json").read_text())
    base = json.loads((zoo / "qwen-rope" / "producer" / "config.json").read_text())
    theta = lambda c: c.get("rope_parameters", {}).get("rope_theta", c.get("rope_theta"))  # noqa: E731
    assert theta(rope) == 1e6 and theta(base) == 1e4
    report = (zoo / "report.md").read_text()
    assert all(f"| {name} |" in report for name in PAIRS)
    kls = [p["raw_reuse"]["kl"] for p in json.loads((zoo / "report.json").read_text())["pairs"]]
    assert kls == sorted(kls)  # easiest to hardest


def test_a_lora_pair_is_its_producer_with_the_saved_adapter_merged(zoo):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    pair = zoo / "llama-lora-code"
    assert json.loads((pair / "adapter" / "adapter_config.json").read_text())["r"] == 16
    base = AutoModelForCausalLM.from_pretrained(str(pair / "producer"), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(pair / "adapter")).merge_and_unload().state_dict()
    saved = weights(pair / "consumer")
    for name, t in saved.items():
        assert torch.allclose(merged[name], t, atol=1e-6), name


def test_eval_texts_come_from_other_documents_than_calibration(zoo):
    def docs(pair, split):
        rows = [json.loads(line) for line in (zoo / pair / "eval" / f"{split}.jsonl").read_text().splitlines()]
        return rows, {r["source"] for r in rows}

    cal, cal_docs = docs("llama-lora-code", "calibration")
    held, held_docs = docs("llama-lora-code", "heldout")
    assert len(cal) == 4 and len(held) == 2 and all(set(r) == {"id", "source", "text"} for r in cal)
    assert not cal_docs & held_docs
    qa, _ = docs("qwen-instruct", "heldout")
    assert all(r["prompt"].startswith("### Instruction:") and r["answer"] for r in qa)


def test_a_finished_model_is_kept_when_the_zoo_is_made_again(zoo):
    before = (zoo / "qwen-rope" / "consumer" / "zoo.json").stat().st_mtime_ns
    assert main(["make-pair-zoo", "--out", str(zoo), "--shrunk", "--only", "qwen-rope"]) == 0
    assert (zoo / "qwen-rope" / "consumer" / "zoo.json").stat().st_mtime_ns == before


def test_domains_are_dealt_by_unit_and_units_never_split():
    sizes = {f"u{i}": 10 + i for i in range(40)}
    where = zoo_corpus.deal(sizes, seed=0)
    share = {s: sum(sizes[u] for u in sizes if where[u] == s) / sum(sizes.values()) for s in zoo_corpus.SHARES}
    assert all(abs(share[s] - want) < 0.05 for s, want in zoo_corpus.SHARES.items())
    cfg = ZooConfig().shrunk()
    for domain in ("stdlib", "code", "docs"):
        splits = zoo_corpus.splits(domain, 0, cfg.package_chars)
        units = {s: {d.unit for d in docs} for s, docs in splits.items()}
        assert all(units[s] for s in units), domain
        assert not units["train"] & units["heldout"] and not units["calibration"] & units["heldout"]


def test_bad_zoo_settings_are_refused():
    with pytest.raises(ConfigError, match="no zoo pair named 'nope'"):
        ZooConfig().pair("nope")
    assert main(["make-pair-zoo", "--out", "/tmp/x", "--only", "nope", "--shrunk"]) == 2


def test_a_training_killed_midway_resumes_to_the_uninterrupted_result(tmp_path):
    import random

    from transformers import LlamaConfig, LlamaForCausalLM

    from scd_serve.pair.zoo_train import lm_batches, train

    stream = torch.arange(400) % 50

    def fresh():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2))

    def batches():
        return lm_batches(stream, 16, 64, 6, random.Random(3))

    def killed_after(n, it):
        for step, batch in enumerate(it):
            if step == n:
                raise KeyboardInterrupt  # the process dies between steps
            yield batch

    whole = fresh()
    train(whole, batches(), 6, 1e-2, 1, "whole", log=lambda _: None)
    ckpt = tmp_path / "c.pt"
    with pytest.raises(KeyboardInterrupt):
        train(fresh(), killed_after(4, batches()), 6, 1e-2, 1, "killed", log=lambda _: None,
              checkpoint=ckpt, checkpoint_seconds=0)
    assert ckpt.exists()
    lines: list[str] = []
    resumed = fresh()
    info = train(resumed, batches(), 6, 1e-2, 1, "resumed", log=lines.append, checkpoint=ckpt, checkpoint_seconds=0)
    assert any("resumed at step 4/6" in line for line in lines)
    assert not ckpt.exists() and info["steps"] == 6
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
