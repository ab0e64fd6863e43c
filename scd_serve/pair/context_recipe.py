"""`scd-serve make-demo-pair --recipe context`: the context pair (models/context-pair).

1. corpus: the stdlib's source split by module (context_corpus.py);
2. tokenizer: byte-level BPE, Qwen2 pre-tokenization, trained on the two training splits;
3. eval/: held-out variable-tracking prompts (expert style, 512-2048 tokens), the same task
   in the producer's style, plain held-out source for perplexity, calibration prompts;
4. producer: a Qwen2 (GQA, q/k/v biases, rope_theta 1e4) trained from the seed on the base
   split with `assert x == ` questions (optionally first as a shallow model on plain lookups,
   then grown: grow.py);
5. consumer: the producer's weights with rope_theta 1e6, fine-tuned on the expert split
   with doctest questions (`>>> x`).
`report.json` records the settings, the corpus, the times and a greedy probe of both models.
"""

from __future__ import annotations

import json
import platform
import random
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch
from transformers import Qwen2ForCausalLM

from scd_serve.config.pair import ContextPairConfig
from scd_serve.pair.bpe import single_token_words, spread, train_bpe
from scd_serve.pair.context_corpus import load_splits, sample_lines, stdlib_root, training_text
from scd_serve.pair.context_task import STYLES, make_examples
from scd_serve.pair.context_train import build_model, train_stage
from scd_serve.pair.grow import grow
from scd_serve.pair.train import consumer_start, save_model
from scd_serve.quality.metrics import exact_match


def tokenizer_texts(splits, cfg: ContextPairConfig) -> list[str]:
    texts = training_text(splits, ("base", "expert"))
    return spread(texts, cfg.tokenizer_chars, 64) if cfg.tokenizer_chars else texts


