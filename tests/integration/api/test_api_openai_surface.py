"""The OpenAI surface vLLM users rely on, through the official openai client, unmodified, against a
real uvicorn server on the real engine (tiny random llama, float32, CPU).

Log-probabilities are compared with the model's own forward pass (`ModelRuntime.prefill`, one
full-sequence forward) rather than the engine's paged path they came from: the two differ only
by float32 rounding, measured below 1e-5 here; LOGPROB_TOL = 1e-4 leaves room for other CPUs.
"""

import httpx
import openai
import pytest
import torch
from api_server import ServerThread, engine_app, stop_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
KEY = "sk-integration-key"
LOGPROB_TOL = 1e-4
IDS = {"return_tokens_as_token_ids": True}  # vLLM's extension: logprob tokens as "token_id:<id>"


@pytest.fixture(scope="module")
def server(tiny_runtime):
    app, engine = engine_app(tiny_runtime, api_kw={"api_key": KEY, "served_model_names": ("tiny-llama", "tiny")})
    with ServerThread(app) as srv:
        srv.engine = engine
        yield srv
    stop_engine(engine)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def forward_logprobs(rt, ids):
    """log-softmax of the model's own forward pass: row i predicts token i + 1. [T, vocab]"""
    return torch.log_softmax(rt.prefill(ids, capture=False).logits.float(), dim=-1)


def token_id(s):
    return int(s.removeprefix("token_id:"))


def greedy(rt, ids, n):
    return rt.generate_greedy(ids, n)


def test_n_2_gives_two_seeded_choices(client):
    r = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=6, temperature=1.0, n=2,
                                  seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12
    again = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=6, temperature=1.0, n=2,
                                      seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seed + index per choice
    assert r.choices[0].text != r.choices[1].text


def test_best_of_returns_the_n_most_likely(client):
    r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=1.0, n=1, best_of=3,
                                  seed=3, logprobs=0)
    assert len(r.choices) == 1 and r.model == "tiny"  # the name asked for, one of the served names
    singles = [client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=1.0, seed=3 + j,
                                         logprobs=0).choices[0] for j in range(3)]
    best = max(singles, key=lambda c: sum(c.logprobs.token_logprobs))
    assert r.choices[0].text == best.text


def test_completion_logprobs_2_match_the_forward_pass(client, tiny_runtime):
    rt = tiny_runtime
    ids = rt.tokenizer.encode("The capital of France is")
    r = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=6, temperature=0, logprobs=2,
                                  extra_body=IDS)
    lp = r.choices[0].logprobs
    out = [token_id(t) for t in lp.tokens]
    assert out == greedy(rt, ids, 6)
    ref = forward_logprobs(rt, ids + out)
    for i, (t, top) in enumerate(zip(out, lp.top_logprobs)):
        row = ref[len(ids) - 1 + i]
        assert len(top) == 2  # the 2 best; greedy's choice is the first of them
        assert sorted(map(token_id, top)) == sorted(torch.topk(row, 2).indices.tolist())
        assert lp.token_logprobs[i] == pytest.approx(float(row[t]), abs=LOGPROB_TOL)
        for k, v in top.items():
            assert v == pytest.approx(float(row[token_id(k)]), abs=LOGPROB_TOL)


def test_chat_top_logprobs_3_match_the_forward_pass(client, tiny_runtime):
    rt = tiny_runtime
    ids = rt.tokenizer.encode("<|user|>\nSay hi\n<|assistant|>\n", add_special_tokens=False)
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, extra_body=IDS)
    content = r.choices[0].logprobs.content
    out = [token_id(c.token) for c in content]
    assert out == greedy(rt, ids, 5)
    ref = forward_logprobs(rt, ids + out)
    for i, c in enumerate(content):
        row = ref[len(ids) - 1 + i]
        assert len(c.top_logprobs) == 3
        assert [token_id(a.token) for a in c.top_logprobs] == torch.topk(row, 3).indices.tolist()
        assert c.logprob == pytest.approx(float(row[out[i]]), abs=LOGPROB_TOL)
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(torch.topk(row, 3).values.tolist(),
                                                                     abs=LOGPROB_TOL)


def test_echo_returns_the_prompt_and_loglikelihood_equals_the_forward_pass(client, tiny_runtime):
    rt = tiny_runtime
    prompt = "Paris is the capital of France"
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3, temperature=0, echo=True)
    ids = rt.tokenizer.encode(prompt)
    assert r.choices[0].text == prompt + rt.tokenizer.decode(greedy(rt, ids, 3))
    # an evaluation harness's log-likelihood request: echo, logprobs 1, max_tokens 0
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=0, temperature=0, echo=True,
                                  logprobs=1)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == len(ids)
    ref = forward_logprobs(rt, ids)
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=LOGPROB_TOL)
    assert all(1 <= len(top) <= 2 for top in c.logprobs.top_logprobs[1:])  # the best, and the prompt's token


