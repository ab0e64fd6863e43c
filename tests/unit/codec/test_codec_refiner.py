"""Refiners: a Reuse stream's nonlinear correction from its code and the prompt's token features."""

import pytest
import torch

from scd_serve import codec
from scd_serve.calibration.assemble import build_codebook
from scd_serve.calibration.fit import collect_rows, fit_layer, subtract_priors, train_refiners
from scd_serve.calibration.feature_fit import FeatureFit
from scd_serve.codec.codebook import Codebook
from scd_serve.codec.codec_spec import spec_of
from scd_serve.codec.features import FeatureSpec
from scd_serve.codec.plan import REUSE, LayerPlan, Plan
from scd_serve.codec.refiner import Refiner, fit_refiner

from codec_pair import make_pair, prompts


def synthetic(n: int, seed: int):
    """A code z [n, 3] and features c [n, 4]; the target has a part the code's linear decode
    misses (a product of code and features) and a part the features alone predict (nonlinearly)."""
    gen = torch.Generator().manual_seed(seed)
    z, c = torch.randn(n, 3, generator=gen), torch.randn(n, 4, generator=gen)
    y = torch.stack([z[:, 0] * torch.tanh(2 * c[:, 0]) + z[:, 2] * c[:, 2], c[:, 1].abs() - 0.8], 1)  # [n, 2]
    return z, c, y


def test_a_refiner_starts_as_no_correction_and_round_trips():
    ref = Refiner(max_rank=3, ctx=4, out=2, width=16)
    z, c, _ = synthetic(10, 0)
    assert torch.equal(ref(z, c), torch.zeros(10, 2))
    torch.nn.init.normal_(ref.down.weight)
    loaded = Refiner.from_tensors(ref.tensors(), max_rank=3)
    torch.testing.assert_close(loaded(z[:, :2], c), ref(z[:, :2], c), atol=2e-3, rtol=2e-3)  # fp16 weights
    torch.nn.init.normal_(loaded.mean)
    for rank in (0, 2, 3):  # serving skips the weights of the channels a code lacks: the same numbers
        with torch.no_grad():
            served = loaded(z[:, :rank], c)
        torch.testing.assert_close(served, loaded(z[:, :rank], c), atol=1e-5, rtol=1e-5)


def test_one_refiner_learns_what_the_linear_decode_misses_at_every_rank():
    z, c, y = synthetic(4000, 1)
    ref, err = fit_refiner(z, c, lambda idx, r: y[idx], ranks=[0, 1, 3], width=64, epochs=60)
    # held-out error left, 1.0 = the linear decode's: the features alone recover their part, the
    # full code the product too
    # (rank 0: ~0.82 at best; seeds 0-3 gave 0.86-0.87, rank 1 0.63-0.64, rank 3 0.16-0.24)
    assert err[0] < 0.95 and err[3] < 0.35 and err[3] < err[1] - 0.1 and err[1] < err[0] - 0.1
    zv, cv, yv = synthetic(1000, 2)  # rows it never saw
    left = (ref(zv, cv) - yv).pow(2).sum() / yv.pow(2).sum()
    assert left < 0.35
    # a rank-1 code: the channels it lacks are zero where the refiner reads them (as trained)
    x = ref.inputs(zv[:, :1], cv)
    assert torch.equal(x[:, 1:3], torch.zeros(1000, 2)) and not torch.equal(x[:, 0], torch.zeros(1000))


def test_on_noise_it_keeps_the_linear_decode():
    gen = torch.Generator().manual_seed(3)
    z, c, y = torch.randn(2000, 3, generator=gen), torch.randn(2000, 4, generator=gen), torch.randn(2000, 2, generator=gen)
    _, err = fit_refiner(z, c, lambda idx, r: y[idx], ranks=[0, 3], width=32, epochs=10)
    assert all(e <= 1.0 for e in err.values())  # the kept epoch is never worse than no correction


