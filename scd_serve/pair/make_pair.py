"""`scd-serve make-demo-pair`: train the embedded producer ("base") and consumer ("expert").

`--recipe demo` (the default) is described below; `--recipe context` makes the Qwen2 pair on
stdlib source in models/context-pair (scd_serve/pair/context_recipe.py).

1. a word-level tokenizer trained on the language's lexicon;
2. the producer: a Llama (GQA, RoPE theta 1e4) trained from a seed on base-style data,
   first as a shallow model that finds the lookup quickly, then grown (grow.py) to its
   full depth and trained further;
3. the consumer: a copy of the producer with rope_theta 1e6 (as MistralLite did),
   fine-tuned on expert-style data (other format, domain words only, longer contexts).
Both are saved as HF directories; `report.json` records the settings, times and probes.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from scd_serve.config.pair import ContextPairConfig, PairConfig
from scd_serve.errors import ConfigError
from scd_serve.pair.grow import grow
from scd_serve.pair.greedy_probe import probe
from scd_serve.pair.tokenizer import train_tokenizer
from scd_serve.pair.train import build_model, consumer_start, save_model, train_stage


RECIPES = {"demo": "models/demo-pair", "context": "models/context-pair", "text": "out/text-pair"}  # -> default --out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="demo", choices=list(RECIPES),
                        help="demo: the synthetic QA pair; context: variable tracking on stdlib source; text: a "
                             "plain language-model pair on stdlib source (measures a codec on real text)")
    parser.add_argument("--out", default=None, help="directory for producer/ and consumer/ "
                                                     "(default: models/demo-pair or models/context-pair)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shallow-steps", type=int, default=None,
                        help="override the shallow stage's steps (demo recipe)")
    parser.add_argument("--producer-steps", type=int, default=None, help="override the producer's steps")
    parser.add_argument("--consumer-steps", type=int, default=None, help="override the consumer's steps")
    parser.add_argument("--probe", type=int, default=100, help="held-out prompts to probe at the end (0: none)")
    parser.add_argument("--shrunk", action="store_true", help="seconds-long tiny config (tests)")


def make_pair(cfg: PairConfig, out: Path, probe_n: int = 100, log=print) -> dict:
    torch.set_num_threads(cfg.threads)
    start = time.time()
    tokenizer = train_tokenizer()
    torch.manual_seed(cfg.seed)
    report: dict = {"config": asdict(cfg)}
    if cfg.shallow_layers:
        shallow = build_model(replace(cfg, num_layers=cfg.shallow_layers), len(tokenizer), tokenizer)
        report["shallow_train"] = train_stage(shallow, cfg.shallow, tokenizer, cfg.seed, log=log)
        producer = grow(shallow, cfg.num_layers)
    else:
        producer = build_model(cfg, len(tokenizer), tokenizer)
    report["params"] = sum(p.numel() for p in producer.parameters())
    report["producer_train"] = train_stage(producer, cfg.producer, tokenizer, cfg.seed + 1, log=log)
    save_model(producer, tokenizer, out / "producer")
    consumer = consumer_start(producer, cfg.consumer_rope_theta)
    report["consumer_train"] = train_stage(consumer, cfg.consumer, tokenizer, cfg.seed + 2, log=log)
    save_model(consumer, tokenizer, out / "consumer")
    report["train_seconds"] = round(time.time() - start, 1)
    if probe_n:
        report["probe_consumer_heldout"] = probe(consumer, tokenizer, "heldout", probe_n, "expert")
        report["probe_producer_heldout"] = probe(producer, tokenizer, "heldout", probe_n, "expert")
        report["probe_producer_base"] = probe(producer, tokenizer, "train-base", probe_n, "base")
        log(json.dumps({k: v for k, v in report.items() if k.startswith("probe")}))
    report["total_seconds"] = round(time.time() - start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def run(args: argparse.Namespace) -> int:
    from scd_serve.pair.context_recipe import make_context_pair

    args.out = args.out or RECIPES[args.recipe]
    context = args.recipe in ("context", "text")
    if context and args.shallow_steps:
        raise ConfigError("--shallow-steps belongs to the demo recipe; the context recipe has no shallow stage")
    cfg = (ContextPairConfig.text(args.seed) if args.recipe == "text" else ContextPairConfig(seed=args.seed)) \
        if context else PairConfig(seed=args.seed)
    if args.shrunk:
        cfg = cfg.shrunk()
    for stage in ("shallow", "producer", "consumer"):
        if steps := getattr(args, f"{stage}_steps"):
            cfg = replace(cfg, **{stage: replace(getattr(cfg, stage), steps=steps)})
    make = make_context_pair if context else make_pair
    report = make(cfg, Path(args.out), probe_n=args.probe, log=lambda line: print(line, flush=True))
    made = f"{args.out}/producer, {args.out}/consumer and {args.out}/eval" if context else \
        f"{args.out}/producer and {args.out}/consumer"
    print(f"wrote {made} in {report['total_seconds']:.0f}s")
    return 0
