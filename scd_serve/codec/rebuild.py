"""Rebuild: the decode side of a codec for one prompt, layer by layer.

    rebuild = begin(codec, tokens, consumer, start)  # tokens: the transferred prompt's ids [T]
    rebuild.prepare()                                 # prompt-only work, while the codes are on their way
    k_pre, v = rebuild.decode_layer(layer, code)      # rows start..T-1

What a codec keeps between a prompt's layers (SCD's token context, a run's forward) lives on the
prompt's Rebuild, so nothing is cached by id() and no proxy stands in for the codec. A codec
without such state needs no `begin` of its own: the plain Rebuild passes the prompt's tokens
to its decode_layer.

A transfer after the decode side's cached prefix carries rows start.. only; a codec whose rows
do not decode alone (a run: the consumer's forward over the whole prompt) is sent every row
and the caller keeps the ones it lacks (`decodes_from`).

A codec may have `head_tokens` S: the consumer computes the prompt's first S tokens itself (its
own prefill of them, in `prepare()` while the codes travel: exact, since causal rows depend on
nothing after them) and the codes carry rows S.. only (`codes_from`). Every later row attends
to the first ones, so a rebuilt row's error there reaches them all: on the pair zoo a head of
16 took 11-18% off scd's KL, and one of 128 beat a replayed tail of 128 (docs/results.md).
The prompt's Rebuild returns the head's rows then the decoded ones, so every caller of `begin`
(the decode worker, eval, calibration's probes, the vLLM connector) gets the head alike. A
codec whose rows do not decode alone is still sent every row; the head's rows replace the
first ones it decodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from scd_serve.errors import ScdError, TransferCorrupt


class Rebuild:
    def __init__(self, codec: Any, tokens: Any, consumer: Any, start: int = 0):
        self.codec, self.tokens, self.consumer, self.start = codec, tokens, consumer, start

    @property
    def rows(self) -> Any:
        """The decoded rows' token ids [T - start] (None where the caller gave no tokens)."""
        return self.tokens if self.tokens is None or not self.start else self.tokens[self.start:]

    def prepare(self) -> None:
        """Prompt-only work (none for a stateless codec)."""

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (k_pre, v): [T, kv_heads, head_dim] each, for the consumer's write_kv."""
        return self.codec.decode_layer(layer, code, self.consumer, tokens=self.rows, start=self.start)


def checked_layer(rebuild: Rebuild, layer: int, code: Mapping[str, torch.Tensor],
                  skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A received layer's (k_pre, v) less its first `skip` rows, refused as TransferCorrupt when the
    code does not decode or decodes to non-finite K/V (a checksum proves bytes, not values)."""
    try:
        k_pre, v = rebuild.decode_layer(layer, code)  # [rows shipped, kv_heads, head_dim] each
    except ScdError:
        raise
    except Exception as exc:  # malformed code: refuse it, never write garbage
        raise TransferCorrupt(f"layer {layer} code could not be decoded: {type(exc).__name__}: {exc}") from None
    k_pre, v = k_pre[skip:], v[skip:]
    if not (all_finite(k_pre) and all_finite(v)):
        raise TransferCorrupt(f"layer {layer} rebuilt to non-finite K/V: refused before the cache")
    return k_pre, v


def all_finite(x: torch.Tensor) -> bool:
    """Every value finite: its min and max are (both propagate NaN), one reduction and no mask
    (0.013 against 0.14 ms for isfinite().all() on a [1023, 2, 64] layer, two threads)."""
    return x.numel() == 0 or all(bool(torch.isfinite(m)) for m in torch.aminmax(x))


class HeadRebuild(Rebuild):
    """Rows start..head-1 the consumer's own, computed from the prompt's first `head` tokens;
    the codec's rebuild `inner` decodes the codes (rows inner.start.., at most head)."""

    def __init__(self, inner: Rebuild, consumer: Any, start: int, head: int):
        super().__init__(inner.codec, inner.tokens, consumer, start)
        self.inner, self.head = inner, head
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def prepare(self) -> None:
        self.inner.prepare()
        self.head_kv()

    def head_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_pre, v) of rows start..head-1: [head - start, kv_heads, head_dim] each."""
        if self._kv is None:
            ids = torch.as_tensor(self.tokens[:self.head], dtype=torch.long)  # ids: [head]
            with torch.no_grad():  # K/V alone: the last layer's attention and MLP are not run
                self._kv = [(s.keys[self.start:], s.values[self.start:])
                            for _, s in self.consumer.iter_prefill(ids, compute_logits=False)]
        return self._kv

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k_pre, v = self.inner.decode_layer(layer, code)  # [T - inner.start, kv_heads, head_dim] each
        head_k, head_v = self.head_kv()[layer]
        past = self.head - self.inner.start  # decoded rows the head's replace (a codec sent every row)
        return torch.cat([head_k.to(k_pre.dtype), k_pre[past:]]), torch.cat([head_v.to(v.dtype), v[past:]])


def begin(codec: Any, tokens: Any, consumer: Any, start: int = 0) -> Rebuild:
    """The prompt's Rebuild of rows start..: the codec's own where it keeps per-prompt state, else
    the plain one, under the consumer's own head rows where the codec has a head past `start`."""
    num_tokens = 0 if tokens is None else len(tokens)
    first = codes_from(codec, start, num_tokens)
    make = getattr(codec, "begin", None)
    inner = make(tokens, consumer, first) if make is not None else Rebuild(codec, tokens, consumer, first)
    head = head_rows(codec, num_tokens)
    return HeadRebuild(inner, consumer, start, head) if head > start else inner


def head_rows(codec: Any, num_tokens: int) -> int:
    """Of a transfer of `num_tokens` rows, how many the consumer computes itself: the codec's
    head, less at least the last row (which the codes carry)."""
    return max(0, min(int(getattr(codec, "head_tokens", 0) or 0), num_tokens - 1))


def codes_from(codec: Any, start: int, num_tokens: int) -> int:
    """The first row the codes carry for a rebuild of rows start..num_tokens-1 (`start` from
    decodes_from): past the codec's head, except that a codec whose rows do not decode alone is
    sent them all."""
    if not getattr(codec, "rows_decode_alone", True):
        return start
    return max(start, head_rows(codec, num_tokens))


def decodes_from(codec: Any, start: int) -> int:
    """The first row a transfer must carry for a decode side that holds rows ..start-1: `start`,
    or 0 for a codec whose rows do not decode alone (`rows_decode_alone` False)."""
    return start if getattr(codec, "rows_decode_alone", True) else 0
