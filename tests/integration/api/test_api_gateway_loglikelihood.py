"""A log-likelihood request (echo, logprobs 1, max_tokens 0) through the gateway, with the official
openai client, for the `scd` and `local` methods: the prompt's log-probabilities equal the
consumer's own forward pass.

The decode side of `scd` rebuilds the prompt's K/V from codes and has no prompt logits, so a
request that asks for them is prefilled by the consumer itself (no transfer); a plain request
with the same method still transfers. One event loop holds everything: a real prefill worker
(gRPC) with a low-rank codebook, a decode worker (engine + RemoteKVFill) behind uvicorn, and
the gateway behind uvicorn, whose only decode worker it is (scd_cluster.py).
Tolerance: LOGPROB_TOL 1e-4 (float32 paged path vs one full forward; measured ~3e-6).
"""

import httpx
import openai
import pytest
import torch
from scd_cluster import build_pair, cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
LOGPROB_TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("gw-scd"))


async def test_loglikelihood_through_the_gateway_equals_the_forward_pass_for_scd_and_local(pair):
    rt, codebook = pair
    ids = rt.tokenizer.encode(PROMPT)
    ref = torch.log_softmax(rt.prefill(ids, capture=False).logits.float(), dim=-1)  # row i predicts ids[i + 1]
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    async with cluster(rt, codebook) as (base, fill, _):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = await client.completions.create(model="tiny", prompt="a plain request transfers", max_tokens=3,
                                            temperature=0, extra_body={"scd_method": "scd"})
        assert r.choices[0].finish_reason == "length"
        transfers = fill.stats.num_transfers
        assert transfers == 1  # the scd path is live: the prompt's K/V came as codes
        for method in ("scd", "local"):
            r = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                                temperature=0, extra_body={"scd_method": method})
            c = r.choices[0]
            assert c.text == PROMPT and r.usage.completion_tokens == 0, method
            assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(ids), method
            assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=LOGPROB_TOL), method
            best = [max(top.values()) for top in c.logprobs.top_logprobs[1:]]
            assert best == pytest.approx(ref[:-1].max(dim=-1).values.tolist(), abs=LOGPROB_TOL), method
        assert fill.stats.num_transfers == transfers  # prompt logprobs: the consumer's own prefill, no transfer
        await client.close()


async def test_after_one_streamed_request_gateway_and_worker_export_latency_under_vllm_names(pair):
    rt, codebook = pair
    async with cluster(rt, codebook) as (base, _, worker):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = await client.completions.create(model="tiny", prompt="count the tokens", max_tokens=4,
                                                 temperature=0, stream=True)
        chunks = [c async for c in stream]
        await client.close()
        async with httpx.AsyncClient(timeout=10) as http:
            gateway_text = (await http.get(base + "/metrics")).text
            worker_text = (await http.get(worker + "/metrics")).text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert 'scd_gateway_time_to_first_token_seconds_count{model_name="tiny"} 1.0' in gateway_text
    # one gap per event after the first (bytes of one character leave as one event)
    assert f'scd_gateway_inter_token_latency_seconds_count{{model_name="tiny"}} {len(chunks) - 1:.1f}' in gateway_text
    for series in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert f'{series}{{model_name="tiny"}} 1.0' in worker_text
    assert 'vllm:generation_tokens_total{model_name="tiny"} 4.0' in worker_text
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"}' in worker_text
    for phase in ("queue", "prefill", "decode", "inference"):  # the real engine reports its queue time
        assert f'vllm:request_{phase}_time_seconds_count{{model_name="tiny"}} 1.0' in worker_text, phase
