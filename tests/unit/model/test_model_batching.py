"""decode_step over random batch layouts (lengths, block sizes, scattered blocks) equals the
last-position logits of a plain prefill; and the same runtime on CUDA where there is one."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model

from model_tol import cross_path_tol


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    # layer 0 full attention, layer 1 a sliding window of 6: both mask paths in one model
    path = save_tiny_model(tmp_path_factory.mktemp("qwen2w"), "qwen2", tokenizer=False,
                           use_sliding_window=True, sliding_window=6, max_window_layers=1)
    return ModelRuntime.load(path)


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5), block_size=st.sampled_from([1, 3, 4, 16]),
       seed=st.integers(0, 1000))
def test_decode_step_equals_prefill_for_any_layout(rt, attention_path, lengths, block_size, seed):
    rng = random.Random(seed)
    prompts = [torch.tensor([rng.randrange(256) for _ in range(n)]) for n in lengths]
    need = [-(-n // block_size) for n in lengths]
    ids = list(range(sum(need) + 3))
    rng.shuffle(ids)  # scattered, out-of-order blocks; a few left unused
    pool = rt.new_kv_pool(len(ids), block_size)
    blocks, at = [], 0
    for n in need:
        blocks.append(ids[at:at + n])
        at += n
    prefixes = [(b, 0, p[:-1]) for b, p in zip(blocks, prompts) if len(p) > 1]
    if prefixes:
        rt.extend(pool, prefixes)
    got = rt.decode_step(pool, [(b, len(p) - 1, int(p[-1])) for b, p in zip(blocks, prompts)])
    want = torch.stack([rt.prefill(p, capture=False).logits[-1] for p in prompts])
    assert (got - want).abs().max() <= cross_path_tol(want)  # decode_step vs prefill: two paths (model_tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(rt):
    gpu = ModelRuntime.load(rt.path, device="cuda")
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0))
    assert (gpu.prefill(ids, capture=False).logits.cpu() - rt.prefill(ids, capture=False).logits).abs().max() <= 1e-3
    assert gpu.generate_greedy(ids, 16) == rt.generate_greedy(ids, 16)
    out = gpu.prefill(ids)
    k, v = gpu.recompute_kv(1, out.attn_inputs[1])
    assert torch.equal(k, out.keys[1]) and k.device.type == "cuda"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return ModelRuntime.load(save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer=False))


@pytest.mark.parametrize("layout", ["consecutive", "scattered"])
@pytest.mark.parametrize("n", [5, 16, 17, 30])
def test_one_sequence_reads_its_blocks_in_place_and_matches_prefill(llama, layout, n, monkeypatch):
    """Attention reads views of the pool: one fused SDPA over one stretch of consecutive blocks,
    per-stretch scores where the blocks are scattered; never index_select (a copy of the cache)."""
    bs, need = 4, -(-n // 4)
    blocks = list(range(3, 3 + need))
    if layout == "scattered":
        blocks[0], blocks[1] = blocks[1], blocks[0]
    pool = llama.new_kv_pool(need + 5, bs)
    prompt = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))
    llama.extend(pool, [(blocks, 0, prompt[:-1])])
    copies = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a: (copies.append(1), real(self, *a))[1])
    got = llama.decode_step(pool, [(blocks, n - 1, int(prompt[-1]))])
    want = llama.prefill(prompt, capture=False).logits[-1]
    assert (got[0] - want).abs().max() <= cross_path_tol(want)  # decode_step vs prefill: two paths (model_tol)
    assert not copies


@pytest.mark.parametrize("model", ["llama", "rt"])  # rt: one full-attention and one sliding-window layer
@pytest.mark.parametrize("layout", ["consecutive", "scattered"])
def test_a_step_layer_reads_only_its_own_layer_of_the_cache(model, layout, request):
    """What running the first step ahead of a fill relies on: layer l of a DecodeStep reads
    only layer l of the pool, so it may run before later layers have landed."""
    model_rt = request.getfixturevalue(model)
    n, bs = 21, 4
    blocks = list(range(2, 2 + -(-n // bs)))
    if layout == "scattered":
        blocks[0], blocks[2] = blocks[2], blocks[0]
    prompt = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3))
    full = model_rt.new_kv_pool(len(blocks) + 3, bs)
    model_rt.extend(full, [(blocks, 0, prompt[:-1])])
    item = (blocks, n - 1, int(prompt[-1]))
    want = model_rt.decode_step(full, [item])

    landing = model_rt.new_kv_pool(len(blocks) + 3, bs)  # layers arrive one by one
    step = model_rt.begin_decode_step(landing, [item])
    for layer in range(model_rt.spec.num_layers):
        landing.k[layer], landing.v[layer] = full.k[layer], full.v[layer]
        step.run_layer()
        assert step.layer == layer + 1 and not landing.k[layer + 1:].any()  # later layers still empty
    assert step.done and torch.equal(step.logits(), want)
    with pytest.raises(RuntimeError, match="every layer"):
        step.run_layer()


@pytest.mark.parametrize("model", ["llama", "rt"])  # rt: one full-attention and one sliding-window layer
def test_mixed_step_equals_extend_then_decode_step(model, request, attention_path):
    """Prefill chunks and decode tokens in one forward (one read of the weights) give the same
    logits and write the same K/V as running them separately; the decode tokens' attention in
    one call over their gathered blocks or each in place."""
    m = request.getfixturevalue(model)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (9, 14, 6, 20)]
    blocks = [[0, 1, 2, 3, 4], [9, 5, 6, 7, 8], [10, 11, 17], [12, 13, 14, 15, 16, 18]]
    pools = [m.new_kv_pool(19, 4) for _ in range(2)]
    for pool in pools:  # sequences 0 and 1 are decoding; 2 and 3 get their first and a later chunk
        m.extend(pool, [(blocks[0], 0, prompts[0][:-1]), (blocks[1], 0, prompts[1][:-1]),
                        (blocks[3], 0, prompts[3][:8])], logits="none")
    chunks = [(blocks[2], 0, prompts[2]), (blocks[3], 8, prompts[3][8:])]
    decodes = [(blocks[0], 8, int(prompts[0][-1])), (blocks[1], 13, int(prompts[1][-1]))]
    sep_chunks = m.extend(pools[0], chunks, logits=["all", "last"])
    sep_decode = m.decode_step(pools[0], decodes)
    mix_chunks, mix_decode = m.mixed_step(pools[1], chunks, ["all", "last"], decodes)
    tol = cross_path_tol(sep_decode)  # one GEMM over all rows vs two: blocking differs (model_tol)
    assert (mix_decode - sep_decode).abs().max() <= tol
    for a, b in zip(mix_chunks, sep_chunks):
        assert a.shape == b.shape and (a - b).abs().max() <= cross_path_tol(b)
    assert (pools[1].k - pools[0].k).abs().max() <= cross_path_tol(pools[0].k)


@pytest.mark.parametrize("model", ["llama", "rt"])
def test_the_last_layer_runs_only_the_rows_whose_logits_are_wanted(model, request, attention_path):
    """A chunk asking for its last logits (or none) runs the last layer's attention and MLP for
    that row only (model/step.py): the same logits as the last of all its rows', the same K/V
    written, and beside a decode token in one step too."""
    m = request.getfixturevalue(model)
    gen = torch.Generator().manual_seed(8)
    prompt, other = torch.randint(0, 256, (21,), generator=gen), torch.randint(0, 256, (7,), generator=gen)
    pools = [m.new_kv_pool(16, 4) for _ in range(3)]
    blocks, other_blocks = [0, 1, 2, 3, 4, 5], [6, 7, 8]
    for pool in pools:  # the first 3 tokens cached the same way in each pool
        m.extend(pool, [(blocks, 0, prompt[:3])], logits="none")
    every = m.extend(pools[0], [(blocks, 3, prompt[3:]), (other_blocks, 0, other)], logits="all")
    last = m.extend(pools[1], [(blocks, 3, prompt[3:]), (other_blocks, 0, other)], logits=["last", "none"])
    assert last[1] is None and (last[0] - every[0][-1:]).abs().max() <= cross_path_tol(every[0])
    m.extend(pools[2], [(blocks, 3, prompt[3:]), (other_blocks, 0, other)], logits="none")
    for pool in pools[1:]:
        assert torch.equal(pool.k, pools[0].k) and torch.equal(pool.v, pools[0].v)
    # with a decode token in the step: its logits as in a decode step of its own
    chunk_logits, decode_logits = m.mixed_step(pools[1], [(other_blocks, 7, prompt[:5])], ["last"],
                                               [(blocks, 21, int(other[0]))])
    alone = m.decode_step(pools[2], [(blocks, 21, int(other[0]))])
    assert (decode_logits - alone).abs().max() <= cross_path_tol(alone)
    assert chunk_logits[0].shape == (1, m.spec.vocab_size)
    # a step resumed past its last layer holds every row: its last row's logits all the same
    every_row = m.begin_extend(pools[0], [(blocks, 3, prompt[3:])], "all")
    every_logits = every_row.logits()[0]
    resumed = m.begin_extend(pools[0], [(blocks, 3, prompt[3:])], "last")
    resumed.resume(m.spec.num_layers, every_row.h)
    assert (resumed.logits()[0] - every_logits[-1:]).abs().max() <= cross_path_tol(every_logits)
