"""`eval --data FILE`: one transfer method on your prompts, against the oracle (the consumer's
own prefill of the same prompt), which runs once per prompt and is reused for every method.

Per prompt, the consumer receives K/V for tokens 0..T-2 (from the method, or its own for the
oracle), runs the last prompt token and then, teacher-forced, the scored tokens: a text's
second half, an answer, or, for a prompt alone, the oracle's own greedy continuation of
`greedy_tokens` tokens. Reported per method, over all scored positions:
  kl, tv   KL(method || oracle) in nats and total variation of the next-token distributions
  top1     how often the method's most likely next token is the oracle's
  ppl      exp(mean NLL) of the given references (texts' second halves and answers) only
  match    share of prompts whose first `greedy_tokens` greedy tokens equal the oracle's
  f1, em   of the greedy answer (as many tokens as the reference answer, fewer at EOS),
           on prompts with an answer
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from scd_serve.extras import tqdm
from scd_serve.quality.data import Prompt, Prompts
from scd_serve.quality.metrics import exact_match, kl_and_tv, token_f1
from scd_serve.quality.transfer import MISMATCHED, ORACLE, Handoff, donor_prefix, teacher_forced, transfer

Tensor = torch.Tensor


@dataclass
class Run:
    """One prompt through one method (the pool is dropped: one prompt's K/V at a time)."""

    logits: Tensor  # [m, vocab] teacher-forced; row i predicts scored[i]
    greedy: list[int]  # greedy continuation of the prompt (up to max(greedy_tokens, answer length))
    payload_bytes: int
    rebuild_s: float  # the method's rebuild; the oracle's own prefill


@dataclass
class OracleRun(Run):
    scored: Tensor = None  # [m] the tokens scored after the prompt


def continue_greedy(rt_b, h: Handoff, first_logits: Tensor, n: int, stop: int) -> list[int]:
    """Up to n greedy tokens after the prompt's last token (already in the pool at num_cached);
    the stop token, when reached, ends the list and is kept in it."""
    out = [int(first_logits.argmax())]
    while len(out) < n and out[-1] != stop:
        pos = h.num_cached + len(out)  # position of out[-1]
        out.append(int(rt_b.decode_step(h.pool, [(h.blocks, pos, out[-1])])[0].argmax()))
    return out


def num_generated(p: Prompt, greedy_tokens: int) -> int:
    return max(greedy_tokens, len(p.reference) if p.answer is not None else 0)


def run_oracle(rt_b, p: Prompt, greedy_tokens: int, stop: int) -> OracleRun:
    n_gen = num_generated(p, greedy_tokens)
    extra = max(n_gen, 0 if p.reference is None else len(p.reference)) + 2
    h = transfer(ORACLE, None, None, rt_b, p.ids[:-1], extra)
    if p.reference is not None:
        scored = p.reference
        logits = teacher_forced(rt_b, h, torch.cat([p.ids[-1:], scored[:-1]]))
        greedy = continue_greedy(rt_b, h, logits[0], n_gen, stop)
    else:  # score the oracle's own continuation (its slots are then written again, teacher-forced)
        greedy = continue_greedy(rt_b, h, teacher_forced(rt_b, h, p.ids[-1:])[0], n_gen, stop)
        scored = torch.tensor(greedy[:greedy_tokens], dtype=torch.long)
        logits = teacher_forced(rt_b, h, torch.cat([p.ids[-1:], scored[:-1]]))
    return OracleRun(logits, greedy, 0, h.rebuild_s, scored)


def run_method(method: str, codec, rt_a, rt_b, p: Prompt, oracle: OracleRun, greedy_tokens: int, stop: int,
               donor: Tensor | None = None) -> Run:
    n_gen = num_generated(p, greedy_tokens)
    h = transfer(method, codec, rt_a, rt_b, p.ids[:-1], max(n_gen, len(oracle.scored)) + 2, donor)
    logits = teacher_forced(rt_b, h, torch.cat([p.ids[-1:], oracle.scored[:-1]]))
    return Run(logits, continue_greedy(rt_b, h, logits[0], n_gen, stop), h.payload_bytes, h.rebuild_s)


def score(run: Run, oracle: OracleRun, p: Prompt, greedy_tokens: int, chunk: int = 256) -> dict[str, float]:
    """Sums for one prompt (divided by their counts in `Tally.row`); rows in chunks, so a long
    text at a large vocabulary holds a few [chunk, vocab] float64 blocks at a time."""
    out = {"kl": 0.0, "tv": 0.0, "top1": 0.0, "positions": int(oracle.scored.numel()),
           "match": float(run.greedy[:greedy_tokens] == oracle.greedy[:greedy_tokens])}
    for i in range(0, oracle.logits.shape[0], chunk):
        lp, lq = run.logits[i: i + chunk], oracle.logits[i: i + chunk]
        kl, tv = kl_and_tv(lp, lq)
        out["kl"] += float(kl.sum())
        out["tv"] += float(tv.sum())
        out["top1"] += float((lp.argmax(-1) == lq.argmax(-1)).sum())
        if p.reference is not None:
            nll = torch.nn.functional.cross_entropy(lp.double(), oracle.scored[i: i + chunk], reduction="sum")
            out["nll"] = out.get("nll", 0.0) + float(nll)
    if p.reference is not None:
        out["nll_tokens"] = int(oracle.scored.numel())
    return out


def answer_text(tokenizer, greedy: list[int], n: int, stop: int) -> str:
    ids = greedy[:n]
    return tokenizer.decode(ids[: ids.index(stop)] if stop in ids else ids, skip_special_tokens=True)


class Tally:
    """One method's sums over the prompts."""

    def __init__(self, method: str):
        self.method, self.sums, self.seconds = method, {}, 0.0

    def add(self, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def row(self, prompts: Prompts, greedy_tokens: int) -> dict:
        s, items = self.sums, prompts.items
        n_ans = sum(p.answer is not None for p in items)
        positions, transferred = s["positions"], sum(int(p.ids.numel()) - 1 for p in items)
        return {
            "method": self.method, "kl": s["kl"] / positions, "tv": s["tv"] / positions,
            "top1": s["top1"] / positions, "match": s["match"] / len(items),
            "ppl": math.exp(s["nll"] / s["nll_tokens"]) if "nll" in s else None,
            "f1": s["f1"] / n_ans if n_ans else None, "em": s["em"] / n_ans if n_ans else None,
            "payload_bytes_per_token": s["bytes"] / transferred,
            "rebuild_vs_prefill": s["rebuild"] / s["prefill"] if self.method != ORACLE else 1.0,
            "num_examples": len(items), "num_answers": n_ans, "num_truncated": prompts.num_truncated,
            "scored_positions": int(positions), "greedy_tokens": greedy_tokens,
            "mean_prompt_tokens": sum(int(p.ids.numel()) for p in items) / len(items),
            "seconds": round(self.seconds, 1),
        }


class Scorer:
    """Every method on every prompt, prompt by prompt: the oracle runs once per prompt, and
    only one prompt's K/V and logits are held at a time."""

    def __init__(self, rt_a, rt_b, prompts: Prompts, greedy_tokens: int = 16, show_progress: bool = True):
        self.rt_a, self.rt_b, self.prompts = rt_a, rt_b, prompts
        self.greedy_tokens, self.show_progress = greedy_tokens, show_progress
        eos = getattr(rt_b.tokenizer, "eos_token_id", None)
        self.stop = -1 if eos is None else int(eos)

    def evaluate(self, codecs: dict[str, object]) -> list[dict]:
        """codecs: method -> codec (None for the oracle). -> one row per method, in order."""
        tallies = {m: Tally(m) for m in codecs}
        items = self.prompts.items
        bar = tqdm(items, desc=f"eval {len(codecs)} method(s)", disable=not self.show_progress)
        for i, p in enumerate(bar):
            start = time.perf_counter()
            oracle = run_oracle(self.rt_b, p, self.greedy_tokens, self.stop)
            oracle_s = time.perf_counter() - start
            for method, codec in codecs.items():
                start = time.perf_counter()
                donor = donor_prefix([q.ids for q in items], i, p.ids.numel() - 1) if method == MISMATCHED else None
                run = oracle if method == ORACLE else run_method(method, codec, self.rt_a, self.rt_b, p, oracle,
                                                                 self.greedy_tokens, self.stop, donor)
                values = score(run, oracle, p, self.greedy_tokens)
                values |= {"bytes": run.payload_bytes, "rebuild": run.rebuild_s, "prefill": oracle.rebuild_s}
                if p.answer is not None:
                    text = answer_text(self.rt_b.tokenizer, run.greedy, len(p.reference), self.stop)
                    values |= {"f1": token_f1(text, p.answer), "em": exact_match(text, p.answer)}
                tallies[method].add(values)
                tallies[method].seconds += time.perf_counter() - start + (oracle_s if method == ORACLE else 0.0)
        return [t.row(self.prompts, self.greedy_tokens) for t in tallies.values()]
