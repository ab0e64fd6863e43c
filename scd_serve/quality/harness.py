"""`scd-serve eval`: quality of a transfer method against the consumer's own prefill (oracle).

Built-in data (default): per held-out QA prompt, F1 / exact match of the consumer's greedy
answer, KL(method || oracle), total variation and top-1 agreement of its next-token
distributions teacher-forced over the reference answer, greedy token agreement with the
oracle; perplexity on held-out text (first half transferred, second half scored).
`--data FILE`: your prompts (quality/data.py), scored by quality/scorer.py.
Both: payload bytes per transferred prompt token next to the raw 16-bit KV bytes.
`--table` runs every registered method.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from scd_serve.engine.kv_budget import RAW_DTYPE_BYTES, bytes_per_token
from scd_serve.calibration.memory import check_fits, estimate
from scd_serve.config.decode import PRIOR_TABLE_MODES
from scd_serve.errors import ConfigError
from scd_serve.extras import tqdm
from scd_serve.model.loader import DTYPES
from scd_serve.corpus.qa import STYLES, load_split
from scd_serve.quality.data import FORMATS_HELP, add_truncation_arguments
from scd_serve.quality.metrics import exact_match, kl_and_tv, token_f1
from scd_serve.quality.transfer import MISMATCHED, ORACLE, donor_prefix, greedy_after, teacher_forced, transfer

DEFAULT_PAIR = Path("models/demo-pair")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--producer", default=str(DEFAULT_PAIR / "producer"), help="producer HF directory")
    parser.add_argument("--consumer", default=str(DEFAULT_PAIR / "consumer"), help="consumer HF directory")
    parser.add_argument("--method", default="raw", help="'oracle' or a codec method (scd_serve.codec.METHODS)")
    parser.add_argument("--codebook", default=None, help="codebook directory for methods that need one")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--data", default=None, metavar="FILE",
                        help=f"your prompts instead of the built-in QA: {FORMATS_HELP} (see docs/results.md)")
    add_truncation_arguments(parser, "the greedy-continuation match compares the first N generated tokens with "
                                     "the oracle's; prompts without an answer are scored over the oracle's N tokens")
    parser.add_argument("--limit", type=int, default=None,
                        help="built-in: held-out QA prompts (1..500, default 150); "
                             "--data: the first N records (default all)")
    parser.add_argument("--text-limit", type=int, default=30, help="held-out texts for perplexity (built-in data)")
    parser.add_argument("--table", action="store_true", help="run every registered method, print a table")
    parser.add_argument("--locality", type=int, default=0, metavar="TAPS",
                        help="also print, per layer, how much of the consumer's K/V (held-out R^2) the last TAPS "
                             "prompt tokens explain (quality/locality.py; 0: not)")
    parser.add_argument("--split", default="heldout", choices=["heldout", "smoke"],
                        help="built-in QA split ('smoke': short prompts for quick checks)")
    parser.add_argument("--prior-table", default="auto", choices=PRIOR_TABLE_MODES,
                        help="the codebook's token prior for every vocabulary token, made before scoring as the "
                             "decode worker makes it (scd-serve decode --prior-table, same default): without it a "
                             "prompt's rebuild time also pays for its unseen tokens' rows")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="dtype the models are loaded in")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--max-memory-gb", type=float, default=None,
                        help="memory the models may take; refused before loading when they would not fit "
                             "(default: the RAM available now, or the GPU's free memory)")


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
    sums = dict(f1=0.0, em=0.0, kl=0.0, tv=0.0, agree=0.0, top1=0.0)
    positions = agree_n = prompt_tokens = nbytes = 0
    rebuild = oracle_prefill = 0.0
    all_ids = [torch.tensor(tok(ex["prompt"])["input_ids"]) for ex in examples]
    for i, ex in enumerate(tqdm(examples, desc=f"eval {method}", leave=False)):
        ids = all_ids[i]
        donor = donor_prefix(all_ids, i, ids.numel() - 1) if method == MISMATCHED else None
        answer = tok(ex["answer"], add_special_tokens=False)["input_ids"] + [stop]
        forced = torch.cat([ids[-1:], torch.tensor(answer[:-1])])  # last prompt token + answer
        runs = {}
        for name in dict.fromkeys([ORACLE, method]):
            h = transfer(name, codec, rt_a, rt_b, ids[:-1], len(forced) + 8, donor if name == method else None)
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
        sums["top1"] += float((logits.argmax(-1) == oracle_logits.argmax(-1)).sum())
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
        "agreement": sums["agree"] / agree_n, "top1": sums["top1"] / positions,
        "payload_bytes_per_token": nbytes / prompt_tokens,
        "rebuild_vs_prefill": rebuild / oracle_prefill if method != ORACLE else 1.0,
        "mean_prompt_tokens": (prompt_tokens + n) / n, "num_examples": n,
    }


def eval_ppl(method: str, codec, rt_a, rt_b, texts: list[dict]) -> float:
    """exp(mean NLL) of each text's second half, its first half transferred by `method`."""
    nll, count = 0.0, 0
    all_ids = [torch.tensor(rt_b.tokenizer(ex["text"])["input_ids"]) for ex in texts]
    for i, ids in enumerate(tqdm(all_ids, desc=f"ppl {method}", leave=False)):
        half = ids.shape[0] // 2
        donor = donor_prefix(all_ids, i, half) if method == MISMATCHED else None
        h = transfer(method, codec, rt_a, rt_b, ids[:half], ids.shape[0] - half, donor)
        logits = teacher_forced(rt_b, h, ids[half:-1])  # predicts ids[half+1:]
        nll += float(torch.nn.functional.cross_entropy(logits.float(), ids[half + 1 :], reduction="sum"))
        count += ids.shape[0] - half - 1
    return math.exp(nll / count)


