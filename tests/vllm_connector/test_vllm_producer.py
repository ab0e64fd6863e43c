"""VllmProducer (`scd-serve prefill --engine vllm`): the states a prefill worker encodes, read
from vLLM's forward by hooks, equal scd-serve's own producer's, layer by layer, for prompts in
one forward and prompts vLLM prefills in chunks. Run by `make test-vllm` (vLLM's own venv)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("SCD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")

import torch  # noqa: E402

from scd_serve.config.prefill import PrefillConfig  # noqa: E402
from scd_serve.errors import ConfigError  # noqa: E402
from scd_serve.model.runtime import ModelRuntime  # noqa: E402
from scd_serve.model.tiny import save_tiny_model  # noqa: E402
from scd_serve.vllm.producer import VllmProducer  # noqa: E402

pytestmark = pytest.mark.timeout(600)
CHUNK = 64  # vLLM's tokens per step: longer prompts are prefilled in chunks


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("m") / "producer", "qwen2", seed=0, hidden_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                           num_hidden_layers=4, vocab_size=512, max_position_embeddings=1024)
    made = VllmProducer.start(PrefillConfig(model=str(path), max_prompt_tokens=512),
                              {"max_num_batched_tokens": CHUNK, "max_num_seqs": 4})
    yield path, made
    made.llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("length", [1, 20, CHUNK, 3 * CHUNK + 5])
def test_states_equal_scd_serves_producer(producer, length):
    path, vllm_producer = producer
    ours = ModelRuntime.load(path)
    ids = torch.randint(4, 500, (length,), generator=torch.Generator().manual_seed(length))
    want = list(ours.iter_prefill(ids, compute_logits=False, residuals=True))
    got = list(vllm_producer.iter_prefill(ids, compute_logits=False, residuals=True))
    assert [layer for layer, _ in got] == list(range(ours.spec.num_layers))
    for (_, a), (_, b) in zip(want, got):
        for name in ("keys", "values", "attn_input", "residual"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.shape == y.shape, name
            assert torch.allclose(x, y, atol=1e-3, rtol=1e-3), (name, float((x - y).abs().max()))
    without = list(vllm_producer.iter_prefill(ids, compute_logits=False))[0][1]
    assert without.residual is None and torch.equal(without.keys, got[0][1].keys)


def test_refuses_what_it_cannot_serve(producer):
    path, vllm_producer = producer
    assert vllm_producer.max_prompt_tokens == 512  # vLLM samples one token after the longest prompt
    with pytest.raises(ValueError, match="layer states only"):
        vllm_producer.iter_prefill([5, 6], compute_logits=True)
    with pytest.raises(ConfigError, match="enforce_eager"):
        VllmProducer.start(PrefillConfig(model=str(path)), {"enforce_eager": False})


def test_a_prompt_stopped_early_frees_the_engine(producer):
    """A transfer cancelled after its first layer (the prefill service closes the states): the
    engine finishes that prompt's step and takes the next prompt, whose states are whole."""
    path, vllm_producer = producer
    layers = ModelRuntime.load(path, weights=False).spec.num_layers
    first = vllm_producer.iter_prefill(list(range(4, 104)), compute_logits=False)
    assert next(first)[0] == 0
    first.close()
    after = list(vllm_producer.iter_prefill(list(range(4, 54)), compute_logits=False))
    assert [layer for layer, _ in after] == list(range(layers)) and after[-1][1].keys.shape[0] == 50
