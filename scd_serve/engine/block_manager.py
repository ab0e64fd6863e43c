"""BlockManager: hands out KV pool blocks to sequences. Plain Python, no torch.

Position p of a sequence lives in block_ids[p // block_size]. Every block has one owner (no
prefix sharing), so a free is always safe. A sequence's next block is the one after its
last when free, else the lowest free one, so its blocks form a few long runs that attention
reads in place as views of the pool (model/paged.py).
"""

from __future__ import annotations

import heapq

from scd_serve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: set[int] = set(range(num_blocks))
        self._lowest: list[int] = list(range(num_blocks))  # min-heap over free ids; stale entries skipped
        self._owner: dict[int, int] = {}  # block id -> seq_id, to catch double frees early

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission: blocks for every token the sequence holds now (prompt, or prompt+output
    #    after a preemption), which also covers the slot of its first decode step.
    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_for(seq.num_tokens) - len(seq.block_ids) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        self._take(seq, self.blocks_for(seq.num_tokens) - len(seq.block_ids), "allocate without can_allocate")

    # -- decode: the next step writes position num_cached; it needs a slot there.
    def can_append(self, seq: Sequence) -> bool:
        return self._append_need(seq) <= self.num_free

    def may_append(self, seq: Sequence) -> None:
        self._take(seq, self._append_need(seq), "may_append without can_append")

    def free(self, seq: Sequence) -> None:
        """Idempotent: a sequence with no blocks is left alone."""
        for block in reversed(seq.block_ids):
            if self._owner.pop(block, None) != seq.seq_id:
                raise RuntimeError(f"block {block} freed by seq {seq.seq_id} but not owned by it")
            self._free.add(block)
            heapq.heappush(self._lowest, block)
        seq.block_ids = []
        if len(self._lowest) > 4 * self.num_blocks:  # drop stale entries now and then
            self._lowest = sorted(self._free)

    def _append_need(self, seq: Sequence) -> int:
        return max(0, self.blocks_for(seq.num_cached + 1) - len(seq.block_ids))

    def _take(self, seq: Sequence, need: int, misuse: str) -> None:
        if need > self.num_free:
            raise RuntimeError(f"{misuse}: need {need}, free {self.num_free}")
        for _ in range(need):
            block = seq.block_ids[-1] + 1 if seq.block_ids else -1
            if block not in self._free:
                block = heapq.heappop(self._lowest)
                while block not in self._free:
                    block = heapq.heappop(self._lowest)
            self._free.remove(block)
            self._owner[block] = seq.seq_id
            seq.block_ids.append(block)
