"""A. HTTP input validation: every bad body is a 4xx with the one error shape, before prefill."""

import resource

import httpx
import pytest

from rel_checks import assert_clean
from scd_serve.testing.faults import FaultyServicer
from scd_serve.testing.soak import completion

pytestmark = pytest.mark.timeout(60)
URL = "/v1/completions"


def assert_error_shape(r: httpx.Response, statuses) -> dict:
    assert r.status_code in statuses, (r.status_code, r.text)
    err = r.json()["error"]
    assert {"message", "type", "param", "code", "request_id"} <= set(err), err  # OpenAI's shape + our id
    assert err["request_id"] and r.headers["x-request-id"] == err["request_id"]
    return err


@pytest.fixture
async def stack(make_stack):
    # FaultyServicer with no fault switched on only counts Prefill calls
    s, base = await make_stack(servicer_wrap=lambda sv: FaultyServicer(sv))
    s.base = base
    return s


def post_raw(stack, content, ctype="application/json"):
    return stack.client.post(URL, content=content, headers={"content-type": ctype})


async def test_a1_malformed_non_object_and_empty_bodies(stack):
    for body in [b'{"prompt": "x"', b"[1, 2]", b'"just a string"', b"", b"null", b"{,}"]:
        assert_error_shape(await post_raw(stack, body), (400,))
    r = await stack.client.post(URL, json=completion("still fine", 2))
    assert r.status_code == 200
    await assert_clean(stack, stack.base)


async def test_a2_missing_mistyped_or_unknown_fields_400(stack):
    """400 (OpenAI's and vLLM's status; FastAPI's default was 422), param naming the field."""
    for body, field in [({"max_tokens": 4}, "prompt"), ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
                        ({"prompt": 123}, "prompt"), ({"prompt": "x", "temperature": "hot"}, "temperature"),
                        ({"prompt": "x", "stream": "yes"}, "stream"),
                        ({"prompt": "x", "guided_decoding_backend": "outlines"}, "guided_decoding_backend")]:
        err = assert_error_shape(await stack.client.post(URL, json=body), (400,))
        assert err["type"] == "invalid_request_error" and err["param"] == field, (body, err)
    r = await stack.client.post("/v1/chat/completions", json={"messages": "hi"})
    assert assert_error_shape(r, (400,))["param"] == "messages"
    await assert_clean(stack, stack.base)


