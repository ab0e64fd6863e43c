"""The folded Reuse decode (codec/reuse.py) is the sum of its four terms, in every combination."""

import pytest
import torch

from scd_serve.codec.refiner import Refiner
from scd_serve.codec.reuse import ReuseDecoder


def _refiner(max_rank: int, ctx: int, out: int, gen: torch.Generator) -> Refiner:
    ref = Refiner(max_rank, ctx, out, width=12)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        ref.mean.copy_(torch.randn(max_rank + ctx, generator=gen))
        ref.scale.copy_(torch.rand(max_rank + ctx, generator=gen) + 0.5)
    return ref.eval()


# a stream that ships nothing (rank 0) has no refiner
@pytest.mark.parametrize("rank, with_prior, with_refiner",
                         [(0, False, False), (0, True, False), (5, False, False), (5, True, False),
                          (5, False, True), (5, True, True)])
def test_the_folded_decode_is_the_sum_of_its_terms(rank, with_prior, with_refiner):
    gen = torch.Generator().manual_seed(rank + 2 * with_prior + 4 * with_refiner)
    t, c, d = 7, 4, 6
    z, ctx = torch.randn(t, rank, generator=gen), torch.randn(t, c, generator=gen)
    dec = torch.randn(rank, d, generator=gen) if rank else None
    mu = torch.randn(d, generator=gen)
    prior = (torch.randn(c, d, generator=gen), torch.randn(d, generator=gen)) if with_prior else None
    ref = _refiner(8, c, d, gen) if with_refiner else None

    want = mu.expand(t, -1)
    if dec is not None:
        want = want + z @ dec
    if prior is not None:
        want = want + ctx @ prior[0] + prior[1]
    if ref is not None:
        with torch.no_grad():
            want = want + ref(z, ctx)
    got = ReuseDecoder(dec, mu, prior, ref)(z if rank else None, ctx, t)
    assert got.shape == (t, d)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_refiner_without_a_prior_still_reads_the_features():
    gen = torch.Generator().manual_seed(9)
    z, ctx = torch.randn(5, 3, generator=gen), torch.randn(5, 4, generator=gen)
    dec, mu = torch.randn(3, 6, generator=gen), torch.randn(6, generator=gen)
    ref = _refiner(3, 4, 6, gen)
    other = ctx + 1.0  # other features: another refiner output, the linear part unchanged
    folded = ReuseDecoder(dec, mu, None, ref)
    with torch.no_grad():
        torch.testing.assert_close(folded(z, ctx, 5) - folded(z, other, 5), ref(z, ctx) - ref(z, other),
                                   atol=1e-4, rtol=1e-4)
