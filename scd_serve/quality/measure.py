"""`scd-serve measure`: a codebook's quality figures on texts it was never fitted or chosen on.

The manifest's `calibration.methods` (KL and top-1 agreement with the consumer's own next token,
per method) is what `auto` and users read. `calibrate` measures them once on report prompts it
held out by document; this command measures them again on any file of records (a user's own
held-out texts, a new domain), exactly as calibrate's report does: the real encode/decode of each
method, the consumer's own prefill as the oracle. `--write` records the figures in the manifest
(the tensors are untouched), with the file they came from.

    scd-serve measure --producer P --consumer C --codebook DIR --data held.jsonl [--limit 64] [--write]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from scd_serve.errors import ConfigError


def measure_held_out(producer: Any, consumer: Any, book: Any, pairs: list, tail: int = 1,
                     show_progress: bool = True) -> tuple[dict[str, dict[str, float]], dict]:
    """pairs: (prompt ids [T], scored ids [n]) -> ({method: kl, top1, payload_ratio}, report facts)."""
    from scd_serve.calibration.probes import measure_methods

    run = book.plan("scd").run_layer
    methods, report = measure_methods(producer, consumer, book, pairs, tail, () if run is None else (run,),
                                      show_progress)
    return methods, report | {"held_out": True}


def record(book_dir: Path, methods: dict, report: dict, min_top1: float) -> dict:
    """The figures into DIR/manifest.json's calibration block (the tensors and their checksum stay)."""
    from scd_serve.codec import figures
    from scd_serve.codec.codebook import MANIFEST

    path = book_dir / MANIFEST
    manifest = json.loads(path.read_text())
    cal = manifest.setdefault("calibration", {})
    if "methods" in cal and "measured" not in cal:  # what calibration itself recorded, kept beside
        cal["calibrated_methods"] = cal["methods"]
    cal = figures.record(manifest, methods, report, min_top1)
    cal["measured"] = {"source": report["source"], "at": time.strftime("%Y-%m-%d")}
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return cal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--producer", required=True, help="producer model directory")
    parser.add_argument("--consumer", required=True, help="consumer model directory")
    parser.add_argument("--codebook", required=True, help="codebook directory (scd-serve calibrate --out)")
    parser.add_argument("--data", required=True,
                        help="JSONL records the codebook was not calibrated on ({\"text\"}, {\"prompt\", \"answer\"} "
                             "or {\"messages\"}; scd-serve eval --help)")
    parser.add_argument("--limit", type=int, default=64, help="records measured (the first N)")
    parser.add_argument("--max-tokens", type=int, default=None, help="longest prompt (default: the models' context)")
    parser.add_argument("--greedy-tokens", type=int, default=32,
                        help="a record without an answer scores this many tokens of the consumer's own continuation")
    parser.add_argument("--min-top1", type=float, default=None,
                        help="the agreement target recorded with --write (default: the manifest's, else 0.95)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--write", action="store_true",
                        help="record the figures in the codebook's manifest (what auto reads)")


def run(args: argparse.Namespace) -> int:
    from scd_serve.codec.codebook import Codebook
    from scd_serve.model import ModelRuntime
    from scd_serve.quality.calibration_data import REPORT_SCORED_TOKENS
    from scd_serve.quality.data import read_records, tokenize
    from scd_serve.quality.scorer import run_oracle

    if args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}", field="limit")
    if not Path(args.data).is_file():
        raise ConfigError(f"--data {args.data}: no such file", field="data")
    records = read_records(args.data)[: args.limit]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    producer = ModelRuntime.load(args.producer, dtype=dtype)
    consumer = ModelRuntime.load(args.consumer, dtype=dtype)
    book = Codebook.load(args.codebook, producer=producer, consumer=consumer)
    context = min(producer.spec.max_position_embeddings, consumer.spec.max_position_embeddings)
    max_tokens = args.max_tokens or context - args.greedy_tokens
    items = tokenize(records, consumer.tokenizer, max_tokens, args.data).items
    eos = getattr(consumer.tokenizer, "eos_token_id", None)
    pairs = [(p.ids, (p.reference if p.reference is not None else
                      run_oracle(consumer, p, args.greedy_tokens, -1 if eos is None else int(eos)).scored)
              [:REPORT_SCORED_TOKENS]) for p in items]
    cal = book.manifest.get("calibration", {})
    tail = cal.get("config", {}).get("probe_tail", 1)
    methods, report = measure_held_out(producer, consumer, book, pairs, tail=tail)
    report["source"] = str(args.data)
    min_top1 = args.min_top1 if args.min_top1 is not None else cal.get("min_top1", 0.95)
    print(f"{'method':<12}{'KL':>10}{'top-1':>8}{'payload/raw':>13}   ({report['prompts']} prompts of {args.data}, "
          f"{report['positions']} scored positions)")
    for name, m in methods.items():
        print(f"{name:<12}{m['kl']:>10.4f}{m['top1']:>8.3f}{m['payload_ratio']:>13.3f}")
    if args.write:
        cal = record(Path(args.codebook), methods, report, min_top1)
        print(f"recorded in {Path(args.codebook) / 'manifest.json'}: scd {'meets' if cal['meets_budget'] else 'does NOT meet'}"
              f" the budget (KL <= {cal.get('kl_budget')}, top-1 >= {min_top1})")
    return 0
