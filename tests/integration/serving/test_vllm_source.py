"""CodeSource (scd_serve/vllm/source.py), the vLLM connector's fetch, against real prefill
workers over real gRPC, without vLLM: what it hands the connector is the consumer's own K/V
(identity), after its RoPE, for exactly the rows asked; a busy worker is waited for, a broken
or silent one gives way to the next, and with none left the load fails within its deadline."""

import asyncio
import threading
import time

import pytest
import torch

from scd_serve import codec as codec_registry
from scd_serve.config.connector import ConnectorConfig
from scd_serve.config.prefill import PrefillConfig
from scd_serve.config.transport import TransportConfig
from scd_serve.errors import TransferFailed, Unavailable
from scd_serve.prefill.worker import PrefillWorker
from scd_serve.testing.faults import FaultyServicer
from scd_serve.vllm.source import CodeSource

from serving_helpers import prompts, start_prefill, tiny_runtime

pytestmark = pytest.mark.timeout(120)


def fetch_all(source, tokens, start, rid="r1", deadline=None):
    """-> {layer: (k, v)} as the connector would write them."""
    got = {}
    fetched = source.fetch(rid, tokens, start, lambda layer, k, v: got.__setitem__(layer, (k, v)), deadline)
    return got, fetched


def own_kv(rt, tokens):
    """The consumer's own prefill K/V: [layers] of (k after RoPE, v), [T, kv_heads, head_dim]."""
    out = rt.prefill(torch.tensor(tokens))
    positions = torch.arange(len(tokens))
    return [(rt.rotate_keys(out.keys[i], positions), out.values[i]) for i in range(rt.spec.num_layers)]


@pytest.mark.parametrize("start", [0, 7])
async def test_identity_rows_are_the_consumers_own(tmp_path, start):
    rt = tiny_runtime(tmp_path / "m")
    node = await start_prefill(rt, methods=("identity",))
    source = CodeSource(ConnectorConfig(prefill=(node.address,), method="identity"), rt)
    try:
        tokens = prompts(1, seed=3)[0][:40]
        got, fetched = await asyncio.to_thread(fetch_all, source, tokens, start)
        want = own_kv(rt, tokens)
        assert sorted(got) == list(range(rt.spec.num_layers))
        for layer, (k, v) in got.items():
            assert k.shape == (len(tokens) - start, rt.spec.num_kv_heads, rt.spec.head_dim)
            torch.testing.assert_close(k, want[layer][0][start:], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, want[layer][1][start:], atol=1e-5, rtol=1e-5)
        assert fetched.prefill == node.address and fetched.rows == len(tokens) - start
        assert fetched.payload_bytes > 0
    finally:
        source.close()
        await node.stop()


async def test_busy_worker_is_waited_for_and_a_dead_one_skipped(tmp_path):
    """One worker runs one transfer at a time and six prompts ask at once: every one is served
    (the others wait for its slot); an address nobody listens on is passed over."""
    rt = tiny_runtime(tmp_path / "m")
    node = await start_prefill(rt, methods=("identity",), max_concurrent=1)
    source = CodeSource(ConnectorConfig(prefill=("127.0.0.1:1", node.address), method="identity",
                                        transport=TransportConfig(rpc_timeout_s=1.0)), rt)
    try:
        tokens = [p[:30] for p in prompts(6, seed=4)]
        results = await asyncio.gather(*(asyncio.to_thread(fetch_all, source, t, 0, f"r{i}")
                                         for i, t in enumerate(tokens)))
        assert [f.prefill for _, f in results] == [node.address] * 6
        assert node.servicer.num_served == 6
    finally:
        source.close()
        await node.stop()


async def test_worker_silent_mid_stream_gives_way_to_the_next(tmp_path):
    rt = tiny_runtime(tmp_path / "m")
    config = PrefillConfig(model="unused", port=0)
    stalled = PrefillWorker(rt, {"identity": codec_registry.build("identity", producer=rt)}, config,
                            servicer_wrap=lambda sv: FaultyServicer(sv, stall_at_chunk=1, stall_s=30))
    await stalled.start()
    healthy = await start_prefill(rt, methods=("identity",))
    source = CodeSource(ConnectorConfig(prefill=(stalled.address, healthy.address), method="identity",
                                        transport=TransportConfig(stall_timeout_s=0.5)), rt)
    source._next = iter([0])  # the stalled worker first  # noqa: SLF001
    try:
        t0 = time.monotonic()
        got, fetched = await asyncio.to_thread(fetch_all, source, prompts(1, seed=5)[0][:30], 0)
        assert fetched.prefill == healthy.address and len(got) == rt.spec.num_layers
        assert time.monotonic() - t0 < 10  # the stall was given up after 0.5 s, not the stream's 30
    finally:
        source.close()
        await stalled.stop()
        await healthy.stop()


