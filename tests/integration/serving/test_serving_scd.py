"""The `scd` method over gRPC with a real codebook directory: handshake, transfer, refusal."""

from contextlib import asynccontextmanager

import pytest

from scd_serve.calibration.assemble import build_codebook
from scd_serve.calibration.fit import collect_rows, fit_layer
from scd_serve.codec.plan import REUSE, LayerPlan, Plan
from scd_serve.codec.codec_spec import spec_of

from serving_helpers import engine_for, greedy, make_decode, prompts, start_prefill, tiny_runtime

pytestmark = pytest.mark.timeout(90)


@asynccontextmanager
async def scd_stack(rt, book):
    """A prefill worker serving `scd` from `book`, the decode side's peers and fill, and an engine
    (all the same model): -> (node, peers, fill, engine), stopped on the way out."""
    node = await start_prefill(rt, methods=("scd",), codebook=book)
    peers, fill = await make_decode(rt, [node.address], method="scd", codebook=book)
    engine = engine_for(rt)
    try:
        assert peers.ready(), peers.why_not_ready()
        yield node, peers, fill, engine
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()


def save_codebook(rt, path, rank, run_from=None, replay=0, head=0):
    """run_from: the scd plan runs the consumer's layers from there on a full-rank residual code;
    replay: the consumer computes the handoff's last tokens itself (codec/base.py), head its first
    (codec/rebuild.py)."""
    spec = spec_of(rt)
    rows = collect_rows(rt, rt, [__import__("torch").tensor(p) for p in prompts(6, seed=11)], max_rows=4096,
                        run_layers=() if run_from is None else (run_from,))
    fits = [fit_layer(r, spec.kv_width, (8, spec.hidden_size), aligner_width=32) for r in rows]
    plan = Plan(tuple(LayerPlan(REUSE, rank, rank) for _ in range(spec.num_layers)))
    scd = plan if run_from is None else Plan.with_run(plan, run_from, spec.hidden_size)
    book = build_codebook(fits, {"scd": scd, "reuse": plan}, spec, spec)
    book.manifest["replay_tokens"], book.manifest["head_tokens"] = replay, head
    book.save(path)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("scd")
    rt = tiny_runtime(root / "model")
    full = save_codebook(rt, root / "book-full", spec_of(rt).kv_width)
    low = save_codebook(rt, root / "book-low", 4)
    return rt, full, low


async def test_scd_full_rank_same_model_matches_local_greedy(setup):
    rt, full, _ = setup
    async with scd_stack(rt, full) as (node, peers, fill, engine):
        info = peers.peers[node.address].info
        assert [c.codec_id for c in info.codecs] == ["scd"] and info.codecs[0].codebook_id
        for i, p in enumerate(prompts(3, seed=5)):
            assert await greedy(engine, f"s{i}", p, "scd", fill) == await greedy(engine, f"l{i}", p)
        assert fill.stats.num_transfers == 3 and fill.stats.payload_bytes > 0


