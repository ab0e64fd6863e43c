"""A received layer is refused before the cache when its values are not all finite: the fast
check (min and max, codec/rebuild.all_finite) agrees with isfinite().all() on every dtype a
codec decodes to, wherever the bad value sits."""

import pytest
import torch

from scd_serve.codec.rebuild import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_agrees_with_isfinite(dtype, bad):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 2, 16, generator=g) * 100).to(dtype)
    assert all_finite(x) and all_finite(x[:0])
    for where in [(0, 0, 0), (39, 1, 15), (17, 0, 9)]:
        y = x.clone()
        y[where] = bad
        assert all_finite(y) == bool(torch.isfinite(y).all()) is False
