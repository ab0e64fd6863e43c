"""`scd-serve eval`: quality of a transfer method against the consumer's own prefill (oracle).

Per held-out QA prompt: F1 / exact match of the consumer's greedy answer, KL(method ||
oracle) and total variation of its next-token distributions teacher-forced over the
reference answer, greedy token agreement with the oracle; perplexity on held-out text
(first half transferred, second half scored); payload bytes per transferred prompt token
next to the raw 16-bit KV bytes. `--table` runs every registered method.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from scd_serve.errors import ConfigError
from scd_serve.pair.data import STYLES, load_split
from scd_serve.quality.metrics import exact_match, kl_and_tv, token_f1
from scd_serve.quality.transfer import ORACLE, greedy_after, teacher_forced, transfer

DEFAULT_PAIR = Path("models/demo-pair")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--producer", default=str(DEFAULT_PAIR / "producer"), help="producer HF directory")
    parser.add_argument("--consumer", default=str(DEFAULT_PAIR / "consumer"), help="consumer HF directory")
    parser.add_argument("--method", default="raw", help="'oracle' or a codec method (scd_serve.codec.METHODS)")
    parser.add_argument("--codebook", default=None, help="codebook directory for methods that need one")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--limit", type=int, default=150, help="held-out QA prompts (max 500)")
    parser.add_argument("--text-limit", type=int, default=30, help="held-out texts for perplexity")
    parser.add_argument("--table", action="store_true", help="run every registered method, print a table")
    parser.add_argument("--split", default="heldout", choices=["heldout", "smoke"],
                        help="QA split ('smoke': short prompts for quick checks)")


def check_pair(spec_a, spec_b) -> None:
    """Same layer count and KV width, or nothing can be transferred: fail before any compute."""
    problems = []
    if spec_a.num_layers != spec_b.num_layers:
        problems.append(f"layers {spec_a.num_layers} vs {spec_b.num_layers}")
    if spec_a.kv_width != spec_b.kv_width:
        problems.append(f"KV width (kv_heads*head_dim) {spec_a.kv_width} vs {spec_b.kv_width}")
    if spec_a.vocab_size != spec_b.vocab_size:
        problems.append(f"vocab size {spec_a.vocab_size} vs {spec_b.vocab_size}")
    if problems:
        raise ConfigError("producer and consumer architectures do not match: " + "; ".join(problems)
                          + ". Pick a consumer of the same architecture as the producer.", field="consumer")


def _end_word(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids(STYLES["expert"].end)


def eval_qa(method: str, codec, rt_a, rt_b, examples: list[dict]) -> dict:
    tok = rt_b.tokenizer
    stop = _end_word(tok)
    sums = dict(f1=0.0, em=0.0, kl=0.0, tv=0.0, agree=0.0)
    positions = agree_n = prompt_tokens = nbytes = 0
    rebuild = oracle_prefill = 0.0
    for ex in examples:
        ids = torch.tensor(tok(ex["prompt"])["input_ids"])
        answer = tok(ex["answer"], add_special_tokens=False)["input_ids"] + [stop]
        forced = torch.cat([ids[-1:], torch.tensor(answer[:-1])])  # last prompt token + answer
        runs = {}
        for name in dict.fromkeys([ORACLE, method]):
            h = transfer(name, codec, rt_a, rt_b, ids[:-1], len(forced) + 8)
            logits = teacher_forced(rt_b, h, forced)  # [len(answer), vocab]
            runs[name] = (logits, greedy_after(rt_b, h, logits[0], len(answer) + 2, stop), h)
        logits, greedy, h = runs[method]
        oracle_logits, oracle_greedy, oracle_h = runs[ORACLE]
        text = tok.decode(greedy, skip_special_tokens=True)
        sums["f1"] += token_f1(text, ex["answer"])
        sums["em"] += exact_match(text, ex["answer"])
        kl, tv = kl_and_tv(logits, oracle_logits)
        sums["kl"] += float(kl.sum())
        sums["tv"] += float(tv.sum())
        positions += kl.numel()
        sums["agree"] += sum(a == b for a, b in zip(greedy, oracle_greedy))
        agree_n += max(len(greedy), len(oracle_greedy), 1)
        prompt_tokens += h.num_cached
        nbytes += h.payload_bytes
        rebuild += h.rebuild_s
        oracle_prefill += oracle_h.rebuild_s
    n = len(examples)
    return {
        "f1": sums["f1"] / n, "em": sums["em"] / n, "kl": sums["kl"] / positions, "tv": sums["tv"] / positions,
        "agreement": sums["agree"] / agree_n, "payload_bytes_per_token": nbytes / prompt_tokens,
        "rebuild_vs_prefill": rebuild / oracle_prefill if method != ORACLE else 1.0,
        "mean_prompt_tokens": (prompt_tokens + n) / n, "num_examples": n,
    }


def eval_ppl(method: str, codec, rt_a, rt_b, texts: list[dict]) -> float:
    """exp(mean NLL) of each text's second half, its first half transferred by `method`."""
    nll, count = 0.0, 0
    for ex in texts:
        ids = torch.tensor(rt_b.tokenizer(ex["text"])["input_ids"])
        half = ids.shape[0] // 2
        h = transfer(method, codec, rt_a, rt_b, ids[:half], ids.shape[0] - half)
        logits = teacher_forced(rt_b, h, ids[half:-1])  # predicts ids[half+1:]
        nll += float(torch.nn.functional.cross_entropy(logits, ids[half + 1 :], reduction="sum"))
        count += ids.shape[0] - half - 1
    return math.exp(nll / count)