def test_rows_of_weight_zero_teach_it_nothing():
    """Weighted rows: where a third of the rows' targets are noise of weight zero, it learns the
    clean rows' correction as if the noise were absent; weighed like the rest, the noise costs it."""
    z, c, y = synthetic(3000, 4)
    noisy = torch.arange(3000) % 3 == 0
    y_noisy = torch.where(noisy[:, None], 5 * torch.randn(3000, 2, generator=torch.Generator().manual_seed(5)), y)
    zv, cv, yv = synthetic(1000, 6)

    def left(weights):
        ref, _ = fit_refiner(z, c, lambda idx, r: y_noisy[idx], ranks=[3], width=64, epochs=60, weights=weights)
        with torch.no_grad():
            return float((ref(zv, cv) - yv).pow(2).sum() / yv.pow(2).sum())

    weighted, plain = left((~noisy).float()), left(None)
    assert weighted < 0.2 and plain > 2 * weighted  # seed 4: 0.07 against 0.47


@pytest.fixture(scope="module")
def refined(tmp_path_factory):
    """A tiny two-model pair's layer fits with a feature prior and refiners, and a codebook of a
    Reuse plan at rank 4 (scd) and at rank 0 (reuse)."""
    producer, consumer = make_pair(tmp_path_factory.mktemp("pair"), layers=2)
    fit_prior = FeatureFit(FeatureSpec(taps=2, width=16, rank=4, hidden=spec_of(consumer).hidden_size))
    rows = collect_rows(producer, consumer, [p for p, _ in prompts(8, 40)], max_rows=4096, prior=fit_prior)
    prior, heads = fit_prior.solve()
    ctx = prior.reduce(rows[0]["ctx"])
    fits = []
    for layer, r in enumerate(rows):
        r["ctx"] = ctx
        mine = {s: heads[(layer, s)] for s in "kvh"}
        r = subtract_priors(r, prior, mine)
        fit = fit_layer(r, spec_of(consumer).kv_width, (8,), aligner_width=16)
        fit.priors, fit.prior = mine, prior
        train_refiners(fit, r, [0, 4, 8], width=16, epochs=3)
        assert fit.refiner_err["k"].keys() == {4, 8}  # none for rank 0
        for ref in fit.refiners.values():  # whatever training kept (zero on rows this few): a correction to see
            torch.nn.init.normal_(ref.down.weight, std=0.1)
        fits.append(fit)
    plans = {"scd": Plan(tuple(LayerPlan(REUSE, 4, 4) for _ in range(2))),
             "reuse": Plan(tuple(LayerPlan(REUSE, 0, 0) for _ in range(2)))}
    book = build_codebook(fits, plans, spec_of(producer), spec_of(consumer))
    return producer, consumer, fits, book


