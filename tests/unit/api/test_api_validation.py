"""Checklist A (input validation) and K8/K9 against the fake backend: the backend is never called."""

import logging

import pytest
from api_fakes import FakeBackend

pytestmark = pytest.mark.timeout(30)

JSON = {"content-type": "application/json"}


def assert_error(r, status, field=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"type", "message", "request_id"} and err["request_id"] == r.headers["x-request-id"]
    if field is not None:
        assert field in err["message"], err
    return err


@pytest.mark.parametrize("raw", [b'{"prompt": "x"', b"", b"[1, 2]", b'"just a string"', b"null"])
async def test_malformed_or_non_object_json(client, backend, raw):
    r = await client.post("/v1/completions", content=raw, headers=JSON)
    assert_error(r, 400)
    assert backend.calls == []
    assert (await client.post("/v1/completions", json={"prompt": "ok"})).status_code == 200


@pytest.mark.parametrize("body,field", [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": 123}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": 5}, "stop"),
])
async def test_wrong_types_are_400_naming_the_field(client, backend, body, field):
    """400 as OpenAI and vLLM answer (FastAPI's default is 422); param names the field."""
    err = assert_error(await client.post("/v1/completions", json=body), 400, field)
    assert err["type"] == "invalid_request_error" and err["param"] == field and err["code"] is None
    assert backend.calls == []


@pytest.mark.parametrize("body,field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages"),
])
async def test_chat_schema_errors(client, body, field):
    assert_error(await client.post("/v1/chat/completions", json=body), 400, field)


@pytest.mark.parametrize("extra,field", [
    ({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": -0.1}, "top_p"), ({"top_p": 1.1}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 65}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": ["x" * 65]}, "stop"), ({"stop": [""]}, "stop"),
    ({"seed": -1}, "seed"), ({"seed": 2**63}, "seed"),
    ({"n": 0}, "n"), ({"n": 65}, "n"), ({"n": 2, "best_of": 1}, "best_of"),
    ({"n": 2, "best_of": 3, "stream": True}, "best_of"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"suffix": "x"}, "suffix"), ({"max_tokens": 0, "echo": False}, "max_tokens"),
])
async def test_out_of_range_sampling_is_400_naming_the_field(client, backend, extra, field):
    import json
    # NaN/inf are not JSON; Python's encoder writes them as NaN/Infinity, which the server must still reject
    r = await client.post("/v1/completions", content=json.dumps({"prompt": "x", **extra}), headers=JSON)
    err = assert_error(r, 400, field)
    assert err["param"] == field
    assert backend.calls == []


async def test_valid_extremes_accepted(client, backend):
    body = {"prompt": "x", "temperature": 0, "top_p": 1.0, "top_k": -1, "max_tokens": 64, "seed": 2**63 - 1,
            "stop": ["a", "b", "c", "d"]}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert backend.calls[0].params.greedy


async def test_prompt_too_long_names_both_numbers_and_boundary_is_accepted(client, backend):
    # max_model_len 256 in the test config; the byte tokenizer makes one token per byte
    for n, max_tokens, status in ((200, 56, 200), (200, 57, 400), (2560, 16, 400), (1, 64, 200)):
        r = await client.post("/v1/completions", json={"prompt": "a" * n, "max_tokens": max_tokens})
        assert r.status_code == status, (n, max_tokens, r.text)
        if status == 400:
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded"
            assert str(n) in err["message"] and str(max_tokens) in err["message"] and "256" in err["message"]
    assert len(backend.calls) == 2  # only the accepted ones reached the backend


async def test_empty_whitespace_and_special_prompts(client, backend):
    assert_error(await client.post("/v1/completions", json={"prompt": ""}), 400, "prompt")
    assert_error(await client.post("/v1/completions", json={"prompt": []}), 400, "prompt")
    assert_error(await client.post("/v1/completions", json={"prompt": ["a", ""]}), 400, "prompt")
    assert_error(await client.post("/v1/completions", json={"prompt": [[1], []]}), 400, "prompt")
    assert_error(await client.post("/v1/completions", json={"prompt": [1, 999]}), 400, "prompt")
    assert (await client.post("/v1/completions", json={"prompt": "   "})).status_code == 200
    assert (await client.post("/v1/completions", json={"prompt": "<eos>"})).status_code == 200


@pytest.mark.parametrize("prompt", ["\ud800", "a\x00b", "emoji 😀🎉", "é" * 100])
async def test_unicode_edge_cases_never_5xx(client, prompt):
    import json
    r = await client.post("/v1/completions", content=json.dumps({"prompt": prompt}), headers=JSON)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "prompt"


