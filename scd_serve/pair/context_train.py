"""Training loop of the context pair: transformers Qwen2ForCausalLM, autograd on the CPU.

Each batch is documents of one target length (little padding): a stdlib excerpt with chains
inserted and every chain's last name asked at the end (context_task.py). Answer digits weigh
1; a random `lm_frac` of the other tokens weigh `lm_weight` (plain language modelling, for
perplexity). Only scored positions go through the 8k-wide output head, which would otherwise
cost as much as the whole body. Lengths and chain depths grow over the first `ramp_frac` of
the steps (a curriculum); "# value" comments on a share of the chains early on show the model
each line's value at the line where it has to be computed, then fade out.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Iterator

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from scd_serve.config.pair import ContextPairConfig, ContextStageConfig
from scd_serve.pair.context_corpus import SourceFile
from scd_serve.pair.context_task import STYLES, answer_token_mask, block_document, build_doc, sample_doc
from scd_serve.pair.train import lr_at, make_optimizer, optimizer_step

Tensor = torch.Tensor


def build_model(cfg: ContextPairConfig, tokenizer) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.producer_rope_theta,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02,
    )
    return Qwen2ForCausalLM(config)


def _schedule(rng: random.Random, stage: ContextStageConfig, progress: float) -> tuple[int, int, float]:
    """-> (target length, max chain depth, comment probability) at this point of the stage."""
    ramp = min(1.0, progress / stage.ramp_frac) if stage.ramp_frac > 0 else 1.0
    if stage.long_frac and progress >= stage.ramp_frac and rng.random() < stage.long_frac:
        length = rng.randint(stage.max_len, stage.long_len)
    else:
        length = rng.randint(stage.min_len, int(stage.start_max_len + ramp * (stage.max_len - stage.start_max_len)))
    depth = round(stage.start_max_depth + ramp * (stage.max_depth - stage.start_max_depth))
    comments = stage.comment_prob * max(0.0, 1.0 - progress / stage.comment_until) if stage.comment_until else 0.0
    return length, depth, comments


def batches(stage: ContextStageConfig, tokenizer, files: tuple[SourceFile, ...], pool: list[str],
            rng: random.Random) -> Iterator[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Yields (input_ids [B, T], labels [B, T], weights [B, T], depth [B, T]); weights[t] scores
    predicting labels[t] (the token at t, or a value target) from position t - 1; depth[t] is the
    asked chain's depth on answer tokens, VALUE_DEPTH on value targets and -1 elsewhere."""
    style = STYLES[stage.style]
    pad = tokenizer.pad_token_id
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    for step in range(stage.steps):
        length, max_depth, comments = _schedule(rng, stage, step / stage.steps)
        rows = []
        for _ in range(max(1, stage.batch_tokens // length)):
            if rng.random() < stage.copy_frac:
                rows.append(copy_document(rng, tokenizer.bos_token_id, length, stage.copy_vocab))
                continue
            if rng.random() < stage.block_frac:
                doc = block_document(rng, files if rng.random() < stage.code_frac else None, pool, style, length,
                                     max_depth, comments)
            elif rng.random() < stage.recall_frac:
                doc = recall_document(rng, pool, style, length, max_depth)
            else:
                depths = [rng.randint(0, max_depth) for _ in range(rng.randint(*stage.chains))]
                asked = rng.sample(range(len(depths)), len(depths))
                doc = sample_doc(rng, files, pool, style, length, depths, asked, comments, stage.one_name)
            ids, mask, values = answer_token_mask(tokenizer, doc)
            weights = [1.0 if m else (stage.lm_weight if rng.random() < stage.lm_frac else 0.0) for m in mask]
            weights[0] = 0.0  # <bos> is given, never predicted
            depth, q = [-1] * len(ids), -1
            for t, m in enumerate(mask):
                if m:
                    q += 1 if t == 0 or not mask[t - 1] else 0
                    depth[t] = doc.asked[q][2]
            labels = list(ids)
            if stage.value_weight:  # the line's last name predicts its new value's ones digit
                for t, value in values.items():
                    if t + 1 < len(ids):
                        labels[t + 1], weights[t + 1], depth[t + 1] = digits[value % 10], stage.value_weight, VALUE_DEPTH
            rows.append((ids, labels, weights, depth))
        width = max(len(r[0]) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), pad, dtype=torch.long)
        weights = torch.zeros((len(rows), width))
        depth = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, (ids, lab, w, d) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            weights[i, : len(w)] = torch.tensor(w)
            depth[i, : len(d)] = torch.tensor(d)
        yield input_ids, labels, weights, depth


COPY_DEPTH = 7  # the "depth" copy-practice tokens are logged under
VALUE_DEPTH = 6  # ... and value targets
COPY_HALF = 32  # longest copied run: induction formed at this length, and longer runs broke it (run 6)


def copy_document(rng: random.Random, bos: int, length: int,
                  vocab: int) -> tuple[list[int], list[int], list[float], list[int]]:
    """Random tokens (at most COPY_HALF), then the same tokens again; the repeat is scored (all but its
    first token).
    A tiny model forms induction heads on this within ~100 steps (a span repeated once inside
    random text, scored sparsely, had not formed them after 700), and the task's lookups reuse them."""
    half = [rng.randrange(4, 4 + vocab) for _ in range(max(2, min(COPY_HALF, (length - 1) // 2)))]
    ids = [bos] + half + half
    scored = [False] * (len(half) + 2) + [True] * (len(half) - 1)
    return ids, ids, [1.0 if m else 0.0 for m in scored], [COPY_DEPTH if m else -1 for m in scored]


RECALL_TOKENS_PER_CHAIN = 16  # about: a statement, its filler line and its question


def recall_document(rng: random.Random, pool: list[str], style, length: int, max_depth: int):
    """The task without the code: chains between filler lines, every chain asked. Six times
    the answers per token of a real excerpt, so a small model learns where a name's value sits
    relative to the name (the question's tokens before the value differ from the statement's)."""
    num = max(1, length // (RECALL_TOKENS_PER_CHAIN * (1 + max_depth)))
    depths = [rng.randint(0, max_depth) for _ in range(num)]
    filler = ["    pass"] * (sum(d + 1 for d in depths) + 1)
    doc = build_doc(rng, filler, pool, style, depths, rng.sample(range(num), num))
    assert doc is not None  # every filler line is an insertion point; the pool has thousands of names
    return doc


def sparse_loss(model: Qwen2ForCausalLM, input_ids: Tensor, labels: Tensor, weights: Tensor,
                depth: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """-> (weighted mean NLL, answer tokens right [n], their depths [n]); the head runs on scored
    positions only. Right padding needs no mask: pads come after every real token."""
    hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]  # [B, T-1, H] predicts 1..T-1
    w = weights[:, 1:]
    scored = w > 0
    logits = model.lm_head(hidden[scored])  # [n_scored, vocab]
    target = labels[:, 1:][scored]
    nll = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    loss = (nll * w[scored]).sum() / w[scored].sum().clamp_min(1e-6)
    answers = depth[:, 1:][scored] >= 0
    right = logits[answers].argmax(-1) == target[answers]
    return loss, right, depth[:, 1:][scored][answers]


def train_stage(model: Qwen2ForCausalLM, stage: ContextStageConfig, tokenizer, files: tuple[SourceFile, ...],
                pool: list[str], seed: int, log: Callable[[str], None] = print, log_every: int = 50) -> dict:
    """Runs one stage in place; returns {"steps", "seconds", "final_loss", "answer_acc_by_depth"}."""
    rng = random.Random(f"context-train:{stage.style}:{seed}")
    torch.manual_seed(seed)
    opt = make_optimizer(model, stage.lr)

    model.train()
    start, running = time.time(), None
    hits, counts = [0] * 8, [0] * 8  # answer tokens right / seen per depth, since the last log line
    acc_by_depth: dict[int, float] = {}
    for step, (input_ids, labels, weights, depth) in enumerate(batches(stage, tokenizer, files, pool, rng)):
        loss, right, depths = sparse_loss(model, input_ids, labels, weights, depth)
        optimizer_step(opt, model.parameters(), loss, lr_at(stage.lr, stage.warmup, stage.steps, step))
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        for d, r in zip(depths.tolist(), right.tolist()):
            hits[d] += r
            counts[d] += 1
        if log_every and ((step + 1) % log_every == 0 or step + 1 == stage.steps):
            acc_by_depth = {d: round(hits[d] / counts[d], 3) for d in range(8) if counts[d]}
            log(f"[{stage.style}] step {step + 1}/{stage.steps} loss {running:.3f} answer-token acc by depth "
                f"{acc_by_depth} T={input_ids.shape[1]} {time.time() - start:.0f}s")
            hits, counts = [0] * 8, [0] * 8
    model.eval()
    return {"steps": stage.steps, "seconds": round(time.time() - start, 1), "final_loss": running,
            "answer_acc_by_depth": acc_by_depth}