def raw_kv_bytes_per_token(spec) -> int:
    return bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, RAW_DTYPE_BYTES)


def build_codec(method: str, rt_a, rt_b, codebook):
    if method == ORACLE:
        return None
    from scd_serve import codec as codecs

    return codecs.build("scd" if method == MISMATCHED else method, producer=rt_a, consumer=rt_b, codebook=codebook)


def evaluate(rt_a, rt_b, method: str, codebook=None, limit: int = 150, text_limit: int = 30,
             split: str = "heldout") -> dict:
    check_pair(rt_a.spec, rt_b.spec)
    if not 1 <= limit <= 500 or not 1 <= text_limit <= 200:
        raise ConfigError("--limit must be in 1..500 and --text-limit in 1..200", field="limit")
    codec = build_codec(method, rt_a, rt_b, codebook)
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
    if codebook is not None:  # the controls: zero payload, and another prompt's codes
        rows += [(m, None) for m in codecs.ABLATIONS] + [(MISMATCHED, None)]
    return rows


# (key, header, width, format); a column shows when some row has its key (built-in: agree = greedy
# answer tokens equal to the oracle's; --data: match = first --greedy-tokens tokens all equal)
COLUMNS = [("payload_bytes_per_token", "bytes/tok", 10, ".1f"), ("ratio_to_raw16", "vs raw16", 9, ".3f"),
           ("rebuild_vs_prefill", "rebuild", 8, ".2f"), ("f1", "F1", 7, ".3f"), ("em", "EM", 7, ".3f"),
           ("kl", "KL", 9, ".4f"), ("tv", "TV", 7, ".3f"), ("ppl", "PPL", 8, ".2f"), ("agreement", "agree", 7, ".3f"),
           ("top1", "top1", 7, ".3f"), ("match", "match", 7, ".3f")]


