"""Codebook save/load and every refusal: other models, wrong shapes, truncated or missing files."""

import json

import pytest
import torch

from scd_serve import codec
from scd_serve.quality.calibrate import calibrate
from scd_serve.codec.base import ATTN_INPUT, ATTN_INPUTS, OWN_INPUTS, RESIDUAL
from scd_serve.codec.codebook import MANIFEST, TENSORS, Codebook
from scd_serve.config.codec import CalibrateConfig
from scd_serve.errors import CodebookError, ConfigError

from codec_pair import make_pair, prompts


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("cb")
    producer, consumer = make_pair(root, layers=2)
    pairs = prompts(10, 32)
    # two random models: a loose KL budget, and a top-1 floor that such a pair can reach (its
    # full-rank plan agrees on 3 of the probe's 16 positions; the search meets both: calibration/search.py)
    # no token prior, and a budget between the means alone (KL 0.12) and full-rank codes (0.03): the
    # plan ships codes (a run would meet it too, at half a prefill: not taken)
    cfg = CalibrateConfig(rebuild_cost="counted", kl_budget=0.07, min_top1=0.15, max_rows=1024, aligner_steps=10, max_patches=1,
                          probe_tail=1, distill_steps=40, distill_batch=4, prior="none")
    result = calibrate(producer, consumer, [p for p, _ in pairs[:6]], pairs[6:], cfg, show_progress=False)
    result.codebook.save(root / "book")
    return producer, consumer, result, root / "book"


def test_calibration_meets_budget_and_reports(calibrated):
    producer, consumer, result, path = calibrated
    stats = result.codebook.manifest["calibration"]
    assert stats["feasible"]
    m = result.methods
    assert set(m) == set(codec.METHODS) - {"identity"} | {"prior-only"}
    assert all(0 <= r["top1"] <= 1 for r in m.values()) and m["prior-only"]["payload_ratio"] == 0
    # no report prompts given: the figures are the probe's, and the manifest says so
    assert stats["report"] == {"prompts": 4, "positions": 16, "held_out": False}
    assert stats["meets_budget"] == (m["scd"]["kl"] <= 0.07 and m["scd"]["top1"] >= stats["min_top1"])
    # the plan the search chose was measured within budget, and re-measured through the codec
    assert m["scd"]["kl"] <= 0.07 * 1.05
    assert m["scd"]["payload_ratio"] < 1.0
    assert 0 < m["scd-int8"]["payload_ratio"] < 0.6 * m["scd"]["payload_ratio"]
    assert m["quant4"]["payload_ratio"] == pytest.approx(0.3125, abs=0.01)
    # distillation ran on the fit prompts' answers and kept no step worse than the closed form
    d = stats["distill"]
    assert (d["train_examples"], d["held_out_examples"]) == (5, 1)
    assert d["held_out_kl_after"] <= d["held_out_kl_before"] and 0 <= d["step_kept"] <= 40


def test_load_round_trip_and_fingerprints(calibrated):
    producer, consumer, result, path = calibrated
    book = Codebook.load(path, producer=producer, consumer=consumer)
    assert book.manifest["producer"]["fingerprint"] == producer.fingerprint
    assert (path / TENSORS).stat().st_mode & 0o044 == 0o044  # readable by a server running as another user
    assert book.plan("scd") == result.codebook.plan("scd")
    c = codec.build("scd", producer=producer, consumer=consumer, codebook=path)
    ids = prompts(1, 20)[0][0]
    residuals = codec.wants_residuals(c, producer.spec.num_layers)  # the plan may run the top layers
    states = [s for _, s in producer.iter_prefill(ids, compute_logits=False, residuals=residuals)]
    assert book.prior is None  # as asked (test_calibration_weighs_replays... fits the default one)
    for layer, state in enumerate(states):
        k, v = c.decode_layer(layer, c.encode_layer(layer, state), consumer, tokens=ids)
        assert k.shape == state.keys.shape and torch.isfinite(k).all()
    # the decoder reads the prompt's tokens: without them a clear error (layer 0 is the consumer's own)
    assert book.plan("scd").layers[0].mode == "own"
    with pytest.raises(CodebookError, match="token ids"):
        c.decode_layer(0, c.encode_layer(0, states[0]), consumer)