def test_logit_bias_plus_100_forces_a_token(client, tiny_runtime):
    z = tiny_runtime.tokenizer.encode("Z", add_special_tokens=False)[0]
    r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=5, temperature=0,
                                  logit_bias={str(z): 100})
    assert r.choices[0].text == "ZZZZZ"
    r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=5, temperature=1.0, seed=1,
                                  logit_bias={str(z): 100})
    assert r.choices[0].text == "ZZZZZ"


def test_penalties_change_the_output_only_after_a_repeat(client, tiny_runtime):
    rt = tiny_runtime
    prompt = "request 4: abcabcabcabc"
    ids = rt.tokenizer.encode(prompt)
    plain = greedy(rt, ids, 12)
    first_repeat = next(i for i in range(1, 12) if plain[i] in plain[:i])  # the tiny model loops soon
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        r = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=12, temperature=0, logprobs=0,
                                      extra_body=IDS, **extra)
        out = [token_id(t) for t in r.choices[0].logprobs.tokens]
        # before the first repeat the penalty only lowers tokens greedy does not pick: same tokens
        assert out[:first_repeat] == plain[:first_repeat], extra
        assert out != plain, extra
        assert len(set(out)) > len(set(plain)), extra  # fewer repeats
    r = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=12, temperature=0, logprobs=0,
                                  extra_body=IDS | {"repetition_penalty": 1.0})
    assert [token_id(t) for t in r.choices[0].logprobs.tokens] == plain  # 1 = off
    r = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=12, temperature=0, logprobs=0,
                                  extra_body=IDS | {"repetition_penalty": 5.0})
    assert [token_id(t) for t in r.choices[0].logprobs.tokens] != plain


def test_a_list_of_two_prompts_gives_two_choices(client, tiny_runtime):
    rt = tiny_runtime
    prompts = ["first prompt", "the second one"]
    r = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, prompts):
        assert c.text == rt.tokenizer.decode(greedy(rt, rt.tokenizer.encode(p), 4))
    assert r.usage.prompt_tokens == sum(len(rt.tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 8


def test_min_tokens_holds_past_a_stop_token(client, tiny_runtime):
    rt = tiny_runtime
    ids = rt.tokenizer.encode("stop early")
    stop = greedy(rt, ids, 1)[0]
    r = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [stop]})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    r = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=8, temperature=0, logprobs=0,
                                  extra_body=IDS | {"stop_token_ids": [stop], "min_tokens": 4})
    out = [token_id(t) for t in r.choices[0].logprobs.tokens]
    assert len(out) >= 4 and stop not in out[:4]


def test_streams_with_two_choices_and_usage(client, tiny_runtime):
    chunks = list(client.completions.create(model="tiny-llama", prompt=["one", "two"], max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.text
    rt = tiny_runtime
    assert [text[0], text[1]] == [rt.tokenizer.decode(greedy(rt, rt.tokenizer.encode(p), 5)) for p in ("one", "two")]
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=4, temperature=0, n=2, stream=True, logprobs=True,
                                            top_logprobs=2, stream_options={"include_usage": True})
    events = list(stream)
    assert {c.choices[0].index for c in events if c.choices} == {0, 1}
    assert sum(len(c.choices[0].logprobs.content) for c in events if c.choices and c.choices[0].logprobs) == 8
    assert events[-1].usage.completion_tokens == 8


def test_response_format_text_is_plain_and_an_unknown_guided_field_is_refused(client):
    # (the constraints themselves: test_api_structured.py)
    msgs = [{"role": "user", "content": "x"}]
    r = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=2,
                                       response_format={"type": "text"})
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=2,
                                  extra_body={"guided_whitespace_pattern": " "})
    assert e.value.body["param"] == "guided_whitespace_pattern" and e.value.body["code"] == "unrecognized_argument"


def test_models_tokenize_detokenize_version(server, client, tiny_runtime):
    assert [m.id for m in client.models.list()] == ["tiny-llama", "tiny"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    h = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=h) as http:
        r = http.post("/tokenize", json={"model": "tiny", "prompt": "hello"}).json()
        assert r["tokens"] == tiny_runtime.tokenizer.encode("hello") and r["count"] == 5
        assert r["max_model_len"] == 256
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert tiny_runtime.tokenizer.decode(chat["tokens"]) == "<|user|>\nhi\n<|assistant|>\n"
        assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "hello"}
        assert http.post("/detokenize", json={"tokens": [10**6]}).json()["error"]["param"] == "tokens"
        assert "version" in http.get("/version").json()
