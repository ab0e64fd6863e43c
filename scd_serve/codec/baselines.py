"""Lossless `identity` and the `raw` 16-bit baseline (the producer's KV as it stands).

`raw` is what naive cross-model KV reuse ships: the producer's post-RoPE keys and its values
in 16-bit. The consumer undoes its own RoPE so that `write_kv` (which rotates with the
consumer's parameters) stores exactly the producer's post-RoPE keys.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from scd_serve.codec.base import (KEYS, VALUES, check_code, first_position, positions_for, state_field,
                                  to_consumer)
from scd_serve.codec.codec_spec import CodecSpec, rotate_with, spec_of


class IdentityCodec:
    """float32 pre-RoPE K and V: lossless, the reference for codec plumbing."""

    name = "identity"
    version = "identity/1"

    def __init__(self, producer: Any = None, consumer: Any = None):
        self.producer = producer

    def states_needed(self, layer: int) -> frozenset[str]:
        return frozenset({KEYS, VALUES})

    def encode_layer(self, layer: int, state: Any) -> dict[str, torch.Tensor]:
        k = state_field(state, KEYS).float()  # k: [T, kvh, hd] pre-RoPE
        v = state_field(state, VALUES).float()
        return check_code({"k": k, "v": v})

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor], consumer: Any,
                     tokens: torch.Tensor | None = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return to_consumer(code["k"], consumer), to_consumer(code["v"], consumer)


class RawCodec:
    """The producer's post-RoPE keys and values in 16-bit, reused as is by the consumer."""

    name = "raw"
    version = "raw/1"

    def __init__(self, producer: Any, consumer: Any = None, dtype: torch.dtype = torch.float16):
        self.producer = producer
        self.producer_spec: CodecSpec = spec_of(producer)
        self.dtype = dtype

    def states_needed(self, layer: int) -> frozenset[str]:
        return frozenset({KEYS, VALUES})

    def encode_layer(self, layer: int, state: Any) -> dict[str, torch.Tensor]:
        k_pre = state_field(state, KEYS)  # [T, kvh, hd]
        pos = positions_for(k_pre.shape[0], first_position(state)).to(k_pre.device)
        k_post = rotate_with(self.producer, self.producer_spec, k_pre.float(), pos)
        return check_code({"k": k_post.to(self.dtype), "v": state_field(state, VALUES).to(self.dtype)})

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor], consumer: Any,
                     tokens: torch.Tensor | None = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        k_post = to_consumer(code["k"], consumer)
        pos = positions_for(k_post.shape[0], start).to(k_post.device)
        k_pre = unrotate_for_consumer(consumer, k_post, pos)
        return k_pre, to_consumer(code["v"], consumer)


def unrotate_for_consumer(consumer: Any, k_post: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Consumer-side pre-RoPE keys whose consumer rotation equals k_post. [T,kvh,hd] -> same."""
    return rotate_with(consumer, spec_of(consumer), k_post, pos, inverse=True)
