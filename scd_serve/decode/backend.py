"""The decode worker's backend for create_app: the engine, the remote KV fill, the peers."""

from __future__ import annotations

from typing import Any

from scd_serve import codec as codec_registry
from scd_serve.api.backend import LOCAL, EngineBackend


class DecodeBackend(EngineBackend):
    """EngineBackend whose transfer methods all go through one RemoteKVFill (it reads
    req.method), ready only while the engine runs and - unless the default method is
    "local" or a failed transfer falls back to a local prefill - at least one compatible
    prefill worker answers. Ready on the fallback alone, /ready's body says so."""

    def __init__(self, engine, model_name: str, fill, peers, default_method: str):
        self.needs_peer = default_method != LOCAL
        must_have_peer = self.needs_peer and peers.config.fallback != "local"
        super().__init__(engine, model_name, fills={m: fill for m in codec_registry.METHODS},
                         peers_ready=(lambda: peers.ready()) if must_have_peer else (lambda: not peers.dead))
        self.fill = fill
        self.peers = peers

    def ready_detail(self) -> dict[str, Any]:
        """What /ready adds to {"status": "ready"}: a worker serving on its fallback alone says so."""
        if not self.needs_peer or self.peers.ready():
            return {}
        return {"prefill": "no usable prefill worker: prompts are prefilled on this worker (fallback local)",
                "prefill_peers": self.peers.status()}

    def why_not_ready(self) -> str:
        """'' when ready; else what is missing, naming a refused peer's differing fields."""
        if not self.engine.ready():
            return "engine loop not running"
        return "" if self.ready() else self.peers.why_not_ready()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats() | {"transfer": self.fill.snapshot(), "prefill_peers": self.peers.status()}

    def load(self) -> dict[str, float]:
        """What heartbeats report to the control plane (numbers only)."""
        s = self.engine.stats()
        t = self.fill.stats
        return {"running": s["num_running"], "waiting": s["num_waiting"] + s.get("num_filling", 0),
                "capacity": self.engine.config.max_num_seqs, "free_blocks": s["num_free_blocks"],
                "tokens": s["num_generated_tokens"], "transfers": t.num_transfers,
                "fallbacks": s.get("num_fallbacks", 0)}
