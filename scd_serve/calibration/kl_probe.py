"""KL probe: how far the consumer's next-token distributions move when some layers' K/V are
replaced by what a transfer method rebuilds (measured profiling for calibration).

Each example follows the serving handoff: the consumer receives K/V for prompt tokens
0..T-2 and runs the last prompt token and the teacher-forced answer itself. The probe keeps
one pool per example filled with the consumer's own (oracle) K/V; a measurement overwrites
the chosen layers, extends over the answer, and restores them. The answer's rows below the
lowest changed layer are what the oracle run computed, so a measurement starts there from the
kept residual rows (most of the calibration's measurements change one layer: on average half
the layers are not run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace as with_fields
from typing import Any, Callable, Iterable

import torch

Tensor = torch.Tensor
# (example, layer) -> (k_pre [P, kvh, hd], v [P, kvh, hd]) on the consumer side
LayerKV = Callable[["Example", int], tuple[Tensor, Tensor]]


@dataclass
class Example:
    prefix: int  # P transferred positions (T-1 in serving)
    feed: Tensor  # [m] the rest of the prompt + answer[:-1], run by the consumer itself
    producer: list[Any]  # per layer LayerState of the producer over the prefix
    consumer: list[Any]  # per layer LayerState of the consumer over the prefix (oracle K/V only)
    oracle_logits: Tensor  # [n, vocab]
    tokens: Tensor | None = None  # [P] the transferred prompt tokens (for token priors)
    pool: Any = None
    blocks: list[int] | None = None
    feed_h: list[Tensor] | None = None  # per layer (and after the last) the feed's residual rows [m, hidden], oracle
    scored_from: int = 0  # feed rows before it are a replayed tail: computed, not scored


def kl_divergence(logits_p: Tensor, logits_q: Tensor) -> Tensor:
    """Per-position KL(P || Q) in nats (P = method, Q = oracle). [N, V] x2 -> [N]."""
    logp = torch.log_softmax(logits_p.double(), -1)
    logq = torch.log_softmax(logits_q.double(), -1)
    return (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)


def split_prompt(length: int, tail: int = 1, replay: int = 0) -> tuple[int, int]:
    """A prompt of `length` tokens in a probe -> (P positions transferred, R replayed): the consumer
    runs the last `tail` itself and scores them, and `replay` more before them, not scored (at
    least one position stays transferred)."""
    scored = min(max(tail, 1), length - 1)
    local = min(scored + max(replay, 0), length - 1)
    return length - local, local - scored


def make_examples(producer: Any, consumer: Any, pairs: Iterable[tuple[Tensor, Tensor]],
                  block_size: int = 16, tail: int = 1, progress: Callable[[], None] | None = None,
                  residual_layers: Iterable[int] = (), replay: int = 0) -> list[Example]:
    """pairs: (prompt_ids [T], answer_ids [n]) -> examples with oracle pools and logits; the
    producer's residuals kept at residual_layers (where runs may start).

    The consumer runs the last `tail` prompt tokens itself (serving: 1); a longer tail scores
    more positions per prompt (the question as well as the answer), so the probe's KL is less
    noisy for the same number of prompts. replay: that many prompt tokens more are run by the
    consumer before the tail and not scored (a codec's replayed tail, codec/base.py; at least
    one token stays transferred)."""
    out, keep = [], set(residual_layers)
    for prompt, answer in pairs:
        prompt, answer = torch.as_tensor(prompt).long(), torch.as_tensor(answer).long()
        p, skip = split_prompt(prompt.shape[0], tail, replay)
        full = torch.cat([prompt, answer])
        feed = full[p:-1]  # [n]
        states_a = [s if s.residual is None or i in keep else with_fields(s, residual=None)
                    for i, s in producer.iter_prefill(prompt[:p], compute_logits=False, residuals=bool(keep))]
        # the consumer's own H_in is never read back (only its K/V restore the oracle): not kept,
        # as it is the widest of the three states
        states_b = [with_fields(s, attn_input=None) for _, s in consumer.iter_prefill(prompt[:p], compute_logits=False)]
        num_blocks = -(-full.shape[0] // block_size)
        pool, blocks = consumer.new_kv_pool(num_blocks, block_size), list(range(num_blocks))
        for layer, s in enumerate(states_b):
            consumer.write_kv(pool, blocks, layer, s.keys, s.values)
        step, feed_h = consumer.begin_extend(pool, [(blocks, p, feed)]), []
        while not step.done:
            feed_h.append(step.h)
            step.run_layer()
        feed_h.append(step.h)
        out.append(Example(p, feed, states_a, states_b, step.logits()[0][skip:], prompt[:p], pool, blocks, feed_h,
                           skip))
        if progress:
            progress()
    return out


@dataclass(frozen=True)
class Measured:
    kl: float  # mean KL(method || oracle) per scored position, nats
    top1: float  # share of scored positions whose most likely next token is the oracle's
    positions: int


class KLProbe:
    def __init__(self, consumer: Any, examples: list[Example]):
        self.consumer = consumer
        self.examples = examples
        self.num_measurements = 0

    @property
    def num_positions(self) -> int:
        return sum(int(e.feed.shape[0]) - e.scored_from for e in self.examples)

    def measure(self, replace: dict[int, LayerKV]) -> float:
        """Mean KL over all answer positions with layers in `replace` rebuilt by their function."""
        return self.measure_all(replace).kl

    def measure_all(self, replace: dict[int, LayerKV]) -> Measured:
        """KL and top-1 agreement over all answer positions with layers in `replace` rebuilt."""
        self.num_measurements += 1
        total, agree, count = 0.0, 0, 0
        first = min(replace, default=len(self.examples[0].consumer) if self.examples else 0)
        for ex in self.examples:
            for layer, fn in replace.items():
                k, v = fn(ex, layer)
                self.consumer.write_kv(ex.pool, ex.blocks, layer, k, v)
            step = self.consumer.begin_extend(ex.pool, [(ex.blocks, ex.prefix, ex.feed)])
            # the layers below are the oracle's; each layer run writes the feed's own K/V before reading it
            step.resume(first, ex.feed_h[first])
            logits = step.logits()[0][ex.scored_from:]
            kl = kl_divergence(logits, ex.oracle_logits)
            total, count = total + float(kl.sum()), count + kl.numel()
            agree += int((logits.argmax(-1) == ex.oracle_logits.argmax(-1)).sum())
            for layer in replace:  # back to the oracle state
                s = ex.consumer[layer]
                self.consumer.write_kv(ex.pool, ex.blocks, layer, s.keys, s.values)
        return Measured(total / max(count, 1), agree / max(count, 1), count)
