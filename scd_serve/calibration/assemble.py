"""From fitted layers and chosen plans to a Codebook holding only what the plans use."""

from __future__ import annotations

from typing import Any

import torch

from scd_serve.codec.base import OWN_INPUTS
from scd_serve.codec.codebook import Codebook
from scd_serve.calibration.fit import LayerFit
from scd_serve.codec.plan import Plan
from scd_serve.codec.codec_spec import CodecSpec


def build_codebook(fits: list[LayerFit], plans: dict[str, Plan], producer: CodecSpec, consumer: CodecSpec,
                   extra: dict[str, Any] | None = None) -> Codebook:
    """Encoders are stored at the widest rank any plan uses (their columns nest); decoders and
    aligners per rank used; a Reuse stream's refiner where a plan ships it at a nonzero rank (one
    serves every rank); token priors (fp16 heads) for the streams any plan uses, and the prior's
    shared tensors (a feature prior's basis)."""
    tensors: dict[str, torch.Tensor] = {}
    prior: dict[str, Any] | None = None
    for plan in plans.values():
        for i, lp in enumerate(plan.layers):
            for s, r in lp.decoded:
                jc, p = fits[i].codes[s], f"layers.{i}.{s}"
                if r:  # a rank-0 stream has no code: only its mean and prior below
                    width = max(r, tensors[f"{p}.enc"].shape[1] if f"{p}.enc" in tensors else 0)
                    tensors[f"{p}.enc"] = jc.enc[:, :width].float().contiguous()
                    tensors[f"{p}.mu_a"] = jc.mu_a.float()
                if s in fits[i].priors:
                    tables, bias = fits[i].priors[s]
                    tensors[f"{p}.prior"] = tables.to(torch.float16).contiguous()
                    tensors[f"{p}.prior_bias"] = bias.float()
                    if prior is None:  # one prior object serves every layer
                        prior = fits[i].prior.manifest()
                        tensors.update(fits[i].prior.tensors())
                if s in "hr":
                    for name, t in fits[i].aligner(s, r).tensors().items():
                        tensors[f"{p}.g.r{r}.{name}"] = t
                else:
                    tensors[f"{p}.mu_b"] = jc.mu_b.float()
                    if r:
                        tensors[f"{p}.dec.r{r}"] = jc.decoder(r).float().contiguous()
                    if r and s in fits[i].refiners:  # every rank's correction; a rank-0 stream reads none
                        for name, t in fits[i].refiners[s].tensors().items():
                            tensors[f"{p}.ref.{name}"] = t
    manifest = {
        "producer": producer.to_dict(),
        "consumer": consumer.to_dict(),
        "plans": {name: plan.to_json() for name, plan in plans.items()},
        "code_dtypes": {"reuse": "float16", "scd": "float16", "scd-int8": "int8+float16 scales"},
    } | ({"prior": prior} if prior else {}) | (extra or {})
    if fits and fits[0].inputs != OWN_INPUTS:  # absent: each stream's own (every codebook before them)
        manifest["code_inputs"] = dict(fits[0].inputs)
    return Codebook(manifest, tensors)


def size_stats(book: Codebook, consumer: Any) -> dict[str, Any]:
    """The codebook's tensor bytes against the consumer's weight bytes (its safetensors files
    on disk, in the dtype they were saved in): the figure that must stay small (<= 5%)."""
    from pathlib import Path

    tensor_bytes = sum(t.numel() * t.element_size() for t in book.tensors.values())
    root = Path(getattr(consumer, "path", "") or "")
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    weights = sum(f.stat().st_size for f in files)
    out: dict[str, Any] = {"codebook_tensor_bytes": tensor_bytes}
    if weights:
        out |= {"consumer_weight_bytes": weights, "fraction_of_consumer": round(tensor_bytes / weights, 4)}
    prior = book.context_prior()
    if prior is not None:
        out["prior_tensor_bytes"] = sum(t.numel() * t.element_size() for name, t in book.tensors.items()
                                        if name.startswith("prior.") or ".prior" in name)
    return out
