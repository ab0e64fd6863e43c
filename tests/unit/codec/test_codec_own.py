"""An own layer (plan.py): layer 0's input is the token alone, so the consumer computes its K/V
from its own embeddings: exact, nothing shipped. Plan rules, exactness, and calibration's use."""

import pytest
import torch

from scd_serve import codec
from scd_serve.codec.plan import OWN, PATCH, REUSE, RUN, LayerPlan, Plan
from scd_serve.codec.scd import own_kv
from scd_serve.config.codec import CalibrateConfig
from scd_serve.quality.calibrate import calibrate

from codec_pair import make_pair, prompts


def test_only_layer_zero_can_be_own_and_it_ships_nothing():
    plan = Plan((LayerPlan(OWN), LayerPlan(REUSE, 4, 4), LayerPlan(PATCH, r_h=8)))
    assert plan.layers[0].streams == () and plan.code_width() == 8 + 8
    assert Plan.from_json(plan.to_json()) == plan and plan.patch_layers == (2,)
    assert Plan.with_run(plan, 1, 16).layers[0].mode == OWN
    with pytest.raises(ValueError, match="only layer 0"):
        Plan((LayerPlan(REUSE, 4, 4), LayerPlan(OWN)))
    with pytest.raises(ValueError, match="ships nothing"):
        LayerPlan(OWN, r_h=4)
    assert LayerPlan(RUN, r_h=0).streams == ()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    producer, consumer = make_pair(root, layers=3)
    pairs = prompts(10, 32)
    cfg = CalibrateConfig(rebuild_cost="counted", kl_budget=0.5, max_rows=1024, aligner_steps=0, max_patches=1, distill_steps=5,
                          distill_batch=2)
    result = calibrate(producer, consumer, [p for p, _ in pairs[:6]], pairs[6:8], cfg, show_progress=False,
                       report_pairs=pairs[8:])
    return producer, consumer, result


def test_own_layer_is_the_consumers_own_prefill_exactly(calibrated):
    producer, consumer, result = calibrated
    ids = prompts(1, 24, seed=5)[0][0]
    own = next(iter(consumer.iter_prefill(ids, compute_logits=False)))[1]
    k, v = own_kv(consumer, 0, ids)
    assert torch.allclose(k, own.keys, atol=1e-6) and torch.allclose(v, own.values, atol=1e-6)


def test_calibration_computes_layer_zero_itself_in_every_plan(calibrated):
    producer, consumer, result = calibrated
    book = result.codebook
    for name in ("scd", "reuse"):
        assert book.plan(name).layers[0].mode == OWN
    ids = prompts(1, 20, seed=7)[0][0]
    states = [s for _, s in producer.iter_prefill(ids, compute_logits=False)]
    oracle = next(iter(consumer.iter_prefill(ids, compute_logits=False)))[1]
    for name in ("scd", "scd-int8", "prior-only"):  # zero payload at layer 0, its K/V the consumer's own
        c = codec.build(name, producer=producer, consumer=consumer, codebook=book)
        code = c.encode_layer(0, states[0])
        assert codec.payload_bytes(code) == 0 and not c.states_needed(0)
        k, v = c.decode_layer(0, code, consumer, tokens=ids)
        assert torch.allclose(k, oracle.keys, atol=1e-6) and torch.allclose(v, oracle.values, atol=1e-6)
    # the figures are measured on the report prompts, which nothing was fitted or chosen on
    stats = book.manifest["calibration"]
    assert stats["report"]["held_out"] and stats["report"]["prompts"] == 2
    assert result.methods["prior-only"]["payload_ratio"] == 0


def test_a_rank_zero_stream_is_its_prior_and_ships_nothing(calibrated):
    """A Reuse stream of rank 0 decodes to the stream's mean and token prior (what prior-only
    rebuilds), and the producer sends no code for it."""
    from scd_serve.codec.codebook import Codebook

    producer, consumer, result = calibrated
    book = result.codebook
    reuse = next(i for i, lp in enumerate(book.plan("reuse").layers) if lp.mode == REUSE)
    r_v = book.plan("reuse").layers[reuse].r_v
    layers = list(book.plan("reuse").layers)
    layers[reuse] = LayerPlan(REUSE, 0, r_v)
    plans = dict(book.manifest["plans"], scd=Plan(tuple(layers)).to_json())
    zero = Codebook(dict(book.manifest, plans=plans), dict(book.tensors))
    zero.validate()
    c = codec.build("scd", producer=producer, consumer=consumer, codebook=zero)
    prior_only = codec.build("prior-only", producer=producer, consumer=consumer, codebook=book)
    ids = prompts(1, 20, seed=9)[0][0]
    state = [s for _, s in producer.iter_prefill(ids, compute_logits=False)][reuse]
    code = c.encode_layer(reuse, state)
    # two models: the value code reads the layer's attention input (codec/base.py ATTN_INPUTS)
    assert set(code) == {"zv"} and c.states_needed(reuse) == frozenset({"attn_input"})
    k, v = c.decode_layer(reuse, code, consumer, tokens=ids)
    k0, v0 = prior_only.decode_layer(reuse, {}, consumer, tokens=ids)
    assert torch.equal(k, k0) and not torch.equal(v, v0)
    both = Plan(tuple(LayerPlan(REUSE, 0, 0) if i == reuse else lp for i, lp in enumerate(layers)))
    none = codec.build("scd", producer=producer, consumer=consumer,
                       codebook=Codebook(dict(book.manifest, plans=dict(plans, scd=both.to_json())), dict(book.tensors)))
    assert none.encode_layer(reuse, state) == {}
    k, v = none.decode_layer(reuse, {}, consumer, tokens=ids)
    assert torch.equal(k, k0) and torch.equal(v, v0)
