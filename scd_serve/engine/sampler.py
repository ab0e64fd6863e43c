"""Sampler: next token per row of logits, each row with its own parameters and RNG.

Each sequence draws from its own torch.Generator (seeded from `seed`, or from the
engine's entropy when no seed is given), so a seeded request yields the same tokens
whatever else shares its batch. Every legal parameter value is safe, extremes included
(temperature 1e-300 or 1e300, top_p 1e-138): a row that still cannot be sampled (the
model gave non-finite logits) fails that request alone, as a StepFailed in its place.

Before choosing (greedy rows too) the logits are shaped as OpenAI and vLLM define it:
repetition penalty over prompt and output, presence/frequency penalties over the output,
logit_bias, and until min_tokens the end tokens masked. Log-probabilities are reported
from the raw logits (vLLM's default), so they equal the model's own forward pass.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection

import torch

from scd_serve.engine.request import SamplingParams, TokenLogprob
from scd_serve.engine.sequence import Sequence
from scd_serve.errors import StepFailed


def generator_for(params: SamplingParams) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return g


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int] = ()) -> list[int | StepFailed]:
    # logits: [B, vocab] (any float dtype/device); one row per sequence
    raw = logits.float().cpu()
    finite = torch.isfinite(raw).all(dim=-1).tolist()
    shaped = [i for i, seq in enumerate(seqs) if seq.request.params.shapes_logits and finite[i]]
    logits = raw.clone() if shaped else raw
    for i in shaped:
        shape_logits(logits[i], seqs[i], eos_token_ids)
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
    wanted = [i for i, seq in enumerate(seqs) if seq.request.params.logprobs is not None and isinstance(out[i], int)]
    if wanted:
        chosen = [out[i] for i in wanted]
        ks = [seqs[i].request.params.logprobs for i in wanted]
        for i, lp in zip(wanted, token_logprobs(raw[wanted], chosen, ks), strict=True):
            seqs[i].last_logprob = lp
    return out


def shape_logits(row: torch.Tensor, seq: Sequence, eos_token_ids: Collection[int]) -> None:
    """In place, one row [vocab]: penalties, bias, and the min_tokens mask."""
    p = seq.request.params
    vocab = row.numel()
    if p.repetition_penalty != 1:  # HF / vLLM: over every token seen, prompt included
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        seen = seen[seen < vocab]
        vals = row[seen]
        limit = torch.finfo(row.dtype).max  # an extreme penalty saturates: +-inf would make inf - inf below
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty).clamp(-limit, limit)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:  # OpenAI: output only
        counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
        row -= p.frequency_penalty * counts.float() + p.presence_penalty * (counts > 0).float()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
        keep = ids < vocab
        row[ids[keep]] += torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype)[keep]
    if seq.num_output_tokens < p.min_tokens:
        ends = [t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab]
        if ends:
            row[torch.tensor(ends, dtype=torch.long)] = float("-inf")


def token_logprobs(logits: torch.Tensor, chosen: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logits [N, vocab] (raw) -> per row the chosen token's logprob and the k best (ks[i])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(chosen, dtype=torch.long)[:, None])[:, 0].tolist()
    k = max(ks)
    top_v, top_i = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(picked[r], tuple(zip(top_i[r][:ks[r]], top_v[r][:ks[r]], strict=True)))
            for r in range(len(chosen))]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] (finite, or -inf where masked) -> probs [vocab] (float64) after temperature,
    top_k, top_p and min_p.

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
    if params.min_p > 0:  # the best token always survives (its probability is the max)
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs
