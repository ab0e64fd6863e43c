"""Answer metrics and distribution distances."""

import math

import torch

from scd_serve.quality.metrics import exact_match, kl_and_tv, token_f1


def test_token_f1_and_exact_match():
    assert token_f1("kelo dunu", "kelo dunu") == 1.0
    assert math.isclose(token_f1("kelo", "kelo dunu"), 2 * 1.0 * 0.5 / 1.5)
    assert token_f1("mira", "kelo dunu") == 0.0
    assert token_f1("", "kelo") == 0.0 and token_f1("", "") == 1.0
    assert exact_match("Kelo  dunu", "kelo dunu") == 1.0 and exact_match("kelo", "kelo dunu") == 0.0


def test_kl_and_tv_are_zero_on_equal_and_positive_otherwise():
    p = torch.randn(4, 10)
    kl, tv = kl_and_tv(p, p.clone())
    assert torch.all(kl == 0) and torch.all(tv.abs() < 1e-12)
    q = p + torch.randn(4, 10)
    kl, tv = kl_and_tv(p, q)
    assert torch.all(kl > 0) and torch.all((tv > 0) & (tv <= 1))
    # two point masses on different tokens: TV is 1
    a, b = torch.full((1, 3), -1e4), torch.full((1, 3), -1e4)
    a[0, 0], b[0, 1] = 0.0, 0.0
    assert math.isclose(float(kl_and_tv(a, b)[1][0]), 1.0, abs_tol=1e-9)
