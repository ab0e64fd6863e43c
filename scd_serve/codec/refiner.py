"""Refiner: a reused stream's nonlinear correction, read from its code and the prompt's token context.

A Reuse layer rebuilds the consumer's keys (or values) as mean + token prior + code @ Dec: every
term linear, in the code and in the token features. Between two models that is most of what
can be had linearly, and little: on `qwen-code-long` (docs/results.md) the linear decode of a
rank-16 key code of layer 1 left 0.75 of what the token prior leaves on documents it was not
fitted on; with a small MLP over [code, the prior's reduced token features F] on top of it, 0.57
(0.52 at rank 64, against 0.69), and over F alone, with no code at all, 0.70-0.84 across layers
(`python scripts/code_fit_study.py /work/zoo/qwen-code-long`, its refined columns).
So the consumer adds

    refine(z, F) = W_d gelu(W_u x),   x = [z padded to the widest rank, F], normalized,

trained on the calibration rows against what the linear decode at that rank leaves, with the
rank drawn per batch from the plan search's grid, so one refiner serves every rank the search may
choose, the code's missing channels read as zero. Not at rank 0: a stream that ships nothing
keeps the linear prior. A refiner over the features alone (a nonlinear prior) did better on
held-out rows of the calibration prompts, but worse on other documents: on `llama-lora-rope-docs`,
which ships nothing, the held-out KL rose 0.0058 -> 0.0083 and the manifest fell outside 25%
(0.71x; docs/results.md). A code carries the prompt's own facts; the features alone learn the
calibration documents' tokens. Its output layers start at zero (the linear decode exactly) and
the epoch kept is the one with the lowest error on held-out rows among those no worse than the
linear decode there at any rank.
No linear term: what is linear in z and F the decoder and the prior hold already (least squares).
Calibration stores the two weights in fp16: at the Qwen2.5-0.5B shape 46 refiners of width 256
are ~7.5 MB, 0.8% of the consumer's bfloat16 weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Tensor = torch.Tensor


class Refiner(torch.nn.Module):
    def __init__(self, max_rank: int, ctx: int, out: int, width: int):
        super().__init__()
        self.max_rank = max_rank
        self.register_buffer("mean", torch.zeros(max_rank + ctx))
        self.register_buffer("scale", torch.ones(max_rank + ctx))
        self.up = torch.nn.Linear(max_rank + ctx, width)
        self.down = torch.nn.Linear(width, out)
        torch.nn.init.zeros_(self.down.weight)  # starts as no correction: the linear decode
        torch.nn.init.zeros_(self.down.bias)
        self._kept: dict[tuple, tuple[Tensor, Tensor]] = {}  # fold's, made after training (eval())

    def inputs(self, z: Tensor, ctx: Tensor) -> Tensor:
        """z [T, r <= max_rank] (a code as shipped), ctx [T, c] -> x [T, max_rank + c], normalized,
        the channels the code lacks zero."""
        x = (torch.cat([torch.nn.functional.pad(z, (0, self.max_rank - z.shape[1])), ctx], 1) - self.mean) / self.scale
        x[:, z.shape[1]:self.max_rank] = 0
        return x

    def forward(self, z: Tensor, ctx: Tensor) -> Tensor:
        if self.training or torch.is_grad_enabled():  # training: the padded inputs, as fit_refiner has them
            hidden = self.up(self.inputs(z.float(), ctx.float()))
        else:  # serving: the channels a rank-r code lacks are zero, so their weights are skipped
            weight, bias = self.fold(z.shape[1])
            hidden = torch.cat([z.float(), ctx.float()], 1) @ weight.T + bias
        return self.down(torch.nn.functional.gelu(hidden))  # [T, out]

    def fold(self, rank: int) -> tuple[Tensor, Tensor]:
        """The up projection of a rank-`rank` code's channels and the features', the normalization
        folded in: (weight [width, rank + ctx], bias [width]), kept per rank."""
        key = (rank, self.up.weight.device)
        if key not in self._kept:
            used = torch.cat([torch.arange(rank), torch.arange(self.max_rank, self.mean.shape[0])]).to(key[1])
            weight = self.up.weight[:, used] / self.scale[used]
            self._kept[key] = (weight.contiguous(), self.up.bias - weight @ self.mean[used])
        return self._kept[key]

    def tensors(self) -> dict[str, Tensor]:
        """The weights in fp16 (what a codebook stores), the rest float32."""
        return {k: v.detach().to(torch.float16 if k.endswith("weight") else torch.float32).contiguous()
                for k, v in self.state_dict().items()}

    def train(self, mode: bool = True) -> "Refiner":
        self._kept.clear()  # weights about to change (or just changed): fold them again
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        self._kept.clear()  # moved or cast: fold them again on the new device
        return super()._apply(fn, *args, **kwargs)

    @classmethod
    def from_tensors(cls, t: dict[str, Tensor], max_rank: int) -> "Refiner":
        width, n_in = t["up.weight"].shape
        module = cls(max_rank, n_in - max_rank, t["down.weight"].shape[0], width)
        module.load_state_dict({k: v.float() for k, v in t.items()})
        return module.eval()


def fit_refiner(z: Tensor, ctx: Tensor, target: Callable[[Tensor, int], Tensor], ranks: Sequence[int],
                width: int, epochs: int, batch: int = 512, lr: float = 1e-3, seed: int = 0,
                holdout: float = 0.1, weights: Tensor | None = None) -> tuple[Refiner, dict[int, float]]:
    """z [N, R]: the rows' codes at the widest rank, in prompt order; ctx [N, c]; target(rows, r)
    -> what the linear decode at rank r leaves of those rows [n, dB]. -> (refiner, held-out
    relative squared error per rank, 1.0 being the linear decode's). The held-out rows are the
    last `holdout` of them, so other prompts than the trained ones (calibration rows come prompt
    by prompt): rows of the same prompts share their contexts and would flatter a refiner that
    learned those contexts by heart. weights [N]: each row's in the squared error (None: all 1)."""
    z, ctx = z.float(), ctx.float()
    w = torch.ones(z.shape[0], 1) if weights is None else weights.float()[:, None]  # [N, 1]
    gen = torch.Generator().manual_seed(seed)
    n_val = max(1, int(holdout * z.shape[0]))
    val, train = torch.arange(z.shape[0] - n_val, z.shape[0]), torch.arange(z.shape[0] - n_val)
    val_targets = {r: target(val, r) for r in ranks}
    with torch.random.fork_rng(devices=[]):  # its initial weights from the seed, not the caller's RNG state
        torch.manual_seed(seed)
        ref = Refiner(z.shape[1], ctx.shape[1], val_targets[ranks[0]].shape[1], width)
    x = torch.cat([z, ctx], 1)
    ref.mean.copy_(x[train].mean(0))
    ref.scale.copy_(x[train].std(0).clamp_min(1e-6))
    base = {r: float((w[val] * t.pow(2)).sum().clamp_min(1e-30)) for r, t in val_targets.items()}

    def held_out() -> dict[int, float]:
        with torch.no_grad():
            return {r: float((w[val] * (ref(z[val, :r], ctx[val]) - t).pow(2)).sum()) / base[r]
                    for r, t in val_targets.items()}

    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=1e-4)
    best_err = held_out()
    best_state = {k: v.clone() for k, v in ref.state_dict().items()}
    for _ in range(epochs):
        order = train[torch.randperm(train.shape[0], generator=gen)]
        for i in range(0, order.shape[0], batch):
            rows = order[i:i + batch]
            r = ranks[int(torch.randint(len(ranks), (1,), generator=gen))]
            loss = (w[rows] * (ref(z[rows, :r], ctx[rows]) - target(rows, r)).pow(2)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        err = held_out()  # kept only where no rank does worse than the linear decode (1.0)
        if max(err.values()) <= 1.0 and sum(err.values()) < sum(best_err.values()):
            best_err, best_state = err, {k: v.clone() for k, v in ref.state_dict().items()}
    ref.load_state_dict(best_state)
    return ref.eval(), best_err
