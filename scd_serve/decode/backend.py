"""The decode worker's backend for create_app: the engine, the remote KV fill, the peers."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from scd_serve import codec as codec_registry
from scd_serve.api.backend import EngineBackend
from scd_serve.config.methods import AUTO, LOCAL
from scd_serve.decode.auto import fixed
from scd_serve.decode.chooser import Choice
from scd_serve.decode.transfer import Transfer
from scd_serve.engine.request import GenerationRequest, TokenEvent
from scd_serve.errors import InvalidRequest


def needs_local(req: GenerationRequest) -> str | None:
    """Why a request is prefilled on this worker whatever its method (the engine fills no K/V
    for it), or None. The same cases as `auto`'s needs-local choice."""
    if req.params.prompt_logprobs is not None:
        return "prompt log-probabilities need the consumer's own prefill"
    if req.num_prompt_tokens < 2:
        return "a one-token prompt has no K/V to transfer"
    return None


class DecodeBackend(EngineBackend):
    """EngineBackend whose transfer methods all go through one RemoteKVFill. Ready while the
    engine runs and, unless the default method is "local" or failures fall back to a local
    prefill, a compatible prefill worker answers. With an AutoMethod, `auto` picks each
    request's method; `choice_of` tells the routes what was picked and why."""

    def __init__(self, engine, model_name: str, fill, peers, default_method: str, auto=None):
        self.needs_peer = default_method != LOCAL
        must_have_peer = self.needs_peer and peers.config.fallback != "local"
        super().__init__(engine, model_name, fills={m: self._watched_fill for m in codec_registry.METHODS},
                         peers_ready=(lambda: peers.ready()) if must_have_peer else (lambda: not peers.dead))
        self.fill, self.peers = fill, peers
        self.auto = auto  # AutoMethod or None (then `auto` is refused)
        self._live: dict[str, Transfer] = {}  # request_id -> its transfer, while it runs (the routes ask by id)
        self.served = {"disaggregated": 0, "local": 0}  # answered requests by where their prompt's K/V came from

    @property
    def methods(self) -> list[str]:
        return sorted([*self.fills, *([AUTO] if self.auto is not None else [])])

    def choice_of(self, request_id: str) -> Choice | None:
        """How a running request's method was picked (None once it ended); `local` with reason
        "fallback" when its transfer failed and the engine prefilled the prompt here."""
        t = self._live.get(request_id)
        return None if t is None else t.reported(self.engine.config.fallback_to_local)

    def transfer_of(self, request_id: str) -> dict | None:
        """What a running request's transfer carried (RemoteKVFill's result), None without one."""
        t = self._live.get(request_id)
        return None if t is None else t.carried

    async def _watched_fill(self, req: GenerationRequest, sink) -> Any:
        """The transfer, noting on it a failure (the engine then prefills here or fails the
        request) or what it carried (the response says so)."""
        t = req.transfer if req.transfer is not None else Transfer(fixed(req.method))  # (made by generate)
        try:
            result = await self.fill(req, sink)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            t.failed = getattr(exc, "kind", None) or type(exc).__name__
            raise
        if not sink.complete:
            t.failed = f"wrote {sink.num_written} of {sink.num_layers} layers"
        elif isinstance(result, dict):
            t.carried = result
        return result

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        if req.method == AUTO:
            if self.auto is None:
                raise InvalidRequest(f"scd_method must be one of {self.methods}, got 'auto'", field="scd_method")
            choice = self.auto.choose(req)
            # with local_if_cold the engine prefills here when the worker holds no codes
            t = Transfer(choice, peer=choice.peer,
                         local_if_cold=choice.local_if_cold and self.peers.config.fallback == "local")
        elif req.method != LOCAL and (why := needs_local(req)):  # no K/V would be transferred: say so
            t = Transfer(Choice(LOCAL, reason="needs-local", detail=f"{why}: {req.method} not used"))
        else:
            t = Transfer(fixed(req.method))
        req = dataclasses.replace(req, method=t.choice.method, transfer=t)
        self._live[rid] = t
        start, first = time.perf_counter(), True
        try:
            async for event in super().generate(req):
                if first:
                    first = False
                    if self.auto is not None:
                        self.auto.outcome(req, time.perf_counter() - start)
                yield event
        finally:
            self._live.pop(rid, None)
            if not first:
                served = t.reported(self.engine.config.fallback_to_local).method
                self.served["local" if served == LOCAL else "disaggregated"] += 1

    def ready_detail(self) -> dict[str, Any]:
        """What /ready adds to {"status": "ready"}: a worker serving on its fallback alone says so."""
        if not self.needs_peer or self.peers.ready():
            return {}
        return {"prefill": "no usable prefill worker: prompts are prefilled on this worker (fallback local)",
                "prefill_peers": self.peers.status()}

    def stats(self) -> dict[str, Any]:
        auto = {"auto": self.auto.chooser.snapshot()} if self.auto is not None else {}
        return self.engine.stats() | {"transfer": self.fill.snapshot(), "prefill_peers": self.peers.status(),
                                      "served": dict(self.served)} | auto

    def load_report(self) -> dict[str, float]:
        """What heartbeats report to the control plane (numbers only)."""
        s = self.engine.stats()
        t = self.fill.stats
        return {"running": s["num_running"], "waiting": s["num_waiting"] + s.get("num_filling", 0),
                "capacity": self.engine.config.max_num_seqs, "free_blocks": s["num_free_blocks"],
                "total_blocks": s["num_total_blocks"],
                "tokens": s["num_generated_tokens"], "transfers": t.num_transfers,
                "fallbacks": s.get("num_fallbacks", 0)}
