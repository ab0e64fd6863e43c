"""PrefixStates: the producer's own prefix cache, so a multi-turn prompt is prefilled once.

A decode worker that holds a prompt's leading blocks asks for the codes of the rest
(PrefillRequest.start), but the producer must still compute every token before them to make
those codes. This keeps the producer's K/V in a paged pool under the engine's block manager
(full blocks hashed by the tokens so far, evicted least recently used): a prompt that starts
with cached blocks runs the producer's layers over the rest only (model/step.py, attending to
the cached K/V in place), yielding each layer's states for those rows. A cached prefix is only
used up to `start`: the codes of rows from there need the states of every row they cover.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch

from scd_serve.engine.block_manager import BlockManager
from scd_serve.engine.request import GenerationRequest
from scd_serve.engine.sequence import Sequence
from scd_serve.model.runtime import LayerState, PrefillIterator

BLOCK_SIZE = 16


class PrefixStates:
    def __init__(self, runtime, num_tokens: int, block_size: int = BLOCK_SIZE):
        num_blocks = max(1, num_tokens // block_size)
        self.rt, self.pool = runtime, runtime.new_kv_pool(num_blocks, block_size)  # allocated once, here
        self.blocks = BlockManager(num_blocks, block_size)
        self._lock = threading.Lock()  # the block manager is plain Python; transfers run in threads

    @property
    def num_hit_tokens(self) -> int:
        """Producer tokens not computed again (the block manager counts its hits)."""
        return self.blocks.num_hit_tokens

    def layers(self, tokens: list[int], start: int,
               last_hidden: bool = False) -> Iterator[tuple[int, LayerState]] | None:
        """The producer's states layer by layer (rows from the cached prefix on, at most `start`),
        or None when the pool cannot hold the prompt now (the caller prefills it whole).
        last_hidden: the run ends with the final row's output [1, hidden] (iter_prefill's)."""
        seq = Sequence(GenerationRequest("prefill", tokens))
        with self._lock:
            if not self.blocks.can_allocate(seq, cache_lookup=True, limit=start):
                return None
            cached = self.blocks.allocate(seq, cache_lookup=True, limit=start)
        return self._run(seq, cached, last_hidden)

    def _run(self, seq: Sequence, cached: int, last_hidden: bool):
        done, out = False, None
        try:
            rest = torch.tensor(seq.token_ids[cached:], dtype=torch.long)  # rest: [T - cached]
            wants = {"last_hidden": True} if last_hidden else {}
            if cached:
                out = yield from self.rt.iter_prefill(rest, compute_logits=False,
                                                      cached=(self.pool, seq.block_ids, cached), **wants)
            else:  # nothing cached: the dense prefill (faster than attending to the pool), its K/V kept
                states = PrefillIterator(self.rt.iter_prefill(rest, compute_logits=False, residuals=True, **wants))
                for layer, state in states:
                    self.rt.write_kv(self.pool, seq.block_ids, layer, state.keys, state.values)
                    yield layer, state
                out = states.logits  # the final row's output where last_hidden asked for it
            done = True
        finally:  # a transfer stopped half way caches nothing: its blocks are half written
            with self._lock:
                if done:
                    seq.num_cached = seq.num_tokens
                    self.blocks.cache_full_blocks(seq)
                self.blocks.free(seq)
        return out
