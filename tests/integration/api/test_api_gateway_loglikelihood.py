"""A log-likelihood request (echo, logprobs 1, max_tokens 0) through the gateway, with the official
openai client, for the `scd` and `local` methods: the prompt's log-probabilities equal the
consumer's own forward pass.

The decode side of `scd` rebuilds the prompt's K/V from codes and has no prompt logits, so a
request that asks for them is prefilled by the consumer itself (no transfer); a plain request
with the same method still transfers. One event loop holds everything: a real prefill worker
(gRPC) with a low-rank codebook, a decode worker (engine + RemoteKVFill) behind uvicorn, and
the gateway behind uvicorn, whose only decode worker it is.
Tolerance: LOGPROB_TOL 1e-4 (float32 paged path vs one full forward; measured ~3e-6).
"""

import asyncio
from contextlib import asynccontextmanager

import httpx
import openai
import pytest
import torch
import uvicorn

from scd_serve.config.api import ApiConfig
from scd_serve.config.decode import DecodeConfig
from scd_serve.config.engine import EngineConfig
from scd_serve.config.gateway import GatewayConfig
from scd_serve.config.prefill import PrefillConfig
from scd_serve.config.transport import TransportConfig
from scd_serve.control.registry import Registry
from scd_serve.decode.worker import DecodeWorker
from scd_serve.gateway.app import create_gateway_app
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from scd_serve.prefill.worker import PrefillWorker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
LOGPROB_TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(runtime, codebook dir): a tiny llama and a rank-4 (lossy) scd codebook for it."""
    from scd_serve.codec.assemble import build_codebook
    from scd_serve.codec.fit import collect_rows, fit_layer
    from scd_serve.codec.plan import REUSE, LayerPlan, Plan
    from scd_serve.codec.codec_spec import spec_of

    root = tmp_path_factory.mktemp("gw-scd")
    rt = ModelRuntime.load(save_tiny_model(root / "model", "llama"))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 256, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g) for _ in range(6)]
    rows = collect_rows(rt, rt, prompts, max_rows=4096)
    spec = spec_of(rt)
    plan = Plan(tuple(LayerPlan(REUSE, 4, 4) for _ in range(spec.num_layers)))
    fits = [fit_layer(r, spec.kv_width, (8, 32), aligner_width=32) for r in rows]
    build_codebook(fits, {"scd": plan}, spec, spec).save(root / "book")
    return rt, str(root / "book")


async def serve_http(app) -> tuple[uvicorn.Server, asyncio.Task, str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    server.install_signal_handlers = lambda: None
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return server, task, f"127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@asynccontextmanager
async def cluster(rt, codebook):
    """prefill worker -> decode worker -> gateway; yields (gateway base URL, the decode side's fill,
    the decode worker's base URL)."""
    from scd_serve import codec as codec_registry
    from scd_serve.codec.codebook import Codebook

    book = Codebook.load(codebook, consumer=rt)
    prefill = PrefillWorker(rt, {"scd": codec_registry.build("scd", producer=rt, codebook=book)},
                            PrefillConfig(model="unused", port=0, transport=TransportConfig()))
    dconf = DecodeConfig(model="unused", codebook=codebook, prefill=(await prefill.start(),), method="scd",
                         fallback="none")
    decode = DecodeWorker(rt, dconf, EngineConfig(num_blocks=128, block_size=8, max_model_len=256,
                                                  fallback_to_local=False),
                          ApiConfig(model_name="tiny", max_model_len=256, max_tokens_cap=64, default_method="scd"))
    await decode.start(health_loop=False)
    assert decode.peers.ready(), decode.peers.why_not_ready()
    worker, worker_task, worker_address = await serve_http(decode.app)
    gw, gw_task, gw_address = await serve_http(
        create_gateway_app(GatewayConfig(port=0, decode=(worker_address,)), Registry(ttl_s=30)))
    try:
        yield f"http://{gw_address}", decode.fill, f"http://{worker_address}"
    finally:
        for server, task in ((gw, gw_task), (worker, worker_task)):
            server.should_exit = True
            await asyncio.wait_for(task, 10)
        await decode.stop(grace_s=1)
        await prefill.stop()


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
