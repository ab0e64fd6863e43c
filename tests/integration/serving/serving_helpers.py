"""Shared pieces of the serving tests: tiny models, a real prefill server, a decode side."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from scd_serve import codec as codec_registry
from scd_serve.config.api import ApiConfig
from scd_serve.config.decode import DecodeConfig
from scd_serve.config.engine import EngineConfig
from scd_serve.config.prefill import PrefillConfig
from scd_serve.config.transport import TransportConfig
from scd_serve.decode.worker import DecodeWorker
from scd_serve.engine.engine import Engine
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.model.runtime import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from scd_serve.prefill.service import PrefillServicer
from scd_serve.prefill.worker import PrefillWorker
from scd_serve.transport.client import PrefillClient


def tiny_runtime(path, seed=0, **overrides) -> ModelRuntime:
    save_tiny_model(path, "llama", seed=seed, **overrides)
    return ModelRuntime.load(path)


async def settled(node: PrefillWorker, served: int, timeout: float = 10.0) -> bool:
    """Wait until the worker counts `served` transfers and holds none: it may still be
    finishing a stream (its status) after the decode side has read the last chunk."""
    end = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < end:
        if node.servicer.num_served == served and not node.servicer.transfers:
            return True
        await asyncio.sleep(0.01)
    return False


async def start_prefill(rt, methods=("identity",), transport: TransportConfig | None = None,
                        servicer_cls=PrefillServicer, port: int = 0, codebook=None, **cfg) -> PrefillWorker:
    """A real prefill worker on 127.0.0.1 (the one `scd-serve prefill` builds), started."""
    transport = transport or TransportConfig()
    config = PrefillConfig(model="unused", port=port, transport=transport, **cfg)
    codecs = {m: codec_registry.build(m, producer=rt, codebook=codebook) for m in methods}
    node = PrefillWorker(rt, codecs, config, servicer_cls=servicer_cls)
    await node.start()
    return node


@contextlib.asynccontextmanager
async def worker_and_client(rt, **cfg):
    """A real prefill worker and a PrefillClient to it, both closed afterwards."""
    node = await start_prefill(rt, **cfg)
    client = PrefillClient(node.address, TransportConfig())
    try:
        yield node, client
    finally:
        await client.close()
        await node.stop()


async def make_decode(rt, addresses, method="identity", client_factory=None, codebook="", **cfg):
    """The transfer side of a decode worker (DecodeWorker.connect, no periodic health checks):
    -> (peers, fill); the caller closes the peers."""
    config = DecodeConfig(model="unused", codebook=codebook, prefill=tuple(addresses), method=method, **cfg)
    worker = DecodeWorker(rt, config, EngineConfig(), ApiConfig(), client_factory=client_factory)
    await worker.connect(health_loop=False)
    return worker.peers, worker.fill


def engine_config(**cfg) -> EngineConfig:
    return EngineConfig(num_blocks=256, block_size=8, max_model_len=256, max_num_seqs=32,
                        **({"fallback_to_local": False} | cfg))


def engine_for(rt, **cfg) -> Engine:
    engine = Engine(rt, engine_config(**cfg))
    engine.start()
    return engine


@contextlib.asynccontextmanager
async def decode_stack(rt, producer=None):
    """One real prefill worker (running `producer`, default `rt`) and a decode worker for it
    (DecodeWorker: peers, fill, an engine that does not fall back): yields (node, fill, engine),
    all stopped after."""
    node = await start_prefill(rt if producer is None else producer)
    config = DecodeConfig(model="unused", codebook="", prefill=(node.address,), method="identity")
    worker = DecodeWorker(rt, config, engine_config(), ApiConfig())
    try:
        await worker.start(health_loop=False)
        yield node, worker.fill, worker.engine
    finally:
        await worker.stop(grace_s=1)
        await node.stop()


def prompts(n: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


async def greedy(engine, rid, tokens, method="local", kv_fill=None, max_tokens=12) -> list[int]:
    req = GenerationRequest(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            method=method)
    out = []
    async for ev in engine.generate(req, kv_fill=kv_fill if method != "local" else None):
        if ev.token_id is not None:
            out.append(ev.token_id)
    return out


async def wait_until(pred, timeout=5.0, step=0.02) -> bool:
    end = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < end:
        if pred():
            return True
        await asyncio.sleep(step)
    return pred()


class SlowRuntime:
    """Wraps a runtime: sleeps `delay` s per prefill layer and calls on_layer(layer) (fault hooks)."""

    def __init__(self, rt, delay: float = 0.0, on_layer=None):
        self._rt, self.delay, self.on_layer = rt, delay, on_layer

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def iter_prefill(self, ids, compute_logits=True, residuals=False, **kw):
        import time as _time

        for layer, state in self._rt.iter_prefill(ids, compute_logits=compute_logits, residuals=residuals, **kw):
            if self.on_layer is not None:
                self.on_layer(layer)
            _time.sleep(self.delay)
            yield layer, state