def write_eval_files(cfg: ContextPairConfig, splits, tokenizer, pool: list[str], directory: Path) -> dict:
    """eval/*.jsonl in formats `scd-serve eval --data` and `calibrate --data` read: the task held out
    (both styles), task prompts and plain source for calibration, plain held-out source."""
    directory.mkdir(parents=True, exist_ok=True)
    common = dict(lengths=cfg.eval_lengths, depths=cfg.eval_depths, num_chains=cfg.eval_chains,
                  one_name=cfg.one_name)
    sets = {
        "heldout.jsonl": make_examples(splits["heldout"], pool, tokenizer, STYLES["expert"], cfg.num_heldout,
                                       f"heldout:{cfg.seed}", **common),
        "heldout-base.jsonl": make_examples(splits["heldout"], pool, tokenizer, STYLES["base"],
                                            cfg.num_heldout // 2, f"heldout-base:{cfg.seed}", **common),
        "calibration.jsonl": make_examples(splits["calibration"], pool, tokenizer, STYLES["expert"],
                                           cfg.num_calibration, f"calibration:{cfg.seed}", **common),
    }
    sets["heldout-text.jsonl"] = plain_texts(cfg, splits["heldout"], tokenizer, cfg.num_text, "heldout-text")
    sets["calibration-text.jsonl"] = plain_texts(cfg, splits["calibration"], tokenizer, cfg.num_calibration,
                                                 "calibration-text")
    for name, rows in sets.items():
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {name: len(rows) for name, rows in sets.items()}


def plain_texts(cfg: ContextPairConfig, files, tokenizer, n: int, name: str) -> list[dict]:
    """`n` plain source excerpts {"id", "text"} of about the held-out prompts' lengths."""
    rng = random.Random(f"{name}:{cfg.seed}")
    lo, hi = cfg.eval_lengths
    texts = []
    while len(texts) < n:
        text = "\n".join(sample_lines(rng, files, int(rng.randint(lo, hi) * 3.3)))
        if len(tokenizer(text)["input_ids"]) >= lo // 2:
            texts.append({"id": f"{name}-{len(texts)}", "text": text})
    return texts


@torch.no_grad()
def probe(model: Qwen2ForCausalLM, tokenizer, path: Path, n: int) -> dict:
    """Greedy exact match with plain transformers on the first `n` records of a task file,
    overall and by the asked chain's depth (the real evaluation is `scd-serve eval --data`)."""
    model.eval()
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    by_depth: dict[str, list[float]] = {}
    for r in rows:
        ids = tokenizer(r["prompt"], return_tensors="pt")["input_ids"]
        steps = len(tokenizer(r["answer"], add_special_tokens=False)["input_ids"])
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        by_depth.setdefault(r["id"].rsplit("-", 1)[1], []).append(exact_match(text, r["answer"]))
    every = [x for xs in by_depth.values() for x in xs]
    return {"n": len(every), "em": round(sum(every) / len(every), 3),
            **{f"em_{k}": round(sum(v) / len(v), 3) for k, v in sorted(by_depth.items())}}


def make_context_pair(cfg: ContextPairConfig, out: Path, probe_n: int = 100,
                      log: Callable[[str], None] = print) -> dict:
    torch.set_num_threads(cfg.threads)
    start = time.time()
    splits = load_splits(cfg.seed)
    report: dict = {"config": asdict(cfg), "python": platform.python_version(), "stdlib": str(stdlib_root()),
                    "corpus": {s: {"modules": sorted({f.module for f in files}), "files": len(files),
                                   "chars": sum(len(f.text) for f in files)} for s, files in splits.items()}}
    tokenizer = train_bpe(tokenizer_texts(splits, cfg), cfg.vocab_size)
    pool = single_token_words(tokenizer)
    report["eval_files"] = write_eval_files(cfg, splits, tokenizer, pool, out / "eval")
    log(f"tokenizer {len(tokenizer)} tokens, {len(pool)} variable names; eval files {report['eval_files']}")
    torch.manual_seed(cfg.seed)
    if cfg.shallow_layers:
        shallow = build_model(replace(cfg, num_layers=cfg.shallow_layers), tokenizer)
        report["copy_train"] = train_stage(shallow, cfg.copy, tokenizer, splits[cfg.copy.split], pool,
                                           cfg.seed + 10, log=log)
        report["shallow_train"] = train_stage(shallow, cfg.shallow, tokenizer, splits[cfg.shallow.split], pool,
                                              cfg.seed, log=log)
        producer = grow(shallow, cfg.num_layers)
    else:
        producer = build_model(cfg, tokenizer)
    report["params"] = sum(p.numel() for p in producer.parameters())
    report["producer_train"] = train_stage(producer, cfg.producer, tokenizer, splits[cfg.producer.split], pool,
                                           cfg.seed + 1, log=log)
    if cfg.long is not None:
        report["long_train"] = train_stage(producer, cfg.long, tokenizer, splits[cfg.long.split], pool,
                                           cfg.seed + 3, log=log)
    save_model(producer, tokenizer, out / "producer")
    consumer = consumer_start(producer, cfg.consumer_rope_theta)
    report["consumer_train"] = train_stage(consumer, cfg.consumer, tokenizer, splits[cfg.consumer.split], pool,
                                           cfg.seed + 2, log=log)
    save_model(consumer, tokenizer, out / "consumer")
    report["train_seconds"] = round(time.time() - start, 1)
    if probe_n:
        report["probe_consumer_heldout"] = probe(consumer, tokenizer, out / "eval" / "heldout.jsonl", probe_n)
        report["probe_producer_heldout"] = probe(producer, tokenizer, out / "eval" / "heldout.jsonl", probe_n)
        report["probe_producer_heldout_base"] = probe(producer, tokenizer, out / "eval" / "heldout-base.jsonl",
                                                      probe_n)
        log(json.dumps({k: v for k, v in report.items() if k.startswith("probe")}))
    report["total_seconds"] = round(time.time() - start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