async def test_huge_unicode_prompt_is_prompt_too_long(make_client):
    c = await make_client(FakeBackend(), max_body_bytes=4 << 20)
    r = await c.post("/v1/completions", json={"prompt": "x" * 200_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


async def test_body_over_limit_is_413_with_and_without_content_length(make_client):
    backend = FakeBackend()
    c = await make_client(backend, max_body_bytes=1000)
    big = b'{"prompt": "' + b"x" * 2000 + b'"}'
    assert_error(await c.post("/v1/completions", content=big, headers=JSON), 413)
    sent = []

    async def chunked():  # no Content-Length: the guard counts what arrives
        for _ in range(100):
            sent.append(1)
            yield b"x" * 100

    r = await c.post("/v1/completions", content=chunked(), headers=JSON)
    assert_error(r, 413)
    assert backend.calls == []
    assert len(sent) < 100  # refused before the whole body was read


async def test_wrong_content_type_is_415(client, backend):
    r = await client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert_error(r, 415)
    r = await client.post("/v1/completions", content=b'{"prompt": "x"}')
    assert_error(r, 415)
    ok = await client.post("/v1/completions", content=b'{"prompt": "x"}',
                           headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    assert len(backend.calls) == 1


async def test_unknown_route_and_method_use_the_error_shape(client):
    assert_error(await client.get("/v2/nothing"), 404)
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


async def test_internal_error_body_has_no_internals(make_client, caplog):
    c = await make_client(FakeBackend(error=ZeroDivisionError("secret /path/to/file.py tensor([1.])")))
    with caplog.at_level(logging.ERROR):
        r = await c.post("/v1/completions", json={"prompt": "x"})
    err = assert_error(r, 500)
    assert err["code"] == "internal_error"
    assert "secret" not in r.text and "Traceback" not in r.text and ".py" not in r.text
    assert "ZeroDivisionError" in caplog.text  # the log has it


async def test_cors_off_and_docs_can_be_disabled(make_client):
    c = await make_client(FakeBackend())
    r = await c.options("/v1/completions", headers={"Origin": "http://evil.example",
                                                      "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    assert (await c.get("/openapi.json")).status_code == 200
    c2 = await make_client(FakeBackend(), enable_docs=False)
    assert (await c2.get("/openapi.json")).status_code == 404
    assert (await c2.get("/docs")).status_code == 404


async def test_logs_carry_ids_and_lengths_never_text(client, caplog):
    secret_prompt, reply = "my-secret-prompt-text", "Hello, world!"
    with caplog.at_level(logging.DEBUG):
        r = await client.post("/v1/completions", json={"prompt": secret_prompt, "max_tokens": 13})
        await client.post("/v1/completions", json={"prompt": secret_prompt, "stream": True})
    assert r.status_code == 200
    assert secret_prompt not in caplog.text and reply not in caplog.text and "world" not in caplog.text
    assert r.headers["x-request-id"] in caplog.text and f"prompt_tokens={len(secret_prompt)}" in caplog.text


@pytest.mark.parametrize("raw,depth", [
    (b'{"prompt": "x"}', 1), (b"[[[]]]", 3), (b'{"a": "[[[[{{{{", "b": ["\\"[[["]}', 2),
    (b'{"a": "\\\\", "b": [[1]]}', 3),  # an escaped backslash ends before the quote: the string closes
    (b"[" * 100_000, 100_000), (b"", 0),
])
def test_json_depth_skips_strings_and_escapes(raw, depth):
    from scd_serve.api.guard import json_depth

    assert json_depth(raw) == depth


async def test_json_nested_past_the_limit_is_400_naming_it_before_parsing(client, backend):
    """Issue 45: 1,000-deep nesting was a RecursionError (500) in the gateway's JSON parser."""
    deep = b'{"prompt": ' + b"[" * 65 + b"1" + b"]" * 65 + b"}"
    err = assert_error(await client.post("/v1/completions", content=deep, headers=JSON), 400)
    assert "nesting depth 66 exceeds the limit of 64" in err["message"]
    ok = b'{"prompt": "x", "stop": ' + b"[" * 62 + b"]" * 62 + b"}"  # depth 63: parsed, a 400 from the schema
    assert (await client.post("/v1/completions", content=ok, headers=JSON)).status_code == 400
    assert backend.calls == []


@pytest.mark.parametrize("key", ["²", "①", "1" * 5000, "-1", "+1", " 7", "0x1f"])
async def test_logit_bias_keys_must_be_ascii_digits(client, backend, key):
    """str.isdigit() accepts "²" and "①", which int() refuses (a 500 before); 5,000 digits exceed int()'s limit."""
    err = assert_error(await client.post("/v1/completions", json={"prompt": "x", "logit_bias": {key: 1}}), 400)
    assert err["param"] == "logit_bias" and "plain ASCII digits" in err["message"]
    assert backend.calls == []
