"""The decode worker's backend for create_app: the engine, the remote KV fill, the peers."""

from __future__ import annotations

from typing import Any

from scd_serve import codec as codec_registry
from scd_serve.api.backend import LOCAL, EngineBackend


class DecodeBackend(EngineBackend):
    """EngineBackend whose transfer methods all go through one RemoteKVFill (it reads
    req.method), ready only while the engine runs and - unless the default method is
    "local" - at least one compatible prefill worker answers."""

    def __init__(self, engine, model_name: str, fill, peers, default_method: str):
        needs_peer = default_method != LOCAL
        super().__init__(engine, model_name, fills={m: fill for m in codec_registry.METHODS},
                         peers_ready=(lambda: peers.ready()) if needs_peer else (lambda: True))
        self.fill = fill
        self.peers = peers

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