async def test_a_run_of_the_upper_layers_serves_concurrent_prompts_as_local_greedy(setup, tmp_path):
    """The scd plan runs the consumer's own layers from the middle: the prefill worker ships the
    residual there (and nothing above), each decode-side transfer holds its own run."""
    import asyncio

    rt, full, _ = setup
    book = save_codebook(rt, tmp_path / "book-run", spec_of(rt).kv_width, run_from=spec_of(rt).num_layers // 2)
    async with scd_stack(rt, book) as (_, peers, fill, engine):
        batch = prompts(4, seed=6)
        got = await asyncio.gather(*(greedy(engine, f"r{i}", p, "scd", fill) for i, p in enumerate(batch)))
        assert got == [await greedy(engine, f"l{i}", p) for i, p in enumerate(batch)]
        # fp16 codes: K/V below the run, the residual at its first layer, nothing above
        spec, half = spec_of(rt), spec_of(rt).num_layers // 2
        shipped, raw = half * 2 * spec.kv_width + spec.hidden_size, spec.num_layers * 2 * spec.kv_width
        assert fill.stats.num_transfers == 4 and fill.stats.payload_bytes * raw == fill.stats.raw_kv_bytes * shipped


async def test_a_replayed_tail_is_not_shipped_and_serves_as_local_greedy(setup, tmp_path):
    """A codebook that replays 5 tokens: the prefill worker gets the handoff less its tail, the
    engine prefills the tail over the rebuilt rest; concurrent requests for one prompt share the
    transfer (decode/shared.py) and each prefills its own tail."""
    import asyncio

    rt, _, _ = setup
    book = save_codebook(rt, tmp_path / "book-replay", spec_of(rt).kv_width, replay=5)
    async with scd_stack(rt, book) as (_, peers, fill, engine):
        batch = prompts(4, seed=7)
        batch += [batch[0], batch[0]]  # one prompt three times at once
        got = await asyncio.gather(*(greedy(engine, f"t{i}", p, "scd", fill) for i, p in enumerate(batch)))
        assert got == [await greedy(engine, f"l{i}", p) for i, p in enumerate(batch)]
        s = fill.stats
        shipped = sum(max(1, len(p) - 1 - 5) for p in batch[:4])
        handoff = sum(len(p) - 1 for p in batch[:4])
        # full-rank fp16 codes weigh what raw K/V of the same tokens does: only the tail is missing
        assert (s.num_transfers, fill.shared.num_shared) == (4, 2)
        assert s.payload_bytes * handoff == s.raw_kv_bytes * shipped


async def test_a_head_is_computed_on_the_decode_side_and_not_shipped(setup, tmp_path):
    """A codebook whose head is 6 tokens: the prefill worker is asked for the rows after it, the
    decode worker computes the head's rows itself (while the codes travel) and serves what a
    local prefill does; with a run the codes carry every row and the head replaces the first."""
    import asyncio

    rt, _, _ = setup
    spec = spec_of(rt)
    book = save_codebook(rt, tmp_path / "book-head", spec.kv_width, head=6)
    async with scd_stack(rt, book) as (_, peers, fill, engine):
        batch = prompts(3, seed=8)
        got = await asyncio.gather(*(greedy(engine, f"h{i}", p, "scd", fill) for i, p in enumerate(batch)))
        assert got == [await greedy(engine, f"l{i}", p) for i, p in enumerate(batch)]
        s = fill.stats
        # a handoff of 5 tokens (a 6-token prompt) still ships its last row: its head is 4
        shipped, handoff = sum(len(p) - 1 - min(6, len(p) - 2) for p in batch), sum(len(p) - 1 for p in batch)
        assert s.num_transfers == 3 and s.payload_bytes * handoff == s.raw_kv_bytes * shipped
    run = save_codebook(rt, tmp_path / "book-head-run", spec.kv_width, run_from=spec.num_layers // 2, head=6)
    async with scd_stack(rt, run) as (_, peers, fill, engine):
        p = prompts(1, seed=9)[0]
        assert await greedy(engine, "hr", p, "scd", fill) == await greedy(engine, "lr", p)
        half = spec.num_layers // 2
        per_row, raw = half * 2 * spec.kv_width + spec.hidden_size, spec.num_layers * 2 * spec.kv_width
        assert fill.stats.payload_bytes * raw == fill.stats.raw_kv_bytes * per_row  # every row


async def test_streams_of_rank_zero_ship_nothing_and_serve(setup, tmp_path):
    """A plan whose Reuse streams may have rank 0 (the stream's mean and prior alone): the prefill
    worker ships only the other codes, a layer with none ships an empty code, the request serves."""
    import torch

    rt, _, _ = setup
    spec = spec_of(rt)
    rows = collect_rows(rt, rt, [torch.tensor(p) for p in prompts(6, seed=11)], max_rows=4096)
    fits = [fit_layer(r, spec.kv_width, (8, spec.hidden_size), aligner_width=32) for r in rows]
    d = spec.kv_width
    plan = Plan((LayerPlan(REUSE, 0, d), LayerPlan(REUSE, 0, 0)) + (LayerPlan(REUSE, d, d),) * (spec.num_layers - 2))
    book = str(build_codebook(fits, {"scd": plan, "reuse": plan}, spec, spec).save(tmp_path / "book0"))
    async with scd_stack(rt, book) as (_, peers, fill, engine):
        assert len(await greedy(engine, "z", prompts(1, seed=5)[0], "scd", fill)) == 12
        shipped, raw = plan.code_width(), spec.num_layers * 2 * d
        assert shipped == d + (spec.num_layers - 2) * 2 * d
        assert fill.stats.num_transfers == 1 and fill.stats.payload_bytes * raw == fill.stats.raw_kv_bytes * shipped


async def test_decode_with_another_codebook_is_refused(setup):
    rt, full, low = setup
    node = await start_prefill(rt, methods=("scd",), codebook=full)
    peers, _ = await make_decode(rt, [node.address], method="scd", codebook=low)
    try:
        assert not peers.ready()
        assert "codebook_id[scd]" in peers.why_not_ready()
    finally:
        await peers.close()
        await node.stop()


async def test_cross_model_pair_scd_default_handshake_and_transfer(tmp_path):
    """Producer != consumer (the demo pair's shape): scd stays the default, handshake passes; the
    codes read the producer's attention input, as calibrate fits two models' (codec/base.py), so
    the prefill worker captures it for every layer."""
    import torch

    from scd_serve.codec.base import ATTN_INPUTS
    from scd_serve.decode.main import resolve_method

    a = tiny_runtime(tmp_path / "producer", seed=0)
    b = tiny_runtime(tmp_path / "consumer", seed=1)
    rows = collect_rows(a, b, [torch.tensor(p) for p in prompts(6, seed=11)], max_rows=4096, inputs=ATTN_INPUTS)
    d = spec_of(b).kv_width
    fits = [fit_layer(r, d, (8, 32), aligner_width=32, inputs=ATTN_INPUTS) for r in rows]
    plan = Plan(tuple(LayerPlan(REUSE, 8, 16) for _ in range(spec_of(b).num_layers)))
    built = build_codebook(fits, {"scd": plan, "reuse": plan}, spec_of(a), spec_of(b))
    assert built.manifest["code_inputs"] == ATTN_INPUTS
    book = str(built.save(tmp_path / "book"))
    assert resolve_method(b, book, "scd", explicit=False) == "scd"
    assert resolve_method(b, None, "scd", explicit=False) == "raw"  # no codebook: raw, with a warning
    with pytest.raises(Exception, match="cannot be used"):
        resolve_method(a, book, "scd", explicit=True)  # a codebook for another consumer
    node = await start_prefill(a, methods=("scd", "identity"), codebook=book)
    peers, fill = await make_decode(b, [node.address], method="scd", codebook=book)
    engine = engine_for(b)
    try:
        assert peers.ready(), peers.why_not_ready()
        out = await greedy(engine, "x", prompts(1, seed=9)[0], "scd", fill)
        assert len(out) == 12 and fill.stats.num_transfers == 1
        assert fill.stats.payload_bytes < fill.stats.raw_kv_bytes  # rank 8/16 of 32: smaller than 16-bit K/V
        # a decode worker holding the producer's model instead is refused by the codebook check
        wrong, _ = await make_decode(a, [node.address], method="scd", codebook=book)
        await wrong.close()
        assert not wrong.ready() and "cannot build consumer half of 'scd'" in wrong.why_not_ready()
    finally:
        await engine.stop(grace_s=1)
        await peers.close()
        await node.stop()
