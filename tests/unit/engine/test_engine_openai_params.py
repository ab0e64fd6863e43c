"""The OpenAI / vLLM sampling parameters in the engine: penalties, logit_bias, min_tokens, min_p,
stop_token_ids and stop_reason, log-probabilities (output and prompt), generation_config.json."""

import json

import pytest
import torch
from engine_helpers import collect, probabilities, req, shape_logits, wait_clean

from scd_serve.engine.generation_config import GenerationDefaults
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.engine.sampler import sample
from scd_serve.engine.sequence import Sequence
from scd_serve.errors import InvalidRequest

pytestmark = pytest.mark.timeout(30)


def seq_with(prompt, output, **params):
    s = Sequence(GenerationRequest("r", list(prompt), SamplingParams(**params)))
    for t in output:
        s.append_token(t)
    return s


def test_presence_and_frequency_penalties_count_only_the_output():
    row = torch.zeros(6)
    shape_logits(row, seq_with([1, 1, 1], [2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25), ())
    # token 1 is only in the prompt: untouched; 2 twice: 0.5 + 2 * 0.25; 3 once: 0.5 + 0.25
    assert row.tolist() == [0.0, 0.0, -1.0, -0.75, 0.0, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    row = torch.tensor([2.0, 2.0, -2.0, 2.0])
    shape_logits(row, seq_with([0], [2], repetition_penalty=2.0), ())
    assert row.tolist() == [1.0, 2.0, -4.0, 2.0]


def test_logit_bias_and_min_tokens_mask():
    row = torch.zeros(5)
    shape_logits(row, seq_with([0], [], logit_bias=((3, 100.0), (1, -100.0)), min_tokens=2,
                               stop_token_ids=(4,), max_tokens=4), eos_token_ids={2})
    assert row.tolist() == [0.0, -100.0, float("-inf"), 100.0, float("-inf")]
    row = torch.zeros(5)
    shape_logits(row, seq_with([0], [1, 1], min_tokens=2, max_tokens=4), eos_token_ids={2})
    assert row[2] == 0  # min_tokens reached: the end tokens are allowed again


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.5))  # keeps p >= 0.25
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0], dtype=p.dtype), atol=1e-6)


def test_logprobs_are_the_raw_distribution_even_when_bias_picks_the_token():
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0]])
    s = Sequence(GenerationRequest("r", [1], SamplingParams(temperature=0, logprobs=2, logit_bias=((3, 100.0),))))
    out = sample(logits, [s])
    assert out.rows == [3] and set(out.logprobs) == {0}  # the bias forced token 3
    raw, lp = torch.log_softmax(logits[0], -1), out.logprobs[0]
    assert lp.logprob == pytest.approx(float(raw[3]))
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx(raw[[1, 2]].tolist())


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                                 dict(repetition_penalty=0), dict(logit_bias=((1, 101.0),)), dict(min_tokens=9),
                                 dict(logprobs=21), dict(prompt_logprobs=-1), dict(stop_token_ids=(-1,))])
def test_out_of_range_values_name_their_field(bad):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(max_tokens=8, **bad)
    field = next(iter(bad))
    assert e.value.field == field


async def test_min_tokens_holds_past_a_likely_eos():
    from scd_serve.engine.engine import Engine
    from scd_serve.testing.fake_runtime import FakeRuntime
    from engine_helpers import cfg

    rt = FakeRuntime(eos_bias=50.0)  # <eos> wins every greedy step
    eng = Engine(rt, cfg())
    eng.start()
    try:
        tokens, _ = await collect(eng, req("a", b"hi", max_tokens=8))
        assert tokens == [256]
        tokens, events = await collect(eng, req("b", b"hi", max_tokens=8, min_tokens=5))
        assert len(tokens) == 6 and 256 not in tokens[:5] and tokens[5] == 256
        assert events[-1].finish_reason == "stop" and events[-1].stop_reason is None
    finally:
        await eng.stop(grace_s=1)


