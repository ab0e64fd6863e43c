"""`scd-serve make-shaped-pair`: a random-weight producer/consumer pair with a real model's shape.

Random weights say nothing about quality; the pair measures COST at a real shape
(calibration time and memory, codebook against weight bytes, rebuild against prefill, TTFT)
without downloading anything. Under --out:
  producer/   the config's architecture with HF's initializer, random q/k/v biases (Qwen's are
              far from zero), bfloat16, and a byte-level BPE tokenizer (pair/bpe.py);
  consumer/   the producer moved by --perturb x each tensor's RMS of Gaussian noise (a stand-in
              for a fine-tune), with --rope-theta-consumer;
  calibration.jsonl, heldout.jsonl   {"text"} records of Python stdlib source (other files
              than the tokenizer's), and *-qa.jsonl: the same as {"prompt", "answer"}, the
              answer a record's last line (calibration scores it through the full model for
              every plan it measures, so it is kept short);
  report.json  settings, parameter and byte counts, seconds per stage.
The tokenizer's few thousand ids use only the first rows of the config's vocabulary; the
embedding and the LM head keep its full size (that is the cost).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch

from scd_serve.planner.shapes import available, config_path
from scd_serve.errors import ConfigError
from scd_serve.model.spec import SUPPORTED
from scd_serve.pair.bpe import train_bpe

NOT_HF_KEYS = ("name", "source")  # our shipped configs' labels, not part of a model's config.json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="qwen2.5-0.5b",
                        help=f"shipped name ({', '.join(available())}) or an HF config.json (model_type qwen2, qwen3, llama or mistral)")
    parser.add_argument("--out", required=True, help="directory for producer/, consumer/ and the text files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rope-theta-consumer", type=float, default=None,
                        help="the consumer's rope_theta (default: the producer's / 100)")
    parser.add_argument("--perturb", type=float, default=0.05,
                        help="consumer = producer + N(0, (perturb x RMS of each tensor)^2), per tensor")
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick runs)")
    parser.add_argument("--vocab-tokens", type=int, default=4096, help="BPE tokenizer size")
    parser.add_argument("--tokenizer-chars", type=int, default=2_000_000, help="stdlib source the tokenizer learns from")
    parser.add_argument("--records", type=int, default=64, help="records in each of calibration.jsonl and heldout.jsonl")
    parser.add_argument("--answer-chars", type=int, default=48, help="most characters of a -qa record's answer")
    parser.add_argument("--record-chars", type=int, default=12_000,
                        help="characters per record (stdlib code is ~3.7 characters per token; calibrate/eval "
                             "--max-tokens keep the last N tokens)")


def read_config(name_or_path: str, layers: int | None = None) -> dict:
    """A shipped name or a config.json path -> the HF config dict to build from."""
    path = config_path(name_or_path, "config")
    cfg = {k: v for k, v in json.loads(path.read_text()).items() if k not in NOT_HF_KEYS}
    if cfg.get("model_type") not in SUPPORTED:  # only what ModelRuntime loads is worth making
        raise ConfigError(f"{path}: model_type {cfg.get('model_type')!r} is not one of {', '.join(SUPPORTED)}",
                          field="config")
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"--layers must be >= 1, got {layers}", field="layers")
        cfg["num_hidden_layers"] = layers
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = min(int(cfg["max_window_layers"]), layers)
    return cfg


def chunks(text: str, size: int) -> list[str]:
    """Pieces of about `size` characters, cut at line ends so records start at a line."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def as_prompt_answer(record: str, answer_chars: int) -> dict:
    """The record's last non-blank line (its first `answer_chars` characters) is the answer."""
    body = record.rstrip()  # so the last line is not blank
    cut = body.rfind("\n") + 1
    return {"prompt": body[:cut], "answer": body[cut: cut + answer_chars]}


