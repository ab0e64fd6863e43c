"""A real scd cluster in one event loop, for API tests that need transfers: a prefill worker (gRPC)
with a low-rank (lossy) scd codebook and raw, a decode worker (engine + RemoteKVFill) behind
uvicorn, and the gateway behind uvicorn, whose only decode worker it is."""

import asyncio
from contextlib import asynccontextmanager

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


def build_pair(root):
    """(runtime, codebook dir): a tiny llama and a rank-4 (lossy) scd codebook for it."""
    from scd_serve.calibration.assemble import build_codebook
    from scd_serve.codec.codec_spec import spec_of
    from scd_serve.calibration.fit import collect_rows, fit_layer
    from scd_serve.codec.plan import REUSE, LayerPlan, Plan

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
    codecs = {m: codec_registry.build(m, producer=rt, codebook=book) for m in ("scd", "raw")}
    prefill = PrefillWorker(rt, codecs,
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
