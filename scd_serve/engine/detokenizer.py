"""Detokenizer: incremental text for one sequence, with stop sequences. No torch.

Text leaves once stable: a partial UTF-8 character ("\ufffd") waits for the next token, and
with stop sequences the last (longest stop - 1) characters are held back, so a stop is never
half-sent. A stop sequence ends generation and is not part of the output (OpenAI semantics).
"""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded as context so the first output token keeps its leading space
# (sentencepiece-style tokenizers drop it at the start of a string).
_CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # output text so far (stop sequence cut off)
        self._emitted = 0  # characters of self.text already returned
        self.stopped = False
        self.stop_reason: str | None = None  # the stop sequence that ended the text

    def add(self, token_id: int, check_stop: bool = True) -> str:
        """Feed one generated token; returns the newly stable text (maybe ""). With check_stop
        False (before a request's min_tokens) stop sequences do not end the text yet."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._advance(final=False, check_stop=check_stop)
        return self._take(final=self.stopped)

    def flush(self) -> str:
        """At the end of the sequence: the held-back rest, including a trailing partial character."""
        if not self.stopped:
            self._advance(final=True)
        return self._take(final=True)

    def _advance(self, final: bool, check_stop: bool = True) -> None:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return  # nothing new, or a partial character
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        start = max(0, len(self.text) - self._hold)  # a stop may straddle old and new text
        self.text += full[len(prefix):]
        hit = self._find_stop(start) if check_stop else None
        if hit is not None:
            self.text, self.stop_reason, self.stopped = self.text[:hit[0]], hit[1], True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._hold
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """(where the earliest stop sequence starts, which one) or None."""
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
