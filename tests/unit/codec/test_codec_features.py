"""Feature prior: the streamed reduced-rank fit against a direct solve, and its codebook round trip."""

import subprocess
import sys
import textwrap

import pytest
import torch

from scd_serve.calibration.feature_fit import FeatureFit
from scd_serve.codec.features import FeaturePrior, FeatureSpec, features, most_frequent
from scd_serve.config.codec import CalibrateConfig
from scd_serve.errors import CodebookError, ConfigError


class Embedder:
    """A consumer stand-in whose layer-0 inputs are rows of a fixed table (what token_inputs reads)."""

    def __init__(self, vocab: int, hidden: int, seed: int = 0):
        self.table = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))

    def token_inputs(self, ids):
        return self.table[ids]


def _data(seed=0, vocab=50, hidden=6, n_prompts=4):
    gen = torch.Generator().manual_seed(seed)
    consumer = Embedder(vocab, hidden, seed)
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen) for n in torch.randint(20, 60, (n_prompts,), generator=gen)]
    return consumer, prompts


def test_lagged_features_shift_with_zeros_before_the_prompt():
    spec = FeatureSpec(taps=3, width=0, hidden=2)
    e = torch.arange(8.0).reshape(4, 2)
    phi = features(spec, e, spec.projection())
    assert phi.shape == (4, 6)
    assert phi[0].tolist() == [0, 1, 0, 0, 0, 0]  # nothing before position 0
    assert phi[3].tolist() == [6, 7, 4, 5, 2, 3]  # x_t, x_{t-1}, x_{t-2}


def test_streamed_fit_equals_a_direct_ridge_and_reduced_rank_solve():
    consumer, prompts = _data()
    spec = FeatureSpec(taps=2, width=16, rank=3, hidden=6)
    gen = torch.Generator().manual_seed(1)
    maps = {"a": torch.randn(spec.num_features, 5, generator=gen), "b": 10 * torch.randn(spec.num_features, 2, generator=gen)}
    fit = FeatureFit(spec)
    phis, ys = [], {k: [] for k in maps}
    for ids in prompts:
        phi = fit.add_tokens(ids, consumer)
        phis.append(phi)
        for k, w in maps.items():
            y = torch.tanh(phi @ w)  # not linear in phi: the fit is an approximation
            ys[k].append(y)
            fit.add_target(k, phi, y)
    prior, heads = fit.solve(ridge=1e-3)
    # direct: centre, scale each block to unit RMS, ridge solve, SVD of the fitted values
    x = torch.cat(phis).double()
    xc = x - x.mean(0)
    blocks = {k: torch.cat(v).double() for k, v in ys.items()}
    scales = {k: float((y - y.mean(0)).pow(2).mean().sqrt()) for k, y in blocks.items()}
    y = torch.cat([(blocks[k] - blocks[k].mean(0)) / scales[k] for k in maps], dim=1)
    g = xc.T @ xc
    g += 1e-3 * float(g.diagonal().mean()) * torch.eye(g.shape[0], dtype=g.dtype)
    w = torch.linalg.solve(g, xc.T @ y)
    fitted = xc @ w
    _, _, vt = torch.linalg.svd(fitted, full_matrices=False)
    direct = fitted @ vt[:3].T @ vt[:3]  # rank-3 fitted values
    ctx = prior.reduce(x.float())
    ours = torch.cat([(prior.apply(*heads[k], ctx).double() - blocks[k].mean(0)) / scales[k] for k in maps], dim=1)
    # float32 application of an fp16 basis against a float64 solve: 4e-4 of the scale here; a wrong
    # scaling or rank shows as > 1e-1
    assert (ours - direct).abs().max() / direct.abs().max() < 1e-2


