"""Code dicts <-> protobuf Tensor messages (name, layer, dtype, shape, raw bytes).

Only the five code dtypes cross the wire: anything else is refused on both sides, so a
malformed message (ValueError, then TransferCorrupt) can never make the receiver allocate
or reinterpret arbitrary memory.
"""

from __future__ import annotations

import math

import torch

from scd_serve.transport.proto import pb

DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n)
                                  for n in ("float16", "bfloat16", "float32", "int8", "uint8")}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_RANK = 6
# the last-row handoff's tensors (PrefillRequest.last_token): the prompt's last token's K/V row of
# a layer, pre-RoPE ([1, kv_heads, head_dim] each), and with the last layer its output [1, hidden]
LAST_K, LAST_V, LAST_H = "last.k", "last.v", "last.h"
LAST_ROW = frozenset((LAST_K, LAST_V, LAST_H))


def to_proto(layer: int, name: str, tensor: torch.Tensor) -> pb.Tensor:
    """One code tensor -> Tensor message (copies to CPU, row-major)."""
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(f"code tensor {name!r} has dtype {tensor.dtype}; allowed: {sorted(DTYPES)}")
    t = tensor.detach().to("cpu").contiguous()
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""  # view(uint8): bf16 has no numpy twin
    return pb.Tensor(name=name, layer=layer, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), data=data)


def encode_code(layer: int, code: dict[str, torch.Tensor]) -> list[pb.Tensor]:
    """A codec's code for one layer -> Tensor messages, in the dict's order."""
    return [to_proto(layer, name, t) for name, t in code.items()]


def from_proto(msg: pb.Tensor) -> torch.Tensor:
    """Tensor message -> tensor, after checking dtype, rank and byte count agree."""
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"tensor {msg.name!r}: unknown dtype {msg.dtype!r}; allowed: {sorted(DTYPES)}")
    shape = list(msg.shape)
    if len(shape) > MAX_RANK:
        raise ValueError(f"tensor {msg.name!r}: rank {len(shape)} > {MAX_RANK}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if expected != len(msg.data):
        raise ValueError(f"tensor {msg.name!r}: shape {shape} x {msg.dtype} needs {expected} bytes, got {len(msg.data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)  # bytearray: writable, owned copy
    return flat.view(dtype).reshape(shape)


def decode_code(tensors, layer: int) -> dict[str, torch.Tensor]:
    code: dict[str, torch.Tensor] = {}
    for msg in tensors:
        if msg.layer != layer:
            continue
        if msg.name in code:
            raise ValueError(f"layer {layer}: tensor {msg.name!r} appears twice")
        code[msg.name] = from_proto(msg)
    return code


def split_last_row(code: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A received layer's tensors -> (the codec's code, the last row's tensors, maybe none)."""
    last = {name: code.pop(name) for name in (LAST_K, LAST_V, LAST_H) if name in code}
    return code, last
