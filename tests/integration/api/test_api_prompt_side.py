"""vLLM's prompt-side fields through the official openai client, on a real server and engine:
`prompt_logprobs` (completions: per choice; chat: beside the choices) in vLLM's shape, a list
per prompt token, None for the first, else {token id: {logprob, rank, decoded_token}} with the
prompt's token first and the k most likely after it (vllm/entrypoints/openai/completion/
protocol.py: `list[dict[int, Logprob] | None]`, vllm/logprobs.py's Logprob); and
`stream_options.continuous_usage_stats` (each chunk carries its choice's usage so far).
Values are checked against one full forward pass of the model (float32: 1e-4)."""

import openai
import pytest
import torch
from api_server import ServerThread, engine_app, stop_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def client(tiny_runtime):
    app, engine = engine_app(tiny_runtime)
    with ServerThread(app) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    stop_engine(engine)


def forward(rt, ids):
    """Log-probabilities of one full forward pass: row i predicts ids[i + 1]."""
    return torch.log_softmax(rt.prefill(ids, capture=False).logits.float(), dim=-1)


def check_vllm_shape(got, rt, ids, k):
    """`got` (as JSON gives it: token ids as string keys) against the forward pass."""
    ref = forward(rt, ids)
    assert isinstance(got, list) and len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        entry = got[i]
        keys = [int(t) for t in entry]
        assert keys[0] == ids[i]  # the prompt's own token first
        own = entry[str(ids[i])]
        assert set(own) == {"logprob", "rank", "decoded_token"}
        assert own["logprob"] == pytest.approx(float(row[ids[i]]), abs=TOL)
        assert own["rank"] == int((row > row[ids[i]]).sum()) + 1
        assert own["decoded_token"] == rt.tokenizer.decode([ids[i]], skip_special_tokens=False)
        best = torch.topk(row, k).indices.tolist()
        assert set(keys) == {ids[i], *best}  # the k best besides it (k + 1 entries unless it is one of them)
        for rank, t in enumerate(best, start=1):
            if t != ids[i]:
                assert entry[str(t)]["rank"] == rank
                assert entry[str(t)]["logprob"] == pytest.approx(float(row[t]), abs=TOL)


def test_completion_prompt_logprobs_in_vllm_shape_per_choice(client, tiny_runtime):
    ids = tiny_runtime.tokenizer.encode(PROMPT)
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    check_vllm_shape(r.choices[0].model_extra["prompt_logprobs"], tiny_runtime, ids, 3)
    assert r.choices[0].logprobs is None and r.usage.completion_tokens == 2  # the completion is untouched
    two = client.completions.create(model="tiny-llama", prompt=[PROMPT, "a second prompt"], max_tokens=1,
                                    temperature=0, extra_body={"prompt_logprobs": 0})
    for choice, text in zip(two.choices, [PROMPT, "a second prompt"]):
        check_vllm_shape(choice.model_extra["prompt_logprobs"], tiny_runtime, tiny_runtime.tokenizer.encode(text), 0)


def test_echo_logprobs_keep_their_own_k_beside_a_larger_prompt_logprobs(client, tiny_runtime):
    ids = tiny_runtime.tokenizer.encode(PROMPT)
    r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0, extra_body={"prompt_logprobs": 5})
    c = r.choices[0]
    check_vllm_shape(c.model_extra["prompt_logprobs"], tiny_runtime, ids, 5)
    assert all(len(top) <= 2 for top in c.logprobs.top_logprobs[1:])  # logprobs=1: the best and the chosen


def test_chat_prompt_logprobs_beside_the_choices(client, tiny_runtime):
    msgs = [{"role": "user", "content": "Say hi"}]
    ids = tiny_runtime.tokenizer.encode("<|user|>\nSay hi\n<|assistant|>\n", add_special_tokens=False)
    r = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    check_vllm_shape(r.model_extra["prompt_logprobs"], tiny_runtime, ids, 2)
    assert "prompt_logprobs" not in r.choices[0].model_extra


def test_prompt_logprobs_refused_when_streaming_or_out_of_range(client):
    for extra in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        stream = extra.pop("stream", False)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=1, stream=stream,
                                      extra_body=extra)
        assert e.value.body["param"] == "prompt_logprobs", extra


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_count_each_choice_so_far(client, tiny_runtime, chat):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        chunks = list(client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, temperature=0, n=2, stream=True,
                                                     stream_options=opts))
    else:
        chunks = list(client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=0,
                                                n=2, stream=True, stream_options=opts))
    *body, last = chunks
    assert not last.choices and last.usage.completion_tokens == 10  # the final usage chunk: both choices
    seen = {0: 0, 1: 0}
    for c in body:
        assert c.usage is not None, c  # every chunk
        index = c.choices[0].index
        assert c.usage.completion_tokens >= seen[index]  # grows, per choice
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        seen[index] = c.usage.completion_tokens
    assert seen == {0: 5, 1: 5}
    plain = list(client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=3, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1])  # without continuous_usage_stats: only the last
