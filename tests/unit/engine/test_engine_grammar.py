"""Structured outputs in the engine: grammars compiled once per spec, the batched mask in the
sampler (rows with and without grammars in one step), preemption, and the edge cases."""

import asyncio
import json

import jsonschema
import pytest
import torch
from engine_helpers import cfg, collect, req
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from scd_serve.engine.engine import Engine
from scd_serve.engine.grammar import GrammarCompiler, GrammarSpec
from scd_serve.engine.sampler import Ended, sample
from scd_serve.engine.sequence import Sequence
from scd_serve.errors import InvalidRequest, StepFailed
from scd_serve.model import tiny
from scd_serve.testing.fake_runtime import FakeRuntime, byte_tokenizer

pytestmark = pytest.mark.timeout(120)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "kind": {"enum": ["cat", "dog"]},
                                           "legs": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "kind", "legs"]}


@pytest.fixture(scope="module")
def compiler():
    tok = byte_tokenizer()
    return GrammarCompiler(tok, len(tok), {tok.eos_token_id})


def spec(schema=SCHEMA):
    return GrammarSpec.json_schema(schema, "response_format.json_schema.schema")


def test_a_spec_compiles_once_and_is_then_served_from_the_cache(compiler):
    first = compiler.compile(spec())
    before, hits = compiler.num_compiled, compiler.num_hits
    again = compiler.compile(GrammarSpec.json_schema(json.dumps(SCHEMA), "guided_json"))  # as text, another field
    assert again is first and compiler.num_compiled == before and compiler.num_hits == hits + 1


@pytest.mark.parametrize("kind,text,says", [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "frobnicate"}}}), "frobnicate"),
    ("json_schema", json.dumps({"$ref": "#/$defs/missing"}), "missing"),
    ("regex", "(ab", "parenthesis"),
    ("ebnf", "root ::= missing_rule", "missing_rule"),
])
def test_an_invalid_spec_is_a_400_naming_the_field_and_the_problem(compiler, kind, text, says):
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(GrammarSpec(kind, text, field="the.field"))
    assert e.value.field == "the.field" and says in e.value.message and "[" not in e.value.message[:3]


def test_a_schema_that_is_not_json_is_a_400():
    with pytest.raises(InvalidRequest, match="not valid JSON") as e:
        GrammarSpec.json_schema("{not json", "guided_json")
    assert e.value.field == "guided_json"


def test_a_vocabulary_that_cannot_start_the_format_is_a_400_at_once():
    words = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="<unk>")
    with pytest.raises(InvalidRequest, match="vocabulary has no token"):
        GrammarCompiler(tok, 4, {1}).compile(GrammarSpec("json_object"))
    assert GrammarCompiler(tok, 4, {1}).compile(GrammarSpec("choice", '["hello"]')) is not None  # words are fine


TOK = byte_tokenizer()


def tid(ch: str) -> int:
    return TOK.encode(ch)[0]


def allowed(grammar, prefix: str):
    """A matcher of `grammar` that has taken the tokens of `prefix`."""
    m = grammar.matcher()
    for t in TOK.encode(prefix):
        assert m.accept_token(t)
    return m


def test_one_step_masks_the_guided_rows_and_leaves_the_others_alone(compiler):
    tok = byte_tokenizer()
    grammar = compiler.compile(GrammarSpec("choice", '["cat", "dog"]', "guided_choice"))
    seqs = [Sequence(req(f"r{i}", [65])) for i in range(4)]
    seqs[1].grammar, seqs[3].grammar = grammar.matcher(), allowed(grammar, "d")
    logits = torch.zeros(4, len(tok))
    logits[:, tid("z")] = 10.0  # every row's favourite is 'z', which no grammar allows
    out = sample(logits.clone(), seqs, {tok.eos_token_id}).rows
    assert out[0] == out[2] == tid("z")  # unconstrained rows: untouched
    assert out[1] in (tid("c"), tid("d")) and out[3] == tid("o")  # constrained: what each grammar allows next


def test_the_grammar_wins_over_min_tokens_and_a_complete_grammar_takes_the_end_token(compiler):
    tok = byte_tokenizer()
    eos = tok.eos_token_id
    grammar = compiler.compile(GrammarSpec("choice", '["ok"]', "guided_choice"))
    seq = Sequence(req("r", [65], min_tokens=5, max_tokens=8))
    seq.grammar = allowed(grammar, "ok")
    assert sample(torch.zeros(1, len(tok)), [seq], {eos}).rows == [eos]  # min_tokens would mask it: the grammar's end wins


