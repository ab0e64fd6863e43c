"""Step: one forward over the pool for any mix of prefill chunks and decode tokens.

Each item (block_ids, num_cached, tokens) feeds its tokens at positions num_cached.. and
writes their K/V there; all items' rows go through each projection and MLP as one matrix
(the weights are read once per step), and each item attends over its own cached prefix in
place (paged.py). Layer l reads only layer l of the cache, so the first step of a request
whose K/V arrives a layer at a time can run as the layers land (engine/step_ahead.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from scd_serve.errors import InvalidRequest, PromptTooLong
from scd_serve.model import cpu_kernel, layers, paged_kernel, rope
from scd_serve.model.kv_pool import KVPool
from scd_serve.model.layers import finish_layer, project_kv, project_q
from scd_serve.model.paged import GATHER_BYTES, attend_gathered, attend_paged, stretches

if TYPE_CHECKING:
    from scd_serve.model.runtime import ModelRuntime

Tensor = torch.Tensor
LOGIT_ROWS = frozenset({"all", "last", "none"})  # what a step returns per item


class Step:
    """items: (block_ids, num_cached, tokens [n]); wants: per item "all" | "last" | "none".
    Layers run in order; `logits()` once all have run."""

    @torch.no_grad()
    def __init__(self, rt: ModelRuntime, pool: KVPool, items: Sequence[tuple[Sequence[int], int, Tensor]],
                 wants: Sequence[str]):
        if not items:
            raise InvalidRequest("a step needs at least one item")
        if len(wants) != len(items) or not set(wants) <= LOGIT_ROWS:
            raise ValueError(f"logits must be one of {sorted(LOGIT_ROWS)} or one per item, got {wants!r}")
        bs, limit, vocab = pool.block_size, rt.spec.max_position_embeddings, rt.spec.vocab_size
        self.rt, self.pool, self.wants = rt, pool, list(wants)
        self.cached, self.lengths, self.runs, self.blocks = [], [], [], []
        tokens, slots, positions = [], [], []
        for block_ids, num_cached, item_tokens in items:  # plain Python: one tensor of each kind below
            cached, toks = int(num_cached), torch.as_tensor(item_tokens).reshape(-1).tolist()
            blocks, n = list(block_ids), len(toks)
            if n == 0 or cached < 0:
                raise InvalidRequest(f"an item needs tokens and num_cached >= 0, got {n} tokens at {cached}")
            if cached + n > limit:
                raise PromptTooLong(f"{cached + n} positions exceed the model's context of {limit} "
                                    f"(max_position_embeddings)")
            if cached + n > len(blocks) * bs:
                raise InvalidRequest(f"positions {cached}..{cached + n - 1} do not fit in {len(blocks)} blocks of {bs}")
            tokens += toks
            positions += range(cached, cached + n)
            slots += [blocks[p // bs] * bs + p % bs for p in range(cached, cached + n)]
            self.cached.append(cached)
            self.lengths.append(n)
            self.runs.append(stretches(blocks, cached + n, bs))
            self.blocks.append(blocks[: -(-(cached + n) // bs)])
        used = [blk for blocks in self.blocks for blk in blocks]
        if min(used) < 0 or max(used) >= pool.num_blocks:
            raise InvalidRequest(f"block ids must lie in 0..{pool.num_blocks - 1}")
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise InvalidRequest(f"token ids must lie in 0..{vocab - 1}")
        dev = rt.device
        self.slots = torch.tensor(slots, device=dev)  # [N] where each row's K/V goes
        self.h = rt.weights.embed[torch.tensor(tokens, device=dev)]  # [N, hidden]: every item's rows, in order
        self.cos, self.sin = rt.rotary.tables(torch.tensor(positions, device=dev))
        # the CPU's C++ kernels where this process uses them: the elementwise work between the
        # linears in one pass each (cpu_kernel.ops), and decode attention
        self.fused = cpu_kernel.ops(rt.device, rt.dtype) if rt.paged_kernel and pool.k.dtype == rt.dtype else None
        # the items of one token (decodes) attend in one batched call: a kernel reading the blocks
        # in place (CUDA's Triton one, the CPU's C++ one), else a gathered copy of their blocks
        kernel = None
        if rt.paged_kernel and paged_kernel.usable(rt.device, pool.block_size):
            kernel = paged_kernel.attend_blocks
        elif self.fused is not None:
            kernel = cpu_kernel.attend_blocks
        self.attend_one_token = kernel or attend_gathered
        # each prefill chunk's block ids, where the CPU's prefill attention reads them
        # (model/cpu_kernel.prefill; one-token items attend in the decode kernel's call)
        self.prefill_tables = None
        if self.fused is not None and cpu_kernel.prefill_ops(rt.device, rt.dtype) is not None:
            self.prefill_tables = [torch.tensor(b) if n > 1 else None for b, n in zip(self.blocks, self.lengths)]
        starts = [0, *accumulate(self.lengths)][:-1]  # item i's rows start at starts[i]
        self.all_spans = list(zip(starts, self.lengths))  # per item (its first row, how many)
        self.one_token_items = [i for i, n in enumerate(self.lengths) if n == 1]
        self.one_token_rows = self._one_token_plan(pool, kernel is not None)
        self.wanted, self.spans = self._wanted_rows()
        # the last layer's attention and MLP only for the rows whose logits are wanted (a prompt
        # chunk's last, none of a chunk whose logits are not asked for): the others feed nothing
        # once their K/V are written, and at 24 layers they are 1/24 of a prefill
        self.kept = None if len(self.wanted) == len(tokens) else torch.tensor(self.wanted, device=dev, dtype=torch.long)
        self.layer = 0  # the next layer to run

    def _one_token_plan(self, pool: KVPool, kernel: bool) -> tuple[Tensor | None, Tensor, Tensor] | None:
        """(rows [D] or None when every item is one token, block table [D, W], key counts [D]) of
        the items with one token, whose attention runs as one call; None: every item attends
        alone, in place. Without the kernel, only for two or more such items whose gathered table
        of one layer is at most GATHER_BYTES (paged.py)."""
        ones = self.one_token_items
        if not ones:
            return None
        if not kernel:
            width = max(len(self.blocks[i]) for i in ones)
            if len(ones) < 2 or len(ones) * width * pool.bytes_per_block // pool.k.shape[0] > GATHER_BYTES:
                return None
        rows = None
        if len(ones) < len(self.lengths):
            rows = torch.tensor([self.all_spans[i][0] for i in ones], device=self.rt.device)
        return (rows, *self._one_token_table(ones))

    def _one_token_table(self, items: Sequence[int]) -> tuple[Tensor, Tensor]:
        """(block table [D, W], each row padded with its first block; key counts [D]) of the
        given one-token items: keys 0..num_cached, the token's own written this step."""
        width = max(len(self.blocks[i]) for i in items)
        table = [self.blocks[i] + [self.blocks[i][0]] * (width - len(self.blocks[i])) for i in items]
        dev = self.rt.device
        return torch.tensor(table, device=dev), torch.tensor([self.cached[i] + 1 for i in items], device=dev)

    @property
    def done(self) -> bool:
        return self.layer == self.rt.spec.num_layers

    def resume(self, layer: int, h: Tensor) -> None:
        """Go on from `layer` with h [N, hidden], the residual rows the layers below it computed
        for these tokens over this cache (e.g. kept from an earlier step over the same tokens):
        the layers below are not run, and the tokens' own K/V there stay as they are."""
        if not self.layer <= layer <= self.rt.spec.num_layers or h.shape != self.h.shape:
            raise ValueError(f"resume needs a layer in {self.layer}..{self.rt.spec.num_layers} and rows of shape "
                             f"{tuple(self.h.shape)}, got {layer} and {tuple(h.shape)}")
        self.h, self.layer = h.to(self.h.device, self.h.dtype), layer

    @torch.no_grad()
    def run_layer(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Run the next layer; it reads only that layer of the pool. -> the step's rows entering
        it (h [N, hidden]), their normed input (x [N, hidden]) and K/V (k_pre, v [N, kv_heads, hd]):
        the producer's states, where a prefill worker's step continues a cached prefix."""
        spec, layer = self.rt.spec, self.layer
        if self.done:
            raise RuntimeError("every layer of this step has run")
        lw, h_in, fused = self.rt.weights.layers[layer], self.h, self.fused
        k_layer, v_layer = self.pool.k[layer], self.pool.v[layer]
        norm = layers.rms_norm if fused is None else fused.rms_norm
        x = norm(self.h, lw.ln1, spec.rms_norm_eps)
        k_pre, v = project_kv(lw, spec, x)  # [N, kv_heads, hd]
        if fused is not None:  # k rotated into the pool and q rotated in one pass
            q = fused.rope_write(project_q(lw, spec, x), k_pre, v, self.cos, self.sin, k_layer, v_layer, self.slots)
        else:
            self.pool.write(layer, self.slots, rope.apply(k_pre, self.cos, self.sin), v)
            q = rope.apply(project_q(lw, spec, x), self.cos, self.sin)  # [N, heads, hd]
        if self.kept is not None and layer == spec.num_layers - 1:  # self.h: the wanted rows [R, hidden]
            h = self.h[self.kept]
            self.h = h if not self.wanted else finish_layer(
                lw, spec, h, self._attend(k_layer, v_layer, q[self.kept], spec.window(layer), self.spans), fused)
        else:
            self.h = finish_layer(lw, spec, self.h, self._attend(k_layer, v_layer, q, spec.window(layer)), fused)
        self.layer += 1
        return h_in, x, k_pre, v

    def _attend(self, k_layer: Tensor, v_layer: Tensor, q: Tensor, window: int | None,
                spans: list[tuple[int, int]] | None = None) -> Tensor:
        # q: [R, heads, hd] -> [R, heads*hd]: per item its last n rows, at q's rows at..at+n-1
        # (spans: (at, n) per item; None: every row of every item). The one-token items in one call
        # where planned (and all attend), the others (prefill chunks, a chunk's last row as a
        # one-row chunk at its position) each over its own stretches of the pool
        spans = self.all_spans if spans is None else spans
        batched = self.one_token_rows is not None and (
            spans is self.all_spans or all(spans[i][1] for i in self.one_token_items))
        if batched:
            rows, table, lengths = self.one_token_rows
            if spans is not self.all_spans:
                rows = torch.tensor([spans[i][0] for i in self.one_token_items], device=q.device)
            one_token = self.attend_one_token(k_layer, v_layer, table, lengths, q if rows is None else q[rows], window)
            if rows is None:  # a decode-only step
                return one_token
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        if batched:
            out[rows] = one_token
        for i, ((at, n), runs, cached, length) in enumerate(zip(spans, self.runs, self.cached, self.lengths)):
            if not n or (batched and length == 1):
                continue
            first = cached + length - n  # the position of the item's first row attending here
            if self.prefill_tables is not None and self.prefill_tables[i] is not None:
                out[at:at + n] = cpu_kernel.prefill(q[at:at + n], k_layer, v_layer, self.prefill_tables[i], first, window)
            else:
                out[at:at + n] = attend_paged(k_layer, v_layer, runs, cached + length, q[at:at + n], first, window)
        return out

    def _wanted_rows(self) -> tuple[list[int], list[tuple[int, int]]]:
        """(the rows whose logits are wanted, in order; per item (its first among them, how many))."""
        rows, spans, at = [], [], 0
        for n, want in zip(self.lengths, self.wants):
            pick = {"all": range(at, at + n), "last": range(at + n - 1, at + n), "none": range(0)}[want]
            spans.append((len(rows), len(pick)))
            rows.extend(pick)
            at += n
        return rows, spans

    @torch.no_grad()
    def logits(self) -> list[Tensor | None]:
        """Per item, by its want: "all" [n, vocab], "last" [1, vocab] (float32), "none" None. The
        output head runs once, on the rows asked for only (at a real vocabulary it costs as much
        as several layers)."""
        while not self.done:
            self.run_layer()
        if not self.wanted:
            return [None] * len(self.wants)
        # self.h holds the wanted rows alone when the last layer ran for them, or when they are all
        # (a step resumed past its last layer holds every row)
        h = self.h if self.h.shape[0] == len(self.wanted) else self.h[torch.tensor(self.wanted, device=self.h.device)]
        out = self.rt.logits_of(h)  # [R, vocab]
        return [None if want == "none" else out[start:start + n] for (start, n), want in zip(self.spans, self.wants)]


class DecodeStep(Step):
    """One token per item (block_ids, num_cached, token_id); logits() -> [B, vocab] float32."""

    def __init__(self, rt: ModelRuntime, pool: KVPool, items: Sequence[tuple[Sequence[int], int, int]]):
        super().__init__(rt, pool, [(b, c, [int(t)]) for b, c, t in items], ["last"] * len(items))

    def logits(self) -> Tensor:
        return torch.cat(super().logits())
