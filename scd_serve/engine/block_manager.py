"""BlockManager: hands out KV pool blocks to sequences, and keeps full blocks for prefix reuse.
Plain Python, no torch.

Position p of a sequence lives in block_ids[p // block_size]. A sequence's next block is the one
after its last when free, else the lowest free one, so its blocks form a few long runs that
attention reads in place as views of the pool (model/paged.py).

Prefix cache (vLLM's automatic prefix caching, in the shape of nano-vllm's block manager): a
block whose every slot holds K/V is registered under a hash of (the sequence's cache namespace,
every token up to the block's end). A later sequence whose prompt starts with the same tokens in
the same namespace takes those blocks (each block knows who holds it) and prefills only the
rest. A block nobody holds keeps its K/V and its hash until the pool needs it: such blocks are
evicted least recently used first, so the cache lives in what would otherwise be idle memory.
Shared blocks are only ever read: a sequence writes at positions >= num_cached, in its own blocks.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict

from scd_serve.engine.sequence import Sequence


def block_hash(parent: bytes, namespace: str, tokens: list[int]) -> bytes:
    """A block's key: its parent's key (b"" for the first), the namespace and its tokens. A
    cryptographic hash, so that no prompt can be built to collide with another's blocks."""
    h = hashlib.blake2b(parent or namespace.encode(), digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free: set[int] = set(range(num_blocks))  # no holder and no cached K/V
        self._lowest: list[int] = list(range(num_blocks))  # min-heap over free ids; stale entries skipped
        self._holders: dict[int, set[int]] = {}  # held block -> the seq_ids holding it (a count that catches misuse)
        self._by_hash: dict[bytes, int] = {}  # cached full block, held or not
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by none; LRU first
        self.num_queried_tokens = self.num_hit_tokens = 0  # prompt tokens looked up / found cached

    @property
    def num_free(self) -> int:
        """Blocks a new sequence can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission: blocks for every token the sequence holds now (prompt, or prompt+output
    #    after a preemption), which also covers the slot of its first decode step. A sequence
    #    that may reuse a prefix (cache_lookup) starts from the longest cached one.
    def can_allocate(self, seq: Sequence, cache_lookup: bool = False, limit: int | None = None) -> bool:
        hits = self._hits(seq, limit) if cache_lookup else []
        need = self.blocks_for(seq.num_tokens) - len(seq.block_ids) - len(hits)
        return need <= self.num_free - sum(b in self._evictable for b in hits)

    def allocate(self, seq: Sequence, cache_lookup: bool = False, limit: int | None = None) -> int:
        """Blocks for the sequence; returns how many of its tokens already have K/V (a cached
        prefix of whole blocks, never the last token: that one is fed to the first decode step;
        at most `limit` tokens where given)."""
        hits = self._hits(seq, limit) if cache_lookup and not seq.block_ids else []
        if cache_lookup:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(hits) * self.block_size
        for block in hits:
            self._evictable.pop(block, None)
            self._holders.setdefault(block, set()).add(seq.seq_id)
            seq.block_ids.append(block)
        seq.block_hashes = [self._hash_of[b] for b in hits]
        self._take(seq, self.blocks_for(seq.num_tokens) - len(seq.block_ids), "allocate without can_allocate")
        return len(hits) * self.block_size

    # -- decode: the next step writes position num_cached; it needs a slot there.
    def can_append(self, seq: Sequence) -> bool:
        return self._append_need(seq) <= self.num_free

    def may_append(self, seq: Sequence) -> None:
        self._take(seq, self._append_need(seq), "may_append without can_append")

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that filled up since the last call (all slots below
        num_cached hold K/V), so later prompts with the same prefix can take them."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_cached // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else b""
            key = block_hash(parent, seq.cache_namespace, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(key)
            block = seq.block_ids[i]
            if key not in self._by_hash and block not in self._hash_of:
                self._by_hash[key], self._hash_of[block] = block, key

    def free(self, seq: Sequence) -> None:
        """Idempotent: a sequence with no blocks is left alone. Its cached blocks stay cached
        (evictable once nobody holds them); the others are free at once."""
        for block in reversed(seq.block_ids):
            holders = self._holders.get(block, set())
            if seq.seq_id not in holders:
                raise RuntimeError(f"block {block} freed by seq {seq.seq_id} but not held by it")
            holders.discard(seq.seq_id)
            if holders:
                continue
            del self._holders[block]
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.add(block)
                heapq.heappush(self._lowest, block)
        seq.block_ids, seq.block_hashes = [], []
        if len(self._lowest) > 4 * self.num_blocks:  # drop stale entries now and then
            self._lowest = sorted(self._free)

    def cached_prefix(self, token_ids: list[int], namespace: str, fill: bool = False) -> int:
        """How many of a prompt's tokens a sequence admitted now would find cached (a peek for
        `auto`'s prediction; changes nothing)."""
        return len(self._lookup(token_ids, namespace, fill)) * self.block_size

    def _hits(self, seq: Sequence, limit: int | None = None) -> list[int]:
        hits = self._lookup(seq.token_ids, seq.cache_namespace, seq.needs_fill)
        return hits if limit is None else hits[:limit // self.block_size]

    def _lookup(self, token_ids: list[int], namespace: str, fill: bool) -> list[int]:
        """The cached blocks the tokens start with, short of the last token (and of one more for
        a fill, which then transfers at least that one)."""
        if not self.prefix_caching:
            return []
        bs, hits, parent = self.block_size, [], b""
        for i in range((len(token_ids) - (2 if fill else 1)) // bs):
            parent = block_hash(parent, namespace, token_ids[i * bs:(i + 1) * bs])
            block = self._by_hash.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def _append_need(self, seq: Sequence) -> int:
        return max(0, self.blocks_for(seq.num_cached + 1) - len(seq.block_ids))

    def _take(self, seq: Sequence, need: int, misuse: str) -> None:
        if need > self.num_free:
            raise RuntimeError(f"{misuse}: need {need}, free {self.num_free}")
        for _ in range(need):
            if self._free:
                block = seq.block_ids[-1] + 1 if seq.block_ids else -1
                if block not in self._free:
                    block = heapq.heappop(self._lowest)
                    while block not in self._free:
                        block = heapq.heappop(self._lowest)
                self._free.remove(block)
            else:  # evict the least recently freed cached block
                block, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
            self._holders[block] = {seq.seq_id}
            seq.block_ids.append(block)