def test_a_complete_grammar_without_any_end_token_ends_the_row_without_a_token():
    tok = tiny.byte_tokenizer()  # 256 bytes, no end token at all (the tiny test models')
    no_end = GrammarCompiler(tok, len(tok), set())
    grammar = no_end.compile(GrammarSpec("choice", '["ok"]', "guided_choice"))
    seq, other = Sequence(req("r", [65])), Sequence(req("o", [65]))
    seq.grammar = grammar.matcher()
    assert all(seq.grammar.accept_token(t) for t in tok.encode("ok"))
    out = sample(torch.zeros(2, len(tok)), [seq, other]).rows
    assert isinstance(out[0], Ended) and isinstance(out[1], int)


def test_a_token_the_grammar_refuses_fails_that_row_alone(compiler, monkeypatch):
    tok = byte_tokenizer()
    grammar = compiler.compile(GrammarSpec("choice", '["ok"]', "guided_choice"))
    seqs = [Sequence(req("g", [65])), Sequence(req("o", [65]))]
    seqs[0].grammar = grammar.matcher()
    monkeypatch.setattr("scd_serve.engine.grammar.TokenMask.reapply", lambda self, logits, rows: None)  # mask lost
    logits = torch.zeros(2, len(tok))
    logits[:, tid("z")] = 5.0
    out = sample(logits, seqs, {tok.eos_token_id}).rows
    assert isinstance(out[0], StepFailed) and "refused" in out[0].message and out[1] == tid("z")


@pytest.fixture
async def engine():
    eng = Engine(FakeRuntime(), cfg(max_model_len=256, num_blocks=128, json_whitespace=2))
    eng.start()
    yield eng
    await eng.stop(grace_s=1)


async def text_of(eng, r):
    events = [e async for e in eng.generate(r)]
    return "".join(e.text_delta for e in events), events[-1].finish_reason


async def test_a_batch_mixes_constrained_and_free_rows_and_each_gets_its_own(engine):
    grammar = await asyncio.to_thread(engine.grammars.compile, spec())
    tok = engine.tokenizer
    free = [req(f"free{i}", tok.encode(f"free {i}"), max_tokens=40) for i in range(4)]
    solo = [(await collect(engine, r))[0] for r in free]
    guided = [req(f"json{i}", tok.encode(f"json {i}"), max_tokens=200, temperature=1.0 if i % 2 else 0, seed=i)
              for i in range(4)]
    for r in guided:
        r.grammar = grammar
    again = [req(f"again{i}", r.prompt_token_ids, max_tokens=40) for i, r in enumerate(free)]
    outs = await asyncio.gather(*(collect(engine, r) for r in again), *(text_of(engine, r) for r in guided))
    assert [o[0] for o in outs[:4]] == solo  # the free rows: exactly what they made alone
    for text, finish in outs[4:]:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


async def test_preempted_constrained_sequences_recompute_and_stay_valid_and_exact():
    eng = Engine(FakeRuntime(), cfg(num_blocks=32, max_model_len=64, max_num_seqs=8))
    eng.start()
    try:
        choice = GrammarSpec("regex", r"[a-d]{30}", "guided_regex")
        grammar = await asyncio.to_thread(eng.grammars.compile, choice)
        tok = eng.tokenizer
        ps = [tok.encode("p%d " % i + "y" * 20) for i in range(8)]  # 8 x 55 tokens > 128 slots: preemption

        def make(i, p):
            r = req(f"r{i}", p, max_tokens=31)
            r.grammar = grammar
            return r

        solo = [await text_of(eng, make(i, p)) for i, p in enumerate(ps[:2])]
        outs = await asyncio.gather(*(text_of(eng, make(i, p)) for i, p in enumerate(ps)))
        assert eng.scheduler.block_manager.num_free == eng.scheduler.block_manager.num_blocks
        assert outs[:2] == solo  # greedy: the same text whether or not it was preempted
        assert all(len(t) == 30 and set(t) <= set("abcd") and f == "stop" for t, f in outs), outs
    finally:
        await eng.stop(1)


def test_length_bounded_strings_stay_json(compiler):
    """xgrammar lets a length-bounded string hold raw control characters; ours are patterns."""
    grammar = compiler.compile(GrammarSpec.json_schema({"type": "string", "minLength": 1, "maxLength": 3}, "x"))
    assert not allowed(grammar, '"').accept_token(tid("\x11"))
    m = allowed(grammar, '"abc')
    assert not m.fork().accept_token(tid("d")) and m.accept_token(tid('"'))


async def test_max_tokens_running_out_mid_json_ends_with_length(engine):
    grammar = await asyncio.to_thread(engine.grammars.compile, GrammarSpec("json_object"))
    r = req("short", engine.tokenizer.encode("x"), max_tokens=3)
    r.grammar = grammar
    text, finish = await text_of(engine, r)
    assert finish == "length" and text.startswith("{") and len(engine.tokenizer.encode(text)) <= 3