async def test_stop_token_ids_and_stop_strings_report_their_stop_reason(engine):
    greedy = engine.runtime.greedy(list(b"abc"), 8)
    i = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])  # its first appearance ends it
    tokens, events = await collect(engine, req("a", b"abc", max_tokens=8, stop_token_ids=(greedy[i],)))
    assert tokens == greedy[:i + 1] and events[-1].stop_reason == greedy[i]
    text = engine.tokenizer.decode(greedy)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    _, events = await collect(engine, req("b", b"abc", max_tokens=8, stop=(stop,)))
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == stop
    await wait_clean(engine)


async def test_prompt_logprobs_equal_the_models_own_forward_pass(engine):
    rt = engine.runtime
    prompt = list(b"the quick brown fox jumps")  # longer than one prefill chunk (16)
    _, events = await collect(engine, req("p", prompt, max_tokens=1, prompt_logprobs=2, logprobs=1))
    got = events[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        want = torch.log_softmax(rt.logits(rt.kv(prompt[:i - 1]), prompt[i - 1]), -1)
        assert got[i].logprob == pytest.approx(float(want[prompt[i]]), abs=1e-5)  # float32, 8-wide toy
        assert [t for t, _ in got[i].top] == torch.topk(want, 2).indices.tolist()
    assert events[0].logprob is not None and len(events[0].logprob.top) == 1
    await wait_clean(engine)


async def test_prompt_logprobs_skip_the_kv_fill(engine):
    called = []

    async def fill(r, sink):
        called.append(r.request_id)

    prompt = list(b"filled or not")
    tokens, events = await collect(engine, req("f", prompt, max_tokens=2, prompt_logprobs=0), kv_fill=fill)
    assert called == [] and len(events[0].prompt_logprobs) == len(prompt)
    assert tokens == engine.runtime.greedy(prompt, 2)
    await wait_clean(engine)


def test_generation_config_eos_list_and_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [7, 9], "temperature": 0.6, "top_p": 0.9, "do_sample": True, "top_k": True}))
    d = GenerationDefaults.load(tmp_path)
    assert d.eos_token_ids == {7, 9} and d.sampling == {"temperature": 0.6, "top_p": 0.9}
    assert GenerationDefaults.from_dict({"eos_token_id": 2}).eos_token_ids == {2}
    assert GenerationDefaults.load(tmp_path / "missing") == GenerationDefaults()


async def test_engine_stops_at_a_generation_config_eos(tmp_path):
    from engine_helpers import cfg

    from scd_serve.engine.engine import Engine
    from scd_serve.testing.fake_runtime import FakeRuntime

    class Special:  # the toy tokenizer, holding greedy[1] as a special token (as <|eot_id|> is)
        def __init__(self, tok, ids):
            self.tok, self.all_special_ids = tok, [tok.eos_token_id, *ids]

        def __getattr__(self, name):
            return getattr(self.tok, name)

    rt = FakeRuntime()
    greedy = rt.greedy(list(b"xyz"), 6)
    rt.path = tmp_path
    # greedy[3] is an ordinary byte token: listed, but not used to stop (a transformers default)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy[1], greedy[3]]}))
    plain = Engine(rt, cfg())
    assert plain.eos_token_ids == {rt.tokenizer.eos_token_id}
    rt.tokenizer = Special(rt.tokenizer, [greedy[1]])
    eng = Engine(rt, cfg())
    eng.start()
    try:
        tokens, events = await collect(eng, req("g", b"xyz", max_tokens=6))
        assert tokens == greedy[:2] and events[-1].finish_reason == "stop"
    finally:
        await eng.stop(grace_s=1)


async def test_a_server_seed_makes_a_fresh_engine_answer_unseeded_requests_alike():
    from engine_helpers import cfg

    from scd_serve.engine.engine import Engine
    from scd_serve.testing.fake_runtime import FakeRuntime

    async def fresh_run(seed):
        eng = Engine(FakeRuntime(), cfg(seed=seed))
        eng.start()
        try:
            return [(await collect(eng, req(f"r{i}", [1, 2, 3], temperature=1.0, max_tokens=12)))[0] for i in range(3)]
        finally:
            await eng.stop(1)

    first, again, other = await fresh_run(7), await fresh_run(7), await fresh_run(8)
    assert first == again and first != other
    assert len({tuple(t) for t in first}) > 1  # the requests draw different seeds from the stream