async def test_a3_prompt_too_long_boundary_and_no_prefill_call(stack):
    max_len, m = 256, 8
    calls = len(stack.served.calls)
    for n in (max_len - m + 1, 10 * max_len):
        r = await stack.client.post(URL, json=completion([7] * n, m, scd_method="identity"))
        err = assert_error_shape(r, (400, 413))
        assert str(n) in err["message"] and str(m) in err["message"] and str(max_len) in err["message"], err
    assert len(stack.served.calls) == calls  # refused before any prefill worker saw it
    r = await stack.client.post(URL, json=completion([7] * (max_len - m), m, scd_method="identity"))
    assert r.status_code == 200, r.text  # exactly max_model_len is accepted
    assert r.json()["usage"] == {"prompt_tokens": max_len - m, "completion_tokens": m, "total_tokens": max_len,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
    assert len(stack.served.calls) == calls + 1
    await assert_clean(stack, stack.base)


BAD_PARAMS = [
    ("temperature", -1), ("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "-Infinity"),
    ("top_p", 0), ("top_p", -0.1), ("top_p", 1.1), ("top_p", "NaN"),
    ("top_k", 0), ("top_k", -2),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 65),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", ["x" * 65]),
    ("seed", -1), ("seed", 2**63), ("seed", 2**70),
    ("n", 0), ("n", 65), ("best_of", 0), ("presence_penalty", 2.5), ("frequency_penalty", "NaN"),
    ("repetition_penalty", 0), ("min_p", 2), ("logprobs", 21), ("min_tokens", 5), ("logit_bias", {"1": 1e9}),
]


async def test_a4_sampling_params_table(stack):
    import json
    calls = len(stack.served.calls)
    for field, value in BAD_PARAMS:
        raw = json.dumps(completion("abc", 4, scd_method="identity"))[:-1]
        raw += f', "{field}": {value if isinstance(value, str) else json.dumps(value)}}}'
        r = await post_raw(stack, raw.encode())
        err = assert_error_shape(r, (400,))
        assert err["param"] == field and field in err["message"], (field, value, err)
    assert len(stack.served.calls) == calls
    for extreme in [{"temperature": 0}, {"temperature": 0.0, "top_p": 1.0}, {"top_k": -1}, {"top_k": 1},
                    {"seed": 0}, {"seed": 2**63 - 1, "temperature": 1.0}, {"max_tokens": 64},
                    {"stop": ["a", "b", "c", "d"]}, {"n": 2, "presence_penalty": 2, "frequency_penalty": -2},
                    {"logprobs": 20, "min_tokens": 4, "logit_bias": {"1": -100}}]:
        r = await stack.client.post(URL, json=completion("ok", 4) | extreme)
        assert r.status_code == 200, (extreme, r.text)
    await assert_clean(stack, stack.base)


async def test_a5_empty_whitespace_and_special_only_prompts(stack):
    for prompt in ["", [], [""]]:
        err = assert_error_shape(await stack.client.post(URL, json=completion(prompt, 2)), (400,))
        assert "prompt" in err["message"] and err["param"] == "prompt"
    for prompt in [" ", "\n\t  ", [0], [255, 255]]:  # defined behaviour: generate from it
        r = await stack.client.post(URL, json=completion(prompt, 2, scd_method="identity"))
        assert r.status_code == 200, (prompt, r.text)
    r = await stack.client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
    assert_error_shape(r, (400,))
    await assert_clean(stack, stack.base)


async def test_a6_chunked_body_over_limit_is_413_before_read(make_stack):
    stack, base = await make_stack(api={"max_body_bytes": 64 * 1024})
    sent = []

    async def body():
        for i in range(200):  # 200 x 16 KiB = 3.2 MiB, no Content-Length
            sent.append(i)
            yield b'{"prompt": "' if i == 0 else b"a" * 16384

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = await stack.client.post(URL, content=body(), headers={"content-type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert_error_shape(r, (413,))
    assert len(sent) < 10, f"server read {len(sent)} chunks before refusing"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 20 * 1024  # KiB
    r = await stack.client.post(URL, content=b"x" * 70000, headers={"content-type": "application/json"})
    assert_error_shape(r, (413,))  # declared Content-Length over the cap
    await assert_clean(stack, base)


async def test_a7_wrong_content_type(stack):
    for ctype in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""]:
        r = await post_raw(stack, b'{"prompt": "x"}', ctype)
        assert_error_shape(r, (415,))
    await assert_clean(stack, stack.base)


async def test_a8_unicode_edge_cases(stack):
    cases = [b'{"prompt": "\\ud800", "max_tokens": 2}', b'{"prompt": "a\\udfff b", "max_tokens": 2}',
             b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}']
    for raw in cases:
        path = "/v1/chat/completions" if b"messages" in raw else URL
        r = await stack.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert_error_shape(r, (400,))
    for prompt in ["nul\x00inside", "emoji \U0001F600\U0001F44D\u200d", "\u202eRTL \ufeff bom"]:
        r = await stack.client.post(URL, json=completion(prompt, 2, scd_method="identity"))
        assert r.status_code == 200, (prompt, r.text)
    r = await stack.client.post(URL, json=completion("z" * 200_000, 2))
    err = assert_error_shape(r, (400, 413))
    assert err["code"] in ("context_length_exceeded", "payload_too_large")
    await assert_clean(stack, stack.base)
