"""Quick quality probe used while training: greedy answers with plain transformers.

The real evaluation is `scd-serve eval` (scd_serve/quality) on the project's runtime; this
probe only needs transformers, so make-demo-pair can report progress and final numbers
(by prompt-length bucket, to show length generalization) without the runtime.
"""

from __future__ import annotations

import torch

from scd_serve.corpus.qa import STYLES, load_split
from scd_serve.quality.metrics import exact_match, token_f1


@torch.no_grad()
def greedy_answer(model, tokenizer, prompt: str, end_word: str, max_new_tokens: int = 5) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    end_id = tokenizer.convert_tokens_to_ids(end_word)
    out = model(input_ids=ids, use_cache=True)
    past, words = out.past_key_values, []
    for _ in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        if nxt == end_id:
            break
        words.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokenizer.decode(words, skip_special_tokens=True)


def probe(model, tokenizer, split: str = "heldout", n: int = 60, style: str = "expert",
          buckets: tuple[int, ...] = (512, 1024, 4096)) -> dict:
    """F1/EM overall and per prompt-length bucket (upper bounds, in tokens)."""
    model.eval()
    rows = []
    for ex in load_split(split, n):
        pred = greedy_answer(model, tokenizer, ex["prompt"], STYLES[style].end)
        length = len(tokenizer(ex["prompt"])["input_ids"])
        rows.append((length, token_f1(pred, ex["answer"]), exact_match(pred, ex["answer"])))
    result = {"n": len(rows), "f1": sum(r[1] for r in rows) / len(rows), "em": sum(r[2] for r in rows) / len(rows)}
    lo = 0
    for hi in buckets:
        if sel := [r for r in rows if lo <= r[0] < hi]:
            result[f"f1_{lo}-{hi}"] = round(sum(r[1] for r in sel) / len(sel), 3)
        lo = hi
    return result
