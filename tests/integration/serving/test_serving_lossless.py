"""L1/L3: over a real gRPC channel, `identity` disaggregated greedy == monolithic greedy."""

import asyncio
import dataclasses

import pytest
import torch

from scd_serve.config.transport import TransportConfig
from scd_serve.decode import kv_fill
from scd_serve.transport.client import PrefillClient
from scd_serve.transport.proto import pb
from scd_serve.transport.tensors import decode_code

from serving_helpers import engine_for, greedy, make_decode, prompts, settled, start_prefill


@pytest.mark.timeout(60)
async def test_identity_transfer_matches_local_alone_and_16_concurrent(rt):
    node = await start_prefill(rt)
    peers, fill = await make_decode(rt, [node.address])
    engine = engine_for(rt, prefix_caching=False)  # the repeated prompt is the producer code cache's to serve
    try:
        assert peers.ready(), peers.status()
        ps = prompts(16)
        solo_local = [await greedy(engine, f"l{i}", p) for i, p in enumerate(ps)]
        first = await greedy(engine, "d0", ps[0], "identity", fill)
        assert first == solo_local[0]
        assert fill.stats.num_transfers == 1 and fill.stats.payload_bytes > 0
        together = await asyncio.gather(*(greedy(engine, f"c{i}", p, "identity", fill) for i, p in enumerate(ps)))
        assert together == solo_local
        assert fill.stats.num_transfers == 17 and fill.stats.num_failed == 0
        # clean state on both sides
        assert fill.num_inflight == 0 and await settled(node, 17)
        assert engine.block_manager.num_free == engine.block_manager.num_blocks
        # the repeated prompt came from the producer's code cache, with the same result
        assert node.servicer.cache.num_hits >= 1 and fill.stats.num_cache_hits >= 1
        # every RPC the decode side made, streams included, carried a deadline
        calls = [(m, t) for p in peers.peers.values() for m, t in p.client.deadlines.timeouts]
        assert sum(m.endswith("/Prefill") for m, _ in calls) == 17  # one stream per transfer
        assert any(m.endswith("/Info") for m, _ in calls)
        assert all(t is not None and t > 0 for _, t in calls)
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["identity", "raw"])
async def test_later_turns_ship_only_what_the_prefix_cache_lacks_and_answer_as_local(rt, method):
    """Multi-turn: each turn repeats the last turn's prompt and answer. The decode worker holds
    the earlier blocks and asks the producer for the rest only (PrefillRequest.start): fewer
    bytes, and the greedy tokens of a local prefill (producer == consumer: lossless)."""
    node = await start_prefill(rt, methods=(method,))
    peers, fill = await make_decode(rt, [node.address], method=method)
    engine = engine_for(rt)
    try:
        prompt, sent = prompts(1, seed=3)[0] * 3, []  # 3 x 3..39 tokens, then the turns' answers
        for turn in range(3):
            before = fill.stats.payload_bytes
            local = await greedy(engine, f"l{turn}", prompt)  # (local's blocks are another namespace)
            assert await greedy(engine, f"d{turn}", prompt, method, fill) == local
            sent.append((fill.stats.payload_bytes - before) / len(prompt))
            prompt = prompt + local + [5, 6, 7]
        assert fill.stats.num_transfers == 3 and fill.stats.num_failed == 0
        # every turn's first token came from the producer's last row, later turns' over its cached blocks
        assert engine.stats()["num_last_rows"] == 3 and node.servicer.prefix.num_hit_tokens > 0
        assert sent[1] < 0.7 * sent[0] and sent[2] < 0.7 * sent[0]  # bytes per prompt token
        assert engine.block_manager.num_hit_tokens > 0
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()


