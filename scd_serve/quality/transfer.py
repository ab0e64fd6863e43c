"""One prompt through a transfer method into the consumer's KV pool, then teacher-forced
and greedy continuations from there.

The handoff follows the architecture contract: the prompt's K/V for tokens 0..T-2 come
from the method (or, for the oracle, from the consumer's own prefill, written through
the same `write_kv`), and the consumer runs the last prompt token itself. A codec that
replays (codec/base.py) is sent the codes of fewer tokens, and the consumer computes the
rest over them, as serving does; that time counts as rebuild.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scd_serve.codec.base import payload_bytes, transferred, wants_residuals
from scd_serve.codec.rebuild import begin, codes_from

ORACLE = "oracle"
# the control that shows codes carry the prompt: scd rebuilt from another prompt's codes (its
# producer states over other text of the same length), the token priors still of this prompt
MISMATCHED = "mismatched"
BLOCK = 16


@dataclass
class Handoff:
    pool: object  # the consumer's KVPool holding the transferred prefix
    blocks: list[int]
    num_cached: int  # prefix tokens in the pool (positions 0..num_cached-1)
    payload_bytes: int  # bytes of the codes on the wire (0 for the oracle)
    rebuild_s: float  # consumer time to turn codes into its KV (oracle: its own prefill)


def transfer(method: str, codec, rt_a, rt_b, prefix: torch.Tensor, extra_tokens: int,
             donor: torch.Tensor | None = None) -> Handoff:
    """Fill a fresh consumer pool with K/V for `prefix` ([T] long) by `method`.

    extra_tokens: room to leave for the tokens that run after the prefix.
    donor: [T] long, what the producer runs instead of the prefix (the MISMATCHED control).
    """
    if donor is not None and donor.shape != prefix.shape:
        raise ValueError(f"a donor prompt must have the prefix's {prefix.shape[0]} tokens, got {donor.shape[0]}")
    total = prefix.shape[0] + extra_tokens
    num_blocks = -(-total // BLOCK)
    pool, blocks = rt_b.new_kv_pool(num_blocks, BLOCK), list(range(num_blocks))
    nbytes, rebuild = 0, 0.0
    if method == ORACLE:
        start = time.perf_counter()
        writer = rt_b.kv_writer(pool, blocks, prefix.shape[0])  # the prompt's slots and rotary tables, once
        for layer, state in rt_b.iter_prefill(prefix, compute_logits=False):
            writer.write(layer, state.keys, state.values)
        rebuild = time.perf_counter() - start
    else:
        cut = transferred(codec, prefix.shape[0])
        source = prefix[:cut] if donor is None else donor[:cut]
        # each layer's code is rebuilt as the producer hands it over, as in serving
        rebuild, nbytes = rebuild_from(codec, rt_b, pool, blocks, prefix, cut, encoded(codec, rt_a, source))
    return Handoff(pool, blocks, prefix.shape[0], nbytes, rebuild)


def encoded(codec, rt_a, tokens: torch.Tensor):
    """The producer's side: (layer, code) of each layer of its prefill of tokens [n], in turn,
    the codes of the rows after the codec's head (which the consumer computes itself)."""
    first = codes_from(codec, 0, tokens.shape[0])
    for layer, state in rt_a.iter_prefill(tokens, compute_logits=False,
                                          residuals=wants_residuals(codec, rt_a.spec.num_layers)):
        yield layer, codec.encode_layer(layer, state.rows_from(first))


def rebuild_from(codec, rt_b, pool, blocks: list[int], prefix: torch.Tensor, cut: int, codes) -> tuple[float, int]:
    """The consumer's side, timed: each (layer, code) of prefix[:cut] decoded and written into
    the pool, then the replayed tail prefix[cut:] computed over them. -> (seconds, code bytes)."""
    start = time.perf_counter()
    prompt, writer = begin(codec, prefix[:cut], rt_b), rt_b.kv_writer(pool, blocks, cut)  # as the decode worker
    rebuild, nbytes = time.perf_counter() - start, 0
    for layer, code in codes:
        nbytes += payload_bytes(code)
        start = time.perf_counter()
        k_pre, v = prompt.decode_layer(layer, code)  # k_pre, v: [cut, kv_heads, head_dim]
        writer.write(layer, k_pre, v)
        rebuild += time.perf_counter() - start
    if cut < prefix.shape[0]:  # the replayed tail, computed by the consumer over the rebuilt rest
        start = time.perf_counter()
        rt_b.extend(pool, [(blocks, cut, prefix[cut:])], logits="none")
        rebuild += time.perf_counter() - start
    return rebuild, nbytes


def rebuilder(codec, rt_a, rt_b, prefix: torch.Tensor) -> Callable[[], float]:
    """A rebuild of prefix [T] to run again and again, from one encoding of it: the producer's
    prefill and the encode are not rebuild time, so they run once. -> () -> seconds of a rebuild."""
    cut = transferred(codec, prefix.shape[0])
    codes = list(encoded(codec, rt_a, prefix[:cut]))
    num_blocks = -(-prefix.shape[0] // BLOCK)
    return lambda: rebuild_from(codec, rt_b, rt_b.new_kv_pool(num_blocks, BLOCK), list(range(num_blocks)), prefix,
                                cut, codes)[0]


def teacher_forced(rt_b, h: Handoff, tokens: torch.Tensor) -> torch.Tensor:
    """Run `tokens` ([n] long) after the prefix. -> logits [n, vocab]; row i predicts token i+1."""
    return rt_b.extend(h.pool, [(h.blocks, h.num_cached, tokens)])[0]


def greedy_after(rt_b, h: Handoff, first_logits: torch.Tensor, max_new: int, stop_id: int) -> list[int]:
    """Greedy tokens that follow the last prompt token, whose logits are `first_logits`.

    The prompt's last token must already sit in the pool at position num_cached (as
    teacher_forced leaves it); later slots are overwritten as decoding goes.
    """
    token = int(first_logits.argmax())
    out = [token]
    while token != stop_id and len(out) < max_new:
        pos = h.num_cached + len(out)  # position of `token`
        token = int(rt_b.decode_step(h.pool, [(h.blocks, pos, token)])[0].argmax())
        out.append(token)
    return out[:-1] if out[-1] == stop_id else out


def donor_prefix(prompts: list[torch.Tensor], i: int, length: int) -> torch.Tensor:
    """`length` tokens of the prompts after prompt i (cyclic, i's own excluded), one after
    another: other text of the same length, for the MISMATCHED control. -> [length] long."""
    others = [prompts[(i + j) % len(prompts)] for j in range(1, len(prompts))]
    if not others:
        raise ValueError("the mismatched-codes control needs at least two prompts")
    out, size = [], 0
    while size < length:
        for p in others:
            out.append(p)
            size += p.numel()
            if size >= length:
                break
    return torch.cat(out)[:length].long()
