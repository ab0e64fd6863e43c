"""What a rebuild costs the decode worker, measured at calibration rather than counted.

A count (a run from L computes (N - L) / N of a prefill, a replay of R tokens R / T) leaves out
what comes on top: the token prior's context, the codes' decode, the K/V writes, and at small
shapes a short forward's fixed cost. On the pair zoo the counted 0.5 measured 0.52-0.80 of the
consumer's own prefill (docs/results.md). So calibration times each option it weighs the way
`eval` does (quality/transfer.py: the codec's decode of every layer, the writes and the replayed
tail, against the consumer's own layer-wise prefill of the same prompt) and keeps it within
`--max-rebuild` by that figure.
"""

from __future__ import annotations

from typing import Any

import torch

from scd_serve.quality.transfer import ORACLE, rebuilder, transfer

TIMED_ROUNDS = 1  # of each prompt's rebuild and prefill side by side, after a warm rebuild


def spread(prompts: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`count` of the prompts at evenly spaced quantiles of their lengths: a rebuild's share of a
    prefill falls as prompts grow (its fixed costs spread), so the few timed must span them."""
    ordered = sorted(prompts, key=lambda p: p.numel())
    if len(ordered) <= count:
        return ordered
    return [ordered[round(i * (len(ordered) - 1) / max(1, count - 1))] for i in range(count)]


class RebuildCost:
    """`cost(codec)` -> its rebuild of the prompts over the consumer's prefill of them. Per prompt,
    a warm rebuild, then `rounds` of a rebuild and the consumer's own prefill of the prompt, one
    right after the other; the fastest of each, summed over the prompts, one sum over the other.
    The prefill is timed beside every option, not once for all: a calibration runs for minutes
    beside whatever else the machine does, and a prefill timed once, in a busy spell at the first
    option, made every later option look cheap (0.45 of a prefill on the probe, 0.58-0.62 on
    held-out texts, docs/results.md); side by side, a busy spell slows both alike. An option's
    rebuilds all start from one encoding of the prompt (the producer's prefill is not rebuild
    time). The warm rebuild leaves the token prior's rows of the prompt's tokens known, as the
    decode worker's vocabulary table does (codec/prior_table.py)."""

    def __init__(self, producer: Any, consumer: Any, prompts: list[torch.Tensor], rounds: int = TIMED_ROUNDS):
        # the handoff: every prompt token but the last, which the consumer decodes itself
        self.prefixes = [p.reshape(-1)[:-1] for p in prompts if p.numel() > 1]
        if not self.prefixes:
            raise ValueError("timing a rebuild needs at least one prompt of two tokens or more")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.producer, self.consumer, self.rounds = producer, consumer, rounds
        self.prefill_s: list[float] = []  # the consumer's prefill of the prompts, one sum per option timed

    def __call__(self, codec: Any) -> float:
        if not self.prefill_s:  # the first option: the consumer's first prefill pays one-time costs
            self._prefill(self.prefixes[0])
        rebuild_s = prefill_s = 0.0
        for prefix in self.prefixes:
            rebuild = rebuilder(codec, self.producer, self.consumer, prefix)
            rebuild()  # warm
            rounds = [(rebuild(), self._prefill(prefix)) for _ in range(self.rounds)]  # side by side
            rebuild_s += min(r for r, _ in rounds)  # the fastest: other work only ever adds time
            prefill_s += min(p for _, p in rounds)
        self.prefill_s.append(prefill_s)
        return rebuild_s / prefill_s

    def _prefill(self, prefix: torch.Tensor) -> float:
        return transfer(ORACLE, None, None, self.consumer, prefix, 1).rebuild_s