@pytest.mark.parametrize("chunk_bytes,chunks", [(1, 2), (1 << 20, 1)])
async def test_cache_hit_resends_codes_in_layer_chunks_or_packed(rt, chunk_bytes, chunks, monkeypatch):
    node = await start_prefill(rt, chunk_bytes=chunk_bytes)
    peers, fill = await make_decode(rt, [node.address])
    engine = engine_for(rt, prefix_caching=False)  # the repeated prompt is the producer code cache's to serve
    headers = []
    real = kv_fill.check_header
    monkeypatch.setattr(kv_fill, "check_header", lambda h, peer, codec: (headers.append(h), real(h, peer, codec))[1])
    try:
        p = prompts(1, seed=21)[0]
        want = await greedy(engine, "l", p)
        assert await greedy(engine, "cold", p, "identity", fill) == want
        assert await greedy(engine, "warm", p, "identity", fill) == want
        assert [h.cache_hit for h in headers] == [False, True]
        assert [h.total_chunks for h in headers] == [rt.spec.num_layers, chunks]
        assert node.servicer.num_prefills == 1  # the warm request ran no producer
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()


async def test_cache_hit_sends_the_header_inside_chunk_zero(rt):
    from scd_serve.config.transport import TransportConfig
    from scd_serve.transport.client import PrefillClient
    from scd_serve.transport.proto import pb

    node = await start_prefill(rt, chunk_bytes=1)
    client = PrefillClient(node.address, TransportConfig())
    try:
        async def stream(rid):
            req = pb.PrefillRequest(request_id=rid, token_ids=prompts(1, seed=5)[0][:-1], method="identity")
            return [msg async for msg in client.prefill(req, timeout=10)]
        cold, warm = await stream("cold"), await stream("warm")
        n = rt.spec.num_layers
        # cold: the header at once, alone (the producer takes a while), then one chunk per layer
        assert cold[0].WhichOneof("body") == "header" and len(cold) == n + 1
        assert not any(m.chunk.HasField("header") for m in cold[1:])
        # warm: one message less; the header rides with chunk 0 and says it was a cache hit
        assert len(warm) == n and warm[0].chunk.seq == 0 and warm[0].chunk.header.cache_hit
        assert not any(m.chunk.HasField("header") for m in warm[1:])
    finally:
        await client.close()
        await node.stop()


@pytest.mark.timeout(60)
async def test_requests_for_the_same_prompt_at_once_share_one_transfer(rt):
    """n > 1 / best_of: three requests with one prompt and method, started together while the
    producer is slow, make ONE transfer; the other two copy its layers as they land. All equal
    the local result. If that transfer fails, each waiting request runs its own."""
    import threading

    from serving_helpers import SlowRuntime, wait_until

    release = threading.Event()  # the producer's first layer waits for it: the transfer is live until then
    node = await start_prefill(SlowRuntime(rt, delay=0.05, on_layer=lambda layer: release.wait(10)))
    peers, fill = await make_decode(rt, [node.address])
    engine = engine_for(rt)

    def readers() -> int:  # fills using the one live transfer (its leader included)
        return sum(s.readers for s in fill.shared.live.values())

    try:
        p = prompts(1, seed=33)[0]
        want = await greedy(engine, "l", p)
        together = asyncio.gather(*(greedy(engine, f"n{i}", p, "identity", fill) for i in range(3)))
        # held until all three have joined, however slow the machine is to start the other two
        joined = await wait_until(lambda: readers() == 3, 20)
        release.set()
        got = await together
        assert joined, fill.shared.live
        assert got == [want] * 3
        assert fill.stats.num_transfers == 1 and fill.shared.num_shared == 2 and fill.shared.live == {}
        assert await settled(node, 1)

        real = fill._fill
        calls = []

        async def first_fails(req, sink):
            calls.append(req.request_id)
            if len(calls) == 1:
                # the leader fails only once the other two have joined its transfer (waited for:
                # a fixed sleep let a slow machine fail it before they joined)
                assert await wait_until(lambda: readers() == 3, 20), fill.shared.live
                from scd_serve.errors import TransferFailed
                raise TransferFailed("injected: the shared transfer fails")
            return await real(req, sink)

        fill._fill = first_fails
        fill.config = dataclasses.replace(fill.config, max_attempts=1)
        results = await asyncio.gather(*(greedy(engine, f"f{i}", p, "identity", fill) for i in range(3)),
                                       return_exceptions=True)
        assert sum(r == want for r in results) == 2 and len(calls) == 3  # the two readers transferred alone
        assert fill.shared.num_shared == 2 and fill.shared.live == {}
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()


