"""The transfer-codec contract shared by every method, and helpers all methods use.

A codec has two halves. The producer calls `encode_layer(layer, state)` on each layer's
state as soon as the layer is done and ships the returned dict of tensors; the consumer
calls `decode_layer(layer, code, consumer)` and writes the returned (k_pre, v) with
`consumer.write_kv`, which applies the consumer's own RoPE. The consumer passes the
transferred prompt's token ids as `tokens=` (it holds them; SCD's token priors read them).
A codec that keeps state between one prompt's layers has `begin(tokens, consumer)`, which
returns that prompt's Rebuild (codec/rebuild.py; SCD keeps its token context and a run there).
Keys cross the codec in pre-RoPE form at the consumer's side: decode returns keys that,
rotated by the consumer, give what the method intends the consumer to attend to.

Prompt positions are 0..T-1 (the whole prompt is transferred from position 0). A codec may
have `replay_tokens` R: the consumer takes codes for all but the prompt's last R handed-off
tokens and computes those itself over the rebuilt rest (target-side context replay: the
tokens nearest the ones it generates are its own computation). `transferred` says how many.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from scd_serve.errors import CodebookError

CODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8)
# Names of the producer states a method may need per layer (LayerState attributes).
KEYS, VALUES, ATTN_INPUT, RESIDUAL = "keys", "values", "attn_input", "residual"
# SCD's code streams (plan.py) -> the state each rebuilds on the consumer
STREAM_STATES = {"k": KEYS, "v": VALUES, "h": ATTN_INPUT, "r": RESIDUAL}
# stream -> the stream whose producer state its code is computed from. OWN: each its own (for one
# model the codes are then exact at full rank, whatever the layers compute between). ATTN: keys
# and values from the layer's attention input, which holds everything they are made of: two
# models apart, it predicts the consumer's keys and values better than the producer's own keys and
# values do (docs/results.md). A codebook's manifest names its choice ("code_inputs").
OWN_INPUTS = {"k": "k", "v": "v", "h": "h", "r": "r"}
ATTN_INPUTS = {"k": "h", "v": "h", "h": "h", "r": "r"}


@runtime_checkable
class TransferCodec(Protocol):
    name: str
    version: str

    def states_needed(self, layer: int) -> frozenset[str]:
        """Which producer states (KEYS, VALUES, ATTN_INPUT, RESIDUAL) encode_layer reads for `layer`."""

    def encode_layer(self, layer: int, state: Any) -> dict[str, torch.Tensor]:
        """Producer side. state: keys [T,kvh,hd] pre-RoPE, values [T,kvh,hd], attn_input [T,hidden]."""

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor], consumer: Any,
                     tokens: torch.Tensor | None = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Consumer side -> (k_pre [T,kvh,hd], v [T,kvh,hd]) for consumer.write_kv.

        tokens: the transferred rows' token ids [T]; the decode side always holds them, and
        codecs whose decoders use them (SCD with token priors) need them. start: the prompt
        position of the first row (a transfer after a cached prefix; state.start on the
        producer side)."""


def state_field(state: Any, name: str) -> torch.Tensor:
    """Read one producer state from a LayerState (attributes) or a mapping."""
    value = state.get(name) if isinstance(state, Mapping) else getattr(state, name, None)
    if value is None:
        raise CodebookError(f"producer state '{name}' was not captured but the codec needs it")
    return value


def wants_residuals(codec: Any, num_layers: int) -> bool:
    """Whether the producer's prefill must keep each layer's residual (iter_prefill(residuals=))."""
    return any(RESIDUAL in codec.states_needed(i) for i in range(num_layers))


def transferred(codec: Any, num_tokens: int) -> int:
    """Of `num_tokens` handed-off prompt tokens (T-1), how many the transfer carries: all but
    the codec's replayed tail, at least one (0 for an empty handoff)."""
    return carried(num_tokens, int(getattr(codec, "replay_tokens", 0) or 0))


def carried(num_tokens: int, replay: int) -> int:
    """transferred() with the replayed tail given (a vLLM scheduler reads it from the manifest)."""
    return max(1, num_tokens - replay) if num_tokens else 0


def payload_bytes(code: Mapping[str, torch.Tensor]) -> int:
    """Bytes on the wire for one code: the tensor bytes (names and shapes are framing)."""
    return sum(t.numel() * t.element_size() for t in code.values())


def check_code(code: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Codes carry only transport dtypes, as contiguous detached tensors."""
    out = {}
    for key, tensor in code.items():
        if tensor.dtype not in CODE_DTYPES:
            raise TypeError(f"code tensor '{key}' has dtype {tensor.dtype}, not a transport dtype")
        out[key] = tensor.detach().contiguous()
    return out


def positions_for(num_tokens: int, start: int = 0) -> torch.Tensor:
    """Prompt positions of a transferred layer's rows, the first at `start`. -> [T] long."""
    return torch.arange(start, start + num_tokens, dtype=torch.long)


def first_position(state: Any) -> int:
    """The prompt position of a producer state's first row (LayerState.start; 0 for a mapping without one)."""
    value = state.get("start", 0) if isinstance(state, Mapping) else getattr(state, "start", 0)
    return int(value)


def device_of(consumer: Any) -> torch.device | None:
    """Where the consumer computes (codes may arrive on the CPU from the transport)."""
    device = getattr(consumer, "device", None)
    return torch.device(device) if device is not None else None


def to_consumer(t: torch.Tensor, consumer: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    device = device_of(consumer)
    return t.to(device=device, dtype=dtype) if device is not None else t.to(dtype)
