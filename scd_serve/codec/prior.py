"""Dense token prior (the explicit option; the default is codec/features.py): the part of the consumer's K/V that the last few prompt tokens predict alone.

The decode node holds the prompt's token ids (it must, to serve the request), so its
decoder may use them for free: per layer and stream, prior_t = sum_j W_j[x_{t-j}] for
j = 0..taps-1 (a pad id stands before position 0). Reuse then codes only the residual
B - prior, so the producer's few code numbers carry what the tokens alone cannot say.
This is our extension of SCD (the paper decodes from codes only). It matters where a
consumer state is mostly a function of nearby tokens, e.g. keys of induction heads (the
previous token's identity), which a per-token linear map of the producer's state misses
when the two models mix neighbours with different rotary bases.

Fit: ridge regression on one-hot token contexts with an intercept. The normal equations
are counted from token ids (one Gram matrix shared by every layer and stream), never
materialized as a one-hot matrix: [taps * (vocab + 1)]^2 doubles.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor
KIND = "dense"


def context_ids(tokens: Tensor, taps: int, vocab: int) -> Tensor:
    """tokens [T] -> column of each (position, tap) in the stacked tables: [T, taps].

    Column j * (vocab + 1) + x_{t-j}; id `vocab` is the pad before the prompt's start.
    Ids outside the table (a bigger tokenizer than calibrated for) also map to the pad."""
    tokens = tokens.long().reshape(-1)
    tokens = torch.where((tokens >= 0) & (tokens < vocab), tokens, torch.full_like(tokens, vocab))
    pad = torch.full((taps,), vocab, dtype=torch.long, device=tokens.device)
    padded = torch.cat([pad, tokens])
    t = tokens.shape[0]
    cols = [padded[taps - j: taps - j + t] + j * (vocab + 1) for j in range(taps)]
    return torch.stack(cols, dim=1)  # [T, taps]


class PriorFit:
    """Accumulates the shared Gram matrix and, per target (layer, stream), X^T Y."""

    def __init__(self, vocab: int, taps: int):
        self.vocab, self.taps = vocab, taps
        self.width = taps * (vocab + 1)
        self.gram = torch.zeros(self.width, self.width, dtype=torch.float64)
        self.col_sum = torch.zeros(self.width, dtype=torch.float64)
        self.rows = 0
        self.xty: dict[object, Tensor] = {}
        self.y_sum: dict[object, Tensor] = {}

    def add_tokens(self, tokens: Tensor, consumer: Any = None) -> Tensor:
        """Count one prompt's contexts into the Gram matrix. -> its context ids [T, taps]."""
        ctx = context_ids(tokens.cpu(), self.taps, self.vocab)
        pairs = (ctx[:, :, None] * self.width + ctx[:, None, :]).reshape(-1)
        self.gram.view(-1).index_add_(0, pairs, torch.ones(pairs.shape[0], dtype=torch.float64))
        self.col_sum.index_add_(0, ctx.reshape(-1), torch.ones(ctx.numel(), dtype=torch.float64))
        self.rows += ctx.shape[0]
        return ctx

    def add_target(self, key: object, ctx: Tensor, y: Tensor) -> None:
        """y: [T, d] consumer rows of one prompt for target `key` (same prompt as ctx)."""
        y = y.reshape(y.shape[0], -1).to("cpu", torch.float64)
        if key not in self.xty:
            self.xty[key] = torch.zeros(self.width, y.shape[1], dtype=torch.float64)
            self.y_sum[key] = torch.zeros(y.shape[1], dtype=torch.float64)
        for j in range(self.taps):
            self.xty[key].index_add_(0, ctx[:, j], y)
        self.y_sum[key] += y.sum(0)

    def solve(self, ridge: float = 1.0) -> tuple[DensePrior, dict[object, tuple[Tensor, Tensor]]]:
        """-> (the prior, {key: (tables [taps * (vocab + 1), d], bias [d])}), prior = bias + sum of table rows.

        ridge is in counts: a context seen n times is shrunk by n / (n + ridge)."""
        n = max(self.rows, 1)
        mean_x = self.col_sum / n
        gram = self.gram - n * torch.outer(mean_x, mean_x)  # centred: Xc^T Xc
        gram.diagonal().add_(ridge)
        chol = torch.linalg.cholesky(gram)
        keys = list(self.xty)
        rhs = torch.cat([self.xty[k] - torch.outer(mean_x, self.y_sum[k]) for k in keys], dim=1)
        sol = torch.cholesky_solve(rhs, chol)  # [width, sum d]
        out, col = {}, 0
        for k in keys:
            d = self.y_sum[k].shape[0]
            w = sol[:, col: col + d]
            bias = self.y_sum[k] / n - mean_x @ w
            out[k] = (w, bias)
            col += d
        return DensePrior(self.taps, self.vocab), out


def apply_prior(tables: Tensor, bias: Tensor, ctx: Tensor) -> Tensor:
    """tables [taps * (vocab + 1), d], ctx [T, taps] -> prior rows [T, d] (one fused gather-sum)."""
    return torch.nn.functional.embedding_bag(ctx, tables, mode="sum") + bias


class DensePrior:
    """The decode side of a dense prior: prompt tokens -> context ids [T, taps] -> table rows."""

    kind = KIND

    def __init__(self, taps: int, vocab: int):
        self.taps, self.vocab = taps, vocab

    def context(self, tokens: Any, consumer: Any = None, device: Any = None) -> Tensor:
        ids = torch.as_tensor(tokens).reshape(-1)
        return context_ids(ids if device is None else ids.to(device), self.taps, self.vocab)

    def reduce(self, ctx: Tensor) -> Tensor:
        return ctx

    @staticmethod
    def apply(tables: Tensor, bias: Tensor, ctx: Tensor) -> Tensor:
        return apply_prior(tables, bias, ctx)

    def rows(self) -> int:
        return self.taps * (self.vocab + 1)

    def manifest(self) -> dict[str, Any]:
        return {"kind": KIND, "taps": self.taps, "vocab": self.vocab}

    def tensors(self) -> dict[str, Tensor]:
        return {}

    @classmethod
    def from_codebook(cls, manifest: dict[str, Any], tensors: dict[str, Tensor]) -> DensePrior:
        return cls(int(manifest["taps"]), int(manifest["vocab"]))
