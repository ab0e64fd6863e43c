"""Rebuild: the decode side of a codec for one prompt, layer by layer.

    rebuild = begin(codec, tokens, consumer)  # tokens: the transferred prompt's ids [T]
    rebuild.prepare()                          # prompt-only work, while the codes are on their way
    k_pre, v = rebuild.decode_layer(layer, code)

What a codec keeps between a prompt's layers (SCD's token context, a run's forward) lives on the
prompt's Rebuild, so nothing is cached by id() and no proxy stands in for the codec. A codec
without such state needs no `begin` of its own: the plain Rebuild passes the prompt's tokens
to its decode_layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class Rebuild:
    def __init__(self, codec: Any, tokens: Any, consumer: Any):
        self.codec, self.tokens, self.consumer = codec, tokens, consumer

    def prepare(self) -> None:
        """Prompt-only work (none for a stateless codec)."""

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (k_pre, v): [T, kv_heads, head_dim] each, for the consumer's write_kv."""
        return self.codec.decode_layer(layer, code, self.consumer, tokens=self.tokens)


def begin(codec: Any, tokens: Any, consumer: Any) -> Rebuild:
    """The prompt's Rebuild: the codec's own where it keeps per-prompt state, else the plain one."""
    make = getattr(codec, "begin", None)
    return make(tokens, consumer) if make is not None else Rebuild(codec, tokens, consumer)
