"""Log-probabilities in OpenAI's two JSON shapes, from the engine's TokenLogprob records.

Completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where
`top_logprobs[i]` maps token text -> logprob for the k best *and* the chosen token (so up to
k + 1 entries, as OpenAI and vLLM do); with echo the prompt comes first, its first token
with null values. Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [k]}]}`.
vLLM's `prompt_logprobs` (either route): per prompt token null or {token id: {"logprob", "rank",
"decoded_token"}}. Token text is the token decoded alone (special tokens kept), or
`token_id:<id>` with vLLM's `return_tokens_as_token_ids`. -inf is sent as -9999.0, as vLLM does: JSON has no -inf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from scd_serve.engine.request import TokenLogprob

FLOOR = -9999.0


class TokenText:
    """token id -> the text a logprob entry shows for it (cached per response)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def value(lp: float) -> float:
    return lp if math.isfinite(lp) else FLOOR


def completion_logprobs(token_ids: Sequence[int], records: Sequence[TokenLogprob | None], text: TokenText,
                        offset: int = 0, k: int | None = None) -> dict[str, list]:
    """One choice's (or one stream chunk's) logprobs; `offset`: where its text starts in the choice;
    `k`: at most this many alternatives (records may hold more: prompt_logprobs asked for them)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, rec in zip(token_ids, records, strict=True):
        token = text(token_id)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if rec is None:  # the first prompt token: nothing before it to predict it
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(value(rec.logprob))
        top = {text(t): value(lp) for t, lp in (rec.top if k is None else rec.top[:k])}
        top.setdefault(token, value(rec.logprob))
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs(token_ids: Sequence[int], records: Sequence[TokenLogprob | None], text: TokenText,
                    k: int) -> list[dict[int, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first: nothing predicts it) or
    {token id: {"logprob", "rank", "decoded_token"}}, the prompt's own token first, then the k
    most likely (ranks 1..k; the prompt's token once, if it is among them)."""
    out: list[dict[int, dict] | None] = []
    for token_id, rec in zip(token_ids, records, strict=True):
        if rec is None:
            out.append(None)
            continue
        entry = {token_id: {"logprob": value(rec.logprob), "rank": rec.rank, "decoded_token": text(token_id)}}
        for rank, (t, lp) in enumerate(rec.top[:k], start=1):
            entry.setdefault(t, {"logprob": value(lp), "rank": rank, "decoded_token": text(t)})
        out.append(entry)
    return out


def merge_completion(a: dict[str, list] | None, b: dict[str, list]) -> dict[str, list]:
    return b if a is None else {k: a[k] + b[k] for k in a}


def chat_logprobs(token_ids: Sequence[int], records: Sequence[TokenLogprob | None], text: TokenText) -> dict:
    return {"content": [_chat_entry(token_id, rec.logprob, text)
                        | {"top_logprobs": [_chat_entry(t, lp, text) for t, lp in rec.top]}
                        for token_id, rec in zip(token_ids, records, strict=True) if rec is not None]}


def _chat_entry(token_id: int, lp: float, text: TokenText) -> dict:
    token = text(token_id)
    return {"token": token, "logprob": value(lp), "bytes": list(token.encode("utf-8"))}
