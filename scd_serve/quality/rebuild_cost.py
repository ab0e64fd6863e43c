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

import statistics
from typing import Any

import torch

from scd_serve.quality.transfer import ORACLE, transfer

TIMED_ROUNDS = 2  # after a warm round, whose figures are dropped


def spread(prompts: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`count` of the prompts at evenly spaced quantiles of their lengths: a rebuild's share of a
    prefill falls as prompts grow (its fixed costs spread), so the few timed must span them."""
    ordered = sorted(prompts, key=lambda p: p.numel())
    if len(ordered) <= count:
        return ordered
    return [ordered[round(i * (len(ordered) - 1) / max(1, count - 1))] for i in range(count)]


class RebuildCost:
    """`cost(codec)` -> its rebuild of the prompts over the consumer's prefill of them: the
    median over TIMED_ROUNDS of the two sums' ratio, each prompt's prefill timed next to its
    rebuild so that a change in the machine's load falls on both. The warm round leaves the
    token prior's rows of the prompts' tokens known, as the decode worker's vocabulary table
    does (codec/prior_table.py)."""

    def __init__(self, producer: Any, consumer: Any, prompts: list[torch.Tensor], rounds: int = TIMED_ROUNDS):
        # the handoff: every prompt token but the last, which the consumer decodes itself
        self.prefixes = [p.reshape(-1)[:-1] for p in prompts if p.numel() > 1]
        if not self.prefixes:
            raise ValueError("timing a rebuild needs at least one prompt of two tokens or more")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.producer, self.consumer, self.rounds = producer, consumer, rounds

    def __call__(self, codec: Any) -> float:
        ratios = []
        for round_ in range(self.rounds + 1):
            rebuild = prefill = 0.0
            for prefix in self.prefixes:
                prefill += transfer(ORACLE, None, None, self.consumer, prefix, 1).rebuild_s
                rebuild += transfer("scd", codec, self.producer, self.consumer, prefix, 1).rebuild_s
            if round_:
                ratios.append(rebuild / prefill)
        return statistics.median(ratios)
