"""A run (plan.py): the consumer computes its upper layers itself from a code of the producer's
residual. Plan rules, exactness on one model, per-prompt runs under interleaving, calibration."""

import pytest
import torch

from scd_serve import codec
from scd_serve.calibration.assemble import build_codebook
from scd_serve.codec.codebook import Codebook
from scd_serve.codec.codec_spec import spec_of
from scd_serve.calibration.fit import collect_rows, fit_layer
from scd_serve.codec.plan import PATCH, REUSE, RUN, LayerPlan, Plan
from scd_serve.config.codec import CalibrateConfig
from scd_serve.errors import CodebookError, ConfigError
from scd_serve.quality.calibrate import calibrate

from codec_pair import make_pair, prompts


def test_a_run_ships_its_first_layer_and_runs_every_layer_above():
    below = Plan((LayerPlan(PATCH, r_h=8),) + (LayerPlan(REUSE, 4, 4),) * 3)
    plan = Plan.with_run(below, 2, 16)
    assert [lp.mode for lp in plan.layers] == [PATCH, REUSE, RUN, RUN]
    assert plan.run_layer == 2 and plan.code_width() == 8 + 8 + 16
    assert plan.layers[3].streams == () and plan.layers[2].streams == (("r", 16),)
    assert Plan.from_json(plan.to_json()) == plan and below.run_layer is None
    for bad in [(LayerPlan(RUN, r_h=0), LayerPlan(RUN, r_h=0)),  # nothing shipped to start from
                (LayerPlan(RUN, r_h=8), LayerPlan(REUSE, 4, 4)),  # a layer above the run not run
                (LayerPlan(RUN, r_h=8), LayerPlan(RUN, r_h=8))]:  # a second start
        with pytest.raises(ValueError, match="run"):
            Plan(bad)


@pytest.fixture(scope="module")
def same_model(tmp_path_factory):
    """One model on both sides, full-rank codes: a run rebuilds the prefill's own K/V."""
    producer, _ = make_pair(tmp_path_factory.mktemp("run"), layers=4)
    spec = spec_of(producer)
    rows = collect_rows(producer, producer, [p for p, _ in prompts(8, 32)], max_rows=2048, run_layers=(2,))
    fits = [fit_layer(r, spec.kv_width, (8, spec.hidden_size), aligner_width=16) for r in rows]
    full = Plan(tuple(LayerPlan(REUSE, spec.kv_width, spec.kv_width) for _ in range(spec.num_layers)))
    plan = Plan.with_run(full, 2, spec.hidden_size)
    book = build_codebook(fits, {"scd": plan, "reuse": full}, spec, spec)
    return producer, book


