"""KVPool: one preallocated, paged K/V store shared by every sequence on a runtime.

Position p of a sequence lives in block block_ids[p // block_size] at offset p % block_size
(block ids from the engine's block manager). Keys are stored AFTER RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scd_serve.errors import InvalidRequest

Tensor = torch.Tensor


@dataclass
class KVPool:
    k: Tensor  # [layers, num_blocks, block_size, kv_heads, head_dim], post-RoPE
    v: Tensor  # [layers, num_blocks, block_size, kv_heads, head_dim]

    @classmethod
    def allocate(cls, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device, dtype):
        if num_blocks < 1 or block_size < 1:
            raise InvalidRequest(f"KV pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        # zeros, not empty: padded slots are masked, but 0 * NaN garbage would still be NaN
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def slots(self, block_ids: Sequence[int], start: int, n: int) -> Tensor:
        """Flat slot index [n] (into num_blocks * block_size) of positions start..start+n-1."""
        bs = self.block_size
        if start < 0 or start + n > len(block_ids) * bs:
            raise InvalidRequest(f"positions {start}..{start + n - 1} do not fit in {len(block_ids)} blocks of {bs}")
        ids = list(block_ids)
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            raise InvalidRequest(f"block ids must lie in 0..{self.num_blocks - 1}")
        table = torch.tensor(ids, dtype=torch.long)
        pos = torch.arange(start, start + n)
        return (table[pos // bs] * bs + pos % bs).to(self.k.device)

    def write(self, layer: int, slots: Tensor, k_rot: Tensor, v: Tensor) -> None:
        # slots: [n]; k_rot, v: [n, kv_heads, head_dim]
        self.k[layer].flatten(0, 1)[slots] = k_rot.to(self.k.dtype)
        self.v[layer].flatten(0, 1)[slots] = v.to(self.v.dtype)
