"""Small fakes for codec tests: specs, layer states and a consumer with only the codec-facing API."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scd_serve.codec.codec_spec import CodecSpec, rotate


@dataclass
class FakeState:
    keys: torch.Tensor        # [T, kvh, hd] pre-RoPE
    values: torch.Tensor      # [T, kvh, hd]
    attn_input: torch.Tensor  # [T, hidden]


class FakeConsumer:
    """What decode_layer may use of a ModelRuntime: spec, rotary, and a linear recompute_kv."""

    def __init__(self, spec: CodecSpec, seed: int = 1, with_unrotate: bool = True):
        self.spec = spec
        g = torch.Generator().manual_seed(seed)
        self.w_k = torch.randn(spec.hidden_size, spec.kv_width, generator=g) / spec.hidden_size ** 0.5
        self.w_v = torch.randn(spec.hidden_size, spec.kv_width, generator=g) / spec.hidden_size ** 0.5
        if with_unrotate:
            self.unrotate_keys = lambda k, pos: rotate(self.spec, k, pos, inverse=True)

    def rotate_keys(self, k, pos):
        return rotate(self.spec, k, pos)

    def recompute_kv(self, layer, attn_input):
        t = attn_input.shape[0]
        shape = (t, self.spec.num_kv_heads, self.spec.head_dim)
        return (attn_input @ self.w_k).reshape(shape), (attn_input @ self.w_v).reshape(shape)


def make_spec(theta: float = 1e4, layers: int = 2) -> CodecSpec:
    return CodecSpec(num_layers=layers, hidden_size=64, num_kv_heads=2, head_dim=16, rope_theta=theta)


def make_state(spec: CodecSpec, t: int = 24, seed: int = 0) -> FakeState:
    g = torch.Generator().manual_seed(seed)
    shape = (t, spec.num_kv_heads, spec.head_dim)
    return FakeState(torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                     torch.randn(t, spec.hidden_size, generator=g))