def test_a_function_linear_in_the_features_is_recovered_at_full_rank():
    consumer, prompts = _data(seed=3)
    spec = FeatureSpec(taps=2, width=8, rank=4, hidden=6)
    truth = torch.randn(spec.num_features, 4, generator=torch.Generator().manual_seed(2))
    fit = FeatureFit(spec)
    rows = []
    for ids in prompts:
        phi = fit.add_tokens(ids, consumer)
        fit.add_target(("layer", "k"), phi, phi @ truth + 1.5)
        rows.append(phi)
    prior, heads = fit.solve(ridge=1e-8)
    x = torch.cat(rows)
    y = x @ truth + 1.5
    pred = prior.apply(*heads[("layer", "k")], prior.reduce(x))
    assert float((pred - y).norm() / (y - y.mean(0)).norm()) < 1e-2  # fp16 basis; a wrong fit is ~1


def test_codebook_round_trip_and_the_decode_side_context():
    consumer, prompts = _data()
    spec = FeatureSpec(taps=3, width=8, rank=2, hidden=6, seed=5)
    fit = FeatureFit(spec)
    for ids in prompts:
        phi = fit.add_tokens(ids, consumer)
        fit.add_target("t", phi, phi[:, :3])
    prior, heads = fit.solve()
    loaded = FeaturePrior.from_codebook(prior.manifest(), prior.tensors())
    ids = prompts[0]
    # the decode side computes from token ids what calibration reduced from its features
    assert torch.allclose(loaded.context(ids, consumer), prior.reduce(fit.add_tokens(ids, consumer)), atol=1e-5)
    for short in (ids[:1], ids[:2]):  # fewer tokens than taps: the missing lags are zeros on both sides
        assert torch.allclose(loaded.context(short, consumer), prior.reduce(fit.add_tokens(short, consumer)),
                              atol=1e-5)
    wrong = prior.manifest() | {"projection_sha256": "0" * 16}
    with pytest.raises(CodebookError, match="another random projection"):
        FeaturePrior.from_codebook(wrong, prior.tensors())
    with pytest.raises(CodebookError, match="expected"):
        FeaturePrior.from_codebook(prior.manifest() | {"rank": 3}, prior.tensors())


