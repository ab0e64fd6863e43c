"""FeatureFit: the feature prior's calibration (codec/features.py says what the prior is).

Normal equations streamed over every position of the fit prompts (one [m, m] Gram matrix,
X^T Y per target), never a vocabulary-sized matrix. Reduced rank: the truncated SVD of the
fitted values, each target block scaled to unit RMS first so that wide blocks (h) do not
drown narrow ones (k, v), computed in the m-dimensional space from the Gram's eigenbasis,
which also gives the ridge of least generalized cross-validation error without a second pass.
"""

from __future__ import annotations

from typing import Any

import torch

from scd_serve.codec.features import FeaturePrior, FeatureSpec, TokenRows, features

Tensor = torch.Tensor


class FeatureFit:
    """Streamed normal equations of the feature prior, shared by every target (layer, stream)."""

    def __init__(self, spec: FeatureSpec, frequent: Tensor | None = None):
        """frequent: the token ids with columns of their own ([<= spec.frequent], most_frequent)."""
        self.spec = spec
        self.frequent = frequent if frequent is not None else torch.zeros(0, dtype=torch.long)
        self._proj = spec.projection()
        self.token_rows = TokenRows(spec)
        m = spec.num_features
        self.gram = torch.zeros(m, m, dtype=torch.float64)
        self.col_sum = torch.zeros(m, dtype=torch.float64)
        self.rows = 0
        self.xty: dict[object, Tensor] = {}
        self.y_sum: dict[object, Tensor] = {}
        self.y_sq: dict[object, float] = {}
        self._pending: tuple[Tensor, list[tuple[object, Tensor]]] | None = None

    def add_tokens(self, tokens: Tensor, consumer: Any) -> Tensor:
        """Count one prompt's features into the Gram matrix. -> phi [T, m] (float32, CPU)."""
        self._flush()
        phi = features(self.spec, self.token_rows(consumer, tokens).cpu(), self._proj, torch.as_tensor(tokens).cpu(),
                       self.frequent).contiguous()
        # one prompt's sums in float32 (a few thousand terms), the running totals in float64
        self.gram += (phi.T @ phi).double()
        self.col_sum += phi.sum(0).double()
        self.rows += phi.shape[0]
        self._pending = (phi, [])
        return phi

    def add_target(self, key: object, phi: Tensor, y: Tensor) -> None:
        """y: [T, d] consumer rows of the prompt whose phi [T, m] `add_tokens` returned last."""
        if self._pending is None or self._pending[0] is not phi:
            raise ValueError("add_target takes the phi of the prompt add_tokens counted last")
        self._pending[1].append((key, y.reshape(y.shape[0], -1).to("cpu", torch.float32)))

    def _flush(self) -> None:
        """X^T Y of the pending prompt, all targets in one product (one GEMM, not one per target)."""
        if not self._pending or not self._pending[1]:
            self._pending = None
            return
        phi, targets = self._pending
        self._pending = None
        xty = (phi.T @ torch.cat([y for _, y in targets], dim=1)).double()  # [m, sum d]
        col = 0
        for key, y in targets:
            d = y.shape[1]
            if key not in self.xty:
                self.xty[key] = torch.zeros(phi.shape[1], d, dtype=torch.float64)
                self.y_sum[key] = torch.zeros(d, dtype=torch.float64)
                self.y_sq[key] = 0.0
            self.xty[key] += xty[:, col: col + d]
            self.y_sum[key] += y.sum(0).double()
            self.y_sq[key] += float(y.double().pow(2).sum())
            col += d

    def solve(self, ridge: float | None = None) -> tuple[FeaturePrior, dict[object, tuple[Tensor, Tensor]]]:
        """-> (the prior, {key: (head [rank, d], bias [d])}). ridge: relative to the mean feature
        variance; None picks it by generalized cross-validation (few rows and many features
        overfit at a small ridge, and the codes then carry the prior's noise)."""
        self._flush()
        n, m = max(self.rows, 1), self.spec.num_features
        mean = self.col_sum / n
        gram = self.gram - n * torch.outer(mean, mean)  # Xc^T Xc
        s, v = torch.linalg.eigh(gram)  # Xc^T Xc = V diag(s) V^T
        s = s.clamp_min(0.0)
        unit = float(gram.diagonal().mean().clamp_min(1e-12))
        del gram
        # X^T Y of every target in the eigenbasis, one block at a time: at real shapes each
        # [m, sum d] float64 copy is over a GB, so only c is ever whole (the sums are consumed)
        keys = list(self.xty)
        dims = [self.y_sum[k].shape[0] for k in keys]
        c = torch.empty(m, sum(dims), dtype=torch.float64)
        scales, energy, col = [], 0.0, 0
        for k, d in zip(keys, dims):  # each block to unit RMS (centred), so the SVD weighs targets alike
            var = (self.y_sq[k] - float(self.y_sum[k].pow(2).sum()) / n) / (n * d)
            scales.append(max(var, 1e-24) ** 0.5)
            c[:, col: col + d] = v.T @ ((self.xty.pop(k) - torch.outer(mean, self.y_sum[k])) / scales[-1])
            energy += n * d * var / scales[-1] ** 2  # ||Y_c||^2 of the scaled block
            col += d
        self.ridge = ridge if ridge is not None else gcv_ridge(s, c.pow(2).sum(1), energy, n, unit)
        inv = 1.0 / (s + self.ridge * unit)
        # the full-rank ridge solution is W = V diag(inv) c; the fitted values' covariance (in the
        # ridge metric) is A^T A with A = diag(sqrt(inv)) c. Neither is formed: only [m, m] and
        # [m, rank] products of c are.
        root = inv.sqrt()
        evals, evecs = torch.linalg.eigh(root[:, None] * (c @ c.T) * root[None, :])  # A A^T [m, m]
        rank = min(self.spec.rank, m)
        top = torch.argsort(evals, descending=True)[:rank]
        p, sv = evecs[:, top], evals[top].clamp_min(1e-30).sqrt()
        q = (c.T @ (root[:, None] * p)) / sv  # [sum d, rank] right singular vectors of A
        basis = v @ (inv[:, None] * (c @ q))  # U = W q [m, rank]
        del c
        # the codebook stores U in fp16: fit the heads' users to the very numbers shipped
        prior = FeaturePrior(self.spec, basis.half().float(), mean.float(), self.frequent)
        out, col = {}, 0
        for k, d, scale in zip(keys, dims, scales):
            head = q[col: col + d].T * scale  # [rank, d]
            out[k] = (head.float(), (self.y_sum[k] / n).float())  # phi is centred by the prior
            col += d
        return prior, out


RIDGE_GRID = tuple(10.0 ** e for e in range(-6, 2))


def gcv_ridge(s: Tensor, c2: Tensor, energy: float, n: int, unit: float) -> float:
    """The relative ridge of RIDGE_GRID with the least generalized cross-validation error
    n * SSE / (n - df)^2, from the Gram's eigenvalues s [m] and the squared norms c2 [m] of
    X^T Y's rows in its eigenbasis (every target at once): no second pass over the data."""
    best, best_score = RIDGE_GRID[0], float("inf")
    for r in RIDGE_GRID:
        lam = r * unit
        shrink = s / (s + lam)
        sse = energy - float(((2 - shrink) / (s + lam) * c2).sum())  # ||Y - X W||^2
        df = float(shrink.sum())
        if df >= n:
            continue
        score = n * max(sse, 0.0) / (n - df) ** 2
        if score < best_score:
            best, best_score = r, score
    return best