def test_same_model_run_rebuilds_the_prefill_and_interleaved_prompts_keep_their_runs(same_model):
    rt, book = same_model
    c = codec.build("scd", producer=rt, consumer=rt, codebook=book)
    assert codec.wants_residuals(c, 4) and c.states_needed(3) == frozenset()
    ids = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (20, 27)]
    states = [[s for _, s in rt.iter_prefill(x, compute_logits=False, residuals=True)] for x in ids]
    codes = [[c.encode_layer(i, s) for i, s in enumerate(st)] for st in states]
    assert codes[0][3] == {} and set(codes[0][2]) == {"zr"}
    # two prompts rebuilt layer by layer in turn, as two transfer threads would: each its own Rebuild
    rebuilds = [codec.begin(c, x, rt) for x in ids]
    for layer in range(4):
        for rb, st, code in zip(rebuilds, states, codes):
            k, v = rb.decode_layer(layer, code[layer])
            torch.testing.assert_close(k, st[layer].keys, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(v, st[layer].values, atol=2e-2, rtol=2e-2)
    assert all(rb._run is None for rb in rebuilds)  # each run let go at its last layer


def test_a_run_is_sent_every_row_after_a_cached_prefix_whose_own_rows_it_cannot_rebuild(same_model):
    """A run is the consumer's forward over the whole prompt: a transfer that starts after the
    decode side's cached prefix still carries every row (decodes_from), and a rebuild asked
    to start mid-prompt is refused rather than attending to nothing before it."""
    rt, book = same_model
    c = codec.build("scd", producer=rt, consumer=rt, codebook=book)
    assert not c.rows_decode_alone and codec.rebuild.decodes_from(c, 16) == 0
    with pytest.raises(CodebookError, match="run"):
        codec.begin(c, torch.arange(20), rt, 16)
    no_run = codec.build("reuse", producer=rt, consumer=rt, codebook=book)
    assert no_run.rows_decode_alone and codec.rebuild.decodes_from(no_run, 16) == 16


def test_run_layers_out_of_turn_are_refused(same_model):
    rt, book = same_model
    c = codec.build("scd", producer=rt, consumer=rt, codebook=book)
    x = torch.arange(10)
    st = [s for _, s in rt.iter_prefill(x, compute_logits=False, residuals=True)]
    with pytest.raises(CodebookError, match="first layer \\(2\\) was not decoded"):
        c.decode_layer(3, {}, rt, tokens=x)  # one layer alone: no run of this prompt holds layer 3
    with pytest.raises(CodebookError, match="tokens="):
        c.decode_layer(2, c.encode_layer(2, st[2]), rt)
    rb = codec.begin(c, x, rt)
    rb.decode_layer(2, c.encode_layer(2, st[2]))
    rb.decode_layer(3, {})
    with pytest.raises(CodebookError, match="was not decoded"):  # the run ended at the last layer
        rb.decode_layer(3, {})
    other = codec.begin(c, x, rt)  # the same tokens, another rebuild: its run is its own
    with pytest.raises(CodebookError, match="was not decoded"):
        other.decode_layer(3, {})
    with pytest.raises(CodebookError, match="'residual' was not captured"):
        c.encode_layer(2, next(iter(rt.iter_prefill(x, compute_logits=False)))[1])


def test_calibration_measures_each_run_layer_and_keeps_a_run_only_where_it_measures_better(tmp_path):
    producer, consumer = make_pair(tmp_path, layers=4)
    pairs = prompts(10, 32)
    cfg = CalibrateConfig(kl_budget=0.05, max_rows=1024, aligner_steps=0, max_patches=1, distill_steps=20,
                          distill_batch=4, run_layers=(2, 3), rebuild_cost="counted")
    result = calibrate(producer, consumer, [p for p, _ in pairs[:6]], pairs[6:], cfg, show_progress=False)
    stats = result.codebook.manifest["calibration"]
    run = stats["run"]
    assert set(run["kl"]) == {"2", "3"}
    plan = result.codebook.plan("scd")
    best = min(run["kl"], key=run["kl"].get)
    if run["kl"][best] < run["kl_without"]:
        assert plan.run_layer == int(best) and stats["plan_kl"] == run["kl"][best]
    else:
        assert plan.run_layer is None and stats["plan_kl"] == run["kl_without"]
    # the DroidSpeak baseline recomputes as many layers as scd's consumer computes
    computed = len(plan.patch_layers) + (4 - plan.run_layer if plan.run_layer is not None else 0)
    assert len(result.codebook.droidspeak_layers) == max(1, computed)
    # the codebook, whatever it chose, loads, validates and serves through the real codec
    book = Codebook.load(result.codebook.save(tmp_path / "book"), producer=producer, consumer=consumer)
    assert book.plan("scd") == plan and result.methods["scd"]["kl"] >= 0
    with pytest.raises(ConfigError, match="run layers"):
        calibrate(producer, consumer, [p for p, _ in pairs[:6]], pairs[6:],
                  CalibrateConfig(kl_budget=0.05, run_layers=(0,)), show_progress=False)


def test_distillation_tunes_the_runs_residual_map_through_the_consumers_own_layers(tmp_path):
    """The run's map starts from its closed form plus noise as large as its weights, the layers
    below at full rank; tuning lowers the held-out KL, and most of the gain is the map's (its
    tuned tensors put back to the noisy start lose it): the graph reaches the map through the
    consumer's own layers above it."""
    from scd_serve.calibration.distill import Decoders, distill, make_examples

    producer, consumer = make_pair(tmp_path, layers=4, noise=0.3)
    spec = spec_of(producer)
    pairs = prompts(60, 32)
    rows = collect_rows(producer, consumer, [p for p, _ in pairs[:20]], max_rows=2048, run_layers=(2,))
    fits = [fit_layer(r, spec.kv_width, (spec.hidden_size,), aligner_width=16) for r in rows]
    below = Plan(tuple(LayerPlan(REUSE, spec.kv_width, spec.kv_width) for _ in range(spec.num_layers)))
    book = build_codebook(fits, {"scd": Plan.with_run(below, 2, spec.hidden_size)}, spec, spec_of(consumer))
    name = f"layers.2.r.g.r{spec.hidden_size}.linear.weight"
    closed = book.tensors[name]
    book.tensors = {**book.tensors, name: closed + closed.std() * torch.randn(closed.shape, generator=torch.Generator().manual_seed(0))}
    start = dict(book.tensors)
    scd = codec.build("scd", producer=producer, consumer=consumer, codebook=book)
    examples = make_examples(scd, producer, consumer, pairs, tail=8)
    out = distill(scd, consumer, examples, steps=40, lr=3e-3, batch=8)
    # measured: held-out KL 0.366 -> 0.300
    assert out["step_kept"] > 0 and out["held_out_kl_after"] < 0.9 * out["held_out_kl_before"], out
    changed = {k for k, v in book.tensors.items() if not torch.equal(v, start[k])}
    assert name in changed and not any(k.startswith("layers.3.") for k in changed)  # nothing kept above the start

    map_put_back = {k: start[k] if k.startswith("layers.2.r.g.") else v for k, v in book.tensors.items()}
    reverted = codec.build("scd", producer=producer, consumer=consumer, codebook=codec.Codebook(book.manifest, map_put_back))
    with torch.no_grad():
        decoders = Decoders(reverted, consumer.device)
        held_out = examples[-out["held_out_examples"]:]
        kl = sum(float(decoders.loss(consumer, ex)) for ex in held_out) / len(held_out)
    gain = out["held_out_kl_before"] - out["held_out_kl_after"]
    assert kl - out["held_out_kl_after"] > 0.5 * gain, (kl, out)