def test_the_codebook_decodes_with_its_refiners_and_without_them_as_before(refined):
    producer, consumer, fits, book = refined
    assert book.refiner(1, "k") is not None and book.refiner(1, "v") is not None
    book.validate()
    prompt, _ = prompts(1, 40, seed=9)[0]
    state = dict(producer.iter_prefill(prompt, compute_logits=False))[1]
    with_ref = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    plain_book = Codebook(book.manifest, {k: v for k, v in book.tensors.items() if ".ref." not in k})
    plain = codec.build("scd", producer=producer, consumer=consumer, codebook=plain_book)
    code = with_ref.encode_layer(1, state)
    k, v = with_ref.decode_layer(1, code, consumer, tokens=prompt)
    k0, v0 = plain.decode_layer(1, code, consumer, tokens=prompt)
    # the difference is the refiner's output on the code as shipped and the prompt's features
    ctx = book.context_prior().context(prompt, consumer)
    z = code["zk"].float()
    torch.testing.assert_close((k - k0).flatten(1), book.refiner(1, "k")(z, ctx), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(k, k0)
    # a stream that ships nothing (prior-only, or a rank-0 plan) keeps the linear prior: no refiner
    prior_only = codec.build("prior-only", producer=producer, consumer=consumer, codebook=book)
    kp, _ = prior_only.decode_layer(1, prior_only.encode_layer(1, state), consumer, tokens=prompt)
    plain_prior = codec.build("prior-only", producer=producer, consumer=consumer, codebook=plain_book)
    kp0, _ = plain_prior.decode_layer(1, plain_prior.encode_layer(1, state), consumer, tokens=prompt)
    assert torch.equal(kp, kp0)


def test_calibration_probe_rebuilds_what_the_codec_decodes(refined):
    """The plan search's candidates (calibration/candidates.py) and the served codec agree."""
    from scd_serve.calibration.candidates import Candidates
    from scd_serve.calibration.kl_probe import make_examples

    producer, consumer, fits, book = refined
    prompt, answer = prompts(1, 40, seed=11)[0]
    ex = make_examples(producer, consumer, [(prompt, answer)], tail=4)[0]
    k_cand = Candidates(fits, producer, consumer).reuse_stream(ex, 1, "k", 4)
    scd = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    state = dict(producer.iter_prefill(ex.tokens, compute_logits=False))[1]
    k, _ = scd.decode_layer(1, scd.encode_layer(1, state), consumer, tokens=ex.tokens)
    torch.testing.assert_close(k_cand, k, atol=2e-3, rtol=2e-3)


def test_the_width_keeps_the_refiners_a_small_share_of_a_small_consumers_work():
    from types import SimpleNamespace

    from scd_serve.calibration.fit import REFINER_SHARE, refiner_width
    from scd_serve.codec.codec_spec import CodecSpec

    def consumer(hidden, layers, kv_heads, intermediate):
        spec = CodecSpec(num_layers=layers, hidden_size=hidden, num_kv_heads=kv_heads, head_dim=64, rope_theta=1e4)
        return SimpleNamespace(spec=SimpleNamespace(intermediate_size=intermediate, **spec.to_dict()))

    small = consumer(128, 8, 2, 512)  # a hidden-128 consumer (the zoo's Llama pairs)
    width = refiner_width(small, 14, 64, 256)
    per_token_layers = 8 * (2 * 128 * 128 + 2 * 128 * 128 + 3 * 128 * 512)
    assert 16 <= width < 256 and 14 * width * (64 + 64 + 128) <= REFINER_SHARE * per_token_layers
    assert refiner_width(consumer(896, 24, 2, 4864), 46, 64, 256) == 256  # the 0.5B shape: the cap
    assert refiner_width(consumer(64, 1, 1, 64), 2, 64, 256) == 16  # never below 16


def test_distillation_tunes_the_refiner_for_the_plans_rank_and_leaves_the_others_fit(refined):
    """calibration/distill.py trains a Reuse stream's refiner on the consumer's KL with its
    decoder; the tuned copy is stored for the scd plan's rank (ref_r4) beside the L2 fit, which
    a plan at another rank keeps reading, and which goes where no plan reads it."""
    from scd_serve.calibration.distill import distill, make_examples as distill_examples

    producer, consumer, fits, _ = refined
    plans = {"scd": Plan(tuple(LayerPlan(REUSE, 4, 4) for _ in range(2))),
             "reuse": Plan(tuple(LayerPlan(REUSE, 8, 8) for _ in range(2)))}
    book = build_codebook(fits, plans, spec_of(producer), spec_of(consumer))
    book.tensors = {k: v * 0 if ".dec.r4" in k else v for k, v in book.tensors.items()}
    scd = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    examples = distill_examples(scd, producer, consumer, prompts(48, 40, seed=5), tail=4)
    assert examples[0].context is not None and examples[0].context.shape[0] == examples[0].prefix
    fit_ref = {k: v.clone() for k, v in book.tensors.items() if ".ref." in k}
    out = distill(scd, consumer, examples, steps=30, lr=3e-3, batch=8)
    assert out["step_kept"] > 0 and out["held_out_kl_after"] < out["held_out_kl_before"]
    tuned = book.tensors["layers.1.k.ref_r4.down.weight"]
    assert not torch.equal(tuned, fit_ref["layers.1.k.ref.down.weight"])
    assert all(torch.equal(book.tensors[k], v) for k, v in fit_ref.items())  # the L2 fit, kept for rank 8
    book.validate()
    assert torch.equal(book.refiner(1, "k", 4).down.weight, tuned.float())
    assert torch.equal(book.refiner(1, "k", 8).down.weight, fit_ref["layers.1.k.ref.down.weight"].float())
    # the served codec decodes with the tuned refiner: its held-out KL is what distillation kept
    served = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    again = distill(served, consumer, examples, steps=0, lr=3e-3, batch=8)
    assert again["held_out_kl_before"] == pytest.approx(out["held_out_kl_after"], rel=1e-2)
    # with the other plan shipping nothing (rank 0), no plan reads the L2 fit once tuned: it goes
    book.manifest["plans"]["reuse"] = Plan(tuple(LayerPlan(REUSE, 0, 0) for _ in range(2))).to_json()
    distill(served, consumer, examples, steps=2, lr=3e-3, batch=8)
    assert not any(".ref." in k for k in book.tensors) and "layers.1.k.ref_r4.up.weight" in book.tensors
    book.validate()
