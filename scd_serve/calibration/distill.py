"""Distill the consumer-side decoders on the consumer's next-token loss (our addition to SCD).

The closed-form fits make each layer's rebuilt K/V close to the consumer's in L2, layer by
layer. What serving needs is the consumer's next-token distribution close to the oracle's,
and cross-model error is not uniform: a small error in the few directions later layers read
costs more than a large one elsewhere. With the plan fixed, the decoders of Reuse layers and
the aligners of Patch layers are tuned end to end. As in serving, the consumer runs the last
tokens of each calibration prompt itself over the K/V rebuilt for the rest; the loss is
KL(oracle || method) on those tokens. The encoders (the producer's side, the payload) stay as
fitted, so codes and payload do not change. Held-out prompts pick the step to keep, and the
closed form is kept where tuning does not beat it on them. A run (plan.py) tunes the map of
its residual code: the consumer's own layers from the mapped residual are part of the graph.
A Reuse stream's refiner (codec/refiner.py), fitted in L2 over every rank, is tuned too, for the
plan's rank: the codebook keeps it beside the stream's (`ref_r{rank}`), so other plans' ranks
keep the L2 fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from scd_serve.codec.base import wants_residuals
from scd_serve.codec.scd import own_kv
from scd_serve.codec.plan import OWN, REUSE, RUN
from scd_serve.codec.refiner import Refiner
from scd_serve.extras import tqdm
from scd_serve.model import rope
from scd_serve.model.layers import attend, causal_mask, finish_layer, project_kv, project_q, rms_norm

Tensor = torch.Tensor


# the oracle's most likely tokens per fed position that the loss reads: its distribution
# beyond them holds little mass, and a full [m, vocab] row per example would not fit at
# real vocabularies (152k columns)
ORACLE_TOP = 128
# a prompt given without the tokens that follow it is scored on this many of its own last tokens
BARE_TAIL = 16


@dataclass
class DistillExample:
    feed: Tensor  # [m] the prompt's last tokens (and the scored ones), run by the consumer itself
    codes: list[dict[str, Tensor]]  # per layer {"k"|"v"|"h"|"r": code [P, r] fp16, as received}
    priors: list[dict[str, Any]]  # per layer {stream: token prior [P, dB] fp16, or 0.0}
    oracle_logp: Tensor  # [m, ORACLE_TOP] the oracle's largest log-probabilities over feed
    oracle_ids: Tensor  # [m, ORACLE_TOP] their token ids
    own: tuple[Tensor, Tensor] | None = None  # an own layer's K/V (plan.py), computed once
    prefix: int = 0  # P, the prompt tokens rebuilt (a layer that ships no code has no rows to count)
    context: Tensor | None = None  # [P, c] fp16 the prompt's token features the refiners read


def suffix_logits(rt: Any, keys: list[Tensor], values: list[Tensor], feed: Tensor) -> Tensor:
    """The consumer's logits over `feed` [m] when positions 0..P-1 hold the given pre-RoPE K/V
    (per layer [P, kv_heads, head_dim]): serving's handoff, differentiable in keys and values.
    -> [m, vocab] float32."""
    spec, w = rt.spec, rt.weights
    prefix, m = keys[0].shape[0], feed.shape[0]
    pos = torch.arange(prefix + m, device=rt.device)
    cos, sin = rt.rotary.tables(pos)  # [P + m, 1, hd]
    lengths = torch.tensor([prefix + m], device=rt.device)
    masks = {win: causal_mask(pos[None, prefix:], lengths, prefix + m, win)
             for win in {spec.window(i) for i in range(spec.num_layers)}}
    h = w.embed[feed.to(rt.device)]  # [m, hidden]
    for layer, lw in enumerate(w.layers):
        x = rms_norm(h, lw.ln1, spec.rms_norm_eps)
        k_new, v_new = project_kv(lw, spec, x)
        q = rope.apply(project_q(lw, spec, x), cos[prefix:], sin[prefix:])
        k = rope.apply(torch.cat([keys[layer].to(rt.dtype), k_new]), cos, sin)
        v = torch.cat([values[layer].to(rt.dtype), v_new])
        attn = attend(q[None], k[None], v[None], masks[spec.window(layer)])
        h = finish_layer(lw, spec, h, attn[0])
    return rt.logits_of(h)


class Decoders(torch.nn.Module):
    """The trainable consumer side of one plan: Dec_B per Reuse stream, g per Patch layer and
    for a run's residual. Another plan of the codebook that uses the same (layer, stream, rank)
    shares the tuned tensor; a refiner is tuned for the plan's rank alone."""

    def __init__(self, codec: Any, device: torch.device):
        super().__init__()
        self.plan, book = codec.plan, codec.codebook
        self.dec, self.mu = torch.nn.ParameterDict(), {}
        self.aligners, self.refiners = torch.nn.ModuleDict(), torch.nn.ModuleDict()
        for i, lp in enumerate(self.plan.layers):
            for s, r in lp.decoded:
                if s in "kv":
                    if r:  # a rank-0 stream (the prior alone) has nothing to tune
                        dec = book.tensor(f"layers.{i}.{s}.dec.r{r}").to(device, torch.float32, copy=True)
                        self.dec[f"{i}_{s}"] = torch.nn.Parameter(dec)
                    self.mu[f"{i}_{s}"] = book.tensor(f"layers.{i}.{s}.mu_b").to(device, torch.float32)
                else:  # h of a Patch, r of a run's first layer
                    self.aligners[str(i)] = book.aligner(i, s, r).to(device).train()
        for (i, s, _), ref in codec.plan_refiners(device).items():  # a copy: the codec's own serves on, untouched
            self.refiners[f"{i}_{s}"] = Refiner.from_tensors(ref.tensors(), ref.max_rank).to(device).train()

    def rebuild(self, rt: Any, ex: DistillExample) -> tuple[list[Tensor], list[Tensor]]:
        """-> per layer pre-RoPE keys and values [P, kv_heads, head_dim]."""
        spec, keys, values, run = rt.spec, [], [], None
        for i, lp in enumerate(self.plan.layers):
            code = {s: z.float() for s, z in ex.codes[i].items()}
            prior = {s: p if isinstance(p, float) else p.float() for s, p in ex.priors[i].items()}
            if lp.mode == OWN:
                k, v = ex.own  # exact and fixed: nothing to tune
            elif lp.mode == RUN:
                if run is None:  # the run's first layer: the consumer's own forward from the mapped residual
                    run = rt.run_from(i, self.aligners[str(i)](code["r"]) + prior["r"], grad=True)
                _, state = next(run)
                k, v = state.keys, state.values
            elif lp.mode == REUSE:
                k, v = ((code[s] @ self.dec[f"{i}_{s}"] if r else 0.0) + self.mu[f"{i}_{s}"] + prior[s]
                        + (self.refiners[f"{i}_{s}"](code[s], ex.context.float()) if f"{i}_{s}" in self.refiners
                           else 0.0)
                        for s, r in lp.decoded)
                k = k.expand(ex.prefix, -1).reshape(ex.prefix, spec.num_kv_heads, spec.head_dim)
                v = v.expand(ex.prefix, -1).reshape(ex.prefix, spec.num_kv_heads, spec.head_dim)
            else:
                h = self.aligners[str(i)](code["h"]) + prior["h"]  # [P, hidden] H_in,B
                k, v = project_kv(rt.weights.layers[i], spec, h.to(rt.dtype))
            keys.append(k)
            values.append(v)
        return keys, values

    def loss(self, rt: Any, ex: DistillExample) -> Tensor:
        """Mean KL(oracle || method) in nats over the example's fed tokens (top_kl)."""
        logp = torch.log_softmax(suffix_logits(rt, *self.rebuild(rt, ex), ex.feed).float(), -1)
        return top_kl(ex.oracle_logp, ex.oracle_ids, logp).mean()

    def write(self, book: Any) -> None:
        """Store the tuned tensors in the codebook under the plan's names."""
        for i, lp in enumerate(self.plan.layers):
            for s, r in lp.streams:  # shipped streams: a rank-0 one has no decoder
                if s in "kv":
                    book.tensors[f"layers.{i}.{s}.dec.r{r}"] = self.dec[f"{i}_{s}"].detach().cpu().contiguous()
                    if f"{i}_{s}" in self.refiners:
                        for name, t in self.refiners[f"{i}_{s}"].tensors().items():
                            book.tensors[f"layers.{i}.{s}.ref_r{r}.{name}"] = t.cpu()
                else:
                    for name, t in self.aligners[str(i)].tensors().items():
                        book.tensors[f"layers.{i}.{s}.g.r{r}.{name}"] = t.cpu()
        drop_unread_refiners(book)