def raw_kv_bytes_per_token(spec) -> int:
    return 2 * spec.num_layers * spec.kv_width * 2  # K and V, every layer, 16-bit


def evaluate(rt_a, rt_b, method: str, codebook=None, limit: int = 150, text_limit: int = 30,
             split: str = "heldout") -> dict:
    check_pair(rt_a.spec, rt_b.spec)
    if not 1 <= limit <= 500 or not 1 <= text_limit <= 200:
        raise ConfigError("--limit must be in 1..500 and --text-limit in 1..200", field="limit")
    codec = None
    if method != ORACLE:
        from scd_serve import codec as codecs

        codec = codecs.build(method, producer=rt_a, consumer=rt_b, codebook=codebook)
    start = time.perf_counter()
    row = {"method": method, **eval_qa(method, codec, rt_a, rt_b, load_split(split, limit))}
    row["ppl"] = eval_ppl(method, codec, rt_a, rt_b, load_split(f"{split}-text", text_limit))
    row["raw_kv_bytes_per_token"] = raw_kv_bytes_per_token(rt_b.spec)
    row["ratio_to_raw16"] = row["payload_bytes_per_token"] / row["raw_kv_bytes_per_token"]
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def table_methods(codebook) -> list[tuple[str, str | None]]:
    """(method, reason skipped or None) for the oracle and every registered codec."""
    from scd_serve import codec as codecs

    needs = getattr(codecs, "NEEDS_CODEBOOK", frozenset())
    rows = [(ORACLE, None)] + [(m, "needs --codebook" if m in needs and codebook is None else None)
                               for m in codecs.METHODS]
    if codebook is not None and codecs.Codebook.load(codebook).prior:  # zero-payload ablation
        rows += [(m, None) for m in codecs.ABLATIONS]
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'method':<12}{'bytes/tok':>10}{'vs raw16':>9}{'rebuild':>8}{'F1':>7}{'EM':>7}" \
           f"{'KL':>9}{'TV':>7}{'PPL':>8}{'agree':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['method']:<12}  skipped: {r['skipped']}")
            continue
        lines.append(f"{r['method']:<12}{r['payload_bytes_per_token']:>10.1f}{r['ratio_to_raw16']:>9.3f}"
                     f"{r['rebuild_vs_prefill']:>8.2f}{r['f1']:>7.3f}{r['em']:>7.3f}{r['kl']:>9.4f}"
                     f"{r['tv']:>7.3f}{r['ppl']:>8.2f}{r['agreement']:>7.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from scd_serve.model import ModelRuntime

    torch.set_num_threads(1)  # a shared 2-core box: one thread is faster than two (see config/pair.py)
    rt_a, rt_b = ModelRuntime.load(args.producer), ModelRuntime.load(args.consumer)
    check_pair(rt_a.spec, rt_b.spec)
    methods = table_methods(args.codebook) if args.table else [(args.method, None)]
    rows = []
    for method, skipped in methods:
        row = {"method": method, "skipped": skipped} if skipped else evaluate(
            rt_a, rt_b, method, args.codebook, args.limit, args.text_limit, args.split)
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"producer": args.producer, "consumer": args.consumer, "split": args.split,
           "codebook": args.codebook, "methods": rows}
    if args.table:
        doc["table"] = format_table(rows)
        print(doc["table"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0
