"""make-demo-pair --recipe context, shrunk: deterministic weights, and a task whose answers are
computed values (checked by an interpreter of the inserted statements written here, not by the
generator's own bookkeeping)."""

import random
import re

import pytest
import torch
from safetensors.torch import load_file

from scd_serve.config.pair import ContextPairConfig
from scd_serve.pair.bpe import single_token_words, train_bpe
from scd_serve.pair.context_corpus import load_splits
from scd_serve.pair.context_recipe import make_context_pair, tokenizer_texts
from scd_serve.pair.context_task import STYLES, block_document, make_examples, sample_doc
from scd_serve.quality.data import read_records

LITERAL = re.compile(r"^\s*([a-z]+) = (\d+)$")
ADDITION = re.compile(r"^\s*([a-z]+) = (\d+) \+ ([a-z]+)$")
COMMENTED = re.compile(r"^\s*([a-z]+) = (\d+) \+ \1  # (\d+)$")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("context")
    cfg = ContextPairConfig(seed=3).shrunk()
    for name in ("a", "b"):
        make_context_pair(cfg, root / name, probe_n=0, log=lambda _: None)
    return root


@pytest.fixture(scope="module")
def tokenizer_and_pool():
    splits = load_splits(0)
    tok = train_bpe(tokenizer_texts(splits, ContextPairConfig().shrunk()), 1024)
    return splits, tok, single_token_words(tok)


def interpret(prompt: str) -> dict[str, tuple[int, int]]:
    """name -> (value, additions since its literal) from the statements a prompt holds; a name
    used before its assignment, or assigned twice, fails the test."""
    env: dict[str, tuple[int, int]] = {}
    for line in prompt.splitlines():
        if m := LITERAL.match(line):
            assert m.group(1) not in env, f"{m.group(1)} assigned twice"
            env[m.group(1)] = (int(m.group(2)), 0)
        elif m := ADDITION.match(line):
            name, add, source = m.group(1), int(m.group(2)), m.group(3)
            assert source in env and name not in env, line
            env[name] = (env[source][0] + add, env[source][1] + 1)
    return env


