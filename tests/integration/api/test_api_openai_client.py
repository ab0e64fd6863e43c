"""The official openai client, unmodified, against a real uvicorn server on the real engine."""

import openai
import pytest
from api_server import ServerThread, engine_app, stop_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
KEY = "sk-integration-key"


@pytest.fixture(scope="module")
def server(tiny_runtime):
    app, engine = engine_app(tiny_runtime, api_kw={"api_key": KEY})
    with ServerThread(app) as srv:
        srv.engine = engine
        yield srv
    stop_engine(engine)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def expected_text(rt, prompt_ids, n):
    return rt.tokenizer.decode(rt.generate_greedy(prompt_ids, n), skip_special_tokens=True)


def test_completions_whole_and_streamed_match_greedy(client, tiny_runtime):
    ids = tiny_runtime.tokenizer.encode("The capital of France is")
    want = expected_text(tiny_runtime, ids, 12)
    r = client.completions.create(model="tiny-llama", prompt="The capital of France is", max_tokens=12,
                                  temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny-llama", prompt="The capital of France is", max_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_whole_and_streamed(client, tiny_runtime):
    msgs = [{"role": "user", "content": "Say hi"}]
    template = "<|user|>\nSay hi\n<|assistant|>\n"
    want = expected_text(tiny_runtime, tiny_runtime.tokenizer.encode(template, add_special_tokens=False), 10)
    r = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    stream = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=10, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want


def test_models_and_errors_through_the_client(client):
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=1, temperature=-1)
    assert "temperature" in str(e.value)
    bad = openai.OpenAI(base_url=client.base_url, api_key="sk-wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_a_chats_later_turns_report_their_cached_prompt_tokens(client, server, tiny_runtime):
    """Multi-turn: each turn's prompt repeats the last; the decode worker's prefix cache holds it,
    `usage.prompt_tokens_details.cached_tokens` says how much, and /metrics counts the hits."""
    import httpx

    msgs = [{"role": "system", "content": "You are a terse assistant for a shipping company."}]
    cached = []
    for turn in range(3):
        msgs.append({"role": "user", "content": f"Where is parcel number {turn}?"})
        r = client.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=6, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < r.usage.prompt_tokens
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    assert cached[1] > 0 and cached[2] > cached[1]
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= cached[1] + cached[2]
