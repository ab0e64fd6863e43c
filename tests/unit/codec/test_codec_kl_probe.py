"""The KL probe starts each measurement at its lowest changed layer: the same numbers as
running the consumer's whole forward, whatever earlier measurements changed."""

from __future__ import annotations

import pytest
import torch

from scd_serve.calibration.kl_probe import KLProbe, kl_divergence, make_examples
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    a = ModelRuntime.load(save_tiny_model(root / "a", "qwen2", seed=0, tokenizer=False, num_hidden_layers=4))
    b = ModelRuntime.load(save_tiny_model(root / "b", "qwen2", seed=1, tokenizer=False, num_hidden_layers=4))
    return a, b


def whole_forward_kl(consumer, ex, replace) -> tuple[float, int]:
    """The reference: the measured layers written into a fresh oracle pool, every layer run."""
    pool = consumer.new_kv_pool(len(ex.blocks), ex.pool.block_size)
    for layer, s in enumerate(ex.consumer):
        k, v = replace[layer](ex, layer) if layer in replace else (s.keys, s.values)
        consumer.write_kv(pool, ex.blocks, layer, k, v)
    kl = kl_divergence(consumer.extend(pool, [(ex.blocks, ex.prefix, ex.feed)])[0], ex.oracle_logits)
    return float(kl.sum()), kl.numel()


def test_measurements_equal_the_whole_forward_in_any_order(pair):
    producer, consumer = pair
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(0, 256, (n,), generator=gen), torch.randint(0, 256, (5,), generator=gen))
             for n in (40, 23)]
    probe = KLProbe(consumer, make_examples(producer, consumer, pairs, tail=3))

    def producer_kv(ex, layer):  # what raw reuse ships: a change the consumer notices at every layer
        return ex.producer[layer].keys, ex.producer[layer].values

    # a low layer, then higher ones (their feed rows below must be the oracle's again), then none
    for layers in ([0], [3], [1, 2], [2], [0, 3], [], [1]):
        replace = {i: producer_kv for i in layers}
        sums = [whole_forward_kl(consumer, ex, replace) for ex in probe.examples]
        want = sum(s for s, _ in sums) / sum(n for _, n in sums)
        assert probe.measure(replace) == pytest.approx(want, rel=1e-6, abs=1e-9), layers
        if not layers:
            assert want == pytest.approx(0.0, abs=1e-9)
        else:
            assert want > 1e-4  # each of these changes the consumer's answer
