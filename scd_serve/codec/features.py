"""Feature prior: the part of the consumer's K/V that the last few prompt tokens predict, read
from the consumer's own embeddings, so that its size does not grow with the vocabulary.

The decode node holds the prompt's token ids and the consumer's weights. Per position t:
  e_t   = the consumer's layer-0 attention input, rms_norm(embed[x_t]) (token ids alone fix it)
  s_t   = the consumer's K/V of x_t at every layer (or its first `state_layers`) when x_t stands
          alone (ModelRuntime.token_states: its own weights' nonlinear reading of the token),
          S-projected to `states` columns
  u_t   = [e_t, s_t]                                      per token [hidden + states]
  g_t   = [u_t, silu(scale * u_t R), onehot_F(x_t)]        per token [hidden + states + width + F]
  phi_t = [g_t, g_{t-1}, ..., g_{t-taps+1}]           (zeros before the prompt) [m]
R [hidden + states, width] and S (only where the model's layers * 2 * kv_width columns exceed
`states`) are Gaussian matrices drawn from the seed (random features: a fixed nonlinear
map of each token, so that the fit can give each token a vector of its own, as a table would);
they are regenerated, not stored, and the manifest holds R's checksum. u_t depends on the token
id alone, so each prompt computes it once per distinct token, and a bounded cache keeps it
across prompts. On the embedded pair the token states cut the prior's own KL 5x against
the embedding alone (docs/results.md). Features of one token
(not of the window) make the prior additive over taps like a dense table: on the embedded
pair it explains the consumer's keys better than random features of the whole window.
onehot_F marks the F tokens seen most often in the calibration prompts (their ids ship in
the codebook; F is fixed, not the vocabulary): those tokens get a vector of their own, as in
a dense table, and the rest share what their embeddings say.
One reduced-rank ridge regression serves every target (layer, stream):
  prior_t = ((phi_t - mean) U) H_target + bias_target,
with U [m, rank] shared and H [rank, dB] per target: the codebook holds m*rank plus rank*dB
numbers per target, whatever the vocabulary.

The fit is calibration/feature_fit.py; every token's reduced rows at once, codec/prior_table.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from scd_serve.errors import CodebookError

Tensor = torch.Tensor
KIND = "features"


@dataclass(frozen=True)
class FeatureSpec:
    taps: int = 3  # prompt tokens read: the current one and taps - 1 before it
    width: int = 512  # random features per token (0: the linear embedding features only)
    rank: int = 64  # shared basis U's columns
    seed: int = 0
    scale: float = 2.0  # of the random projection, before the silu
    hidden: int = 0  # the consumer's hidden size (set by the fit)
    frequent: int = 0  # F: tokens with a one-hot column of their own (the most frequent in the fit)
    states: int = 0  # token-state columns per token (0: the embedding alone, as codebooks before them)
    state_layers: int = 0  # the token states' first layers (0: every layer; fewer cost less on a cold prompt)

    @property
    def num_features(self) -> int:
        return self.taps * (self.hidden + self.states + self.width + self.frequent)

    def projection(self) -> Tensor:
        """R [hidden + states, width], float32 on the CPU: the same numbers on every machine."""
        gen = torch.Generator().manual_seed(self.seed)
        base = self.hidden + self.states
        return torch.randn(base, self.width, generator=gen) / max(base, 1) ** 0.5

    def state_projection(self, natural: int) -> Tensor | None:
        """S [natural, states] for a model whose token states have `natural` columns (None: kept whole)."""
        if not self.states or natural == self.states:
            return None
        gen = torch.Generator().manual_seed(self.seed + 1)
        return torch.randn(natural, self.states, generator=gen) / natural ** 0.5


def _checksum(t: Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def most_frequent(prompts: list, count: int) -> Tensor:
    """The `count` token ids seen most often in the prompts (ties: lower id first). -> [<= count]"""
    ids = torch.cat([torch.as_tensor(p).reshape(-1).long() for p in prompts])
    found, counts = torch.unique(ids, return_counts=True)
    order = sorted(range(found.shape[0]), key=lambda i: (-int(counts[i]), int(found[i])))[:count]
    return found[sorted(order)].clone()


def token_features(spec: FeatureSpec, inputs: Tensor, proj: Tensor, ids: Tensor | None = None,
                   frequent: Tensor | None = None) -> Tensor:
    """inputs: each token's u [T, hidden + states] (TokenRows), ids [T] the tokens (needed
    with frequent-token columns), frequent [F] -> g [T, hidden + states + width + F] float32:
    what one tap reads of a token, a function of its id alone."""
    e = inputs.float()
    parts = [e]
    if spec.width:
        parts.append(torch.nn.functional.silu(spec.scale * (e @ proj.to(e.device))))
    if spec.frequent:
        onehot = ids.reshape(-1, 1).to(e.device) == frequent.to(e.device).reshape(1, -1)  # [T, F]
        parts.append(torch.cat([onehot.float(), e.new_zeros(e.shape[0], spec.frequent - onehot.shape[1])], dim=1))
    return torch.cat(parts, dim=1)


def features(spec: FeatureSpec, inputs: Tensor, proj: Tensor, ids: Tensor | None = None,
             frequent: Tensor | None = None) -> Tensor:
    """token_features of each position and of the taps - 1 before it (zeros before the
    prompt) -> phi [T, taps * (hidden + states + width + F)] float32."""
    g = token_features(spec, inputs, proj, ids, frequent)
    t = g.shape[0]
    lagged = [g] + [torch.cat([g.new_zeros(min(j, t), g.shape[1]), g[: max(t - j, 0)]]) for j in range(1, spec.taps)]
    return torch.cat(lagged, dim=1)


def cached_rows(cache: dict[int, Tensor], keys: list[int], compute: Callable[[list[int]], Tensor],
                max_bytes: int) -> Tensor:
    """The rows of token ids `keys`, stacked [K, ...]: from `cache`, the missing ones computed
    at once and kept. Bounded: past max_bytes the cache starts over rather than grow."""
    rows = {i: r for i in keys if (r := cache.get(i)) is not None}  # safe beside a clear()
    if missing := [i for i in keys if i not in rows]:
        fresh = dict(zip(missing, compute(missing)))
        rows.update(fresh)
        if (len(cache) + len(fresh)) * fresh[missing[0]].numel() * 4 > max_bytes:
            cache.clear()
        cache.update(fresh)
    return torch.stack([rows[i] for i in keys])


class TokenRows:
    """u [T, hidden + states] of prompt tokens from the consumer's weights. The token states are
    computed once per distinct token and kept (up to `max_bytes`) for later prompts: a token's
    row never changes. e is one embedding gather, not worth a cache."""

    def __init__(self, spec: FeatureSpec, max_bytes: int = 64 << 20):
        self.spec, self.max_bytes = spec, max_bytes
        self._rows: dict[int, Tensor] = {}  # token id -> its state row [states]
        self._state_proj: dict[Any, Tensor | None] = {}

    def _states(self, consumer: Any, ids: Tensor) -> Tensor:  # ids: [U] -> [U, states]
        s = consumer.token_states(ids, layers=self.spec.state_layers or None).float()  # [U, layers * 2 * kv_width]
        if s.device not in self._state_proj:
            proj = self.spec.state_projection(s.shape[1])
            self._state_proj[s.device] = None if proj is None else proj.to(s.device)
        proj = self._state_proj[s.device]
        return s if proj is None else s @ proj

    def __call__(self, consumer: Any, tokens: Any, device: Any = None, keep: bool = True) -> Tensor:
        """tokens [T] -> u [T, hidden + states]; keep False: the states computed are not kept (a
        vocabulary sweep would only churn the cache)."""
        ids = torch.as_tensor(tokens).reshape(-1).long()
        ids = ids if device is None else ids.to(device)
        e = consumer.token_inputs(ids)  # [T, hidden]
        if not self.spec.states:
            return e
        uniq, inverse = torch.unique(ids, return_inverse=True)
        table = self._states(consumer, uniq) if not keep else cached_rows(
            self._rows, uniq.tolist(), lambda missing: self._states(
                consumer, torch.as_tensor(missing, device=ids.device)), self.max_bytes)  # [U, states]
        return torch.cat([e, table[inverse.to(table.device)].to(e.device)], dim=1)


class FeaturePrior:
    """The decode side: prompt tokens -> reduced features F [T, rank] -> each target's prior."""

    kind = KIND

    def __init__(self, spec: FeatureSpec, basis: Tensor, mean: Tensor, frequent: Tensor | None = None):
        self.spec = spec
        self.basis, self.mean = basis, mean  # U [m, rank], phi's mean [m]
        self.frequent = frequent if frequent is not None else torch.zeros(0, dtype=torch.long)  # [F] token ids
        self._proj = spec.projection()
        self.token_rows = TokenRows(spec)
        self._reduced: dict[Any, dict[int, Tensor]] = {}  # device -> token id -> its taps' rows [taps, rank]
        self._tables: dict[Any, Tensor] = {}  # device -> every token's rows [vocab, taps, rank] (set_table)
        self._on: dict[Any, tuple[Tensor, Tensor, Tensor]] = {}

    def _moved(self, device) -> tuple[Tensor, Tensor, Tensor]:
        if device not in self._on:
            self._on[device] = (self.basis.to(device, torch.float32), self.mean.to(device, torch.float32),
                                self._proj.to(device))
        return self._on[device]

    def reduce(self, phi: Tensor) -> Tensor:
        """phi [N, m] -> F [N, rank]."""
        basis, mean, _ = self._moved(phi.device)
        return (phi.float() - mean) @ basis

    def context(self, tokens: Any, consumer: Any, device: Any = None) -> Tensor:
        """The prompt's reduced features F [T, rank], computed once per prompt. F is linear in
        phi, and phi's taps are per-token rows shifted: so each distinct token's rows are
        reduced once per tap ([taps, rank]: from the vocabulary table where one is set, else
        computed and kept for later prompts like its states), and F sums them shifted. The same
        numbers as reduce(features(...)), at a fraction of the cost: a prompt has far fewer
        distinct tokens than positions, and most were seen."""
        ids = torch.as_tensor(tokens).reshape(-1).long()
        uniq, inverse = torch.unique(ids, return_inverse=True)
        where = torch.device(device) if device is not None else ids.device
        basis, mean, _ = self._moved(where)
        table = self._tables.get(where)
        if table is not None:
            per_token = table[uniq.to(where)].float()  # [U, taps, rank]
        else:
            per_token = cached_rows(self._reduced.setdefault(where, {}), uniq.tolist(),
                                    lambda missing: self.token_reduced(consumer, missing, where),
                                    self.token_rows.max_bytes)  # [U, taps, rank]
        per_tap = per_token[inverse.to(per_token.device)].transpose(0, 1)  # [taps, T, rank]
        ctx = per_tap[0] - mean @ basis
        for j in range(1, min(self.spec.taps, ids.shape[0])):
            ctx[j:] += per_tap[j, :-j]
        return ctx

    def token_reduced(self, consumer: Any, ids: Any, device: Any = None, keep_states: bool = True) -> Tensor:
        """Each token's reduced rows, one per tap: ids [M] -> [M, taps, rank] float32 (before the
        mean's share, which context() takes once); keep_states as TokenRows' keep."""
        where = torch.device(device) if device is not None else torch.device("cpu")
        basis, _, proj = self._moved(where)
        new = torch.as_tensor(ids).reshape(-1).long()
        g = token_features(self.spec, self.token_rows(consumer, new, where, keep_states), proj, new, self.frequent)
        return (g @ basis.reshape(self.spec.taps, g.shape[1], -1)).transpose(0, 1)

    def set_table(self, table: Tensor, device: Any = "cpu") -> None:
        """Every token's token_reduced rows [vocab, taps, rank] (codec/prior_table.py), used by
        context() on `device` from now on."""
        self._tables[torch.device(device)] = table.to(device)

    def has_table(self, device: Any = "cpu") -> bool:
        return torch.device(device) in self._tables

    @staticmethod
    def apply(head: Tensor, bias: Tensor, ctx: Tensor) -> Tensor:
        """head [rank, d], bias [d], ctx F [T, rank] -> prior rows [T, d]."""
        return ctx @ head.to(ctx.device, torch.float32) + bias.to(ctx.device, torch.float32)

    def rows(self) -> int:
        return self.spec.rank

    def manifest(self) -> dict[str, Any]:
        return {"kind": KIND, **asdict(self.spec), "projection_sha256": _checksum(self._proj)}

    def tensors(self) -> dict[str, Tensor]:
        out = {"prior.basis": self.basis.to(torch.float16).contiguous(), "prior.mean": self.mean.float().contiguous()}
        if self.spec.frequent:
            out["prior.frequent"] = self.frequent.long().contiguous()
        return out

    @classmethod
    def from_codebook(cls, manifest: dict[str, Any], tensors: dict[str, Tensor]) -> FeaturePrior:
        fields = {k: manifest[k] for k in FeatureSpec.__dataclass_fields__ if k in manifest}
        spec = FeatureSpec(**fields)
        for name in ("prior.basis", "prior.mean"):
            if name not in tensors:
                raise CodebookError(f"codebook tensor '{name}' is missing (its manifest has a feature prior)")
        basis, mean = tensors["prior.basis"].float(), tensors["prior.mean"].float()
        if tuple(basis.shape) != (spec.num_features, spec.rank) or tuple(mean.shape) != (spec.num_features,):
            raise CodebookError(f"feature prior tensors have shapes {list(basis.shape)} and {list(mean.shape)}, "
                                f"expected [{spec.num_features}, {spec.rank}] and [{spec.num_features}]")
        frequent = tensors.get("prior.frequent")
        if spec.frequent and (frequent is None or frequent.dim() != 1 or frequent.shape[0] > spec.frequent):
            raise CodebookError(f"codebook tensor 'prior.frequent' must hold at most {spec.frequent} token ids")
        prior = cls(spec, basis, mean, frequent)
        want = manifest.get("projection_sha256")
        if want and want != _checksum(prior._proj):
            raise CodebookError("this torch build draws another random projection from the feature prior's seed "
                                f"(checksum {_checksum(prior._proj)} != {want}): recalibrate on this build")
        return prior