def build_producer(cfg: dict, seed: int):
    import transformers

    arch = SUPPORTED[cfg["model_type"]]
    hf_cfg = transformers.AutoConfig.for_model(**(cfg | {"architectures": [arch]}))
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_cfg).eval()
    std = float(getattr(hf_cfg, "initializer_range", 0.02))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, std)
    return model.to(torch.bfloat16)


@torch.no_grad()
def perturb_(model, scale: float, seed: int) -> None:
    """In place: each tensor += scale x its RMS x N(0, 1), computed in float32 (bf16 noise would round
    away), so every tensor moves by the same relative amount whatever its size."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():  # a tied embedding is one parameter: perturbed once
        w = p.float()
        rms = w.pow(2).mean().sqrt().clamp_min(1e-3)  # zero tensors still move a little
        p.copy_(w + scale * rms * torch.randn(w.shape, generator=gen))


def save(model, tokenizer, directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def make_shaped_pair(args: argparse.Namespace, log=print) -> dict:
    out = Path(args.out)
    cfg = read_config(args.config, args.layers)
    theta = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
    theta_b = float(args.rope_theta_consumer or theta / 100)
    if theta_b == theta:
        raise ConfigError(f"--rope-theta-consumer equals the producer's ({theta:g}); the pair needs another",
                          field="rope_theta_consumer")
    seconds: dict[str, float] = {}
    start = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal start
        seconds[stage] = round(time.perf_counter() - start, 2)
        log(f"{stage}: {seconds[stage]:.1f}s")
        start = time.perf_counter()

    # top-level stdlib modules: a fixed, sorted, dependency-free corpus on every machine with Python
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    tok_texts, used = [], 0
    for text in texts[0::2]:  # even files teach the tokenizer, odd files become the records
        if used >= args.tokenizer_chars:
            break
        tok_texts.append(text[: args.tokenizer_chars - used])
        used += len(tok_texts[-1])
    tokenizer = train_bpe(tok_texts, args.vocab_tokens)
    if len(tokenizer) > int(cfg["vocab_size"]):
        raise ConfigError(f"--vocab-tokens {len(tokenizer)} exceeds the config's vocab_size {cfg['vocab_size']}",
                          field="vocab_tokens")
    records = [c for text in texts[1::2] for c in chunks(text, args.record_chars) if len(c) > args.record_chars // 2]
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("calibration", records[: args.records]), ("heldout", records[args.records: 2 * args.records])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in part))
        (out / f"{name}-qa.jsonl").write_text("".join(json.dumps(as_prompt_answer(r, args.answer_chars)) + "\n"
                                                      for r in part))
    lap("tokenizer + text")

    cfg |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    model = build_producer(cfg, args.seed)
    lap("init producer")
    producer_bytes = save(model, tokenizer, out / "producer")
    lap("save producer")
    perturb_(model, args.perturb, args.seed + 1)
    model.config.rope_parameters = dict(model.config.rope_parameters, rope_theta=theta_b)
    lap("perturb consumer")
    consumer_bytes = save(model, tokenizer, out / "consumer")
    lap("save consumer")

    report = {"note": "random weights: this pair measures cost, never quality",
              "config": args.config, "layers": cfg["num_hidden_layers"], "seed": args.seed,
              "rope_theta": {"producer": theta, "consumer": theta_b}, "perturb": args.perturb,
              "params": sum(p.numel() for p in model.parameters()),
              "weight_bytes": {"producer": producer_bytes, "consumer": consumer_bytes},
              "tokenizer_tokens": len(tokenizer),
              "records": {"calibration": min(args.records, len(records)),
                          "heldout": max(0, min(args.records, len(records) - args.records))},
              "seconds": seconds, "total_seconds": round(sum(seconds.values()), 1)}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def run(args: argparse.Namespace) -> int:
    report = make_shaped_pair(args, log=lambda line: print(line, flush=True))
    mb = report["weight_bytes"]["consumer"] / 1e6
    print(f"wrote {args.out}/producer and {args.out}/consumer ({report['params'] / 1e6:.1f}M params, "
          f"{mb:.0f} MB each, random weights) in {report['total_seconds']:.0f}s")
    return 0
