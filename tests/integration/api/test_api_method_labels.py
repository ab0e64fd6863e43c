"""Labels that never lie: every response names the method that produced its K/V, per request kind.

Through the gateway with the official openai client, against a real prefill worker and decode
worker (scd_cluster.py). For each kind the `x-scd-method` header and the body's `scd.method`
must agree with what the decode worker's fill did: a transfer counted for every engine request
labelled `scd`/`raw`, none for `local`. A request that needs the consumer's own prefill
(prompt log-probabilities: echo + logprobs, max_tokens 0; a one-token prompt) is served
locally whatever its forced method, and says so: `local`, reason `needs-local`.
"""

import openai
import pytest
from scd_cluster import build_pair, cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("labels"))


def moved(fill) -> int:
    """K/V fills that came over the wire or copied one that did (n > 1 share one transfer)."""
    return fill.stats.num_transfers + fill.shared.num_shared


async def labelled(call, **kwargs):
    """(header method, body scd field, parsed response) of a non-streamed call."""
    raw = await call.with_raw_response.create(**kwargs)
    body = raw.parse()
    return raw.headers.get("x-scd-method"), body.model_extra.get("scd"), body


async def test_every_request_kind_is_labelled_with_the_method_that_filled_its_kv(pair):
    rt, codebook = pair
    async with cluster(rt, codebook) as (base, fill, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        common = dict(model="tiny", max_tokens=3, temperature=0)
        cases = {  # kind -> (kwargs, the method it must say, transfers it must have made)
            "completion": (dict(prompt="a plain completion", extra_body={"scd_method": "scd"}), "scd", 1),
            "completion raw": (dict(prompt="a plain completion", extra_body={"scd_method": "raw"}), "raw", 1),
            "local": (dict(prompt="a plain completion", extra_body={"scd_method": "local"}), "local", 0),
            "prompt list": (dict(prompt=["first of two", "second of two"], extra_body={"scd_method": "scd"}),
                            "scd", 2),
            "n=2": (dict(prompt="two choices of one prompt", n=2, extra_body={"scd_method": "scd"}), "scd", 2),
            "one-token prompt": (dict(prompt=[5], extra_body={"scd_method": "scd"}), "local", 0),
        }
        for kind, (kwargs, want, transfers) in cases.items():
            before = moved(fill)
            header, scd, body = await labelled(client.completions, **common | kwargs)
            assert header == want and scd["method"] == want, (kind, header, scd)
            assert moved(fill) - before == transfers, kind
            assert ("transfer" in scd) == (transfers > 0), (kind, scd)
            if transfers:
                assert scd["transfer"]["payload_bytes"] > 0 and scd["transfer"]["raw_kv_bytes"] > 0, kind
            assert len(body.choices) == (2 if kind in ("prompt list", "n=2") else 1), kind

        before = moved(fill)
        header, scd, body = await labelled(client.chat.completions, messages=[{"role": "user", "content": "hi"}],
                                           **common | dict(extra_body={"scd_method": "scd"}))
        assert header == "scd" == scd["method"] and moved(fill) - before == 1
        assert body.choices[0].message.role == "assistant"

        before = moved(fill)
        stream = await client.completions.create(prompt="a streamed completion", stream=True, **common,
                                                 extra_body={"scd_method": "scd"})
        chunks = [c async for c in stream]
        assert stream.response.headers["x-scd-method"] == "scd" == chunks[0].model_extra["scd"]["method"]
        assert moved(fill) - before == 1 and chunks[-1].choices[0].finish_reason == "length"
        await client.close()


@pytest.mark.parametrize("method", ["scd", "raw"])
async def test_a_loglikelihood_request_with_a_forced_method_says_local_and_why(pair, method):
    rt, codebook = pair
    async with cluster(rt, codebook) as (base, fill, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in ("score this continuation", ["score this", "and this one"]):  # one prompt, a list
            before = moved(fill)
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0,
                extra_body={"scd_method": method})
            body = raw.parse()
            scd = body.model_extra["scd"]
            assert raw.headers["x-scd-method"] == "local" == scd["method"], scd
            assert scd["reason"] == "needs-local" and scd["requested"] == method
            assert f"{method} not used" in scd["detail"] and "prompt log-probabilities" in scd["detail"]
            assert raw.headers["x-scd-method-reason"].startswith("needs-local")
            assert moved(fill) == before  # nothing was transferred, as the label says
            assert all(c.logprobs.token_logprobs[0] is None for c in body.choices)
            assert body.usage.completion_tokens == 0
        await client.close()
