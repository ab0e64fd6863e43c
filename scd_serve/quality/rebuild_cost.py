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

from scd_serve.quality.transfer import ORACLE, rebuild_rounds, transfer

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
    fastest of TIMED_ROUNDS rounds of each sum, one over the other. The prefill is the same for
    every option, so it is timed once, at the first call (a warm round, then the rounds): timing
    it again next to each of the ~45 options a calibration weighs cost 15 of a 63-minute
    calibration at the 0.5B shape (docs/benchmarks.md). An option's rounds rebuild each prompt
    from one encoding of it (the producer's prefill is not rebuild time: run per round, it was
    most of a timing). The warm round leaves the token prior's rows of the prompts' tokens known,
    as the decode worker's vocabulary table does (codec/prior_table.py)."""

    def __init__(self, producer: Any, consumer: Any, prompts: list[torch.Tensor], rounds: int = TIMED_ROUNDS):
        # the handoff: every prompt token but the last, which the consumer decodes itself
        self.prefixes = [p.reshape(-1)[:-1] for p in prompts if p.numel() > 1]
        if not self.prefixes:
            raise ValueError("timing a rebuild needs at least one prompt of two tokens or more")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.producer, self.consumer, self.rounds = producer, consumer, rounds
        self.prefill_s: list[float] = []  # the consumer's prefill of all the prompts, per timed round

    def __call__(self, codec: Any) -> float:
        if not self.prefill_s:
            self.prefill_s = self._rounds(lambda prefix: [transfer(ORACLE, None, None, self.consumer, prefix, 1).rebuild_s
                                                          for _ in range(self.rounds + 1)])
        rebuild_s = self._rounds(lambda prefix: rebuild_rounds(codec, self.producer, self.consumer, prefix,
                                                               self.rounds + 1))
        # the fastest round of each: other work on the machine only ever adds time, so the least is
        # the figure least moved by it (a busy spell during one option's rounds made it "over")
        return min(rebuild_s) / min(self.prefill_s)

    def _rounds(self, run) -> list[float]:
        """run(prefix) -> its seconds in each round, a warm one first -> the prompts' sums per timed round."""
        per_prompt = [run(prefix) for prefix in self.prefixes]
        return [sum(seconds[r] for seconds in per_prompt) for r in range(1, self.rounds + 1)]
