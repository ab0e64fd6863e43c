"""The `auto` method's wiring: live state -> the chooser, its choice -> the request, outcomes -> back.

The chooser (chooser.py) sees only what this adapter hands it: each usable prefill worker's
methods with their calibrated KL, its load, and our transfers in flight to it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from scd_serve.codec.figures import QualityFigures
from scd_serve.config.decode import DecodeConfig
from scd_serve.config.methods import LOCAL
from scd_serve.engine.kv_budget import RAW_DTYPE_BYTES, bytes_per_token
from scd_serve.decode.chooser import Choice, Chooser, PeerView, method_kl, prompt_key
from scd_serve.decode.transfer import handoff

log = logging.getLogger("scd_serve.decode")
LINK_BOUND_SHARE = 0.5  # a transfer whose reader waited this share of its first-to-last-chunk time was link-bound
PAYLOAD_RATIO = {"raw": 1.0, "identity": 2.0}  # payload / 16-bit K+V of the codebook-free methods (float32 identity)


class AutoMethod:
    def __init__(self, spec, fingerprint: str, peers, fill, config: DecodeConfig, calibration: QualityFigures,
                 metrics=None, clock: Callable[[], float] = time.monotonic):
        cfg = config.chooser
        budget = cfg.quality_budget if cfg.quality_budget is not None else (calibration.budget or 0.0)
        min_top1 = cfg.min_top1 if cfg.min_top1 is not None else calibration.min_top1
        raw = bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, RAW_DTYPE_BYTES)  # one token
        self.chooser = Chooser(cfg, budget, raw, PAYLOAD_RATIO | calibration.payload_ratio, clock,
                               min_top1=min_top1, strict_kl=cfg.quality_budget is not None)
        self.fingerprint, self.peers, self.calibration, self.metrics = fingerprint, peers, calibration, metrics
        fill.on_transfer, fill.on_cold = self.observe_transfer, self.observe_cold
        # (prompt ids, method) -> tokens the engine's prefix cache holds for it (set with the engine)
        self.cached_prefix: Callable[[list[int], str], int] = lambda ids, method: 0

    def views(self, num_tokens: int) -> list[PeerView]:
        """Every prefill worker a transfer could go to now, with the methods the pair allows."""
        out = []
        for peer in self.peers.peers.values():
            if not (peer.usable and peer.breaker.available()):
                continue
            if num_tokens > (peer.info.max_prompt_tokens or num_tokens):
                continue
            pair = method_kl(peer.info.producer_fingerprint, self.fingerprint, self.calibration.kl,
                             self.calibration.producer)
            top1 = method_kl(peer.info.producer_fingerprint, self.fingerprint, self.calibration.top1,
                             self.calibration.producer, lossless=1.0)
            kl = {m: pair[m] for m in self.peers.usable_methods(peer) if m in pair}
            load = peer.load.get("running")
            load = int(load) if isinstance(load, (int, float)) and not isinstance(load, bool) else 0
            running = max(load, self.peers.balancer.inflight[peer.address])
            out.append(PeerView(peer.address, kl, running, int(peer.info.max_concurrent),
                                {m: top1[m] for m in kl if m in top1}))
        return out

    def choose(self, req) -> Choice:
        n = req.num_prompt_tokens
        if n < 2 or req.params.prompt_logprobs is not None:
            why = ("prompt_logprobs need the consumer's own prefill" if n >= 2
                   else "a one-token prompt has no KV to fill")
            choice = Choice(LOCAL, reason="needs-local", detail=why)
        else:
            cached = self.cached_prefix(req.prompt_token_ids, LOCAL)  # what a local prefill would skip
            choice = self.chooser.choose(prompt_key(handoff(req.prompt_token_ids)), n, self.views(n), cached)
            if choice.method == LOCAL:
                choice = dataclasses.replace(choice, cached_tokens=cached)
        if self.metrics is not None:
            self.metrics.observe_auto_choice(choice.method)
        log.debug("request_id=%s prompt_tokens=%d auto -> %s (%s: %s)", req.request_id, n, choice.method,
                  choice.reason, choice.detail)
        return choice

    def observe_transfer(self, address: str, req, got, wall_s: float) -> None:
        """RemoteKVFill.on_transfer: one completed transfer (any method, auto or not); what the
        request's TTFT will teach is kept on its Transfer."""
        link_s = (got.last_chunk_at - got.first_chunk_at) if got.first_chunk_at is not None else 0.0
        measured = self.chooser.observe_transfer(
            address, req.method, prompt_key(handoff(req.prompt_token_ids)), req.num_prompt_tokens,
            payload_bytes=got.payload_bytes, rebuild_s=got.rebuild_s, producer_s=got.encode_us / 1e6,
            cache_hit=got.cache_hit, wall_s=wall_s, link_bytes=got.payload_bytes - got.first_chunk_bytes,
            link_s=link_s, link_bound=link_s > 0 and got.wait_s >= LINK_BOUND_SHARE * link_s)
        if req.transfer is not None:
            req.transfer.measured = measured

    def observe_cold(self, address: str, req) -> None:
        """RemoteKVFill.on_cold: the peer's first message said it holds no codes for the prompt,
        and the request goes to the local prefill (the choice had said so: Choice.local_if_cold)."""
        self.chooser.observe_cold(address, req.method, prompt_key(handoff(req.prompt_token_ids)))
        if req.transfer is not None:
            req.transfer.switched = Choice(
                LOCAL, reason="cold-switch", detail=f"{req.method}@{address} had no cached codes for the prompt "
                                                    "(its first message said so): a local prefill beats a cold transfer")
        if self.metrics is not None:
            self.metrics.observe_auto_choice(LOCAL)

    def outcome(self, req, ttft_s: float) -> None:
        """The request's first token came ttft_s after its choice (req.transfer's)."""
        choice = req.transfer.choice
        # a local prefill's speed is learnt from the tokens it computed (not those it found cached)
        error = self.chooser.observe_outcome(choice, req.num_prompt_tokens - choice.cached_tokens, ttft_s,
                                             req.transfer.measured)
        if error is not None and choice.reason != "fixed":
            if self.metrics is not None:
                self.metrics.observe_auto_prediction(choice.method, error)
            log.debug("request_id=%s auto %s predicted %.1f ms, took %.1f ms", req.request_id, choice.method,
                      choice.predicted_s * 1e3, ttft_s * 1e3)


def fixed(method: str) -> Choice:
    """The record of a request whose method was named (by it or the server's default): no choice made."""
    return Choice(method, reason="fixed")
