"""The pair zoo's training: plain next-token language modelling with transformers on the CPU.

Language-model stages read windows of a domain's token stream (documents joined, each opened
by <bos> and closed by <eos>); instruction stages read prompt/answer documents with the loss on
the answer tokens only, as instruction fine-tunes do. A LoRA stage trains a peft adapter on every
linear layer of the blocks and merges it into the weights, which is how most fine-tunes users
bring are made; the adapter itself is saved too.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, PreTrainedModel

from scd_serve.config.zoo import ZooConfig, ZooPairConfig, ZooProducerConfig
from scd_serve.pair.train import lr_at, make_optimizer, optimizer_step

Tensor = torch.Tensor
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_producer(p: ZooProducerConfig, zoo: ZooConfig, tokenizer) -> PreTrainedModel:
    common = dict(vocab_size=len(tokenizer), hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                  num_hidden_layers=p.num_layers, num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
                  max_position_embeddings=zoo.max_position_embeddings, rope_theta=p.rope_theta,
                  tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, initializer_range=0.02)
    if p.family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(rms_norm_eps=1e-6, use_sliding_window=False, **common))
    return LlamaForCausalLM(LlamaConfig(rms_norm_eps=1e-5, **common))


def token_stream(tokenizer, texts: list[str]) -> Tensor:
    """[N] long: every text as <bos> ids <eos> (the tokenizer adds <bos>), one after another."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for start in range(0, len(texts), 256):
        for row in tokenizer(texts[start: start + 256])["input_ids"]:
            ids += row + [eos]
    return torch.tensor(ids, dtype=torch.long)


def lm_batches(stream: Tensor, seq_len: int, batch_tokens: int, steps: int,
               rng: random.Random) -> Iterator[tuple[Tensor, Tensor]]:
    """(input_ids [B, T], loss weights [B, T]) windows of the stream; every position scored."""
    rows = max(1, batch_tokens // seq_len)
    width = min(seq_len, stream.numel())
    for _ in range(steps):
        starts = [rng.randrange(0, stream.numel() - width + 1) for _ in range(rows)]
        ids = torch.stack([stream[s: s + width] for s in starts])
        yield ids, torch.ones_like(ids, dtype=torch.float32)


def instruct_batches(tokenizer, examples: list[tuple[str, str]], seq_len: int, batch_tokens: int, steps: int,
                     rng: random.Random) -> Iterator[tuple[Tensor, Tensor]]:
    """Prompt/answer rows padded to the longest: only the answer's tokens and its <eos> are scored."""
    encoded = []
    for prompt, answer in examples:
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(a) < seq_len:
            keep = seq_len - len(a)
            encoded.append((p[-keep:] if len(p) > keep else p, a))
    rows = max(1, batch_tokens // seq_len)
    for _ in range(steps):
        chosen = [encoded[rng.randrange(len(encoded))] for _ in range(rows)]
        width = max(len(p) + len(a) for p, a in chosen)
        ids = torch.full((rows, width), tokenizer.pad_token_id, dtype=torch.long)
        weights = torch.zeros((rows, width))
        for i, (p, a) in enumerate(chosen):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            weights[i, len(p): len(p) + len(a)] = 1.0
        yield ids, weights


def weighted_loss(model: PreTrainedModel, ids: Tensor, weights: Tensor) -> Tensor:
    """Mean NLL of the weighted positions; position t's weight scores predicting ids[t] from t - 1.
    Right padding needs no mask: every pad comes after the last real token."""
    logits = model(input_ids=ids).logits[:, :-1]  # [B, T-1, vocab]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                            reduction="none")
    w = weights[:, 1:].reshape(-1)
    return (nll * w).sum() / w.sum().clamp_min(1.0)


def train(model: torch.nn.Module, batches: Iterator[tuple[Tensor, Tensor]], steps: int, lr: float, warmup: int,
          name: str, log: Callable[[str], None] = print, log_every: int = 100,
          checkpoint: Path | None = None, checkpoint_seconds: float = 300.0) -> dict:
    """Trains in place; -> {"steps", "seconds", "final_loss"}.

    With `checkpoint`, the weights, the optimizer and the step are saved there every
    `checkpoint_seconds` and a run killed midway resumes from the last one: the batches are
    replayed up to its step (they are cheap), so the result equals an uninterrupted run's.
    The file is removed once training ends."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(model, lr) if len(params) == len(list(model.parameters())) else \
        torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    first, running, spent = 0, None, 0.0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)  # tensors, numbers, lists: no pickled code
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        first, running, spent = state["step"], state["running"], state["seconds"]
        log(f"[{name}] resumed at step {first}/{steps} from {checkpoint}")
    start = last_save = time.time()
    for step, (ids, weights) in enumerate(batches):
        if step < first:
            continue  # replayed only to move the batch RNG to where the checkpoint left it
        loss = weighted_loss(model, ids, weights)
        optimizer_step(opt, params, loss, lr_at(lr, warmup, steps, step))
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        elapsed = spent + time.time() - start
        if log_every and ((step + 1) % log_every == 0 or step + 1 == steps):
            log(f"[{name}] step {step + 1}/{steps} loss {running:.3f} {elapsed:.0f}s")
        if checkpoint is not None and step + 1 < steps and time.time() - last_save >= checkpoint_seconds:
            _save_checkpoint(checkpoint, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                          "torch_rng": torch.get_rng_state(), "step": step + 1,
                                          "running": running, "seconds": elapsed})
            last_save = time.time()
    model.eval()
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return {"steps": steps, "seconds": round(spent + time.time() - start, 1), "final_loss": running}


def _save_checkpoint(path: Path, state: dict) -> None:
    """Written aside and renamed: a kill mid-write leaves the previous checkpoint whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".writing")
    torch.save(state, partial)
    os.replace(partial, path)


def with_lora(model: PreTrainedModel, pair: ZooPairConfig):
    """A peft LoRA model over `model` (its base weights frozen)."""
    from scd_serve.extras import extra

    with extra("zoo", "make-pair-zoo's LoRA pairs"):
        from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=pair.lora_rank, lora_alpha=2 * pair.lora_rank, lora_dropout=0.0,
                        target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, config)