def test_calibration_at_a_152k_vocabulary_allocates_nothing_vocab_sized(tmp_path):
    """A one-layer pair with Qwen2.5's vocabulary (151,936): a dense prior would need a 1.66 TB
    Gram matrix; the feature prior's whole calibration stays within a few hundred MB."""
    script = textwrap.dedent(f"""
        import resource, torch
        from scd_serve.quality.calibrate import calibrate
        from scd_serve.config.codec import CalibrateConfig
        from scd_serve.model import ModelRuntime
        from scd_serve.model.tiny import save_tiny_model
        shape = dict(vocab_size=151936, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                     intermediate_size=32, num_hidden_layers=2, tie_word_embeddings=True)
        a, b = [ModelRuntime.load(save_tiny_model({str(tmp_path)!r} + "/" + n, "qwen2", seed=i, tokenizer=False,
                                                  **shape)) for i, n in enumerate("ab")]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 151936, (40,), generator=gen) for _ in range(6)]
        cfg = CalibrateConfig(rebuild_cost="counted", kl_budget=1.0, num_prompts=4, num_probe_prompts=2, num_profile_prompts=2,
                              max_rows=128, aligner_steps=0, prior_width=64, prior_rank=8,
                              distill_steps=10)
        out = calibrate(a, b, prompts[:4], [(p[:30], p[30:]) for p in prompts[4:]], cfg, show_progress=False)
        assert out.codebook.context_prior().kind == "features"
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print("GREW_KB", grew)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parents[3]))
    assert done.returncode == 0, done.stderr[-2000:]
    grew_kb = int(done.stdout.split("GREW_KB")[1])
    assert grew_kb < 1_000_000, f"calibration grew the peak RSS by {grew_kb} kB"


def test_frequent_tokens_get_vectors_of_their_own():
    """A target that is an arbitrary table of the current token: a linear map of 6-dim random
    embeddings cannot hold 40 arbitrary vectors; one-hot columns for the frequent tokens can."""
    consumer, prompts = _data(seed=4, vocab=40)
    table = torch.randn(40, 3, generator=torch.Generator().manual_seed(9))
    scores = {}
    for frequent in (0, 40):
        spec = FeatureSpec(taps=1, width=0, rank=3, hidden=6, frequent=frequent)
        fit = FeatureFit(spec, most_frequent(prompts, frequent) if frequent else None)
        for ids in prompts:
            fit.add_target("t", fit.add_tokens(ids, consumer), table[ids])
        prior, heads = fit.solve(ridge=1e-6)
        loaded = FeaturePrior.from_codebook(prior.manifest(), prior.tensors())
        ids = torch.cat(prompts)
        pred = loaded.apply(*heads["t"], loaded.context(ids, consumer))
        y = table[ids]
        scores[frequent] = 1 - float((pred - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    assert scores[40] > 0.99 and scores[0] < 0.6, scores


def test_most_frequent_counts_over_all_prompts():
    prompts = [torch.tensor([5, 5, 7, 1]), torch.tensor([7, 7, 2, 5])]
    assert most_frequent(prompts, 2).tolist() == [5, 7]  # 5 and 7 thrice each, ids ascending
    assert sorted(most_frequent(prompts, 10).tolist()) == [1, 2, 5, 7]


def test_the_default_ridge_is_picked_by_cross_validation_and_beats_a_tiny_one_on_held_out_rows():
    """Few rows, many features, a noisy target: a tiny ridge fits the noise; GCV's choice does
    better on prompts the fit never saw."""
    consumer = Embedder(vocab=50, hidden=6, seed=0)
    gen = torch.Generator().manual_seed(11)
    truth = torch.randn(6, 2, generator=gen)
    train = [torch.randint(0, 50, (30,), generator=gen) for _ in range(4)]
    test = [torch.randint(0, 50, (30,), generator=gen) for _ in range(8)]

    def target(ids):
        return consumer.token_inputs(ids) @ truth + 2.0 * torch.randn(ids.shape[0], 2, generator=gen)

    errors = {}
    for ridge in (1e-6, None):
        fit = FeatureFit(FeatureSpec(taps=2, width=64, rank=2, hidden=6))
        for ids in train:
            fit.add_target("t", fit.add_tokens(ids, consumer), target(ids))
        prior, heads = fit.solve(ridge=ridge)
        errors[ridge] = sum(float((prior.apply(*heads["t"], prior.context(ids, consumer)) - target(ids)).pow(2).sum())
                            for ids in test)
        if ridge is None:
            assert fit.ridge > 1e-3, fit.ridge  # 140 features on 120 rows: a strong ridge
    assert errors[None] < errors[1e-6], errors


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from scd_serve.model import ModelRuntime
    from scd_serve.model.tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=3, tokenizer=False, vocab_size=64,
                           hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           intermediate_size=48, num_hidden_layers=3)
    return ModelRuntime.load(path)


def test_token_states_are_the_models_own_kv_of_a_token_standing_alone(qwen2):
    ids = torch.tensor([3, 40, 3, 17])
    states = qwen2.token_states(ids, chunk=3)  # [4, layers * 2 * kv_width], chunked as long prompts are
    assert states.shape == (4, 3 * 2 * 16)
    for row, token in zip(states, ids):
        alone = [s for _, s in qwen2.iter_prefill(token.reshape(1), compute_logits=False)]
        want = torch.cat([torch.cat([s.keys.flatten(), s.values.flatten()]) for s in alone])
        assert torch.allclose(row, want, atol=1e-5)
    # the pass cut short at the first layers gives those layers' columns, and no more
    assert torch.equal(qwen2.token_states(ids, chunk=3, layers=2), states[:, : 2 * 2 * 16])


def test_a_prior_on_the_first_layers_states_computes_only_those(qwen2):
    from scd_serve.codec.features import TokenRows

    consumer = Counting(qwen2)
    rows = TokenRows(FeatureSpec(taps=2, width=8, rank=4, hidden=32, states=32, state_layers=1))(consumer, [5, 9])
    assert consumer.layers == [1]
    assert torch.allclose(rows[:, 32:], qwen2.token_states(torch.tensor([5, 9]), layers=1), atol=1e-6)
    cfg = CalibrateConfig(kl_budget=0.1, prior_state_layers=2)
    assert cfg.state_columns(num_layers=3, kv_width=16) == 2 * 2 * 16
    with pytest.raises(ConfigError, match="prior_state_layers"):
        CalibrateConfig(kl_budget=0.1, prior_state_layers=-1)


class Counting:
    """The runtime, counting the token ids whose states it computes."""

    def __init__(self, runtime):
        self.runtime, self.computed, self.layers = runtime, [], []

    def token_inputs(self, ids):
        return self.runtime.token_inputs(ids)

    def token_states(self, ids, layers=None):
        self.computed += ids.tolist()
        self.layers.append(layers)
        return self.runtime.token_states(ids, layers=layers)


@pytest.mark.parametrize("states", [96, 40])  # all of the 3 x 2 x 16 columns; a seeded projection to 40
def test_token_rows_are_computed_once_per_distinct_token_and_agree_on_both_sides(qwen2, states):
    from scd_serve.codec.features import TokenRows

    spec = FeatureSpec(taps=2, width=8, rank=4, hidden=32, states=states)
    consumer = Counting(qwen2)
    rows = TokenRows(spec)
    first = rows(consumer, torch.tensor([5, 9, 5, 5, 12]))
    assert first.shape == (5, 32 + states)
    assert sorted(consumer.computed) == [5, 9, 12]  # distinct tokens only
    again = rows(consumer, torch.tensor([9, 12, 7]))
    assert consumer.computed[3:] == [7]  # 9 and 12 came from the cache
    assert torch.equal(again[:2], first[[1, 4]])
    if states == 96:  # kept whole: the model's own rows
        assert torch.allclose(first[:, 32:], qwen2.token_states(torch.tensor([5, 9, 5, 5, 12])), atol=1e-6)
    bounded = TokenRows(spec, max_bytes=2 * states * 4)  # room for two tokens' states: starts over
    assert torch.allclose(bounded(consumer, torch.tensor([5, 9, 12, 9])), first[[0, 1, 4, 1]], atol=1e-6)
    # the fit and the decode side (from the codebook) compute the same context from token ids
    fit = FeatureFit(spec)
    prompts = [torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for ids in prompts:
        phi = fit.add_tokens(ids, consumer)
        fit.add_target("t", phi, phi[:, :5])
    prior, _ = fit.solve()
    loaded = FeaturePrior.from_codebook(prior.manifest(), prior.tensors())
    assert loaded.spec.states == states
    assert torch.allclose(loaded.context(prompts[0], qwen2), prior.reduce(fit.add_tokens(prompts[0], qwen2)),
                          atol=1e-5)
    # the decode side keeps each token's reduced rows: a prompt of seen tokens computes nothing
    counting = Counting(qwen2)
    again = loaded.context(prompts[0], counting)
    assert counting.computed == [] and torch.equal(again, loaded.context(prompts[0], qwen2))
    assert torch.allclose(loaded.context(prompts[1], counting), prior.reduce(fit.add_tokens(prompts[1], qwen2)),
                          atol=1e-5)
    assert 0 < len(counting.computed) <= len(set(prompts[1].tolist()) - set(prompts[0].tolist()))


def test_a_codebook_from_before_token_states_loads_without_them():
    consumer, prompts = _data()
    fit = FeatureFit(FeatureSpec(taps=2, width=8, rank=2, hidden=6))
    for ids in prompts:
        phi = fit.add_tokens(ids, consumer)
        fit.add_target("t", phi, phi[:, :2])
    prior, _ = fit.solve()
    old = {k: v for k, v in prior.manifest().items() if k != "states"}
    loaded = FeaturePrior.from_codebook(old, prior.tensors())
    assert loaded.spec.states == 0
    assert torch.allclose(loaded.context(prompts[1], consumer), prior.context(prompts[1], consumer))
