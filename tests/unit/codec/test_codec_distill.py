"""Distillation of the scd plan's decoders on the consumer's own KL (calibration/distill.py)."""

import pytest
import torch

from scd_serve import codec
from scd_serve.calibration.distill import make_examples, distill, suffix_logits, top_kl
from scd_serve.calibration.kl_probe import KLProbe, make_examples as probe_examples
from scd_serve.config.codec import CalibrateConfig
from scd_serve.model import ModelRuntime
from scd_serve.model.tiny import save_tiny_model
from scd_serve.quality.calibrate import calibrate, measure_codec

from codec_pair import make_pair, prompts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_suffix_logits_with_its_own_kv_are_the_consumers_prefill(tmp_path, arch):
    rt = ModelRuntime.load(save_tiny_model(tmp_path / arch, arch, seed=3, num_hidden_layers=2))
    ids = prompts(1, 40)[0][0]
    full = rt.prefill(ids)
    prefix = 31
    own = [s for _, s in rt.iter_prefill(ids[:prefix], compute_logits=False)]
    got = suffix_logits(rt, [s.keys for s in own], [s.values for s in own], ids[prefix:])
    torch.testing.assert_close(got, full.logits[prefix:], rtol=1e-4, atol=1e-4)


def test_top_kl_is_a_kl_that_overconfidence_cannot_lower():
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(6, 50, generator=gen), -1)
    logq = torch.log_softmax(torch.randn(6, 50, generator=gen), -1)
    full = (logp.exp() * (logp - logq)).sum(-1)
    top = logp.topk(8, -1)
    # the whole vocabulary as the top: the full KL
    every = logp.topk(50, -1)
    torch.testing.assert_close(top_kl(every.values, every.indices, logq), full, rtol=1e-4, atol=1e-5)
    got = top_kl(top.values, top.indices, logq)
    assert (got >= 0).all() and (got <= full + 1e-5).all()
    assert float(top_kl(top.values, top.indices, logp).abs().max()) < 1e-5  # zero at q == p
    # q = p with the rest's mass moved onto the top tokens: the sum over the top alone goes below
    # zero for it (what distillation used to chase); this loss says it is worse than q == p
    sharp = torch.full_like(logp, -1e9).scatter(-1, top.indices, torch.log_softmax(top.values, -1))
    truncated = (top.values.exp() * (top.values - sharp.gather(-1, top.indices))).sum(-1)
    assert (truncated < 0).all() and (top_kl(top.values, top.indices, sharp) > 0.1).all()


@pytest.fixture(scope="module")
def closed_form(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    producer, consumer = make_pair(root, layers=2, noise=0.3)
    pairs = prompts(130, 32)
    cfg = CalibrateConfig(rebuild_cost="counted", kl_budget=0.05, max_rows=2048, aligner_steps=0, max_patches=1, probe_tail=1,
                          distill_steps=0)
    book = calibrate(producer, consumer, [p for p, _ in pairs[:30]], pairs[120:], cfg, show_progress=False).codebook
    return producer, consumer, pairs, book


def test_distillation_lowers_the_kl_and_leaves_the_payload_alone(closed_form):
    """On this random pair the closed form is already near what its codes allow, so the test
    starts from decoders that know nothing (zeroed): distillation must find a way down through
    the consumer's forward alone, on prompts it did not train on, and write it back where
    serving reads it."""
    producer, consumer, pairs, book = closed_form
    book = codec.Codebook(dict(book.manifest), {k: v * 0 if ".dec.r" in k or k.endswith("g.r64.linear.weight")
                                                else v.clone() for k, v in book.tensors.items()})
    scd = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    state = next(iter(producer.iter_prefill(pairs[0][0], compute_logits=False)))[1]
    code_before = scd.encode_layer(0, state)
    tensors_before = {k: v.clone() for k, v in book.tensors.items()}
    run = book.plan("scd").run_layer  # the plan may run the top layer: the probe keeps its residual
    probe = KLProbe(consumer, probe_examples(producer, consumer, pairs[120:], tail=8,
                                             residual_layers=() if run is None else (run,)))
    kl_before = measure_codec(probe, scd, consumer)

    examples = make_examples(scd, producer, consumer, pairs[:120], tail=8)
    assert [ex.feed.shape[0] for ex in examples] == [11] * 120  # the last 8 prompt tokens + answer[:-1]
    out = distill(scd, consumer, examples, steps=60, lr=3e-3, batch=8)
    assert (out["train_examples"], out["held_out_examples"]) == (100, 20)
    assert out["held_out_kl_after"] < 0.8 * out["held_out_kl_before"] and out["step_kept"] > 0

    changed = {k for k, v in book.tensors.items() if k not in tensors_before or not torch.equal(v, tensors_before[k])}
    # decoders, aligners, and refiners (a tuned one beside the stream's, at the plan's rank)
    assert changed and all(".dec.r" in k or ".h.g.r" in k or ".ref_r" in k for k in changed)
    tuned = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    code_after = tuned.encode_layer(0, state)
    assert code_after.keys() == code_before.keys()
    assert all(torch.equal(code_after[k], code_before[k]) for k in code_before)  # same bytes on the wire
    kl_after = measure_codec(probe, tuned, consumer)
    assert kl_after["payload_ratio"] == kl_before["payload_ratio"]
    # on prompts neither fitted nor used to pick the step (measured: 0.150 -> 0.099)
    assert kl_after["kl"] < 0.8 * kl_before["kl"]


def test_prompts_without_answers_feed_their_last_tokens(closed_form):
    producer, consumer, pairs, book = closed_form
    scd = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    bare = [(p, torch.zeros(0, dtype=torch.long)) for p, _ in pairs[:2]]
    examples = make_examples(scd, producer, consumer, bare, tail=1)
    assert [ex.feed.tolist() for ex in examples] == [p[-16:].tolist() for p, _ in bare]
    assert all(z.shape[0] == 32 - 16 for layer in examples[0].codes for z in layer.values())  # the prefix only