def drop_unread_refiners(book: Any) -> None:
    """Remove a stream's L2-fit refiner where every plan of the codebook that ships the stream
    reads a tuned one (`ref_r{rank}`) instead: the codebook does not carry it twice."""
    read = {(i, s, r) for name in book.manifest.get("plans", {}) for i, lp in enumerate(book.plan(name).layers)
            if lp.mode == REUSE for s, r in lp.decoded if r}
    for i, s in {(i, s) for i, s, _ in read}:
        if all(f"layers.{i}.{s}.ref_r{r}.up.weight" in book.tensors for j, t, r in read if (j, t) == (i, s)):
            for name in [k for k in book.tensors if k.startswith(f"layers.{i}.{s}.ref.")]:
                del book.tensors[name]


def top_kl(oracle_logp: Tensor, oracle_ids: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) per row of the distributions over the oracle's top tokens plus one bucket for the
    rest of the vocabulary: never negative, never above the full KL, equal to it when the top holds
    the whole vocabulary. (The sum over the top tokens alone rewards moving mass from the rest onto
    them, an overconfident rebuild: it went below zero while the real KL doubled.)
    oracle_logp, oracle_ids: [m, top]; logq: [m, vocab] log-probabilities -> [m]"""
    logq_top = logq.gather(-1, oracle_ids)
    p_top = oracle_logp.exp()
    p_rest = (1 - p_top.sum(-1)).clamp_min(1e-12)
    q_rest = (1 - logq_top.exp().sum(-1)).clamp_min(1e-12)
    return (p_top * (oracle_logp - logq_top)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())


def make_examples(codec: Any, producer: Any, consumer: Any, pairs: list[tuple[Tensor, Tensor]], tail: int,
                  progress: Callable[[], None] | None = None) -> list[DistillExample]:
    """pairs: (prompt ids [T], scored ids [n], possibly empty) -> examples that feed the
    prompt's last min(tail, T // 2) tokens and the scored ones but the last (kl_probe's layout);
    a prompt with nothing scored feeds its last min(BARE_TAIL, T // 2)."""
    out, residuals = [], wants_residuals(codec, len(codec.plan.layers))
    refined = bool(codec.plan_refiners(consumer.device))
    with torch.no_grad():
        for prompt, scored in pairs:
            prompt, scored = torch.as_tensor(prompt).long(), torch.as_tensor(scored).long()
            fed = tail if scored.numel() else BARE_TAIL
            p = prompt.shape[0] - max(1, min(fed, prompt.shape[0] // 2))
            prefix, feed = prompt[:p], torch.cat([prompt, scored])[p:-1] if scored.numel() else prompt[p:]
            codes, priors, rebuild, context = [], [], codec.begin(prefix, consumer), None
            for layer, state in producer.iter_prefill(prefix, compute_logits=False, residuals=residuals):
                code, prior = codec.decoder_inputs(layer, codec.encode_layer(layer, state), rebuild, refine=False)
                codes.append({s: z.half() for s, z in code.items()})
                priors.append({s: x if isinstance(x, float) else x.half() for s, x in prior.items()})
                if context is None and refined and code:  # one context serves every layer's refiners
                    context = rebuild.context(next(iter(code.values()))).half()
            oracle = [s for _, s in consumer.iter_prefill(prefix, compute_logits=False)]
            logits = suffix_logits(consumer, [s.keys for s in oracle], [s.values for s in oracle], feed)
            top = torch.log_softmax(logits.float(), -1).topk(min(ORACLE_TOP, logits.shape[-1]), dim=-1)
            own = own_kv(consumer, 0, prefix) if codec.plan.layers[0].mode == OWN else None
            out.append(DistillExample(feed, codes, priors, top.values, top.indices, own, p, context))
            if progress:
                progress()
    return out


def distill(codec: Any, consumer: Any, examples: list[DistillExample], steps: int, lr: float, batch: int,
            seed: int = 0, progress: Callable[[int, float | None], None] | None = None,
            held_out: list[DistillExample] | None = None) -> dict[str, Any]:
    """Tune `codec`'s plan in its codebook, in place. `held_out` (default: the last sixth of the
    examples, at least one) picks the step kept, the closed form (step 0) included; calibration
    passes prompts of other documents, so the step kept is the one that generalizes, not the one
    that fits the training documents best.
    progress(step, held-out KL or None) after every step. -> held-out KL before and after."""
    if held_out:
        train = examples
    else:
        num_held = max(1, len(examples) // 6)
        train, held_out = examples[:-num_held] or examples, examples[-num_held:]
    decoders = Decoders(codec, consumer.device)
    gen = torch.Generator().manual_seed(seed)

    def held_out_kl() -> float:
        with torch.no_grad():
            return sum(float(decoders.loss(consumer, ex)) for ex in held_out) / len(held_out)

    before = best = held_out_kl()
    best_step, best_state = 0, {k: v.clone() for k, v in decoders.state_dict().items()}
    if not list(decoders.parameters()):  # the plan ships nothing to tune (priors alone, own layers)
        steps = 0
    opt = torch.optim.Adam(decoders.parameters(), lr=lr) if steps else None
    every = max(1, min(25, steps // 8))
    with torch.enable_grad():
        for step in range(1, steps + 1):
            idx = torch.randint(0, len(train), (min(batch, len(train)),), generator=gen)
            opt.zero_grad()
            for j in idx:  # one example's graph at a time (a run's layers hold [P, intermediate] each)
                (decoders.loss(consumer, train[int(j)]) / len(idx)).backward()
            opt.step()
            kl = held_out_kl() if step % every == 0 or step == steps else None
            if kl is not None and kl < best:
                best, best_step, best_state = kl, step, {k: v.clone() for k, v in decoders.state_dict().items()}
            if progress:
                progress(step, kl)
    decoders.load_state_dict(best_state)
    decoders.write(codec.codebook)
    return {"held_out_kl_before": before, "held_out_kl_after": best, "step_kept": best_step,
            "train_examples": len(train), "held_out_examples": len(held_out)}


def distill_plan(book: Any, producer: Any, consumer: Any, cfg: Any, show_progress: bool,
                 pairs: list, held_out_pairs: list | None = None) -> dict[str, Any]:
    """Tune the scd plan's decoders on the consumer's KL, in place (calibrate's step, with progress
    bars); held_out_pairs (prompt, scored) pick the step kept."""
    from scd_serve import codec as registry

    started = time.time()
    codec = registry.build("scd", producer=producer, consumer=consumer, codebook=book)
    with tqdm(total=len(pairs), desc="distill examples", disable=not show_progress) as bar:
        examples = make_examples(codec, producer, consumer, pairs, cfg.probe_tail, bar.update)
        held_out = make_examples(codec, producer, consumer, held_out_pairs, cfg.probe_tail) if held_out_pairs else None
    with tqdm(total=cfg.distill_steps, desc="distill", disable=not show_progress) as bar:
        def progress(step: int, kl: float | None) -> None:
            bar.update()
            if kl is not None:
                bar.set_postfix_str(f"held-out KL {kl:.4f}")

        out = distill(codec, consumer, examples, cfg.distill_steps, cfg.distill_lr, cfg.distill_batch,
                      cfg.seed, progress, held_out)
    return out | {"seconds": round(time.time() - started, 1)}
