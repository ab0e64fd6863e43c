"""Offline fitting math of SCD (pure torch, float64): low-rank codes and the aligner.

Per layer and stream: centre producer rows A [N, dA] and consumer rows B [N, dB]. Two fits of
the code Z = A Enc (its columns nested: rank r uses the first r):
- regression (keys and values, whose decoders are linear; our choice): reduced-rank regression.
  The ridge map W [dA, dB] predicts B from A; the code's channels are the principal directions V
  of those predictions A W, so Enc = W V. Every channel goes to what predicts B: at a quarter of
  a stream's width, codes of the producer's own keys and values left 0.83-0.91 of what the token
  prior leaves on held-out documents of the zoo's hardest pair, the joint SVD 0.86-0.94
  (docs/results.md, scripts/code_fit_study.py).
- joint (the attention input and residual a Patch or Run maps with an aligner; the paper's): the
  truncated SVD of [A | B], each block scaled to unit RMS, and a ridge encoder A Enc ~ Z. With
  reduced-rank codes instead, the aligners trained worse there (probe KL 0.0841 against 0.0820).
The consumer decoder is fitted on the codes the producer will actually send:
Dec_B(r) = argmin ||(A Enc_r) Dec - B||^2, refit per rank; both are exact at full rank in
same-model mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class JointCode:
    mu_a: Tensor  # [dA] producer mean
    enc: Tensor  # [dA, R] encoder, columns ordered by singular value (of the predictions, or joint)
    mu_b: Tensor  # [dB] consumer mean
    gram: Tensor  # [R, R] Z_hat^T Z_hat on calibration rows (for the per-rank decoder)
    cross: Tensor  # [R, dB] Z_hat^T (B - mu_b)
    b_energy: float  # ||B - mu_b||^2, to report relative errors

    @property
    def max_rank(self) -> int:
        return self.enc.shape[1]

    def decoder(self, rank: int, ridge: float = 1e-8) -> Tensor:
        """Dec_B for the first `rank` code channels: [rank, dB] (least squares on Z_hat)."""
        g = self.gram[:rank, :rank]
        lam = ridge * float(torch.trace(g)) / max(rank, 1)
        eye = torch.eye(rank, dtype=g.dtype)
        return torch.linalg.solve(g + lam * eye, self.cross[:rank])

    def rel_error(self, rank: int) -> float:
        """||A Enc_r Dec_B(r) - B||^2 / ||B||^2 on the calibration rows (centred); rank 0: the mean alone."""
        if rank == 0:
            return 1.0
        dec = self.decoder(rank)
        # ||Zh D - B||^2 = tr(D^T G D) - 2 tr(D^T C) + ||B||^2
        g, c = self.gram[:rank, :rank], self.cross[:rank]
        err = float((dec * (g @ dec)).sum() - 2 * (dec * c).sum()) + self.b_energy
        return max(err, 0.0) / max(self.b_energy, 1e-30)


def _unit_rms(x: Tensor) -> Tensor:
    return x / float(x.pow(2).mean().sqrt().clamp_min(1e-12))


@dataclass
class ProducerRows:
    """Producer rows centred, with the ridge system every code fitted on them solves: streams
    whose codes read one state (codec/base.py ATTN_INPUTS) share it instead of each building it.
    With row weights w the fits are weighted least squares: means are weighted, and centred rows
    (the producer's here, the consumer's in fit_code) are scaled by sqrt(w)."""
    mu: Tensor  # [dA]
    centred: Tensor  # [N, dA] float64, times sqrt(w)
    system: Tensor  # [dA, dA] A^T W A + ridge
    root_w: Tensor | None = None  # [N, 1] sqrt(w), None: every row weighs 1

    def centre(self, b: Tensor) -> tuple[Tensor, Tensor]:
        """Consumer rows b [N, dB] -> (their mean [dB], centred rows times sqrt(w)), float64."""
        b = b.to(torch.float64)
        if self.root_w is None:
            mu = b.mean(0)
            return mu, b - mu
        w = self.root_w.pow(2)
        mu = (w * b).sum(0) / w.sum()
        return mu, (b - mu) * self.root_w


def producer_rows(a: Tensor, ridge: float = 1e-6, weights: Tensor | None = None) -> ProducerRows:
    """a: [N, dA]; weights: [N] (None: all 1)."""
    a = a.to(torch.float64)
    if weights is None:
        root_w, mu = None, a.mean(0)
        ac = a - mu
    else:
        w = weights.to(torch.float64).clamp_min(0)[:, None]  # [N, 1]
        root_w, mu = w.sqrt(), (w * a).sum(0) / w.sum()
        ac = (a - mu) * root_w
    gram = ac.T @ ac
    lam = ridge * float(torch.trace(gram)) / ac.shape[1]
    return ProducerRows(mu, ac, gram + lam * torch.eye(ac.shape[1], dtype=a.dtype), root_w)


def fit_code(a: Tensor | ProducerRows, b: Tensor, max_rank: int, regression: bool = True) -> JointCode:
    """a: [N, dA] producer rows (or producer_rows of them), b: [N, dB] consumer rows (same
    tokens) -> JointCode up to max_rank; regression: reduced-rank regression, else the joint SVD
    (the module's docstring)."""
    pa = a if isinstance(a, ProducerRows) else producer_rows(a)
    ac = pa.centred
    mu_b, bc = pa.centre(b)
    if regression:
        w = torch.linalg.solve(pa.system, ac.T @ bc)  # [dA, dB]
        fitted = ac @ w  # [N, dB]: B as A predicts it
        evals, evecs = torch.linalg.eigh(fitted.T @ fitted)  # ascending
        rank = min(max_rank, b.shape[1], ac.shape[1], ac.shape[0])
        enc = w @ evecs[:, torch.argsort(evals, descending=True)[:rank]]  # [dA, R]
    else:
        m = torch.cat([_unit_rms(ac), _unit_rms(bc)], dim=1)  # [N, dA+dB]
        evals, evecs = torch.linalg.eigh(m.T @ m)  # ascending
        rank = min(max_rank, m.shape[1], m.shape[0])
        z = m @ evecs[:, torch.argsort(evals, descending=True)[:rank]]  # [N, R] joint code (U S)
        enc = torch.linalg.solve(pa.system, ac.T @ z)  # [dA, R]
    zh = ac @ enc
    return JointCode(pa.mu, enc, mu_b, zh.T @ zh, zh.T @ bc, float(bc.pow(2).sum()))


class Aligner(torch.nn.Module):
    """g: producer code of H_in [.., r] -> consumer H_in [.., hidden]: linear map plus a small MLP."""

    def __init__(self, rank: int, hidden: int, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(rank, hidden)
        self.up = torch.nn.Linear(rank, width)
        self.down = torch.nn.Linear(width, hidden)
        torch.nn.init.zeros_(self.down.weight)  # starts as the least-squares linear map
        torch.nn.init.zeros_(self.down.bias)

    def forward(self, z: Tensor) -> Tensor:
        return self.linear(z) + self.down(torch.nn.functional.silu(self.up(z)))

    def tensors(self) -> dict[str, Tensor]:
        return {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}

    @classmethod
    def from_tensors(cls, t: dict[str, Tensor]) -> "Aligner":
        rank, width, hidden = t["up.weight"].shape[1], t["up.weight"].shape[0], t["linear.weight"].shape[0]
        module = cls(rank, hidden, width)
        module.load_state_dict(t)
        return module.eval()


def _rel_err(g: Aligner, z: Tensor, h: Tensor) -> float:
    with torch.no_grad():
        return float((g(z) - h).pow(2).sum() / (h - h.mean(0)).pow(2).sum().clamp_min(1e-30))


def fit_aligner(z: Tensor, h_b: Tensor, width: int, steps: int = 300, batch: int = 1024,
                lr: float = 3e-3, seed: int = 0, holdout: float = 0.1) -> tuple[Aligner, float]:
    """z: [N, r] producer codes, h_b: [N, hidden] consumer H_in. L2 loss.

    The linear part starts at the least-squares solution; the MLP is trained on (1 - holdout)
    of the rows and the state with the lowest held-out error is kept (never worse than the
    linear start on held-out rows). -> (aligner, held-out relative squared error)."""
    z, h_b = z.float(), h_b.float()
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(z.shape[0], generator=gen)
    n_val = max(1, int(holdout * z.shape[0])) if z.shape[0] > 10 else 0
    val, train = perm[:n_val], perm[n_val:]
    zt, ht = z[train], h_b[train]
    zv, hv = (z[val], h_b[val]) if n_val else (zt, ht)
    torch.manual_seed(seed)
    g = Aligner(z.shape[1], h_b.shape[1], width)
    zc = torch.cat([zt, torch.ones(zt.shape[0], 1)], dim=1).double()
    sol = torch.linalg.lstsq(zc, ht.double(), driver="gelsd").solution  # [r+1, hidden]
    with torch.no_grad():
        g.linear.weight.copy_(sol[:-1].T.float())
        g.linear.bias.copy_(sol[-1].float())
    best_err, best_state = _rel_err(g, zv, hv), {k: v.clone() for k, v in g.state_dict().items()}
    with torch.enable_grad():
        opt = torch.optim.Adam(g.parameters(), lr=lr)
        for step in range(1, steps + 1):
            idx = torch.randint(0, zt.shape[0], (min(batch, zt.shape[0]),), generator=gen)
            loss = (g(zt[idx]) - ht[idx]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 50 == 0 or step == steps:
                err = _rel_err(g, zv, hv)
                if err < best_err:
                    best_err, best_state = err, {k: v.clone() for k, v in g.state_dict().items()}
    g.load_state_dict(best_state)
    return g.eval(), best_err
