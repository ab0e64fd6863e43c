"""Sampler: next token per row of logits, each row with its own parameters and RNG.

Each sequence draws from its own torch.Generator (seeded from `seed`, or from the
engine's entropy when no seed is given), so a seeded request yields the same tokens
whatever else shares its batch. Every legal parameter value is safe, extremes included
(temperature 1e-300 or 1e300, top_p 1e-138): a row that still cannot be sampled (the
model gave non-finite logits) fails that request alone, as a StepFailed in its place.
"""

from __future__ import annotations

import secrets

import torch

from scd_serve.engine.request import SamplingParams
from scd_serve.engine.sequence import Sequence
from scd_serve.errors import StepFailed


def generator_for(params: SamplingParams) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return g


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | StepFailed]:
    # logits: [B, vocab] (any float dtype/device); one row per sequence
    logits = logits.float().cpu()
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    out: list[int | StepFailed] = list(torch.argmax(logits, dim=-1).tolist())  # greedy rows are done here
    for i, seq in enumerate(seqs):
        params = seq.request.params
        if not finite[i]:
            out[i] = StepFailed(f"the model produced non-finite logits for request {seq.request.request_id} "
                                f"at output token {seq.num_output_tokens}")
            continue
        if params.greedy:
            continue
        if seq.sampler_state is None:
            seq.sampler_state = generator_for(params)
        try:
            probs = probabilities(logits[i], params)
            out[i] = int(torch.multinomial(probs, 1, generator=seq.sampler_state))
        except RuntimeError as exc:  # a bug here must cost one request, never the batch
            out[i] = StepFailed(f"sampling failed for request {seq.request.request_id}: {exc}")
    return out


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] (finite) -> probs [vocab] (float64) after temperature, top_k and top_p.

    In float64, from logits shifted so the best is 0: dividing by any temperature > 0 then
    keeps the best token(s) at exactly 0 and the rest at <= 0 (possibly -inf), so softmax
    never sees inf - inf; and a top_p below float32's smallest value does not round to 0."""
    shifted = logits.double() - logits.max().double()
    scaled = shifted / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p, and always the top token
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