async def _chunks(client, rid: str, tokens: list[int], **fields) -> list:
    call = client.prefill(pb.PrefillRequest(request_id=rid, token_ids=tokens, method="identity", **fields), timeout=10)
    return [m.chunk for m in [msg async for msg in call] if m.WhichOneof("body") == "chunk"]


@pytest.mark.timeout(60)
async def test_the_last_row_rides_with_each_layer_for_the_consumers_own_model(rt):
    """PrefillRequest.last_token from a consumer running the worker's model: every layer's chunk
    carries the last token's K/V row, the last one its output too, each the model's own; never
    kept in the code cache, never for another model."""
    node = await start_prefill(rt)
    client = PrefillClient(node.address, TransportConfig())
    try:
        prompt = prompts(1, seed=11)[0]
        tokens, last, n = prompt[:-1], prompt[-1], rt.spec.num_layers
        full = rt.prefill(torch.tensor(prompt))  # keys [L, T, kv_heads, hd], logits [T, vocab]
        chunks = await _chunks(client, "a", tokens, last_token=last, consumer_fingerprint=rt.fingerprint)
        codes = [decode_code(c.tensors, layer) for c in chunks for layer in range(c.layer_start, c.layer_end)]
        assert len(codes) == n
        for layer, code in enumerate(codes):
            assert torch.allclose(code["last.k"].float(), full.keys[layer, -1:].float(), atol=1e-5)
            assert ("last.h" in code) == (layer == n - 1)
            assert code["k"].shape[0] == len(tokens)  # the codes cover the handoff's rows only
        first = rt.logits_of(codes[-1]["last.h"])[0]  # [vocab]
        assert torch.allclose(first, full.logits[-1], atol=1e-4)
        # the same prompt again: the code cache's codes, without the row
        again = await _chunks(client, "b", tokens, last_token=last, consumer_fingerprint=rt.fingerprint)
        assert node.servicer.cache.num_hits == 1
        assert not [t.name for c in again for t in c.tensors if t.name.startswith("last.")]
        # another consumer's model (or none named): no row
        other = await _chunks(client, "c", prompt[1:-1], last_token=last, consumer_fingerprint="another")
        assert not [t.name for c in other for t in c.tensors if t.name.startswith("last.")]
    finally:
        await client.close()
        await node.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["identity", "raw"])
async def test_the_first_token_comes_from_the_producers_last_row_and_equals_local(rt, method):
    """P/D with one model: the decode side takes its first token from the row the worker shipped
    (no first step of its own) and every token is the local prefill's; a resend from the code
    cache carries no row, and the engine runs that step itself, to the same tokens."""
    node = await start_prefill(rt, methods=(method,))
    peers, fill = await make_decode(rt, [node.address], method=method)
    engine = engine_for(rt, prefix_caching=False)  # a repeat is the producer code cache's to serve
    try:
        ps = prompts(3, seed=12)
        local = [await greedy(engine, f"l{i}", p) for i, p in enumerate(ps)]
        rows, ahead = engine.stats()["num_last_rows"], engine.stats()["num_steps_ahead"]
        assert [await greedy(engine, f"d{i}", p, method, fill) for i, p in enumerate(ps)] == local
        assert engine.stats()["num_last_rows"] == rows + 3 and fill.stats.num_cache_hits == 0
        assert engine.stats()["num_steps_ahead"] == ahead  # no first step ran here
        assert await greedy(engine, "again", ps[0], method, fill) == local[0]
        assert fill.stats.num_cache_hits == 1 and engine.stats()["num_last_rows"] == rows + 3
        assert engine.stats()["num_steps_ahead"] == ahead + 1  # the engine was idle: run as the K/V landed
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()
