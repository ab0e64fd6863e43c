"""Engine on a tiny random llama (scd_serve.model): exactness against the runtime's own greedy."""

import asyncio
import threading

import pytest

from scd_serve.config.engine import EngineConfig
from scd_serve.engine.engine import Engine
from scd_serve.engine.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    from scd_serve.model import ModelRuntime
    from scd_serve.model.tiny import save_tiny_model
    return ModelRuntime.load(save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


@pytest.fixture
async def engine(runtime):
    eng = Engine(runtime, EngineConfig(num_blocks=128, block_size=8, max_model_len=256, max_num_seqs=16,
                                       max_concurrent=32, max_prefill_tokens=64, idle_poll_s=0.01))
    eng.start()
    yield eng
    await eng.stop(1)


def req(rid, ids, n, **params):
    params.setdefault("temperature", 0)
    return GenerationRequest(rid, list(ids), SamplingParams(max_tokens=n, **params))


async def run(eng, r, kv_fill=None):
    return [e.token_id async for e in eng.generate(r, kv_fill)]


def prompts(rt, n):
    return [rt.tokenizer.encode(f"question {i}: " + "why " * (i % 5) + "?") for i in range(n)]


async def test_greedy_equals_runtime_reference(engine, runtime):
    for ids in prompts(runtime, 3) + [[7]]:
        assert await run(engine, req("a", ids, 12)) == runtime.generate_greedy(ids, 12)


async def test_sixteen_concurrent_equal_solo(engine, runtime):
    ps = prompts(runtime, 16)
    solo = [await run(engine, req(f"s{i}", p, 10)) for i, p in enumerate(ps)]
    together = await asyncio.gather(*(run(engine, req(f"c{i}", p, 10)) for i, p in enumerate(ps)))
    assert together == solo


async def test_seed_determinism(engine, runtime):
    ids = runtime.tokenizer.encode("seeded sampling")
    a = await run(engine, req("a", ids, 16, temperature=0.8, top_k=50, seed=5))
    b = await run(engine, req("b", ids, 16, temperature=0.8, top_k=50, seed=5))
    assert a == b


async def test_lossless_fill_equals_local(engine, runtime):
    ps = prompts(runtime, 8)
    local = await asyncio.gather(*(run(engine, req(f"l{i}", p, 10)) for i, p in enumerate(ps)))
    filled = await asyncio.gather(*(run(engine, req(f"f{i}", p, 10), layer_fill(runtime)) for i, p in enumerate(ps)))
    assert filled == local


async def test_abort_frees_blocks(engine):
    gen = engine.generate(req("a", [1, 2, 3, 4], 200))
    async for _ in gen:
        break
    await gen.aclose()
    for _ in range(100):
        s = engine.stats()
        if s["num_free_blocks"] == s["num_total_blocks"] and not engine.scheduler.has_unfinished():
            break
        await asyncio.sleep(0.01)
    assert s["num_free_blocks"] == s["num_total_blocks"] and not engine.scheduler.has_unfinished()


def count_decodes(monkeypatch, runtime):
    """Record the positions every decode_step is asked to feed."""
    fed, real = [], runtime.decode_step
    monkeypatch.setattr(runtime, "decode_step", lambda pool, items: (fed.extend(c for _, c, _ in items),
                                                                    real(pool, items))[1])
    return fed


def layer_fill(runtime, order=None, delay_s=0.0):
    async def fill(r, sink):  # what a lossless transfer delivers: the consumer's own K/V, in `order`
        out = runtime.prefill(r.prompt_token_ids[:-1])
        for layer in order or range(sink.num_layers):  # the rows after a cached prefix
            await asyncio.sleep(delay_s)
            sink.write_layer(layer, out.keys[layer][sink.start:], out.values[layer][sink.start:])
    return fill


@pytest.mark.parametrize("order", [None, [1, 0]])
async def test_first_step_runs_ahead_of_a_fill_on_an_idle_engine_and_gives_the_local_tokens(engine, runtime,
                                                                                            monkeypatch, order):
    ps = prompts(runtime, 4)
    local = [await run(engine, req(f"l{i}", p, 6, temperature=0.7, seed=i)) for i, p in enumerate(ps)]
    fed, ahead = count_decodes(monkeypatch, runtime), engine.stats()["num_steps_ahead"]
    fill = layer_fill(runtime, order, delay_s=0.01)
    filled = [await run(engine, req(f"f{i}", p, 6, temperature=0.7, seed=i), fill) for i, p in enumerate(ps)]
    assert filled == local  # same sampled tokens: the logits made ahead are the decode step's
    # the engine decoded every token but the first ones: those came from the steps made ahead
    assert len(fed) == sum(len(t) - 1 for t in filled)
    assert engine.stats()["num_steps_ahead"] == ahead + len(ps)
    assert not engine.runner._ready  # nothing left behind


async def test_a_busy_engine_decodes_the_first_step_in_its_batch(engine, runtime, monkeypatch):
    busy_ids, ids = list(range(5, 45)), prompts(runtime, 1)[0]
    assert len(ids) < len(busy_ids)  # so position len(ids) - 1 is fed only for the filled request
    local = await run(engine, req("l", ids, 3))
    fed, ahead = count_decodes(monkeypatch, runtime), engine.stats()["num_steps_ahead"]
    busy = asyncio.ensure_future(run(engine, req("busy", busy_ids, 60)))
    while engine.stats()["num_running"] < 1:
        await asyncio.sleep(0.005)
    assert await run(engine, req("f", ids, 3), layer_fill(runtime)) == local
    assert len(ids) - 1 in fed  # its first step went through the engine's batch, not ahead
    assert engine.stats()["num_steps_ahead"] == ahead
    await busy


async def test_a_failing_step_ahead_costs_only_the_head_start(engine, runtime, monkeypatch, caplog):
    ids = prompts(runtime, 1)[0]
    local = await run(engine, req("l", ids, 5))

    def broken(pool, items):
        raise RuntimeError("boom")

    monkeypatch.setattr(runtime, "begin_decode_step", broken)
    fed = count_decodes(monkeypatch, runtime)
    assert await run(engine, req("f", ids, 5), layer_fill(runtime)) == local
    assert fed[0] == len(ids) - 1  # the engine decoded the first token itself
    assert "decoding it as usual" in caplog.text


async def test_a_layer_written_again_restarts_the_step_ahead(engine, runtime):
    """A retry rewrites layers the step already read: the first token must come from the K/V
    as finally written, not from the first attempt's."""
    ids = prompts(runtime, 1)[0]
    local = await run(engine, req("l", ids, 4))

    async def retried_fill(r, sink):
        out = runtime.prefill(r.prompt_token_ids[:-1])
        k, v = out.keys[:, sink.start:], out.values[:, sink.start:]  # the rows after a cached prefix
        sink.write_layer(0, -k[0] * 3, v[0] * 5)  # an attempt that broke off after layer 0
        await asyncio.sleep(0.01)
        for layer in range(sink.num_layers):  # the retry writes every layer
            sink.write_layer(layer, k[layer], v[layer])

    ahead = engine.stats()["num_steps_ahead"]
    assert await run(engine, req("f", ids, 4), retried_fill) == local
    assert engine.stats()["num_steps_ahead"] == ahead + 1  # made ahead, on the K/V as finally written


async def test_prefill_chunks_and_decodes_share_one_forward(engine, runtime, monkeypatch):
    """While one request decodes, a long prompt arrives: its chunks run in the same forward as
    the decode steps (mixed_step), and both still equal the runtime's own greedy. The first decode
    step is held until the long prompt is in the engine's inbox, so no machine is too fast for it."""
    calls, entered, release = [], threading.Event(), threading.Event()
    real_mixed, real_decode = type(runtime).mixed_step, type(runtime).decode_step

    def held_decode(self, *a):
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return real_decode(self, *a)

    monkeypatch.setattr(type(runtime), "mixed_step", lambda self, *a: (calls.append(len(a[1])), real_mixed(self, *a))[1])
    monkeypatch.setattr(type(runtime), "decode_step", held_decode)
    short, long = [5, 6, 7], list(range(3, 200))  # 197 tokens: 4 chunks of up to 64
    first = asyncio.ensure_future(run(engine, req("d", short, 40)))
    assert await asyncio.to_thread(entered.wait, 30)  # the short request is decoding
    second = asyncio.ensure_future(run(engine, req("p", long, 8)))
    while engine.stats()["num_requests"] < 2:  # admitted, so its "add" is queued for the next step
        await asyncio.sleep(0.005)
    release.set()
    assert await first == runtime.generate_greedy(short, 40) and await second == runtime.generate_greedy(long, 8)
    assert calls  # at least one step held both a chunk and a decode


def tail_fill(runtime, replay, corrupt_tail=False):
    """A lossless transfer of all but the last `replay` handed-off tokens (a replaying codec):
    the engine must prefill those itself. corrupt_tail: K/V of the whole handoff is written
    first (an attempt of the other length), garbage in the tail, before the limit."""
    async def fill(r, sink):
        handoff = r.prompt_token_ids[:-1]
        out = runtime.prefill(handoff)
        k, v = out.keys[:, sink.start:], out.values[:, sink.start:]  # the rows after a cached prefix
        if corrupt_tail:
            sink.write_layer(0, k[0] * 0 + 9, v[0] * 0 - 9)
        n = max(sink.start + 1, len(handoff) - replay)
        sink.limit(n)
        for layer in range(sink.num_layers):
            sink.write_layer(layer, k[layer][:n - sink.start], v[layer][:n - sink.start])
    return fill


@pytest.mark.parametrize("replay,corrupt", [(3, False), (100, False), (3, True)])
async def test_a_fill_that_leaves_a_replayed_tail_gives_the_local_tokens(engine, runtime, monkeypatch, replay, corrupt):
    ps = [p for p in prompts(runtime, 6) if len(p) > 5]
    local = [await run(engine, req(f"l{i}", p, 8)) for i, p in enumerate(ps)]
    fed = count_decodes(monkeypatch, runtime)
    filled = [await run(engine, req(f"f{i}", p, 8), tail_fill(runtime, replay, corrupt)) for i, p in enumerate(ps)]
    assert filled == local
    # no step ran ahead of the tail: every first token came from the tail's own last chunk (which
    # runs the last prompt token), every later one from a decode step
    assert len(fed) == sum(len(t) - 1 for t in filled)
    assert not engine.runner._ready


async def test_turns_that_reuse_cached_blocks_answer_as_the_model_alone(engine, runtime):
    """Each turn repeats the last one's prompt and answer: its prefill starts after the cached
    blocks, and the greedy tokens are the runtime's own."""
    prompt = runtime.tokenizer.encode("system: you answer in one line. ")
    for turn in range(3):
        prompt = prompt + runtime.tokenizer.encode(f"user: question {turn}? assistant:")
        events = [e async for e in engine.generate(req(f"t{turn}", prompt, 8))]
        tokens = [e.token_id for e in events if e.token_id is not None]
        assert tokens == runtime.generate_greedy(prompt, 8)
        assert (events[-1].usage.cached_tokens > 0) == (turn > 0)
        prompt = prompt + tokens
