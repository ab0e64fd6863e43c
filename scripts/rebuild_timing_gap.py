#!/usr/bin/env python3
"""One codebook's rebuild over the consumer's prefill on a pair's held-out prompts, timed the ways
`eval` and calibration time it, to see where their figures part (docs/results.md):

  eval, one pass    each prompt once: the consumer's prefill, then the rebuild (quality/transfer.py)
  eval, again       the same pass a second time (the token prior's rows of the prompts now known)
  calibration, all  quality/rebuild_cost.py on every prompt
  calibration, 8    the same on the 8 prompts spread over their lengths that calibration times

    python scripts/rebuild_timing_gap.py PAIR_DIR CODEBOOK [--prior-table on|off] [--method scd]

PAIR_DIR: producer/, consumer/, eval/heldout.jsonl (scd-serve make-pair-zoo). One thread.
"""

from __future__ import annotations

import argparse

import torch

from scd_serve import codec as codecs
from scd_serve.codec import prior_table
from scd_serve.config.codec import CalibrateConfig
from scd_serve.model import ModelRuntime
from scd_serve.quality.data import read_records, tokenize
from scd_serve.quality.rebuild_cost import RebuildCost, spread
from scd_serve.quality.transfer import ORACLE, transfer

TIMING_PROMPTS = CalibrateConfig.num_timing_prompts


def eval_pass(method: str, codec, producer, consumer, prompts: list[torch.Tensor]) -> float:
    rebuild_s = prefill_s = 0.0
    for ids in prompts:
        prefill_s += transfer(ORACLE, None, None, consumer, ids[:-1], 1).rebuild_s
        rebuild_s += transfer(method, codec, producer, consumer, ids[:-1], 1).rebuild_s
    return rebuild_s / prefill_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pair")
    parser.add_argument("codebook")
    parser.add_argument("--prior-table", default="on", choices=["on", "off"])
    parser.add_argument("--method", default="scd")
    args = parser.parse_args()
    torch.set_num_threads(1)
    producer = ModelRuntime.load(f"{args.pair}/producer")
    consumer = ModelRuntime.load(f"{args.pair}/consumer")
    book = codecs.Codebook.load(args.codebook, producer, consumer)
    if said := prior_table.fill_codebook(book, consumer, args.prior_table):
        print(said)
    codec = codecs.build(args.method, producer=producer, consumer=consumer, codebook=book)
    context = consumer.spec.max_position_embeddings
    prompts = [p.ids for p in tokenize(read_records(f"{args.pair}/eval/heldout.jsonl"), consumer.tokenizer,
                                       context, "heldout").items]
    print(f"{len(prompts)} prompts; rebuild over the consumer's prefill:")
    print(f"  eval, one pass     {eval_pass(args.method, codec, producer, consumer, prompts):.3f}")
    print(f"  eval, again        {eval_pass(args.method, codec, producer, consumer, prompts):.3f}")
    print(f"  calibration, all   {RebuildCost(producer, consumer, prompts)(codec):.3f}")
    print(f"  calibration, {TIMING_PROMPTS}     "
          f"{RebuildCost(producer, consumer, spread(prompts, TIMING_PROMPTS))(codec):.3f}")


if __name__ == "__main__":
    main()
