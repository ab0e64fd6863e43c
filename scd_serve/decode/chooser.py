"""Chooser: per request, the fastest way to fill the prompt's KV that the quality budget allows.

The options are the consumer's own prefill (`local`) and every (prefill worker, transfer
method) within the quality budget: where the codebook measured a method's top-1 agreement
(the share of next tokens equal to the consumer's own, on held-out prompts), that share must
reach `min_top1`; otherwise its KL must be within the KL budget (an explicit KL budget holds
in both cases). Each gets a predicted time to first token
(T = prompt tokens) from live estimates, and the fastest is taken:

    local    = local_per_token * T                      (recent local prefills on this worker)
    transfer = slot wait + max(wire, rebuild, producer) + residual[method, warm or cold]
      wire     = payload_per_token[method] * T * link[peer]   (seconds per byte: recent warm transfers)
      rebuild  = rebuild_per_token[method] * T          (decode + write, and the first step run ahead)
      producer = producer_per_token[peer] * T * (1 + transfers running there), when not cached there
      residual = what outcomes of that method showed beyond the max (first chunk, tail, engine)

An option missing an estimate is tried once (`explore`); a link or local estimate older than
stale_s is re-measured by the next request that would not refresh it anyway (`reprobe`; a
local one only while within probe_ratio of the best). Every outcome is recorded against its
prediction. Plain Python, no I/O: the clock is injected, so tests run on a fake one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from scd_serve.config.methods import LOCAL
from scd_serve.config.decode import ChooserConfig

LOSSLESS = ("identity", "raw")  # exact where the producer is the consumer (16-bit raw: as good as exact)
MIN_LINK_BYTES = 32 * 1024  # smaller transfers say more about latency than about the link
LINK_JUMP = 1.5  # a link-bound pace this far from the estimate replaces it (the link changed) instead of smoothing


def method_kl(producer: str, consumer: str, calibrated: Mapping[str, float], calibrated_for: str,
              lossless: float = 0.0) -> dict[str, float]:
    """A figure (KL, or top-1 with lossless=1.0) of each transfer method for this producer ->
    consumer pair, where it is known: the codebook's calibration (made for producer
    `calibrated_for`), and `lossless` for the lossless methods when both sides run the same
    model. Methods not in the result have no known figure."""
    kl = dict(calibrated) if calibrated_for and producer == calibrated_for else {}
    if producer and producer == consumer:
        kl.update({m: lossless for m in LOSSLESS})
    return kl


@dataclass(frozen=True)
class PeerView:
    """A prefill worker as the chooser sees it at one request."""

    address: str
    kl: Mapping[str, float]  # methods usable there -> their KL for this pair (method_kl)
    running: int = 0  # transfers running there now (its heartbeat, or ours in flight)
    capacity: int = 0  # transfers it runs at once; 0 = unknown
    top1: Mapping[str, float] = field(default_factory=dict)  # methods -> measured top-1 agreement, where known


@dataclass(frozen=True)
class Choice:
    method: str
    peer: str = ""  # prefill address; "" for local
    predicted_s: float | None = None  # None: no prediction (explored, or not chosen here)
    # fixed (named by the request or the server) | fastest | explore | reprobe | only | needs-local,
    # cold-switch (set by auto.py when the peer turned out not to hold the codes), and fallback
    # (set by the backend when the transfer failed and the engine prefilled here)
    reason: str = "fixed"
    detail: str = ""
    cached: bool = False  # the chooser expected the peer to hold the prompt's codes
    # ... and, should the peer say it does not (its first message), the local prefill beats a cold transfer
    local_if_cold: bool = False
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache held for a local prefill, at the choice


@dataclass
class Estimate:
    value: float | None = None
    at: float = float("-inf")  # clock time of the last update
    n: int = 0

    def update(self, x: float, weight: float, now: float) -> None:
        self.value = x if self.value is None else self.value + weight * (x - self.value)
        self.at, self.n = now, self.n + 1


@dataclass
class _Option:
    method: str
    peer: str
    predicted: float | None
    cached: bool = False
    stale: bool = False  # its link or local estimate needs re-measuring
    missing: str = ""  # why there is no prediction

    @property
    def label(self) -> str:
        return f"{self.method}@{self.peer}" if self.peer else self.method


@dataclass
class Chooser:
    config: ChooserConfig
    budget: float  # the KL budget in force (config's, or the codebook's)
    raw_bytes_per_token: float  # 16-bit K+V of one token, every layer
    payload_ratio: Mapping[str, float] = field(default_factory=dict)  # prior: payload / raw per method
    clock: Callable[[], float] = time.monotonic
    min_top1: float | None = None  # the agreement floor for methods with a measured top-1 (None: KL only)
    strict_kl: bool = False  # the KL budget holds for those too (set explicitly)

    def __post_init__(self) -> None:
        self.local = Estimate()  # seconds per prompt token of this worker's own prefill
        self.link: dict[str, Estimate] = {}  # peer -> seconds per payload byte
        self.duration: dict[str, Estimate] = {}  # peer -> wall seconds of a transfer (slot waits)
        self.producer: dict[str, Estimate] = {}  # peer -> producer seconds per token (cold)
        self.payload: dict[str, Estimate] = {}  # method -> bytes per token
        self.rebuild: dict[str, Estimate] = {}  # method -> seconds per token
        self.residual: dict[tuple[str, bool], Estimate] = {}  # (method, warm) -> seconds
        self._cached: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self._probed: dict[str, float] = {}  # option label -> when it was last explored or re-probed

    # ---- the choice -------------------------------------------------------------------------
    def choose(self, key: int, num_tokens: int, peers: Sequence[PeerView], local_cached: int = 0) -> Choice:
        """The option for a prompt (`key`: prompt_key of its ids) of num_tokens tokens, of which a
        local prefill finds local_cached in the engine's prefix cache."""
        now = self.clock()
        local = self._local(num_tokens - local_cached, now)
        transfers = [self._transfer(p, m, key, num_tokens) for p in peers for m in self.allowed(p)]
        if not transfers:
            why = "no usable prefill worker" if not peers else f"no transfer method within {self.describe_budget()}"
            return Choice(LOCAL, predicted_s=local.predicted, reason="only", detail=why)
        options = [*transfers, local]
        known = sorted((o for o in options if o.predicted is not None), key=lambda o: o.predicted)
        best = known[0] if known else None
        due = lambda o: now - self._probed.get(o.label, float("-inf")) >= self.config.stale_s  # noqa: E731
        if unknown := [o for o in options if o.predicted is None and due(o)]:
            return self._probe(unknown[0], now, "explore", f"no estimate of its {unknown[0].missing} yet", known)
        for o in known:  # cheapest first
            measured_anyway = o is best or (o.peer and o.peer == best.peer)  # the pick refreshes that link
            worth_it = o.peer or o.predicted <= self.config.probe_ratio * best.predicted  # a link may have recovered
            if o.stale and due(o) and not measured_anyway and worth_it:
                what = f"link to {o.peer}" if o.peer else "local prefill speed"
                return self._probe(o, now, "reprobe", f"its {what} estimate is stale", known)
        if best is None:  # nothing predictable and everything tried recently: the safe option
            return Choice(LOCAL, reason="only", detail="no prediction yet for any option")
        local_if_cold = False
        if best.cached and local.predicted is not None:  # what if the peer evicted it?
            view = next(p for p in peers if p.address == best.peer)
            cold = self._transfer(view, best.method, key, num_tokens, cached=False)
            local_if_cold = cold.predicted is None or local.predicted < cold.predicted
        return Choice(best.method, best.peer, best.predicted, "fastest", _ranking(known), best.cached, local_if_cold)

    def allowed(self, peer: PeerView) -> list[str]:
        """Methods at `peer` within the budget, smallest expected payload first."""
        ok = [m for m, kl in peer.kl.items() if m != LOCAL and self.within(kl, peer.top1.get(m))]
        return sorted(ok, key=lambda m: (self._payload_per_token(m), m))

    def within(self, kl: float, top1: float | None) -> bool:
        """The quality budget: the agreement floor where top-1 was measured, else the KL budget."""
        if top1 is not None and self.min_top1 is not None:
            return top1 >= self.min_top1 and (not self.strict_kl or kl <= self.budget)
        return kl <= self.budget

    def describe_budget(self) -> str:
        if self.min_top1 is None:
            return f"quality budget {self.budget:g} (KL)"
        kl = f"KL <= {self.budget:g}"
        return f"quality budget top-1 >= {self.min_top1:g}" + (f" and {kl}" if self.strict_kl else f" (else {kl})")

    def _probe(self, o: _Option, now: float, reason: str, why: str, known: list[_Option]) -> Choice:
        self._probed[o.label] = now
        return Choice(o.method, o.peer, o.predicted, reason, f"{o.label}: {why}; {_ranking(known)}".rstrip("; "),
                      o.cached)

    def _local(self, n: int, now: float) -> _Option:
        if self.local.value is not None:
            return _Option(LOCAL, "", self.local.value * n, stale=now - self.local.at > self.config.stale_s)
        prior = [e.value for e in self.producer.values() if e.value is not None]  # same architecture
        if prior:
            return _Option(LOCAL, "", min(prior) * n, stale=True)
        return _Option(LOCAL, "", None, missing="local prefill speed")

    def _transfer(self, p: PeerView, method: str, key: int, n: int, cached: bool | None = None) -> _Option:
        now = self.clock()
        cached = (p.address, method, key) in self._cached if cached is None else cached
        link, rebuild = self.link.get(p.address), self.rebuild.get(method)
        if link is None or link.value is None:
            return _Option(method, p.address, None, cached, missing=f"link to {p.address}")
        if rebuild is None or rebuild.value is None:
            return _Option(method, p.address, None, cached, missing=f"{method} rebuild cost")
        core = max(self._payload_per_token(method) * n * link.value, rebuild.value * n)
        if not cached:
            per_token = self.producer.get(p.address, Estimate()).value or self.local.value
            if per_token is None:
                return _Option(method, p.address, None, cached, missing=f"producer speed at {p.address}")
            core = max(core, per_token * n * (1 + max(p.running, 0)))
        wait = 0.0
        if p.capacity and p.running >= p.capacity:  # every slot is taken: wait for one
            wait = (p.running - p.capacity + 1) * (self.duration.get(p.address, Estimate()).value or 0.0) / p.capacity
        residual = self.residual.get((method, cached)) or self.residual.get((method, not cached))
        stale = now - link.at > self.config.stale_s
        return _Option(method, p.address, wait + core + (residual.value if residual else 0.0), cached, stale)

    def _payload_per_token(self, method: str) -> float:
        e = self.payload.get(method)
        if e is not None and e.value is not None:
            return e.value
        return self.payload_ratio.get(method, 1.0) * self.raw_bytes_per_token

    # ---- what happened ----------------------------------------------------------------------
    def observe_transfer(self, peer: str, method: str, key: int, num_tokens: int, *, payload_bytes: int,
                         rebuild_s: float, producer_s: float, cache_hit: bool, wall_s: float,
                         link_bytes: int = 0, link_s: float = 0.0, link_bound: bool = False) -> tuple[float, bool]:
        """A completed transfer of `method` from `peer`: what crossed, how long each part took.
        link_bytes / link_s is the pace from the first chunk to the last: the link's, when the
        reader mostly waited for bytes (link_bound) on cached codes and enough crossed; else only a
        bound (the link is at least that fast). A cold transfer, paced by the producer, only gives
        a link not measured yet a first guess (its producer time taken out).
        -> (the transfer's core seconds, warm): what observe_outcome needs of it."""
        now, w, n = self.clock(), self.config.smoothing, max(1, num_tokens)
        self.payload.setdefault(method, Estimate()).update(payload_bytes / n, w, now)
        self.rebuild.setdefault(method, Estimate()).update(rebuild_s / n, w, now)
        self.duration.setdefault(peer, Estimate()).update(wall_s, w, now)
        if not cache_hit and producer_s > 0:
            self.producer.setdefault(peer, Estimate()).update(producer_s / n, w, now)
        wire, link = 0.0, self.link.setdefault(peer, Estimate())
        if link_bytes <= 0 or link_s <= 0:  # one chunk: only the whole transfer bounds the link
            link_bytes, link_s, link_bound = payload_bytes, wall_s, False
        if not cache_hit:  # the producer paced the chunks: a first guess at most, its time taken out
            if link.value is None and payload_bytes > 0:
                link.update(max(0.0, wall_s - producer_s) / payload_bytes, 1.0, now)
        elif link_bytes > 0 and link_s > 0:
            pace = link_s / link_bytes
            if link_bound and link_bytes >= MIN_LINK_BYTES:
                jump = link.value is None or not 1 / LINK_JUMP <= pace / link.value <= LINK_JUMP
                link.update(pace, 1.0 if jump else w, now)  # a link that changed by LINK_JUMP is followed at once
                wire = payload_bytes * pace
            elif link.value is None or pace < link.value:  # at least this fast: the estimate was too slow
                link.update(pace, 1.0, now)
            else:
                link.at = now  # consistent with the estimate: it still holds
        self._remember(peer, method, key)
        return max(wire, rebuild_s, 0.0 if cache_hit else producer_s), cache_hit

    def observe_outcome(self, choice: Choice, num_tokens: int, ttft_s: float,
                        measured: tuple[float, bool] | None = None) -> float | None:
        """The request's time to first token (from the choice); measured: what observe_transfer
        returned for its transfer (None: none completed). Teaches the local speed or the method's
        residual; -> |predicted - actual| / actual, or None without a prediction."""
        now, w = self.clock(), self.config.smoothing
        if choice.method == LOCAL:
            self.local.update(ttft_s / max(1, num_tokens), w, now)
        elif measured is not None:  # a transfer that completed (not one that fell back to local)
            core, warm = measured
            self.residual.setdefault((choice.method, warm), Estimate()).update(ttft_s - core, w, now)
        else:
            return None
        if choice.predicted_s is None or ttft_s <= 0:
            return None
        return abs(choice.predicted_s - ttft_s) / ttft_s

    def observe_cold(self, peer: str, method: str, key: int) -> None:
        """The peer said it does not hold this prompt's codes (evicted, or it restarted): nor, in
        a least-recently-used cache, those this worker had it make before them."""
        entry = (peer, method, key)
        if entry not in self._cached:
            return
        for older in list(self._cached):
            if older[0] == peer:
                del self._cached[older]
            if older == entry:
                break

    def _remember(self, peer: str, method: str, key: int) -> None:
        if self.config.cache_entries <= 0:
            return
        entry = (peer, method, key)
        self._cached[entry] = None
        self._cached.move_to_end(entry)
        while len(self._cached) > self.config.cache_entries:
            self._cached.popitem(last=False)

    def snapshot(self) -> dict:
        """The estimates, in readable units (for /metrics' stats and logs)."""
        per = lambda d, scale: {k: round(e.value * scale, 4) for k, e in d.items() if e.value is not None}  # noqa: E731
        return {"budget": self.budget, "min_top1": self.min_top1, "local_us_per_token": None if self.local.value is None else
                round(self.local.value * 1e6, 3),
                "link_mbit_s": {k: round(8e-6 / e.value, 1) for k, e in self.link.items() if e.value},
                "rebuild_us_per_token": per(self.rebuild, 1e6), "payload_bytes_per_token": per(self.payload, 1),
                "producer_us_per_token": per(self.producer, 1e6),
                "residual_ms": {f"{m}/{'warm' if warm else 'cold'}": round(e.value * 1e3, 3)
                                for (m, warm), e in self.residual.items() if e.value is not None},
                "cached_prompts": len(self._cached)}


def prompt_key(token_ids: Sequence[int]) -> int:
    """A prompt's identity for the code-cache guess (the prefill worker keys on the same ids)."""
    return hash(tuple(token_ids))


def _ranking(known: list[_Option]) -> str:
    """'scd-int8 14.2 ms < scd 18.1 ms < local 61.0 ms': each method's best prediction."""
    seen: dict[str, float] = {}
    for o in known:  # sorted fastest first
        seen.setdefault(o.method, o.predicted)
    return " < ".join(f"{m} {s * 1e3:.1f} ms" for m, s in seen.items())
