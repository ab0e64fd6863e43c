"""Detokenizer: incremental text for one sequence, with stop sequences. No torch.

Text is emitted only once it is stable: a token ending in a partial UTF-8 character
("\ufffd") is held until the next one completes it, and when stop sequences are set the
last (longest stop - 1) characters are held back so a stop sequence is never half-sent.
A stop sequence ends generation and is not part of the output (OpenAI semantics).
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
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # output text so far (stop sequence cut off)
        self._emitted = 0  # characters of self.text already returned
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the newly stable text (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new, or a partial character
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        start = max(0, len(self.text) - self._hold)  # a stop may straddle old and new text
        self.text += delta
        cut = self._find_stop(start)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self.flush()
        stable = len(self.text) - self._hold
        if stable <= self._emitted:
            return ""
        out = self.text[self._emitted:stable]
        self._emitted = stable
        return out

    def flush(self) -> str:
        """The held-back rest, once the sequence has finished."""
        out = self.text[self._emitted:]
        self._emitted = len(self.text)
        return out

    def _find_stop(self, start: int) -> int | None:
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
