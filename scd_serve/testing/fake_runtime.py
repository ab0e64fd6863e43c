"""FakeRuntime: a few-line stand-in for the model runtime, for fast engine and API tests.

It honours the runtime contract the engine uses with a model that runs in microseconds:
a token's "K/V" is its embedding scaled by its position, and the next-token logits a fixed
projection of the mean cached V plus the input token's embedding, so a wrong block table or
cross-talk between sequences changes the output. `greedy()` is the same model without a
pool; fault hooks: `fail_after_steps` (the forward raises), `step_delay_s` (a slow step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from scd_serve.model import tiny

_DIM = 8


def byte_tokenizer():
    """model/tiny.py's byte-level tokenizer (256 byte tokens) + <eos> (256). No files needed."""
    fast = tiny.byte_tokenizer()
    fast.add_special_tokens({"eos_token": "<eos>"})
    assert fast.eos_token_id == 256
    return fast


@dataclass
class FakePool:
    k: torch.Tensor  # [layers, num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[2]


class FakeRuntime:
    path = None  # no generation_config.json
    mixed_step = None  # prompt chunks and decode steps run as two forwards
    begin_decode_step = None  # no first step ahead of a fill

    def __init__(self, seed: int = 0, num_layers: int = 2, eos_bias: float = 0.0):
        self.tokenizer = byte_tokenizer()
        vocab = len(self.tokenizer)
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(vocab, _DIM, generator=g)  # [vocab, dim]
        self.proj = torch.randn(vocab, _DIM, generator=g)  # [vocab, dim]
        self.bias = torch.zeros(vocab)
        self.bias[self.tokenizer.eos_token_id] = eos_bias  # > 0 makes <eos> likely, to test "stop"
        self.spec = SimpleNamespace(family="fake", num_layers=num_layers, num_kv_heads=1, head_dim=_DIM,
                                    vocab_size=vocab, max_position_embeddings=1 << 16)
        self.fail_after_steps: int | None = None
        self.step_delay_s = 0.0
        self.num_steps = 0

    # -- the model: K/V of token t at position p, in every layer l
    def kv(self, tokens: list[int], start: int = 0) -> torch.Tensor:
        # -> [layers, T, 1, dim]
        pos = torch.arange(start, start + len(tokens), dtype=torch.float32)[:, None]
        rows = self.embed[torch.as_tensor(tokens, dtype=torch.long)] * (1 + 0.01 * pos)
        return torch.stack([rows * (layer + 1) for layer in range(self.spec.num_layers)])[:, :, None, :]

    def logits(self, cached_v: torch.Tensor, token: int) -> torch.Tensor:
        # cached_v: [layers, n, 1, dim] -> [vocab]
        ctx = cached_v.mean(dim=(0, 1, 2)) if cached_v.shape[1] else torch.zeros(_DIM)
        return self.proj @ (ctx + self.embed[token]) + self.bias

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """Reference: the same model without a pool, `n` greedy tokens (stops after <eos>)."""
        tokens, out = list(prompt), []
        for _ in range(n):
            t = int(torch.argmax(self.logits(self.kv(tokens[:-1]), tokens[-1])))
            out.append(t)
            tokens.append(t)
            if t == self.tokenizer.eos_token_id:
                break
        return out

    # -- the runtime contract
    def new_kv_pool(self, num_blocks: int, block_size: int) -> FakePool:
        shape = (self.spec.num_layers, num_blocks, block_size, 1, _DIM)
        return FakePool(torch.zeros(shape), torch.zeros(shape))

    def prefill(self, input_ids):
        kv = self.kv(list(map(int, input_ids)))
        return SimpleNamespace(keys=kv, values=kv)

    def write_kv(self, pool: FakePool, block_ids, layer: int, k_pre, v, start: int = 0) -> None:
        for i in range(k_pre.shape[0]):
            b, o = divmod(start + i, pool.block_size)
            pool.k[layer, block_ids[b], o] = k_pre[i]
            pool.v[layer, block_ids[b], o] = v[i]

    def kv_writer(self, pool: FakePool, block_ids, num_tokens: int, start: int = 0) -> SimpleNamespace:
        return SimpleNamespace(write=lambda layer, k_pre, v: self.write_kv(pool, block_ids, layer, k_pre, v, start))

    def _read_v(self, pool: FakePool, block_ids, n: int) -> torch.Tensor:
        bs = pool.block_size
        rows = [pool.v[:, block_ids[p // bs], p % bs] for p in range(n)]
        return torch.stack(rows, dim=1) if rows else torch.zeros(self.spec.num_layers, 0, 1, _DIM)

    def _step(self) -> None:
        self.num_steps += 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.fail_after_steps is not None and self.num_steps > self.fail_after_steps:
            raise RuntimeError("injected forward failure")

    def extend(self, pool: FakePool, items, logits="all") -> list[torch.Tensor | None]:
        """As ModelRuntime.extend, `logits` included ("all", "last", "none"; one or one per item)."""
        self._step()
        wants = [logits] * len(items) if isinstance(logits, str) else list(logits)
        out = []
        for (block_ids, num_cached, tokens), want in zip(items, wants, strict=True):
            tokens = list(map(int, tokens))
            kv = self.kv(tokens, start=num_cached)
            for layer in range(self.spec.num_layers):
                self.write_kv(pool, block_ids, layer, kv[layer], kv[layer], start=num_cached)
            cached = self._read_v(pool, block_ids, num_cached + len(tokens))
            rows = [self.logits(cached[:, :num_cached + i], t) for i, t in enumerate(tokens)]
            out.append(None if want == "none" else torch.stack(rows[-1:] if want == "last" else rows))
        return out

    def decode_step(self, pool: FakePool, items) -> torch.Tensor:
        self._step()
        rows = []
        for block_ids, num_cached, token in items:
            kv = self.kv([int(token)], start=num_cached)
            for layer in range(self.spec.num_layers):
                self.write_kv(pool, block_ids, layer, kv[layer], kv[layer], start=num_cached)
            rows.append(self.logits(self._read_v(pool, block_ids, num_cached), int(token)))
        return torch.stack(rows)  # [B, vocab]
