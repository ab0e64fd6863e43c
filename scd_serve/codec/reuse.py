"""A Reuse stream's decode at one rank, its terms folded into one matrix for serving.

The rebuilt rows are the sum of four terms (codec/scd.py, refiner.py):

    b = mu + (F @ H + h) + z @ Dec + down(gelu([z, F] @ Wu^T + u))

mean, token prior over the prompt's features F, the code's linear decode and the refiner.
Every term but the refiner's second layer reads X = [z, F], so one product gives them all:

    Y = X @ [[Dec; H] | Wu^T] + [mu + h + down.bias | u]      Y: [T, dB + width]
    b = Y[:, :dB] + gelu(Y[:, dB:]) @ down^T

two matrix products a stream instead of four, and no separate adds: at the pair zoo's shapes
(hidden 128-192, prompts of a few hundred tokens) a Reuse layer's decode is a few dozen small
operations, whose fixed cost rivals their arithmetic. Distillation (calibration/distill.py)
tunes the terms apart and reads them through ScdCodec.decoder_inputs, not through this.
"""

from __future__ import annotations

import torch

from scd_serve.codec.refiner import Refiner

Tensor = torch.Tensor


class ReuseDecoder:
    """dec [rank, dB] or None (rank 0), mu [dB], prior (head [c, dB], bias [dB]) over float
    features or None, refiner (codec/refiner.py, reading the same c features) or None; every
    tensor on one device."""

    @torch.no_grad()
    def __init__(self, dec: Tensor | None, mu: Tensor, prior: tuple[Tensor, Tensor] | None = None,
                 refiner: Refiner | None = None):
        self.rank, self.out = (0 if dec is None else dec.shape[0]), mu.shape[0]
        up = refiner.fold(self.rank) if refiner is not None else None  # ([width, rank + c], [width])
        ctx = prior[0].shape[0] if prior is not None else (up[0].shape[1] - self.rank if up is not None else 0)
        self.features = ctx > 0
        linear = torch.zeros(self.rank + ctx, self.out, device=mu.device)  # [rank + c, dB]
        if dec is not None:
            linear[:self.rank] = dec
        if prior is not None:
            linear[self.rank:] = prior[0]
        bias = mu.float() + (prior[1].float() if prior is not None else 0.0)
        self.down: Tensor | None = None
        if up is not None:
            linear, bias = torch.cat([linear, up[0].t()], 1), torch.cat([bias + refiner.down.bias, up[1]])
            self.down = refiner.down.weight.t().contiguous()  # [width, dB]
        self.weight = linear.contiguous() if linear.shape[0] else None
        self.bias = bias.contiguous()

    @torch.no_grad()
    def __call__(self, z: Tensor | None, ctx: Tensor | None, num_tokens: int) -> Tensor:
        """z [T, rank] (None at rank 0), ctx F [T, c] (read where there are features) -> b [T, dB]."""
        if self.weight is None:  # rank 0 and no prior: the mean alone
            return self.bias.expand(num_tokens, -1)
        parts = ([z] if self.rank else []) + ([ctx] if self.features else [])
        x = parts[0] if len(parts) == 1 else torch.cat(parts, 1)  # [T, rank + c]
        y = torch.addmm(self.bias, x, self.weight)  # [T, dB (+ width)]
        if self.down is None:
            return y
        return torch.addmm(y[:, :self.out], torch.nn.functional.gelu(y[:, self.out:]), self.down)
