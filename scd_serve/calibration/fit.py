"""Paired calibration rows from both models and the per-layer Reuse/Patch fits.

Rows are token positions of the calibration prompts, the same positions for the producer
(A) and the consumer (B): pre-RoPE keys, values and normalized attention inputs, and at the
layers a run may start from, the residual stream entering the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from scd_serve.calibration.attention import received_attention
from scd_serve.codec.base import OWN_INPUTS, STREAM_STATES
from scd_serve.codec.codec_spec import spec_of
from scd_serve.codec.lowrank import Aligner, JointCode, ProducerRows, fit_aligner, fit_code, producer_rows
from scd_serve.codec.refiner import Refiner, fit_refiner

Tensor = torch.Tensor
STREAMS = ("k", "v", "h")  # fitted at every layer; "r" at the layers a run may start from
# Rows are kept in bfloat16: they are held through the token prior's solve, calibration's memory
# peak (at the Qwen2.5-0.5B shape ~2.5 GB of float32 rows, half of it the residuals of the 12
# layers a run may start from), and the fits read them in float64. Rounding a row to bfloat16
# moves it by ~0.2%, far below what one model's rows leave unexplained of the other's.
ROW_DTYPE = torch.bfloat16


@dataclass
class LayerFit:
    codes: dict[str, JointCode]  # stream -> joint code (k, v: pre-RoPE K and V; h: H_in; r: residual)
    aligners: dict[int, Aligner] = field(default_factory=dict)  # r_h -> g
    aligner_err: dict[int, float] = field(default_factory=dict)  # r_h -> relative L2 error
    run_aligner: Aligner | None = None  # the residual's map, at its code's full rank
    # stream -> token prior (head [rows, dB], bias [dB]) of `prior`; codes carry B - prior
    priors: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    prior: Any = None  # DensePrior (codec/prior.py) or FeaturePrior (codec/features.py)
    inputs: dict[str, str] = field(default_factory=lambda: dict(OWN_INPUTS))  # stream -> its code's A stream
    refiners: dict[str, Refiner] = field(default_factory=dict)  # k, v -> its Reuse decode's correction
    refiner_err: dict[str, dict[int, float]] = field(default_factory=dict)  # held-out error left, per rank

    def aligner(self, s: str, rank: int) -> Aligner:
        return self.aligners[rank] if s == "h" else self.run_aligner


def collect_rows(producer: Any, consumer: Any, prompts: Iterable[Tensor], max_rows: int,
                 seed: int = 0, progress: Callable[[], None] | None = None,
                 prior: Any = None, run_layers: Iterable[int] = (),
                 inputs: dict[str, str] = OWN_INPUTS) -> list[dict[str, Any]]:
    """-> per layer {stream: (A rows [N, dA], B rows [N, dB]), "w": [N]}, at most max_rows rows,
    ROW_DTYPE; stream r (the residuals) only at run_layers. A: the producer's state of stream
    inputs[s] (streams with the same input share one tensor). w: each row's weight in the fits,
    the attention the consumer's queries give it at that layer (calibration/attention.py).

    With `prior` (a PriorFit or FeatureFit), every position (not only the sampled rows) is
    counted into its normal equations for targets (layer, stream), and each layer's dict also
    holds "ctx": the sampled rows' contexts (token ids [N, taps] or features [N, m], ROW_DTYPE)."""
    prompts = [torch.as_tensor(p).long() for p in prompts]
    run_layers = set(run_layers)
    per_prompt = max(1, max_rows // max(len(prompts), 1))
    gen = torch.Generator().manual_seed(seed)
    parts: list[tuple[dict[str, list], dict[str, list]]] = []  # per layer: (A by input stream, B by stream)
    weights: list[list[Tensor]] = []  # per layer
    ctx_parts: list[Tensor] = []
    for ids in prompts:
        t = ids.shape[0]
        idx = torch.randperm(t, generator=gen)[: min(per_prompt, t)].sort().values
        if prior is not None:
            ctx = prior.add_tokens(ids, consumer)
            ctx_parts.append(ctx[idx].to(ROW_DTYPE) if ctx.is_floating_point() else ctx[idx])  # token ids stay long
        states = zip(producer.iter_prefill(ids, compute_logits=False, residuals=bool(run_layers)),
                     consumer.iter_prefill(ids, compute_logits=False, residuals=bool(run_layers)))
        for (layer, sa), (_, sb) in states:
            streams = STREAMS + ("r",) * (layer in run_layers)
            if len(parts) <= layer:
                parts.append(({inputs[s]: [] for s in streams}, {s: [] for s in streams}))
                weights.append([])
            a_rows, b_rows = parts[layer]
            weights[layer].append(received_attention(consumer, layer, sb.keys, sb.attn_input, gen)[idx])
            for s in a_rows:
                a = getattr(sa, STREAM_STATES[s])
                a_rows[s].append(a.reshape(t, -1)[idx.to(a.device)].to("cpu", ROW_DTYPE))
            for s in streams:
                b = getattr(sb, STREAM_STATES[s])
                b_rows[s].append(b.reshape(t, -1)[idx.to(b.device)].to("cpu", ROW_DTYPE))
                if prior is not None and s != "r":
                    prior.add_target((layer, s), ctx, b.reshape(t, -1))
        if progress:
            progress()
    rows = []
    for (a_rows, b_rows), w in zip(parts, weights):
        a = {s: torch.cat(v) for s, v in a_rows.items()}
        rows.append({s: (a[inputs[s]], torch.cat(v)) for s, v in b_rows.items()} | {"w": torch.cat(w)})
    if prior is not None:
        ctx_rows = torch.cat(ctx_parts)
        for layer in rows:
            layer["ctx"] = ctx_rows
    return rows


def subtract_priors(rows: dict[str, Any], prior: Any, priors: dict[str, tuple[Tensor, Tensor]]) -> dict[str, Any]:
    """One layer's rows with each consumer block B replaced by B - prior (what codes carry);
    rows["ctx"] is already reduced by the prior (prior.reduce)."""
    out = dict(rows)
    for s, (head, bias) in priors.items():
        a, b = rows[s]
        out[s] = (a, b.float() - prior.apply(head, bias, rows["ctx"]).float())
    return out


def code_rows(jc: JointCode, a: Tensor, rank: int) -> Tensor:
    """The producer's code of rows a [N, dA] at `rank`, rounded to fp16 as it ships. -> [N, rank]."""
    a = a.to("cpu", jc.enc.dtype)  # the fits live on the CPU in float64
    z = (a - jc.mu_a) @ jc.enc[:, :rank]
    return z.to(torch.float16).float()


def fit_layer(rows: dict[str, tuple[Tensor, Tensor]], kv_rank: int, h_ranks: Iterable[int],
              aligner_width: int, inputs: dict[str, str] = OWN_INPUTS) -> LayerFit:
    """Codes for k, v (up to kv_rank) and h, and linear aligners for every r_h; where the rows
    hold residuals (r), their full-rank code and linear map. inputs: what collect_rows read as A."""
    h_ranks = sorted(set(h_ranks))
    prepared: dict[int, ProducerRows] = {}  # id(A) -> its centred rows and ridge system: once per input
    codes = {}
    for s in (s for s in STREAMS + ("r",) if s in rows):
        a, b = rows[s]
        if id(a) not in prepared:
            prepared[id(a)] = producer_rows(a, weights=rows.get("w"))
        codes[s] = fit_code(prepared[id(a)], b, max_rank=kv_rank if s in "kv" else max(h_ranks), regression=s in "kv")
    del prepared
    fit = LayerFit(codes, inputs=dict(inputs))
    for r in h_ranks:
        train_aligner(fit, rows["h"], r, aligner_width, steps=0)
    if "r" in rows:
        fit.run_aligner, _ = fit_aligner(code_rows(codes["r"], rows["r"][0], max(h_ranks)), rows["r"][1],
                                         aligner_width, steps=0)
    return fit


def train_aligner(fit: LayerFit, h_rows: tuple[Tensor, Tensor], rank: int, width: int, steps: int) -> None:
    """(Re)fit g for rank r_h: steps=0 gives the closed-form linear map only."""
    a, b = h_rows
    z = code_rows(fit.codes["h"], a, rank)
    g, err = fit_aligner(z, b, width, steps=steps)
    fit.aligners[rank], fit.aligner_err[rank] = g, err


REFINER_SHARE = 0.1  # of the consumer's own per-token layer work that all refiners together may take


def refiner_width(consumer: Any, num_streams: int, ctx: int, cap: int) -> int:
    """Each refiner's hidden width: at most `cap`, and small enough that the refiners of
    num_streams streams (a code of half the stream's width and ctx features in, the stream out)
    cost at most REFINER_SHARE of the consumer's per-token layer multiply-adds. At width 256 they
    added ~0.4 of the prefill to a hidden-128 consumer's rebuild (8 layers; 0.2-0.6 against 0.1-0.2
    without them, bench.rebuild_timing); at the Qwen2.5-0.5B shape the share allows far more than the cap."""
    spec = getattr(consumer, "spec", None)
    c = spec_of(consumer)
    hidden, kv = c.hidden_size, c.kv_width
    layer_macs = c.num_layers * (2 * hidden * hidden + 2 * hidden * kv
                                 + 3 * hidden * getattr(spec, "intermediate_size", 4 * hidden))
    per_width = max(1, num_streams) * (kv // 2 + ctx + kv)
    return max(16, min(cap, int(REFINER_SHARE * layer_macs / per_width)))


def train_refiners(fit: LayerFit, rows: dict[str, Any], ranks: Iterable[int], width: int, epochs: int) -> None:
    """Refiners for the layer's k and v (codec/refiner.py), from rows whose consumer blocks are
    already less the token prior and whose "ctx" is the prior's reduced features."""
    for s in "kv":
        jc, (a, b) = fit.codes[s], rows[s]
        usable = sorted({r for r in ranks if 0 < r <= jc.max_rank})  # rank 0 ships nothing: no refiner
        if not usable:
            continue
        z = code_rows(jc, a, usable[-1])  # [N, R] as it ships
        decoders = {r: jc.decoder(r).float() for r in usable}
        mu = jc.mu_b.float()

        def left(idx: Tensor, r: int) -> Tensor:  # what the linear decode at rank r leaves of rows idx
            return b[idx] - mu - z[idx, :r] @ decoders[r]

        fit.refiners[s], fit.refiner_err[s] = fit_refiner(z, rows["ctx"], left, usable, width, epochs,
                                                          weights=rows.get("w"))
