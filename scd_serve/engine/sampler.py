"""Sampler: next token per row of logits, each row with its own parameters and RNG.

Each sequence draws from its own torch.Generator (seeded from `seed`, or from the
engine's entropy when no seed is given), so a seeded request yields the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import secrets

import torch

from scd_serve.engine.request import SamplingParams
from scd_serve.engine.sequence import Sequence


def generator_for(params: SamplingParams) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return g


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    # logits: [B, vocab] (any float dtype/device); one row per sequence
    logits = logits.float().cpu()
    out = torch.argmax(logits, dim=-1).tolist()  # greedy rows are done here
    for i, seq in enumerate(seqs):
        params = seq.request.params
        if params.greedy:
            continue
        if seq.sampler_state is None:
            seq.sampler_state = generator_for(params)
        probs = probabilities(logits[i], params)
        out[i] = int(torch.multinomial(probs, 1, generator=seq.sampler_state))
    return out


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] -> probs [vocab] after temperature, top_k and top_p (nucleus)."""
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