async def test_no_worker_left_fails_within_the_deadline(tmp_path):
    rt = tiny_runtime(tmp_path / "m")
    source = CodeSource(ConnectorConfig(prefill=("127.0.0.1:1",), method="identity",
                                        transport=TransportConfig(rpc_timeout_s=0.5)), rt)
    try:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="127.0.0.1:1: unreachable"):
            await asyncio.to_thread(fetch_all, source, list(range(5, 25)), 0)
        assert time.monotonic() - t0 < 5
    finally:
        source.close()


async def test_other_models_worker_is_refused_by_the_handshake(tmp_path):
    """A worker whose producer has another shape is not asked at all: its differing fields are named."""
    consumer = tiny_runtime(tmp_path / "c")
    other = tiny_runtime(tmp_path / "o", num_hidden_layers=3)
    node = await start_prefill(other, methods=("identity",))
    source = CodeSource(ConnectorConfig(prefill=(node.address,), method="identity"), consumer)
    try:
        with pytest.raises(Unavailable, match="num_layers: producer 3 != consumer 2"):
            await asyncio.to_thread(fetch_all, source, list(range(5, 25)), 0)
        assert node.servicer.num_served == 0
    finally:
        source.close()
        await node.stop()


async def test_cancel_stops_the_stream_at_once(tmp_path):
    """The request ended (vLLM aborted it) while its codes were on their way: the stream is
    cancelled, the producer sees it, and no other worker is asked."""
    rt = tiny_runtime(tmp_path / "m")
    config = PrefillConfig(model="unused", port=0)
    faulty = {}

    def wrap(sv):
        faulty["sv"] = FaultyServicer(sv, stall_at_chunk=1, stall_s=30)
        return faulty["sv"]

    stalled = PrefillWorker(rt, {"identity": codec_registry.build("identity", producer=rt)}, config, servicer_wrap=wrap)
    await stalled.start()
    other = await start_prefill(rt, methods=("identity",))
    source = CodeSource(ConnectorConfig(prefill=(stalled.address, other.address), method="identity"), rt)
    source._next = iter([0])  # the stalled worker first  # noqa: SLF001
    cancel = threading.Event()
    try:
        asyncio.get_running_loop().call_later(0.5, cancel.set)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="cancelled"):
            await asyncio.to_thread(source.fetch, "r1", prompts(1, seed=6)[0][:30], 0, lambda *_: None, None, cancel)
        assert time.monotonic() - t0 < 5
        assert other.servicer.num_served == 0
        for _ in range(100):  # the producer's handler sees the cancellation
            if faulty["sv"].cancelled:
                break
            await asyncio.sleep(0.05)
        assert faulty["sv"].cancelled
    finally:
        source.close()
        await stalled.stop()
        await other.stop()


@pytest.mark.parametrize("method", ["identity", "raw"])
async def test_a_method_that_computes_nothing_needs_no_consumer_weights(tmp_path, method):
    """The connector loads a consumer without its weights for such a method (no second copy
    beside vLLM's): what it hands on is the same as with them."""
    from scd_serve.model.runtime import ModelRuntime

    rt = tiny_runtime(tmp_path / "m")
    bare = ModelRuntime.load(tmp_path / "m", weights=False)
    assert bare.weights is None and bare.fingerprint == rt.fingerprint
    node = await start_prefill(rt, methods=(method,))
    sources = [CodeSource(ConnectorConfig(prefill=(node.address,), method=method), r) for r in (rt, bare)]
    try:
        tokens = prompts(1, seed=7)[0][:40]
        (full, _), (light, _) = [await asyncio.to_thread(fetch_all, s, tokens, 3) for s in sources]
        for layer in full:
            torch.testing.assert_close(light[layer], full[layer], atol=0, rtol=0)
    finally:
        for s in sources:
            s.close()
        await node.stop()


async def test_a_failed_handshake_is_not_retried_for_every_prompt(tmp_path):
    """A worker that is down or incompatible is asked again only after HANDSHAKE_RETRY_S: prompts
    in between do not each wait for it (a black-holed address would cost rpc_timeout_s each)."""
    consumer = tiny_runtime(tmp_path / "c")
    other = tiny_runtime(tmp_path / "o", num_hidden_layers=3)
    wrapped = {}

    def wrap(sv):
        wrapped["sv"] = FaultyServicer(sv)
        return wrapped["sv"]

    node = PrefillWorker(other, {"identity": codec_registry.build("identity", producer=other)},
                         PrefillConfig(model="unused", port=0), servicer_wrap=wrap)
    await node.start()
    source = CodeSource(ConnectorConfig(prefill=(node.address,), method="identity"), consumer)
    infos = lambda: sum(rpc == "Info" for rpc, _ in wrapped["sv"].deadlines)  # noqa: E731
    try:
        for _ in range(3):
            with pytest.raises(Unavailable, match="num_layers"):
                await asyncio.to_thread(fetch_all, source, list(range(5, 25)), 0)
        assert infos() == 1
        source.workers[0].retry_at = time.monotonic() - 1  # as HANDSHAKE_RETRY_S later
        with pytest.raises(Unavailable, match="num_layers"):
            await asyncio.to_thread(fetch_all, source, list(range(5, 25)), 0)
        assert infos() == 2
    finally:
        source.close()
        await node.stop()
