"""Training loop for the pair: plain transformers LlamaForCausalLM with autograd on the CPU.

The loss weighs answer tokens 1 and every other token `lm_weight`: answers carry the
retrieval signal, the rest keeps the model a language model (for perplexity). Documents
grow from short to long over the first part of a stage (a curriculum), because a tiny
model finds the induction-style lookup far sooner in short contexts.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from scd_serve.config.pair import PairConfig, StageConfig
from scd_serve.corpus.qa import STYLES, make_copy_document, make_document
from scd_serve.pair.tokenizer import encode_words


def build_model(cfg: PairConfig, vocab_size: int, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.producer_rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.02,
    )
    return LlamaForCausalLM(config)


def _doc_len(rng: random.Random, stage: StageConfig, progress: float) -> int:
    if stage.long_frac and rng.random() < stage.long_frac and progress >= stage.ramp_frac:
        return rng.randint(stage.max_len, stage.long_len)
    ramp = min(1.0, progress / stage.ramp_frac) if stage.ramp_frac > 0 else 1.0
    hi = int(stage.start_max_len + ramp * (stage.max_len - stage.start_max_len))
    return rng.randint(stage.min_len, hi)


def batches(stage: StageConfig, tokenizer, rng: random.Random) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields (input_ids [B, T], weights [B, T]); weights[t] scores predicting token t."""
    style = STYLES[stage.style]
    pad = tokenizer.pad_token_id
    for step in range(stage.steps):
        progress = step / stage.steps
        docs: list[tuple[list[int], list[float]]] = []
        total = 0
        while total < stage.batch_tokens:
            length = _doc_len(rng, stage, progress)
            if rng.random() < stage.copy_frac:
                doc = make_copy_document(rng, style, length - 1, stage.copy_vocab)
            else:
                num_q = max(2, int(length * stage.question_rate))  # dense retrieval signal
                doc, _ = make_document(rng, style, length - 1, num_q, stage.fact_prob)
            ids = encode_words(tokenizer, doc.words)
            weights = [0.0] + [1.0 if m else stage.lm_weight for m in doc.answer_mask]
            docs.append((ids, weights))
            total += len(ids)
        width = max(len(ids) for ids, _ in docs)
        input_ids = torch.full((len(docs), width), pad, dtype=torch.long)
        weights = torch.zeros((len(docs), width))
        for row, (ids, w) in enumerate(docs):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            weights[row, : len(w)] = torch.tensor(w)
        yield input_ids, weights


def weighted_loss(model: LlamaForCausalLM, input_ids: torch.Tensor,
                  weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """-> (weighted mean NLL, greedy accuracy on the answer tokens)."""
    logits = model(input_ids=input_ids).logits[:, :-1]  # [B, T-1, vocab] predicts tokens 1..T-1
    flat, target = logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
    nll = torch.nn.functional.cross_entropy(flat, target, reduction="none")
    w = weights[:, 1:].reshape(-1)
    answers = w == 1.0
    accuracy = (flat[answers].argmax(-1) == target[answers]).float().mean().item() if answers.any() else 0.0
    return (nll * w).sum() / w.sum().clamp_min(1e-6), accuracy


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms and biases)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98), eps=1e-8)


def lr_at(lr: float, warmup: int, steps: int, step: int) -> float:
    """The learning rate at `step`: linear warmup, then cosine down to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def optimizer_step(opt: torch.optim.Optimizer, params, loss: torch.Tensor, lr: float) -> None:
    """One update at `lr`, gradients clipped to norm 1."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def consumer_start(producer: PreTrainedModel, rope_theta: float | None) -> PreTrainedModel:
    """The producer's weights under the consumer's config (a new rotary base where asked): the
    starting point of the expert's fine-tune."""
    cfg = type(producer.config).from_dict(producer.config.to_dict())
    if rope_theta is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(rope_theta)}
    consumer = type(producer)(cfg)
    consumer.load_state_dict(producer.state_dict())
    return consumer


def save_model(model: PreTrainedModel, tokenizer, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


def train_stage(model: LlamaForCausalLM, stage: StageConfig, tokenizer, seed: int,
                log: Callable[[str], None] = print, log_every: int = 50) -> dict:
    """Runs one stage in place; returns {"steps", "seconds", "final_loss"}."""
    rng = random.Random(f"train:{stage.style}:{seed}")
    torch.manual_seed(seed)
    opt = make_optimizer(model, stage.lr)

    model.train()
    start, running, acc = time.time(), None, None
    for step, (input_ids, weights) in enumerate(batches(stage, tokenizer, rng)):
        loss, accuracy = weighted_loss(model, input_ids, weights)
        optimizer_step(opt, model.parameters(), loss, lr_at(stage.lr, stage.warmup, stage.steps, step))
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        acc = accuracy if acc is None else 0.9 * acc + 0.1 * accuracy
        if log_every and (step + 1) % log_every == 0:
            log(f"[{stage.style}] step {step + 1}/{stage.steps} loss {running:.3f} answer acc {acc:.3f} "
                f"T={input_ids.shape[1]} {time.time() - start:.0f}s")
    model.eval()
    return {"steps": stage.steps, "seconds": round(time.time() - start, 1), "final_loss": running,
            "final_answer_acc": acc}
