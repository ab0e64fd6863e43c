"""Token priors: context ids, and the counted ridge fit against a dense one-hot solve."""

import torch

from scd_serve.codec.prior import PriorFit, apply_prior, context_ids


def test_context_ids_shift_pad_and_out_of_range():
    ctx = context_ids(torch.tensor([3, 1, 7]), taps=2, vocab=5)  # 7 is outside the table
    # tap 0: x_t; tap 1: x_{t-1} offset by vocab + 1 = 6; pad id is 5
    assert ctx.tolist() == [[3, 6 + 5], [1, 6 + 3], [5, 6 + 1]]


def _dense(tokens_list, ys, vocab, taps, ridge):
    x = torch.cat([torch.nn.functional.one_hot(context_ids(t, taps, vocab), taps * (vocab + 1)).sum(1)
                   for t in tokens_list]).double()
    y = torch.cat(ys).double()
    xc, yc = x - x.mean(0), y - y.mean(0)
    w = torch.linalg.solve(xc.T @ xc + ridge * torch.eye(x.shape[1], dtype=x.dtype), xc.T @ yc)
    return x, w, y.mean(0) - x.mean(0) @ w


def test_counted_fit_matches_dense_ridge_and_recovers_an_additive_table():
    gen = torch.Generator().manual_seed(0)
    vocab, taps = 11, 3
    truth = torch.randn(taps * (vocab + 1), 4, generator=gen).double()
    tokens = [torch.randint(0, vocab, (n,), generator=gen) for n in (40, 70, 25)]
    ys = [truth[context_ids(t, taps, vocab)].sum(1) + 0.5 for t in tokens]  # [T, 4] each
    fit = PriorFit(vocab, taps)
    for t, y in zip(tokens, ys):
        fit.add_target(("layer", "k"), fit.add_tokens(t), y)
    tables, bias = fit.solve(ridge=1e-3)[1][("layer", "k")]
    x, w_dense, b_dense = _dense(tokens, ys, vocab, taps, 1e-3)
    pred = x @ tables + bias
    # two float64 solves of one ridge system: 1.6e-14 apart at |pred| ~ 6 (default/avx2); a wrong count is > 1e-3
    assert torch.allclose(pred, x @ w_dense + b_dense, atol=1e-8)
    y = torch.cat(ys)
    assert float((pred - y).norm() / (y - y.mean(0)).norm()) < 1e-3  # the function is exactly additive
    # apply_prior gives the same rows as the dense product
    ctx = context_ids(tokens[0], taps, vocab)
    # float64: the same 3 table rows summed (gather) or among exact zeros (matmul): a few ulp, 9e-16 here
    assert torch.allclose(apply_prior(tables, bias, ctx), pred[: tokens[0].shape[0]], atol=1e-10)