def test_refuses_other_models(calibrated):
    producer, consumer, _, path = calibrated
    with pytest.raises(CodebookError, match="calibrated for producer"):
        Codebook.load(path, producer=consumer, consumer=consumer)
    with pytest.raises(CodebookError, match="calibrated for consumer"):
        codec.build("scd", producer=producer, consumer=producer, codebook=path)


def test_refuses_wrong_shapes(calibrated, tmp_path):
    _, _, result, path = calibrated
    tensors = dict(result.codebook.tensors)
    name = next(k for k in tensors if ".dec.r" in k)
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    Codebook(dict(result.codebook.manifest), tensors).save(tmp_path / "bad")
    with pytest.raises(CodebookError, match=f"'{name}' has shape"):
        Codebook.load(tmp_path / "bad")


def test_codes_of_two_models_read_the_attention_input_and_the_manifest_says_so(calibrated, tmp_path):
    """Two models: every stream's code reads the layer's attention input (codec/base.py), the
    manifest records it and the encoders have its width; a manifest this version cannot read is
    refused by name, and one without the key (every codebook before it) reads each stream's own."""
    producer, consumer, result, path = calibrated
    book = Codebook.load(path, producer=producer, consumer=consumer)
    assert book.manifest["code_inputs"] == ATTN_INPUTS == book.code_inputs()
    encoders = [name for name in book.tensors if name.endswith((".k.enc", ".v.enc"))]
    assert encoders and all(book.tensors[name].shape[0] == producer.spec.hidden_size for name in encoders)
    c = codec.build("scd", producer=producer, consumer=consumer, codebook=path)
    assert all(c.states_needed(i) <= {ATTN_INPUT, RESIDUAL} for i in range(producer.spec.num_layers))
    bad = dict(book.manifest, code_inputs={"k": "v", "v": "v", "h": "h", "r": "r"})
    Codebook(bad, dict(book.tensors)).save(tmp_path / "bad")
    with pytest.raises(CodebookError, match="code_inputs"):
        Codebook.load(tmp_path / "bad")
    old = {k: v for k, v in book.manifest.items() if k != "code_inputs"}
    assert Codebook(old, dict(book.tensors)).code_inputs() == OWN_INPUTS
    with pytest.raises(CodebookError, match=r"\.enc' has shape|\.mu_a' has shape"):  # hidden-wide encoders
        Codebook(old, dict(book.tensors)).validate()


