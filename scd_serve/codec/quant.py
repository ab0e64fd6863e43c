"""KIVI-style asymmetric quantization of the producer's KV (`quant4`, `quant2`).

Keys are quantized per channel (one scale/min per channel for each group of G tokens:
key outliers live in fixed channels), values per token (one scale/min per token for each
group of G channels). Codes are packed into uint8, scales and minimums ship in fp16.
Like `raw`, the keys are the producer's post-RoPE keys: the cross-model baseline ships
what the producer attended to. (KIVI's full-precision window of recent tokens is not
used: the whole prompt is transferred once.)
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from scd_serve.codec.base import KEYS, VALUES, check_code, first_position, positions_for, state_field, to_consumer
from scd_serve.codec.baselines import unrotate_for_consumer
from scd_serve.codec.codec_spec import rotate_with, spec_of


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q: [N, D] integers in [0, 2^bits) -> [N, D*bits/8] uint8 (low bits first)."""
    per = 8 // bits
    q = q.to(torch.uint8).reshape(q.shape[0], -1, per)
    out = torch.zeros(q.shape[:2], dtype=torch.uint8, device=q.device)
    for i in range(per):
        out |= q[..., i] << (bits * i)
    return out


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """p: [N, B] uint8 -> [N, B*8/bits] uint8 integers."""
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(p >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(p.shape[0], -1)


def quantize_groups(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [N, G, M] -> q [N, G, M] (int), scale [N, 1, M], min [N, 1, M] (fp16), reducing over G."""
    lo = x.amin(dim=1, keepdim=True).to(torch.float16)
    hi = x.amax(dim=1, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo.float()) / levels).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: q = 0, x = min
    q = torch.round((x - lo.float()) / scale.float()).clamp(0, levels)
    return q, scale, lo


class QuantCodec:
    """Producer KV at `bits` per element plus fp16 group scales/minimums."""

    version_tag = "kivi/1"

    def __init__(self, producer: Any, bits: int, group: int = 32):
        if bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, not {bits}")
        self.producer = producer
        self.producer_spec = spec_of(producer)
        self.bits, self.group = bits, group
        self.name = f"quant{bits}"
        self.version = f"quant{bits}/{self.version_tag}/g{group}"
        if self.producer_spec.kv_width % group:
            raise ValueError(f"kv width {self.producer_spec.kv_width} is not a multiple of group {group}")

    def states_needed(self, layer: int) -> frozenset[str]:
        return frozenset({KEYS, VALUES})

    def encode_layer(self, layer: int, state: Any) -> dict[str, torch.Tensor]:
        k_pre = state_field(state, KEYS).float()  # [T, kvh, hd]
        t = k_pre.shape[0]
        pos = positions_for(t, first_position(state)).to(k_pre.device)
        k = rotate_with(self.producer, self.producer_spec, k_pre, pos)
        k = k.reshape(t, -1)  # [T, d]
        v = state_field(state, VALUES).float().reshape(t, -1)  # [T, d]
        g, d = self.group, k.shape[1]
        # keys: per channel over groups of G tokens (pad the last group by repeating the last row)
        t_pad = -t % g
        k_padded = F.pad(k[None], (0, 0, 0, t_pad), mode="replicate")[0] if t_pad else k
        kq, ks, km = quantize_groups(k_padded.reshape(-1, g, d), self.bits)  # [T/G, G, d]
        # values: per token over groups of G channels
        vq, vs, vm = quantize_groups(v.reshape(t, d // g, g).transpose(1, 2), self.bits)  # [T, G, d/G]
        vq = vq.transpose(1, 2).reshape(t, d)
        return check_code({
            "kq": pack(kq.reshape(-1, d), self.bits), "ks": ks[:, 0], "km": km[:, 0],
            "vq": pack(vq, self.bits), "vs": vs[:, 0], "vm": vm[:, 0],
        })

    def decode_layer(self, layer: int, code: Mapping[str, torch.Tensor], consumer: Any,
                     tokens: torch.Tensor | None = None, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.group
        vq = unpack(to_consumer(code["vq"], consumer, torch.uint8), self.bits).float()  # [T, d]
        t, d = vq.shape
        v = (vq.reshape(t, d // g, g) * to_consumer(code["vs"], consumer)[..., None]
             + to_consumer(code["vm"], consumer)[..., None]).reshape(t, d)
        kq = unpack(to_consumer(code["kq"], consumer, torch.uint8), self.bits).float()  # [T_pad, d]
        k = (kq.reshape(-1, g, d) * to_consumer(code["ks"], consumer)[:, None]
             + to_consumer(code["km"], consumer)[:, None]).reshape(-1, d)[:t]
        spec = spec_of(consumer)
        k_post = k.reshape(t, spec.num_kv_heads, spec.head_dim)
        k_pre = unrotate_for_consumer(consumer, k_post, positions_for(t, start).to(k.device))
        return k_pre, v.reshape(t, spec.num_kv_heads, spec.head_dim)
