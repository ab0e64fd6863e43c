"""DroidSpeak-style selective recompute: ship the producer's attention input for a few layers.

At the chosen layers the producer sends its normalized attention input H_in,A in 16-bit and
the consumer regenerates that layer's K/V with its own weights (consumer.recompute_kv);
every other layer travels as `raw` 16-bit KV. Unlike SCD's Patch there is no aligner: the
consumer's projections read the producer's features directly.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from scd_serve.codec.base import ATTN_INPUT, check_code, state_field, to_consumer
from scd_serve.codec.baselines import RawCodec


def default_layers(num_layers: int) -> tuple[int, ...]:
    """Without a calibrated choice: the first eighth of the layers (at least one)."""
    return tuple(range(max(1, num_layers // 8)))


class DroidSpeakCodec:
    name = "droidspeak"
    version = "droidspeak/1"

    def __init__(self, producer: Any, layers: Iterable[int] | None = None, dtype: torch.dtype = torch.float16):
        self.raw = RawCodec(producer, dtype=dtype)
        num_layers = self.raw.producer_spec.num_layers
        self.layers = frozenset(default_layers(num_layers) if layers is None else layers)
        if bad := sorted(i for i in self.layers if not 0 <= i < num_layers):
            raise ValueError(f"droidspeak layers {bad} are outside 0..{num_layers - 1}")
        self.dtype = dtype

    def states_needed(self, layer: int) -> frozenset[str]:
        return frozenset({ATTN_INPUT}) if layer in self.layers else self.raw.states_needed(layer)

    def encode_layer(self, layer: int, state: Any) -> dict[str, torch.Tensor]:
        if layer not in self.layers:
            return self.raw.encode_layer(layer, state)
        return check_code({"h": state_field(state, ATTN_INPUT).to(self.dtype)})  # h: [T, hidden]

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor], consumer: Any,
                     tokens: torch.Tensor | None = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if "h" not in code:
            return self.raw.decode_layer(layer, code, consumer, tokens, start)
        return consumer.recompute_kv(layer, to_consumer(code["h"], consumer, _compute_dtype(consumer)))


def _compute_dtype(consumer: Any) -> torch.dtype:
    dtype = getattr(consumer, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