def test_refuses_truncated_and_corrupt_files(calibrated, tmp_path):
    _, _, result, _ = calibrated
    out = result.codebook.save(tmp_path / "b")
    data = (out / TENSORS).read_bytes()
    (out / TENSORS).write_bytes(data[: len(data) // 2])
    with pytest.raises(CodebookError, match="truncated"):
        Codebook.load(out)
    (out / TENSORS).write_bytes(data[:-4] + b"\0\0\0\0")
    with pytest.raises(CodebookError, match="checksum"):
        Codebook.load(out)


def test_refuses_missing_or_foreign_manifest(calibrated, tmp_path):
    _, _, result, _ = calibrated
    with pytest.raises(CodebookError, match="no manifest.json"):
        Codebook.load(tmp_path)
    out = result.codebook.save(tmp_path / "c")
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps(manifest | {"version": "scd-codebook/0"}))
    with pytest.raises(CodebookError, match="codebook version"):
        Codebook.load(out)
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(CodebookError, match="not valid JSON"):
        Codebook.load(out)


def test_methods_without_codebook_and_bad_budget(calibrated):
    producer, consumer, _, _ = calibrated
    with pytest.raises(CodebookError, match="needs a codebook"):
        codec.build("scd", producer=producer, consumer=consumer)
    with pytest.raises(ConfigError, match="kl_budget"):
        CalibrateConfig(kl_budget=0)
    with pytest.raises(ConfigError, match="distill_steps must be >= 0"):
        CalibrateConfig(kl_budget=0.1, distill_steps=-1)
    with pytest.raises(ConfigError, match="distill_lr must be in"):
        CalibrateConfig(kl_budget=0.1, distill_lr=0)
    for bad in (0.0, 1.5):
        with pytest.raises(ConfigError, match="max_payload must be in"):
            CalibrateConfig(kl_budget=0.1, max_payload=bad)


def test_prior_only_ablation_ships_nothing_and_is_not_served(calibrated):
    producer, consumer, _, path = calibrated
    assert "prior-only" not in codec.METHODS and "prior-only" in codec.ABLATIONS
    c = codec.build("prior-only", producer=producer, consumer=consumer, codebook=path)
    ids = prompts(1, 20)[0][0]
    state = next(iter(producer.iter_prefill(ids, compute_logits=False)))[1]
    code = c.encode_layer(0, state)
    assert codec.payload_bytes(code) == 0
    k, v = c.decode_layer(0, code, consumer, tokens=ids)
    assert k.shape == state.keys.shape and v.shape == state.values.shape


def test_same_model_calibration_fits_no_token_priors(tmp_path):
    """One model on both sides: codes alone are exact at full rank, so no priors are fitted."""
    producer, _ = make_pair(tmp_path, layers=2)
    pairs = prompts(6, 24)
    cfg = CalibrateConfig(rebuild_cost="counted", kl_budget=0.5, max_rows=512, aligner_steps=0, max_patches=0)
    book = calibrate(producer, producer, [p for p, _ in pairs[:4]], pairs[4:], cfg, show_progress=False).codebook
    assert book.prior is None and not any(name.endswith(".prior") for name in book.tensors)
    assert "code_inputs" not in book.manifest  # each stream's own: exact at full rank for one model


def test_payload_cap_bounds_what_scd_ships(tmp_path):
    """--max-payload: an unreachable KL budget would take full rank; the cap holds the plan (and
    what the codec really ships, measured through encode_layer) under the fraction of raw."""
    producer, consumer = make_pair(tmp_path, layers=2)
    pairs = prompts(8, 24)
    cfg = CalibrateConfig(rebuild_cost="counted", kl_budget=1e-6, max_rows=512, aligner_steps=0, max_patches=1, distill_steps=0,
                          max_payload=0.25)
    result = calibrate(producer, consumer, [p for p, _ in pairs[:5]], pairs[5:], cfg, show_progress=False)
    stats = result.codebook.manifest["calibration"]
    assert not stats["feasible"]
    assert result.methods["scd"]["payload_ratio"] <= 0.25
    assert 0 < result.methods["scd-int8"]["payload_ratio"] < 0.6 * result.methods["scd"]["payload_ratio"]
    # a layer that ships a code refuses token ids of another count than the code's rows
    c = codec.build("scd", producer=producer, consumer=consumer, codebook=result.codebook)
    ids = pairs[0][0]
    residuals = codec.wants_residuals(c, producer.spec.num_layers)
    states = [s for _, s in producer.iter_prefill(ids, compute_logits=False, residuals=residuals)]
    layer = next(i for i, lp in enumerate(result.codebook.plan("scd").layers) if lp.streams)
    with pytest.raises(CodebookError, match="token ids for a code of"):
        c.decode_layer(layer, c.encode_layer(layer, states[layer]), consumer, tokens=ids[:-1])
    assert result.methods["scd-int8"]["payload_ratio"] <= 0.25 * 0.6
    assert all(point["code_width"] <= 0.25 * 2 * 2 * consumer.spec.kv_width for point in stats["curve"])


def test_a_timed_rebuild_keeps_only_options_that_fit_measured_and_says_what_it_cost(tmp_path):
    """The default: each option whose count fits --max-rebuild is measured on the probe, then timed
    against the consumer's own prefill in the order of its count, unless as long in every way as
    one timed over, or no better on the probe than one timed within; none timed over is chosen
    but the plan alone (the cheapest there is, said to be over). Which are over depends on the
    machine: the rules hold whatever the timings."""
    producer, consumer = make_pair(tmp_path, layers=2)
    pairs = prompts(10, 32)
    cfg = CalibrateConfig(kl_budget=0.05, max_rows=1024, aligner_steps=0, max_patches=0, distill_steps=0,
                          replay=(0, 8), head=(0, 4), max_rebuild=0.6, num_timing_prompts=2)
    result = calibrate(producer, consumer, [p for p, _ in pairs[:6]], pairs[6:], cfg, show_progress=False)
    r = result.codebook.manifest["calibration"]["replay"]
    options = r["options"]
    key = lambda o: (o["replay"], o["head"], o["run"])  # noqa: E731
    # those whose counts fit 0.6 (of a 31-token handoff: the run from 1 is half, replay 8 and head 4 8 / 31 and 4 / 31)
    assert {key(o) for o in options} == {(0, 0, None), (0, 0, 1), (8, 0, None), (0, 4, None), (8, 4, None)}
    timed = [o for o in options if "cost" in o]
    assert key(timed[0]) == (0, 0, None) and [o["counted"] for o in timed] == sorted(o["counted"] for o in timed)
    over = [o for o in timed if o["cost"] > 0.6]
    for o in options:
        assert "kl" in o and o["counted"] <= 0.6 and o.get("cost", 1) > 0
        longer = [x for x in over if timed_before(options, x, o) and x["replay"] <= o["replay"]
                  and x["head"] <= o["head"] and (o["run"] is not None or x["run"] is None)]
        better = [x for x in timed if x["cost"] <= 0.6 and timed_before(options, x, o)
                  and x["kl"] <= o["kl"] and x["top1"] >= o["top1"]]
        assert ("cost" in o) == (key(o) == (0, 0, None) or not (longer or better)), o
    chosen = next(o for o in options if key(o) == (r["tokens"], r["head"], r["run"]))
    assert r["rebuild"] == chosen["cost"] and r["rebuild_within"] == (chosen["cost"] <= 0.6)
    assert r["rebuild_within"] or key(chosen) == (0, 0, None)
    with pytest.raises(ConfigError, match="rebuild_cost"):
        CalibrateConfig(kl_budget=0.05, rebuild_cost="guessed")


def timed_before(options, x, o):
    return options.index(x) < options.index(o)


def test_a_rebuild_is_timed_against_the_consumers_own_prefill_of_the_same_prompts(tmp_path):
    from scd_serve.quality.rebuild_cost import RebuildCost

    producer, consumer = make_pair(tmp_path, layers=2)
    timer = RebuildCost(producer, consumer, [p for p, _ in prompts(3, 24)], rounds=1)
    assert [int(p.numel()) for p in timer.prefixes] == [23, 23, 23]  # the last token is the consumer's own
    cost = timer(codec.build("identity", producer=producer, consumer=consumer))
    assert 0 < cost < float("inf")
    # the consumer's prefill: timed again beside each option, so a busy spell moves both alike
    assert 0 < timer(codec.build("raw", producer=producer, consumer=consumer)) < float("inf")
    assert len(timer.prefill_s) == 2 and all(s > 0 for s in timer.prefill_s)
    from scd_serve.quality.rebuild_cost import spread

    lengths = [5, 40, 12, 33, 8, 21, 17]
    assert [p.numel() for p in spread([torch.arange(n) for n in lengths], 3)] == [5, 17, 40]  # min, median, max
    assert [p.numel() for p in spread([torch.arange(n) for n in lengths[:2]], 3)] == [5, 40]
    with pytest.raises(ValueError, match="two tokens"):
        RebuildCost(producer, consumer, [torch.tensor([5])])
    with pytest.raises(ValueError, match="rounds"):
        RebuildCost(producer, consumer, [torch.arange(8)], rounds=0)


def test_each_prompts_prefill_is_timed_right_after_the_options_rebuild_of_it(tmp_path, monkeypatch):
    """Side by side, prompt by prompt and option by option: a busy spell then slows both alike."""
    from scd_serve.quality import rebuild_cost, transfer

    producer, consumer = make_pair(tmp_path, layers=2)
    events = []
    real_rebuild, real_transfer = transfer.rebuild_from, rebuild_cost.transfer
    monkeypatch.setattr(transfer, "rebuild_from", lambda *a: (events.append(("rebuild", a[4].numel())),
                                                              real_rebuild(*a))[1])
    monkeypatch.setattr(rebuild_cost, "transfer", lambda *a: (events.append(("prefill", a[4].numel())),
                                                              real_transfer(*a))[1])
    timer = rebuild_cost.RebuildCost(producer, consumer, [torch.arange(4, 4 + n) for n in (9, 13)], rounds=2)
    for method in ("identity", "raw"):
        timer(codec.build(method, producer=producer, consumer=consumer))
    per_prompt = lambda n: [("rebuild", n), ("rebuild", n), ("prefill", n), ("rebuild", n), ("prefill", n)]
    option = per_prompt(8) + per_prompt(12)  # a warm rebuild, then a rebuild and a prefill per round
    assert events == [("prefill", 8)] + option + option  # one warm-up prefill for the whole calibration
    assert len(timer.prefill_s) == 2


def test_an_options_timed_rounds_rebuild_from_one_encoding(tmp_path):
    from scd_serve.quality.transfer import rebuilder

    producer, consumer = make_pair(tmp_path, layers=2)
    prefills, real = [], producer.iter_prefill
    producer.iter_prefill = lambda *a, **kw: (prefills.append(a[0].numel()), real(*a, **kw))[1]
    prefix = prompts(1, 24)[0][0][:-1]
    rebuild = rebuilder(codec.build("raw", producer=producer, consumer=consumer), producer, consumer, prefix)
    seconds = [rebuild() for _ in range(3)]
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert prefills == [prefix.numel()]  # the producer's prefill is not rebuild time: once for all rounds


def test_calibration_weighs_replays_and_heads_against_runs_and_the_served_codecs_use_its_choice(tmp_path):
    producer, consumer = make_pair(tmp_path, layers=2)
    pairs = prompts(10, 32)
    cfg = CalibrateConfig(kl_budget=0.05, min_top1=1.0, max_rows=1024, aligner_steps=0, max_patches=0,
                          distill_steps=0, replay=(0, 4, 8, 64), head=(0, 16), max_rebuild=0.6, rebuild_cost="counted")
    result = calibrate(producer, consumer, [p for p, _ in pairs[:6]], pairs[6:], cfg, show_progress=False)
    r = result.codebook.manifest["calibration"]["replay"]
    # counted: the plan and a run from layer 1 (half the layers), each with replay 0, 4 and 8 (of a
    # 31-token handoff) and head 0 and 16 where they fit 0.6 together; replay 64 (the whole prompt)
    # never fits, nor head 16 with anything else. Each replay's probe replaces the last (its
    # examples' token contexts must not be taken for theirs)
    tried = {(o["replay"], o["head"], o["run"]): o["counted"] for o in r["options"]}
    assert tried == pytest.approx({(0, 0, None): 0.0, (0, 0, 1): 0.5, (0, 16, None): 16 / 31, (4, 0, None): 4 / 31,
                                   (8, 0, None): 8 / 31}, abs=1e-3)
    assert all(o["cost"] == o["counted"] for o in r["options"] if "cost" in o)
    meets = [o for o in r["options"] if o["kl"] <= 0.05 and o["top1"] >= 1.0]
    chosen = next(o for o in r["options"] if (o["replay"], o["head"], o["run"]) == (r["tokens"], r["head"], r["run"]))
    assert r["meets"] == bool(meets) and (not meets or chosen["cost"] == min(o["cost"] for o in meets))
    assert result.codebook.plan("scd").run_layer == r["run"]
    result.codebook.save(tmp_path / "book")
    build = lambda m: codec.build(m, producer=producer, consumer=consumer, codebook=tmp_path / "book")  # noqa: E731
    for field, chosen_count in (("replay_tokens", r["tokens"]), ("head_tokens", r["head"])):
        assert getattr(build("scd"), field) == getattr(build("scd-int8"), field) == \
            getattr(build("prior-only"), field) == chosen_count == result.methods["scd"][field]
        assert getattr(build("reuse"), field) == 0 and result.methods["raw"][field] == 0
