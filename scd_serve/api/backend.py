"""Backend: what the HTTP app needs from whatever generates tokens (the decode worker's
EngineBackend, or a test's fake).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from scd_serve.config.methods import LOCAL
from scd_serve.engine.request import GenerationRequest, KVFill, TokenEvent
from scd_serve.errors import InvalidRequest



class Backend(Protocol):
    model_name: str
    tokenizer: Any
    vocab_size: int  # optional: token-id prompts are checked against it (default len(tokenizer))
    sampling_defaults: dict[str, Any]  # optional: generation_config.json's defaults for omitted fields
    grammars: Any  # optional: an engine.grammar.GrammarCompiler (structured outputs; without it they are 400)

    def ready(self) -> bool: ...  # engine loop alive and peers reachable
    def engine_ready(self) -> bool: ...  # engine loop alive (GET /health)
    def ready_detail(self) -> dict[str, Any]: ...  # what /ready adds to {"status": "ready"}
    def stats(self) -> dict[str, Any]: ...  # engine stats (num_running, num_waiting, ...)
    def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]: ...  # async generator


class EngineBackend:
    """An Engine plus a KV fill per transfer method ("local": none); an unknown method is a 400."""

    def __init__(self, engine: Any, model_name: str, fills: Mapping[str, KVFill] | None = None,
                 peers_ready: Callable[[], bool] = lambda: True):
        self.engine, self.model_name, self.tokenizer = engine, model_name, engine.tokenizer
        self.vocab_size = int(engine.runtime.spec.vocab_size)
        self.sampling_defaults = dict(engine.generation_defaults.sampling)
        self.grammars = engine.grammars  # structured outputs: compiles a request's grammar (GrammarCompiler)
        self.fills: dict[str, KVFill | None] = {LOCAL: None, **(fills or {})}
        self.peers_ready = peers_ready

    @property
    def methods(self) -> list[str]:
        return sorted(self.fills)

    def ready(self) -> bool:
        return self.engine.ready() and self.peers_ready()

    def engine_ready(self) -> bool:
        return self.engine.ready()

    def ready_detail(self) -> dict[str, Any]:
        return {}

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if req.method not in self.fills:
            raise InvalidRequest(f"scd_method must be one of {self.methods}, got {req.method!r}", field="scd_method")
        gen = self.engine.generate(req, self.fills[req.method])
        try:
            async for event in gen:
                yield event
        finally:
            await gen.aclose()