def format_table(rows: list[dict]) -> str:
    cols = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    head = f"{'method':<12}" + "".join(f"{h:>{w}}" for _, h, w, _ in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['method']:<12}  skipped: {r['skipped']}")
            continue
        lines.append(f"{r['method']:<12}" + "".join(  # a space before every cell: wide values stay apart
            f"{'-':>{w}}" if r.get(k) is None else f" {r[k]:>{w - 1}{fmt}}" for k, _, w, fmt in cols))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from scd_serve import codec as codecs
    from scd_serve.codec import prior_table
    from scd_serve.model import ModelRuntime

    torch.set_num_threads(1)  # a shared 2-core box: one thread is faster than two (see config/pair.py)
    check_fits(estimate(args.producer, args.consumer, args.dtype), args.device, args.max_memory_gb, "eval")
    records = None
    if args.data is not None:  # a bad file fails here, before any model is loaded
        from scd_serve.quality.data import read_records

        if args.limit is not None and args.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {args.limit}", field="limit")
        records = read_records(args.data)[: args.limit]
    elif args.limit is None:
        args.limit = 150
    dtype = DTYPES[args.dtype]
    rt_a = ModelRuntime.load(args.producer, device=args.device, dtype=dtype)
    rt_b = ModelRuntime.load(args.consumer, device=args.device, dtype=dtype)
    check_pair(rt_a.spec, rt_b.spec)
    # loaded once: the methods share its token prior, so each prompt's token states are computed once
    book = codecs.Codebook.load(args.codebook, rt_a, rt_b) if args.codebook else None
    if book is not None and (said := prior_table.fill_codebook(book, rt_b, args.prior_table)):
        print(said, flush=True)  # rebuild times as a decode worker's, which makes it at its start
    methods = table_methods(book) if args.table else [(args.method, None)]
    if records is not None:
        rows = eval_data(args, records, rt_a, rt_b, methods, book)
    else:
        rows = []
        for method, skipped in methods:
            row = {"method": method, "skipped": skipped} if skipped else evaluate(
                rt_a, rt_b, method, book, args.limit, args.text_limit, args.split)
            rows.append(row)
            print(json.dumps(row), flush=True)
    doc = {"producer": args.producer, "consumer": args.consumer, "data": args.data or args.split,
           "split": args.split, "dtype": args.dtype, "codebook": args.codebook, "methods": rows}
    if args.table:
        doc["table"] = format_table(rows)
        print(doc["table"])
    if args.locality > 0:
        doc["locality"] = print_locality(args, records, rt_b)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def print_locality(args: argparse.Namespace, records: list | None, consumer) -> list[dict[str, float]]:
    """--locality TAPS on the same prompts as the table (a held-out quarter scores the fit)."""
    from scd_serve.quality.locality import format_locality, locality

    if records is not None:
        from scd_serve.quality.data import tokenize

        items = tokenize(records, consumer.tokenizer, args.max_tokens or consumer.spec.max_position_embeddings,
                         str(args.data)).items
        prompts = [torch.cat([p.ids, p.reference]) if p.reference is not None else p.ids for p in items]
    else:
        from scd_serve.quality.calibration_data import load_prompts

        prompts = [p for p, _ in load_prompts(consumer.tokenizer, args.split, args.limit, seed=0)]
    rows = locality(consumer, prompts, taps=args.locality)
    print(format_locality(rows, args.locality), flush=True)
    return rows


def eval_data(args: argparse.Namespace, records: list, rt_a, rt_b, methods: list[tuple[str, str | None]],
              book=None) -> list[dict]:
    """`--data FILE`: every method, prompt by prompt (one oracle run per prompt)."""
    from scd_serve.quality.data import tokenize
    from scd_serve.quality.scorer import Scorer

    if args.greedy_tokens < 1:
        raise ConfigError(f"--greedy-tokens must be >= 1, got {args.greedy_tokens}", field="greedy_tokens")
    context = min(rt_a.spec.max_position_embeddings, rt_b.spec.max_position_embeddings)
    max_tokens = context - args.greedy_tokens if args.max_tokens is None else args.max_tokens
    if max_tokens + args.greedy_tokens > context:
        raise ConfigError(f"--max-tokens {max_tokens} + --greedy-tokens {args.greedy_tokens} exceed the models' "
                          f"context of {context} positions", field="max_tokens")
    prompts = tokenize(records, rt_b.tokenizer, max_tokens, str(args.data))
    print(prompts.summary(), flush=True)
    codecs = {m: build_codec(m, rt_a, rt_b, book) for m, skipped in methods if not skipped}
    done = {r["method"]: r for r in Scorer(rt_a, rt_b, prompts, args.greedy_tokens).evaluate(codecs)}
    rows = []
    for method, skipped in methods:
        row = {"method": method, "skipped": skipped} if skipped else done[method]
        if not skipped:
            row["raw_kv_bytes_per_token"] = raw_kv_bytes_per_token(rt_b.spec)
            row["ratio_to_raw16"] = row["payload_bytes_per_token"] / row["raw_kv_bytes_per_token"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows
