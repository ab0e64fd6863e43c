"""`scd-serve make-pair-zoo --out DIR`: the pair zoo (config/zoo.py says what each pair varies).

DIR/
  tokenizer/                 one byte-level BPE for every model, trained on all three domains
  producers/NAME/            a base model per architecture, pretrained on stdlib source
  PAIR/producer -> ../producers/NAME
  PAIR/consumer/             the fine-tuned expert (LoRA pairs: merged; the adapter in PAIR/adapter/)
  PAIR/eval/calibration.jsonl, heldout.jsonl   the consumer's domain, from different documents
  PAIR/pair.json             the recipe, training figures and raw-reuse KL on held-out texts
  report.json, report.md     every pair, easiest to hardest by raw-reuse KL

Resumable: a model whose directory holds zoo.json is kept, so an interrupted run picks up
where it stopped (`--only` makes a subset). Runs on the CPU in hours (threads in config).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from scd_serve.config.zoo import ZooConfig, ZooPairConfig, ZooProducerConfig
from scd_serve.errors import ConfigError
from scd_serve.pair import zoo_corpus as corpus
from scd_serve.pair.bpe import spread, train_bpe
from scd_serve.pair.train import consumer_start, save_model
from scd_serve.pair.zoo_train import build_producer, instruct_batches, lm_batches, token_stream, train, with_lora

DONE = "zoo.json"


def _tokenizer(cfg: ZooConfig, out: Path, log):
    from transformers import PreTrainedTokenizerFast

    path = out / "tokenizer"
    if (path / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    texts = []
    for domain in ("stdlib", "code", "docs"):
        texts += spread([d.text for d in corpus.splits(domain, cfg.seed, cfg.package_chars)["train"]],
                        cfg.tokenizer_chars, 256)
    tok = train_bpe(texts, cfg.vocab_size)
    tok.save_pretrained(str(path))
    log(f"tokenizer: {len(tok)} tokens from {sum(map(len, texts)):,} characters")
    return tok


def _stream(cfg: ZooConfig, domain: str, tokenizer, out: Path) -> torch.Tensor:
    path = out / "cache" / f"{domain}-train.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    texts, size = [], 0
    for d in corpus.splits(domain, cfg.seed, cfg.package_chars)["train"]:
        texts.append(d.text)
        size += len(d.text)
        if size >= cfg.domain_chars:
            break
    stream = token_stream(tokenizer, texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(stream, path)
    return stream


def eval_records(cfg: ZooConfig, pair: ZooPairConfig, tokenizer, split: str, n: int) -> list[dict]:
    """n records of the pair's domain from `split`: prompt/answer for instruction pairs, else texts
    of cfg.text_tokens tokens (their first half is the prompt, the second half is scored)."""
    docs = corpus.splits(pair.domain, cfg.seed, cfg.package_chars)[split]
    rng = random.Random(f"zoo-eval:{pair.domain}:{split}:{cfg.seed}")
    if pair.instruct:
        examples = corpus.instructions(docs)
        rng.shuffle(examples)
        if len(examples) < n:
            raise ConfigError(f"{pair.domain}/{split}: {len(examples)} instruction examples, {n} wanted")
        return [{"id": f"{split}-{i}", "source": doc, "prompt": p, "answer": a}
                for i, (p, a, doc) in enumerate(examples[:n])]
    lo, hi = cfg.text_tokens
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n:
            raise ConfigError(f"{pair.domain}/{split}: too few long documents for {n} texts of {lo}+ tokens")
        doc, text = corpus.excerpt(rng, docs, rng.randint(lo, hi) * 4)
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= lo:
            text = tokenizer.decode(ids[:hi], skip_special_tokens=True)
            out.append({"id": f"{split}-{len(out)}", "source": doc.name, "text": text})
    return out


def _save(model, tokenizer, directory: Path, info: dict) -> None:
    save_model(model, tokenizer, directory)
    (directory / DONE).write_text(json.dumps(info, indent=1) + "\n")


def _load(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)


def make_producer(cfg: ZooConfig, p: ZooProducerConfig, tokenizer, out: Path, log) -> Path:
    path = out / "producers" / p.name
    if (path / DONE).exists():
        return path
    torch.manual_seed(cfg.seed)
    model = build_producer(p, cfg, tokenizer)
    stream = _stream(cfg, "stdlib", tokenizer, out)
    rng = random.Random(f"zoo-producer:{p.name}:{cfg.seed}")
    info = {"config": asdict(p), "params": sum(x.numel() for x in model.parameters()),
            "train_tokens": int(stream.numel())}
    info["train"] = train(model, lm_batches(stream, p.seq_len, p.batch_tokens, p.steps, rng), p.steps, p.lr,
                          p.warmup, f"producer {p.name}", log,
                          checkpoint=out / "producers" / f"{p.name}.checkpoint.pt")
    _save(model, tokenizer, path, info)
    return path


def make_consumer(cfg: ZooConfig, pair: ZooPairConfig, producer_dir: Path, tokenizer, out: Path, log) -> dict:
    path = out / pair.name / "consumer"
    if (path / DONE).exists():
        return json.loads((path / DONE).read_text())
    torch.manual_seed(pair.seed + 1000)
    model = consumer_start(_load(producer_dir), pair.rope_theta)
    rng = random.Random(f"zoo-pair:{pair.domain}:{pair.instruct}:{pair.seed}")
    if pair.instruct:
        examples = [(p, a) for p, a, _ in corpus.instructions(corpus.splits(pair.domain, cfg.seed,
                                                                               cfg.package_chars)["train"])]
        batches = instruct_batches(tokenizer, examples, pair.seq_len, pair.batch_tokens, pair.steps, rng)
        data = {"train_examples": len(examples)}
    else:
        stream = _stream(cfg, pair.domain, tokenizer, out)
        batches = lm_batches(stream, pair.seq_len, pair.batch_tokens, pair.steps, rng)
        data = {"train_tokens": int(stream.numel())}
    trained = with_lora(model, pair) if pair.method == "lora" else model
    info = {"config": asdict(pair), **data}
    info["train"] = train(trained, batches, pair.steps, pair.lr, pair.warmup, pair.name, log,
                          checkpoint=out / pair.name / "consumer.checkpoint.pt")
    if pair.method == "lora":
        trained.save_pretrained(str(out / pair.name / "adapter"))  # the adapter as users bring it
        model = trained.merge_and_unload()
    _save(model, tokenizer, path, info)
    return info


def raw_reuse(cfg: ZooConfig, pair_dir: Path, n: int) -> dict:
    """KL and top-1 of raw K/V reuse (the producer's cache served as is) on held-out texts."""
    from scd_serve import codec
    from scd_serve.model import ModelRuntime
    from scd_serve.quality.data import read_records, tokenize
    from scd_serve.quality.scorer import Scorer
    from scd_serve.quality.transfer import ORACLE

    rt_a = ModelRuntime.load(str(pair_dir / "producer"))
    rt_b = ModelRuntime.load(str(pair_dir / "consumer"))
    path = pair_dir / "eval" / "heldout.jsonl"
    records = read_records(str(path))[:n]
    prompts = tokenize(records, rt_b.tokenizer, rt_b.spec.max_position_embeddings - 32, str(path))
    rows = Scorer(rt_a, rt_b, prompts, show_progress=False).evaluate(
        {ORACLE: None, "raw": codec.build("raw", producer=rt_a, consumer=rt_b)})
    raw = rows[1]
    return {"kl": round(raw["kl"], 4), "top1": round(raw["top1"], 4), "texts": len(records),
            "scored_positions": raw["scored_positions"]}


def axes(pair: ZooPairConfig) -> str:
    out = [f"{pair.method} fine-tune on {pair.domain}, {pair.steps} steps"]
    if pair.rope_theta is not None:
        out.append(f"rope_theta -> {pair.rope_theta:g}")
    if pair.instruct:
        out.append("instruction format, loss on answers")
    if pair.held_back:
        out.append(f"held-back seed {pair.seed}")
    return "; ".join(out)


def make_pair_zoo(cfg: ZooConfig, out: Path, only: list[str] | None = None,
                  log: Callable[[str], None] = print) -> dict:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per save and load would bury the training log
    torch.set_num_threads(cfg.threads)
    start = time.time()
    pairs = [cfg.pair(name) for name in only] if only else list(cfg.pairs)
    tokenizer = _tokenizer(cfg, out, log)
    for pair in pairs:
        pair_dir = out / pair.name
        eval_dir = pair_dir / "eval"
        eval_dir.mkdir(parents=True, exist_ok=True)
        for split, n in (("calibration", cfg.num_calibration), ("heldout", cfg.num_heldout)):
            if not (eval_dir / f"{split}.jsonl").exists():
                rows = eval_records(cfg, pair, tokenizer, split, n)
                (eval_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        producer_dir = make_producer(cfg, cfg.producer(pair.producer), tokenizer, out, log)
        link = pair_dir / "producer"
        if not link.exists():
            link.symlink_to(os.path.relpath(producer_dir, pair_dir))
        info = make_consumer(cfg, pair, producer_dir, tokenizer, out, log)
        summary_path = pair_dir / "pair.json"
        if not summary_path.exists():
            summary = {"name": pair.name, "producer": pair.producer, "axes": axes(pair), "held_back": pair.held_back,
                       "consumer_train": info["train"], "raw_reuse": raw_reuse(cfg, pair_dir, cfg.report_texts)}
            summary_path.write_text(json.dumps(summary, indent=1) + "\n")
            log(f"{pair.name}: raw-reuse KL {summary['raw_reuse']['kl']} top-1 {summary['raw_reuse']['top1']}")
    report = write_report(cfg, out)
    report["seconds"] = round(time.time() - start, 1)
    return report


def write_report(cfg: ZooConfig, out: Path) -> dict:
    made = [json.loads((out / p.name / "pair.json").read_text()) for p in cfg.pairs if (out / p.name / "pair.json").exists()]
    made.sort(key=lambda s: s["raw_reuse"]["kl"])
    packages = [p for p in corpus.CODE_PACKAGES if (corpus.site_packages() / p).exists()
                or (corpus.site_packages() / f"{p}.py").exists()]
    report = {"python": platform.python_version(), "packages": packages, "config": asdict(cfg), "pairs": made}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Pair zoo", "", "Raw-reuse KL: the producer's K/V served to the consumer as is, on "
             f"{cfg.report_texts} held-out texts of the consumer's domain (KL per scored token against the "
             "consumer's own prefill).", "",
             "| pair | producer | what the fine-tune changed | raw KL | raw top-1 | final loss |", "|---|---|---|---|---|---|"]
    for s in made:
        lines.append(f"| {s['name']} | {s['producer']} | {s['axes']} | {s['raw_reuse']['kl']} | "
                     f"{s['raw_reuse']['top1']} | {s['consumer_train']['final_loss']:.3f} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="zoo directory (resumable: finished models are kept)")
    parser.add_argument("--only", nargs="+", default=None, metavar="PAIR",
                        help=f"make these pairs only (of {', '.join(p.name for p in ZooConfig().pairs)})")
    parser.add_argument("--seed", type=int, default=0, help="corpus split and producer seed")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's)")
    parser.add_argument("--shrunk", action="store_true", help="seconds-long tiny zoo (tests)")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    cfg = ZooConfig(seed=args.seed)
    if args.shrunk:
        cfg = cfg.shrunk()
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}", field="threads")
        cfg = replace(cfg, threads=args.threads)
    report = make_pair_zoo(cfg, Path(args.out), args.only, log=lambda line: print(line, flush=True))
    print(f"zoo: {len(report['pairs'])} pairs in {args.out} ({report['seconds']:.0f} s); {args.out}/report.md")
    return 0
