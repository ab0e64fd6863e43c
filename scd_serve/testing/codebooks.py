"""A codebook in seconds for tests: joint codes and aligners fitted on a few random prompts,
with a fixed plan (no calibration search, no probe). Its quality means nothing; it exercises
every decode-side path a plan can take (Reuse streams, a Patch layer, a replayed tail)."""

from __future__ import annotations

from pathlib import Path

import torch

from scd_serve.calibration.assemble import build_codebook
from scd_serve.calibration.fit import collect_rows, fit_layer
from scd_serve.codec.codec_spec import spec_of
from scd_serve.codec.plan import PATCH, REUSE, LayerPlan, Plan


def quick_codebook(producer, consumer, root: str | Path, *, patch: tuple[int, ...] = (), replay: int = 0,
                   head: int = 0, kv_rank: int = 8, h_rank: int = 16, seed: int = 11, num_prompts: int = 6) -> str:
    """-> the directory of a codebook for (producer, consumer) runtimes: an "scd" plan of Reuse
    streams at kv_rank, the `patch` layers patched at h_rank; `replay` tokens replayed, the first
    `head` computed by the consumer."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(producer.spec.vocab_size, consumer.spec.vocab_size)
    prompts = [torch.randint(1, vocab, (int(torch.randint(16, 64, (1,), generator=g)),), generator=g)
               for _ in range(num_prompts)]
    rows = collect_rows(producer, consumer, prompts, max_rows=4096)
    b = spec_of(consumer)
    fits = [fit_layer(r, kv_rank, (h_rank,), aligner_width=32) for r in rows]
    plan = Plan(tuple(LayerPlan(PATCH, r_h=h_rank) if i in patch else LayerPlan(REUSE, kv_rank, kv_rank)
                      for i in range(b.num_layers)))
    extra = {"replay_tokens": replay, "head_tokens": head}
    return str(build_codebook(fits, {"scd": plan}, spec_of(producer), b, extra=extra).save(root))