def test_same_seed_same_tokenizer_and_weights_and_a_real_fine_tune(made):
    for side in ("producer", "consumer"):
        wa, wb = load_file(str(made / "a" / side / "model.safetensors")), load_file(str(made / "b" / side / "model.safetensors"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), side
        assert (made / "a" / side / "tokenizer.json").read_bytes() == (made / "b" / side / "tokenizer.json").read_bytes()
    prod = load_file(str(made / "a" / "producer" / "model.safetensors"))
    cons = load_file(str(made / "a" / "consumer" / "model.safetensors"))
    assert any(not torch.equal(prod[k], cons[k]) for k in prod)
    assert any(k.endswith("k_proj.bias") for k in prod)  # Qwen2: q/k/v biases
    for name in ("heldout.jsonl", "heldout-base.jsonl", "calibration.jsonl", "heldout-text.jsonl",
                 "calibration-text.jsonl"):
        assert (made / "a" / "eval" / name).read_text() == (made / "b" / "eval" / name).read_text()
        assert read_records(made / "a" / "eval" / name)  # the format eval/calibrate --data read


def test_answers_are_computed_through_chains_never_written(tokenizer_and_pool):
    splits, tok, pool = tokenizer_and_pool
    examples = make_examples(splits["heldout"], pool, tok, STYLES["expert"], 12, "test", lengths=(128, 512),
                             depths=(1, 3), num_chains=(2, 4))
    depths = set()
    for ex in examples:
        assert ex["prompt"].endswith("\n") and ex["prompt"].splitlines()[-1].startswith(">>> ")
        asked = ex["prompt"].splitlines()[-1].removeprefix(">>> ")
        value, depth = interpret(ex["prompt"])[asked]
        assert ex["answer"] == str(value) and 1 <= depth <= 3 and ex["id"].endswith(f"depth{depth}")
        assert not re.search(rf"\b{asked} = {value}\b", ex["prompt"])  # no line states the answer
        depths.add(depth)
        ids = tok(ex["prompt"])["input_ids"]
        assert 128 <= len(ids) <= 512
        # the answer's tokens alone are the tokens that follow the prompt (eval scores those)
        both = tok(ex["prompt"] + ex["answer"])["input_ids"]
        assert both == ids + tok(ex["answer"], add_special_tokens=False)["input_ids"]
    assert len(depths) > 1


def test_training_documents_ask_every_chain_in_the_producer_style(tokenizer_and_pool):
    splits, _, pool = tokenizer_and_pool
    rng = random.Random(0)
    doc = sample_doc(rng, splits["base"], pool, STYLES["base"], 300, [0, 2, 1], [2, 0, 1])
    env = interpret(doc.text)
    for (name, value, depth), (start, end) in zip(doc.asked, doc.answers):
        assert doc.text[:start].endswith(f"assert {name} == ") and doc.text[start:end] == str(value)
        assert env[name] == (value, depth)
    assert sorted(d for _, _, d in doc.asked) == [0, 1, 2]


def run_one_name(text: str) -> list[tuple[str, int, int]]:
    """Executes statements in order, a name reassigned as it goes (x = 41 ... x = 3 + x); ->
    (name, value, additions) at each question, each comment checked against the value there."""
    env: dict[str, tuple[int, int]] = {}
    asked = []
    for line in text.splitlines():
        if m := LITERAL.match(line):
            env[m.group(1)] = (int(m.group(2)), 0)
        elif (m := COMMENTED.match(line)) or (m := ADDITION.match(line)):
            name, add = m.group(1), int(m.group(2))
            source = m.group(3) if m.re is ADDITION else name
            assert source == name and name in env, line  # one name: it adds to its own latest value
            env[name] = (env[name][0] + add, env[name][1] + 1)
            if m.re is COMMENTED:
                assert int(m.group(3)) == env[name][0], line
        elif m := re.match(r"^(?:assert ([a-z]+) == |>>> ([a-z]+)$)", line):
            name = m.group(1) or m.group(2)
            asked.append((name, *env[name]))
    return asked


def test_blocks_ask_every_variable_and_score_the_values_comments_show(tokenizer_and_pool):
    splits, _, pool = tokenizer_and_pool
    for files in (splits["base"], None):
        doc = block_document(random.Random(1), files, pool, STYLES["base"], 1500, 2, comment_prob=1.0)
        questions = run_one_name(doc.text)
        assert len(questions) >= 3 and {d for _, _, d in questions} >= {1, 2}
        spans = [doc.text[a:b] for a, b in doc.answers]
        assert all(doc.text[:a].endswith(("== ", "# ")) for a, _ in doc.answers)
        shown = [v for (_, v, _), (a, _) in zip(doc.asked, doc.answers) if doc.text[:a].endswith("# ")]
        assert shown and len(shown) == sum(d for _, _, d in questions)  # every addition, with comment_prob 1
        assert [str(v) for _, v, _ in doc.asked] == spans
        asked_questions = [x for x, (a, _) in zip(doc.asked, doc.answers) if doc.text[:a].endswith("== ")]
        assert asked_questions == questions


def test_one_name_heldout_chains_are_computed_at_their_lines(tokenizer_and_pool):
    splits, tok, pool = tokenizer_and_pool
    examples = make_examples(splits["heldout"], pool, tok, STYLES["expert"], 8, "one", lengths=(128, 512),
                             depths=(1, 2), num_chains=(1, 1), one_name=True)
    for ex in examples:
        ((name, value, depth),) = run_one_name(ex["prompt"])
        assert ex["answer"] == str(value) and 1 <= depth <= 2 and ex["id"].endswith(f"depth{depth}")
        assert not re.search(rf"\b{name} = {value}\b", ex["prompt"])  # no line states the answer


def test_up_pair_context_picks_the_context_pair_unless_a_flag_says_otherwise():
    from scd_serve.cli import build_parser
    from scd_serve.cluster.up import resolve_pair

    args = build_parser("up").parse_args(["up", "--pair", "context", "--consumer", "elsewhere/consumer"])
    resolve_pair(args)
    assert (args.producer, args.consumer, args.codebook) == (
        "models/context-pair/producer", "elsewhere/consumer", "models/context-pair/codebook")
    args = build_parser("up").parse_args(["up"])
    resolve_pair(args)
    assert args.producer == "models/demo-pair/producer"


def test_text_recipe_scores_every_token_and_makes_a_rope_changed_fine_tune(tmp_path):
    """`--recipe text` (the plain language-model pair): the CLI path, shrunk; every token is
    scored, the producer is trained from scratch, the consumer differs and has its own rope_theta."""
    import json

    from scd_serve.cli import main

    cfg = ContextPairConfig.text()
    assert cfg.shallow_layers == 0 and cfg.producer.lm_frac == cfg.producer.lm_weight == 1.0
    assert main(["make-demo-pair", "--recipe", "text", "--shrunk", "--probe", "0", "--out", str(tmp_path)]) == 0
    p = json.loads((tmp_path / "producer" / "config.json").read_text())
    c = json.loads((tmp_path / "consumer" / "config.json").read_text())
    theta = [cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"] for cfg in (p, c)]
    assert theta == [1e4, 1e6]
    prod = load_file(str(tmp_path / "producer" / "model.safetensors"))
    cons = load_file(str(tmp_path / "consumer" / "model.safetensors"))
    assert any(not torch.equal(prod[k], cons[k]) for k in prod)
    assert read_records(tmp_path / "eval" / "heldout-text.jsonl")


def test_value_targets_sit_on_each_addition_lines_last_name_and_are_its_new_ones_digit(tokenizer_and_pool):
    """The training-only target of an addition line: its last token (the name) predicts the ones
    digit of the value the line computes, in place of the newline; nothing else moves."""
    from dataclasses import replace

    from scd_serve.pair.context_task import answer_token_mask
    from scd_serve.pair.context_train import VALUE_DEPTH, batches

    splits, tok, pool = tokenizer_and_pool
    docs = [block_document(random.Random(2), splits["base"], pool, STYLES["base"], 600, 2, comment_prob=0.5),
            sample_doc(random.Random(3), splits["base"], pool, STYLES["base"], 400, [2, 1], [0, 1], 0.5, True)]
    for doc in docs:
        ids, _, values = answer_token_mask(tok, doc)
        additions = [line for line in doc.text.splitlines() if ADDITION.match(line) or COMMENTED.match(line)]
        assert len(values) == len(additions) >= 2
        running = {}
        for line in doc.text.splitlines():  # the value each addition computes, in text order
            if m := LITERAL.match(line):
                running[m.group(1)] = int(m.group(2))
            elif (m := COMMENTED.match(line)) or (m := ADDITION.match(line)):
                running[m.group(1)] += int(m.group(2))
                t, value = next(iter(values.items()))
                values.pop(t)
                assert value == running[m.group(1)]
                assert tok.decode(ids[t]).strip() == m.group(1) and tok.decode(ids[t + 1]).startswith(("\n", " "))

    stage = replace(ContextPairConfig().producer, steps=1, batch_tokens=600, min_len=300, start_max_len=300,
                    max_len=300, comment_prob=0.0, copy_frac=0.0, value_weight=0.5)
    input_ids, labels, weights, depth = next(batches(stage, tok, splits["base"], pool, random.Random(4)))
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    moved = labels != input_ids
    assert moved.any() and (depth[moved] == VALUE_DEPTH).all() and (weights[moved] == 0.5).all()
    assert set(labels[moved].tolist()) <= digits and (depth == VALUE_DEPTH).sum() == moved.sum()
    plain = next(batches(replace(stage, value_weight=0.0), tok, splits["base"], pool, random.Random(4)))
    assert torch.equal(plain[0], plain[1])  # without value targets, labels are the text
