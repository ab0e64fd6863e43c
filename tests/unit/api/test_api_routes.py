"""Happy paths of the OpenAI routes against a fake backend: shapes, SSE, usage, health, metrics."""

import json

import pytest
from api_fakes import FakeBackend

from scd_serve.errors import Overloaded, TransferFailed

pytestmark = pytest.mark.timeout(30)


def sse_events(text):
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def test_completion_whole(client, backend):
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["choices"][0]["text"] == "Hello" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and body["id"] == f"cmpl-{rid}"  # one id: the header's, in the body too
    req = backend.calls[0]
    assert req.prompt_token_ids == backend.tokenizer.encode("hi") and req.params.temperature == 0
    assert req.method == "local" and req.request_id == rid


@pytest.mark.parametrize("given,kept", [("trace-42:a/b", True), ("bad id with spaces", False), ("x" * 200, False)])
async def test_a_clients_x_request_id_is_the_request_id_everywhere(client, backend, given, kept):
    r = await client.post("/v1/chat/completions", headers={"x-request-id": given},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    rid = r.headers["x-request-id"]
    assert (rid == given) is kept and r.headers.get_list("x-request-id") == [rid]
    assert r.json()["id"] == f"chatcmpl-{rid}" and backend.calls[-1].request_id == rid
    bad = await client.post("/v1/completions", headers={"x-request-id": given}, json={"prompt": "hi", "n": 0})
    assert bad.json()["error"]["request_id"] == bad.headers["x-request-id"]


async def test_completion_prompt_as_token_ids_and_method_extension(client, backend):
    r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "scd_method": "raw", "max_tokens": 2})
    assert r.status_code == 200
    assert backend.calls[0].prompt_token_ids == [1, 2, 3] and backend.calls[0].method == "raw"


@pytest.mark.parametrize("route,body", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
async def test_an_unknown_method_is_a_400_naming_the_vocabulary(client, backend, route, body):
    r = await client.post(route, json=body | {"scd_method": "scd-int4", "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "scd_method" and "'scd-int8'" in err["message"] and "'local'" in err["message"]
    assert backend.calls == []  # refused before the engine saw it


def test_the_method_vocabulary_is_the_codec_registrys():
    from scd_serve import codec
    from scd_serve.config import methods

    assert codec.METHODS == list(methods.TRANSFER_METHODS) and codec.ABLATIONS == list(methods.ABLATIONS)
    for name in (*methods.TRANSFER_METHODS, *methods.ABLATIONS):
        assert codec._FACTORIES[name]  # each name builds


async def test_chat_whole_uses_default_template(client, backend):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 13})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello, world!"}
    expected = "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert backend.tokenizer.decode(backend.calls[0].prompt_token_ids) == expected


async def test_completion_stream_with_usage(client):
    body = {"prompt": "hi", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hell"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)


async def test_chat_stream_role_first_then_deltas(client):
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": 3, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == "Hel"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events[:-1])


async def test_error_mid_stream_is_the_last_event(make_client):
    c = await make_client(FakeBackend(error_after=(2, TransferFailed("prefill worker went away"))))
    r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "transfer_failed" and err["request_id"] == r.headers["x-request-id"]


async def test_overloaded_before_first_token_is_a_429_with_retry_after(make_client):
    c = await make_client(FakeBackend(error=Overloaded(retry_after_s=3)))
    for stream in (False, True):
        r = await c.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"


async def test_models_live_ready(client, backend, make_client):
    r = await client.get("/v1/models")
    card = r.json()["data"][0]
    assert card["id"] == "fake-model" and card["root"] == "fake-model" and card["parent"] is None
    assert card["created"] > 1.7e9 and card["max_model_len"] == 256 and card["owned_by"] == "scd-serve"
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]
    named = await make_client(FakeBackend(), served_model_names=("a", "b"), model_root="/models/x")
    assert [(m["id"], m["root"]) for m in (await named.get("/v1/models")).json()["data"]] == [
        ("a", "/models/x"), ("b", "/models/x")]  # vLLM's: every name, one root
    assert (await client.get("/live")).status_code == 200
    assert (await client.get("/ready")).status_code == 200
    assert (await client.get("/health")).status_code == 200
    backend.peers_ready = False  # not ready to serve transfers, but the engine works: /health stays 200
    assert (await client.get("/ready")).status_code == 503 and (await client.get("/health")).status_code == 200
    backend.is_ready = False
    for path in ("/ready", "/health"):
        r = await client.get(path)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
    assert (await client.get("/live")).status_code == 200


async def test_metrics_record_latencies_and_transfer_hooks(client):
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    client.app.state.metrics.observe_transfer("scd", payload_bytes=100, raw_bytes=1000, rebuild_s=0.01)
    text = (await client.get("/metrics")).text
    assert 'scd_time_to_first_token_seconds_count{method="local"} 2.0' in text
    assert 'scd_inter_token_latency_seconds_count{method="local"} 4.0' in text
    assert 'scd_e2e_request_latency_seconds_count{method="local"} 2.0' in text
    assert 'scd_requests_total{route="/v1/completions",status="200"} 2.0' in text
    assert 'scd_requests_total{route="/v1/completions",status="400"} 1.0' in text
    assert 'scd_transfer_payload_ratio_sum{method="scd"} 0.1' in text
    assert 'scd_transfer_bytes_total{method="scd"} 100.0' in text
    assert "scd_kv_blocks_free 10.0" in text


async def test_metrics_carry_vllm_names_and_model_label(client):
    """An existing vLLM dashboard queries these names with a model_name label."""
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": True})
    text = (await client.get("/metrics")).text
    label = '{model_name="fake-model"}'
    for series in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert f"{series}{label} 2.0" in text
    for series in ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"):
        assert f"{series}{label} 4.0" in text  # 3 tokens: 2 gaps per request
    usage = (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})).json()["usage"]
    text = (await client.get("/metrics")).text
    assert f"vllm:prompt_tokens_total{label} {3.0 * usage['prompt_tokens']}" in text
    assert f"vllm:generation_tokens_total{label} 9.0" in text
    assert f"vllm:request_generation_tokens_count{label} 3.0" in text
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake-model"} 3.0' in text
    assert f"vllm:num_requests_running{label} 0.0" in text and f"vllm:num_requests_waiting{label} 0.0" in text
    assert f"vllm:kv_cache_usage_perc{label} 0.0" in text  # the fake reports 10 of 10 blocks free
    assert f"vllm:request_decode_time_seconds_count{label} 3.0" in text


async def test_wrong_model_name_is_404_naming_both(client):
    r = await client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-9"})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    assert "fake-model" in r.json()["error"]["message"]


async def test_omitted_max_tokens_is_the_default_or_what_fits(make_client):
    backend = FakeBackend()
    c = await make_client(backend, max_model_len=256, max_tokens_cap=64, default_max_tokens=32)
    await c.post("/v1/completions", json={"prompt": "a" * 10})
    await c.post("/v1/completions", json={"prompt": "a" * 250})
    assert [r.params.max_tokens for r in backend.calls] == [32, 6]
    r = await c.post("/v1/completions", json={"prompt": "a" * 256})  # nothing fits: still a clear 400
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
