"""The codes' fit (codec/lowrank.py): reduced-rank regression of the consumer's rows on the
producer's (keys and values), nested by rank, exact where the consumer's rows are a linear map
of the producer's; and the joint SVD the aligners read, exact for one model at full rank."""

import torch

from scd_serve.codec.lowrank import fit_code


def rows(n=400, da=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, da, generator=g, dtype=torch.float64), g


def test_a_consumer_block_of_rank_two_is_exact_from_a_rank_two_code():
    a, g = rows()
    w = torch.randn(12, 2, generator=g, dtype=torch.float64) @ torch.randn(2, 6, generator=g, dtype=torch.float64)
    b = a @ w + 3.0  # [N, 6]: every column a mix of two directions of A, plus a mean
    jc = fit_code(a, b, max_rank=6)
    assert jc.max_rank == 6  # at most the consumer block's width
    assert jc.rel_error(2) < 1e-9 and jc.rel_error(1) > 1e-3
    z = (a - jc.mu_a) @ jc.enc[:, :2]
    assert torch.allclose(z @ jc.decoder(2) + jc.mu_b, b, atol=1e-4)  # values ~30; the fit's ridge


def test_ranks_nest_and_each_channel_lowers_the_error():
    a, g = rows(da=10)
    b = torch.tanh(a[:, :8] @ torch.randn(8, 8, generator=g, dtype=torch.float64))  # not linear in A
    jc = fit_code(a, b, max_rank=8)
    errors = [jc.rel_error(r) for r in range(0, 9)]
    assert all(x > y for x, y in zip(errors, errors[1:])), errors
    # the first channel is the direction that predicts the most of B: at rank 1 no single
    # column of A (a channel that ignores B) does better
    best_single = min(float(((a[:, [j]] - a[:, [j]].mean()) @ torch.linalg.lstsq(a[:, [j]] - a[:, [j]].mean(), b - b.mean(0)).solution
                             - (b - b.mean(0))).pow(2).sum() / (b - b.mean(0)).pow(2).sum()) for j in range(10))
    assert errors[1] <= best_single + 1e-9


def test_one_model_on_both_sides_is_exact_at_full_rank_either_way():
    a, _ = rows(da=6)
    for regression in (True, False):
        assert fit_code(a, a.clone(), max_rank=6, regression=regression).rel_error(6) < 1e-9


def test_row_weights_fit_as_the_rows_repeated_that_many_times():
    """Weighted least squares: a row of weight 3 counts as three copies of it (the code, its
    decoder and the means), for the regression codes and the joint SVD alike."""
    from scd_serve.codec.lowrank import producer_rows

    a, g = rows(n=120, da=8)
    b = torch.tanh(a[:, :6] @ torch.randn(6, 5, generator=g, dtype=torch.float64))
    counts = torch.randint(1, 4, (120,), generator=g)
    repeated = torch.repeat_interleave(torch.arange(120), counts)
    for regression in (True, False):
        weighted = fit_code(producer_rows(a, weights=counts.double()), b, max_rank=4, regression=regression)
        copies = fit_code(a[repeated], b[repeated], max_rank=4, regression=regression)
        assert torch.allclose(weighted.mu_a, copies.mu_a) and torch.allclose(weighted.mu_b, copies.mu_b)
        for r in (1, 4):
            decode = lambda jc: (a - jc.mu_a) @ jc.enc[:, :r] @ jc.decoder(r) + jc.mu_b
            assert torch.allclose(decode(weighted), decode(copies), atol=1e-6)
            assert abs(weighted.rel_error(r) - copies.rel_error(r)) < 1e-9
