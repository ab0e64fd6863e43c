"""Rebuild functions used while calibrating: how each option turns the producer's prefix states
into consumer K/V for one layer, computed from the fits directly (the codec does the same
from the codebook; calibration finally re-measures through the real codecs)."""

from __future__ import annotations

from typing import Any

import torch

from scd_serve.codec.base import STREAM_STATES, positions_for
from scd_serve.calibration.fit import LayerFit, code_rows
from scd_serve.codec.plan import OWN, PATCH, REUSE, LayerPlan
from scd_serve.calibration.kl_probe import Example, LayerKV
from scd_serve.codec.codec_spec import CodecSpec, rotate_with, spec_of

Tensor = torch.Tensor


class Candidates:
    def __init__(self, fits: list[LayerFit], producer: Any, consumer: Any):
        self.fits, self.producer, self.consumer = fits, producer, consumer
        self.pspec: CodecSpec = spec_of(producer)
        self.cspec: CodecSpec = spec_of(consumer)
        self._decoders: dict[tuple[int, str, int], Tensor] = {}
        # id(prefix tokens) -> (those tokens, their prior's context): the tokens are held, so that
        # another probe's example (a replayed tail's: calibration builds several) never takes the id
        self._ctx: dict[int, tuple[Tensor, Tensor]] = {}
        self._run: tuple[int, dict[int, tuple[Tensor, Tensor]]] | None = None  # (id(example), layer -> K/V)

    def _shape(self, x: Tensor) -> Tensor:
        return x.reshape(x.shape[0], self.cspec.num_kv_heads, self.cspec.head_dim)

    def decoder(self, layer: int, s: str, rank: int) -> Tensor:
        key = (layer, s, rank)
        if key not in self._decoders:
            self._decoders[key] = self.fits[layer].codes[s].decoder(rank).float()
        return self._decoders[key]

    def context(self, ex: Example, layer: int) -> Tensor:
        """The prior's context of this example's prefix (features F [P, rank] for a feature prior)."""
        held = self._ctx.get(id(ex.tokens))
        if held is None or held[0] is not ex.tokens:
            prior = self.fits[layer].prior
            held = self._ctx[id(ex.tokens)] = (ex.tokens, prior.context(ex.tokens.cpu(), self.consumer, device="cpu"))
        return held[1]

    def prior(self, ex: Example, layer: int, s: str) -> Tensor | float:
        """The token prior of stream s on this example's prefix: [P, dB], or 0 without one."""
        if s not in self.fits[layer].priors:
            return 0.0
        head, bias = self.fits[layer].priors[s]
        return self.fits[layer].prior.apply(head, bias, self.context(ex, layer)).float()

    def reuse_stream(self, ex: Example, layer: int, s: str, rank: int) -> Tensor:
        """Consumer-side pre-RoPE keys (s='k') or values (s='v') rebuilt from a rank-r code (rank 0:
        the mean and token prior alone), and the stream's refiner where it has one."""
        fit = self.fits[layer]
        jc = fit.codes[s]
        a = getattr(ex.producer[layer], STREAM_STATES[fit.inputs[s]])
        b = jc.mu_b.float() + self.prior(ex, layer, s)
        if rank:  # (rank 0 ships nothing: the mean and the linear prior alone, no refiner)
            z = code_rows(jc, a.reshape(a.shape[0], -1).double(), rank)  # [P, r] fp16-rounded
            b = b + z @ self.decoder(layer, s, rank)
            if s in fit.refiners:
                with torch.no_grad():
                    b = b + fit.refiners[s](z, self.context(ex, layer))
        return self._shape(b.expand(a.shape[0], -1)).to(a.device)

    def patch(self, ex: Example, layer: int, rank: int) -> tuple[Tensor, Tensor]:
        jc, g = self.fits[layer].codes["h"], self.fits[layer].aligners[rank]
        z = code_rows(jc, ex.producer[layer].attn_input.double(), rank)
        with torch.no_grad():
            h = g(z) + self.prior(ex, layer, "h")  # [P, hidden] consumer H_in estimate
            return self.consumer.recompute_kv(layer, h.to(_dtype(self.consumer)))  # moved by the runtime

    def run(self, ex: Example, layer: int, start: bool) -> tuple[Tensor, Tensor]:
        """A run's layer: its first (start) maps the residual and runs the consumer's layers from
        there (all of them, kept for this example); the layers above read what it computed."""
        if start:
            jc = self.fits[layer].codes["r"]
            z = code_rows(jc, ex.producer[layer].residual.double(), jc.max_rank)
            with torch.no_grad():
                h = self.fits[layer].run_aligner(z)  # [P, hidden] the consumer's residual estimate
            self._run = id(ex), {i: (s.keys, s.values) for i, s in self.consumer.run_from(layer, h)}
        assert self._run is not None and self._run[0] == id(ex), "the probe measures a run's layers in order"
        return self._run[1][layer]

    # ---- LayerKV factories for the probe ------------------------------------------------
    def layer_kv(self, lp: LayerPlan) -> LayerKV:
        if lp.mode == OWN:
            from scd_serve.codec.scd import own_kv

            return lambda ex, layer: own_kv(self.consumer, layer, ex.tokens)
        if lp.mode == REUSE:
            return lambda ex, layer: (self.reuse_stream(ex, layer, "k", lp.r_k),
                                      self.reuse_stream(ex, layer, "v", lp.r_v))
        if lp.mode == PATCH:
            return lambda ex, layer: self.patch(ex, layer, lp.r_h)
        return lambda ex, layer: self.run(ex, layer, start=lp.r_h > 0)

    def stream_kv(self, s: str, rank: int) -> LayerKV:
        if s == "k":
            return lambda ex, layer: (self.reuse_stream(ex, layer, "k", rank), ex.consumer[layer].values)
        if s == "v":
            return lambda ex, layer: (ex.consumer[layer].keys, self.reuse_stream(ex, layer, "v", rank))
        return lambda ex, layer: self.patch(ex, layer, rank)

    def prior_only(self, ex: Example, layer: int) -> tuple[Tensor, Tensor]:
        """K/V from the consumer's token priors and means alone (no code: zero payload)."""
        return self.reuse_stream(ex, layer, "k", 0), self.reuse_stream(ex, layer, "v", 0)

    def raw(self, ex: Example, layer: int) -> tuple[Tensor, Tensor]:
        """The producer's post-RoPE keys and values in fp16, as the consumer stores them."""
        s = ex.producer[layer]
        pos = positions_for(s.keys.shape[0]).to(s.keys.device)
        k_post = rotate_with(self.producer, self.pspec, s.keys.float(), pos).half().float()
        k_pre = rotate_with(self.consumer, self.cspec, k_post, pos, inverse=True)
        return k_pre, s.values.half().float()

    def droidspeak(self, ex: Example, layer: int) -> tuple[Tensor, Tensor]:
        h = ex.producer[layer].attn_input.half().to(_dtype(self.consumer))
        return self.consumer.recompute_kv(layer, h)


def _dtype(consumer: Any) -> torch.dtype:
    dtype = getattr(consumer, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
