"""Quality metrics: token F1 / exact match of answers, KL and total variation of distributions."""

from __future__ import annotations

from collections import Counter

import torch


def _words(text: str) -> list[str]:
    return text.lower().split()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style F1 over whitespace words (our language has no punctuation inside answers)."""
    pred, ref = _words(prediction), _words(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, reference: str) -> float:
    return float(_words(prediction) == _words(reference))


def kl_and_tv(logits_p: torch.Tensor, logits_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(P || Q) in nats and total variation (callers pass P = method, Q = oracle).

    logits_p, logits_q: [N, vocab] -> (kl [N], tv [N]).
    """
    logp = torch.log_softmax(logits_p.double(), dim=-1)
    logq = torch.log_softmax(logits_q.double(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    tv = 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
    return kl.clamp_min(0.0), tv


def top_kl(top_logprobs: torch.Tensor, top_ids: torch.Tensor, logq: torch.Tensor) -> float:
    """KL(P || Q) in nats where P is known on its top tokens only (an engine's returned
    log-probabilities, e.g. vLLM's `logprobs`): over `top_ids` plus the rest of the vocabulary as
    one bucket, on both sides. top_logprobs, top_ids: [k]; logq: [vocab] log-probabilities."""
    p, q = top_logprobs.double().exp(), logq.double().exp()[top_ids]
    p_rest, q_rest = (1 - p.sum()).clamp_min(1e-12), (1 - q.sum()).clamp_min(1e-12)
    return max(0.0, float((p * (p.log() - q.log())).sum() + p_rest * (p_rest.log() - q_rest.log())))
