"""DecodeWorker: one decode worker's serving parts (codecs, peers, KV fill, `auto`, engine,
backend, app), built in one place for `scd-serve decode`, the soak's LocalStack and the test
harnesses; what a test changes (a faulty runtime, a fake gRPC client) goes in as an argument.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from scd_serve.config.api import ApiConfig
from scd_serve.config.decode import DecodeConfig
from scd_serve.config.engine import EngineConfig
from scd_serve.errors import ScdError

log = logging.getLogger("scd_serve.decode")


class DecodeWorker:
    def __init__(self, runtime: Any, config: DecodeConfig, engine_config: EngineConfig, api_config: ApiConfig, *,
                 metrics: Any = None, runtime_wrap: Callable[[Any], Any] | None = None,
                 client_factory: Callable | None = None):
        from scd_serve.api.metrics import Metrics

        self.rt, self.config, self.engine_config = runtime, config, engine_config
        self.api_config = api_config
        self.metrics = metrics if metrics is not None else Metrics()
        # the name the backend reports: the API's, else the model directory's
        self.model_name = api_config.model_name or os.path.basename(os.path.normpath(config.model))
        self.runtime_wrap, self.client_factory = runtime_wrap, client_factory
        self.peers = self.fill = self.auto = self.engine = self.backend = self.app = None

    async def connect(self, health_loop: bool = True) -> DecodeWorker:
        """The transfer side alone: codecs, a handshake with the static prefill peers, the
        remote KV fill and `auto`'s chooser. health_loop False: no periodic peer checks."""
        from scd_serve.codec.figures import QualityFigures
        from scd_serve.decode.auto import AutoMethod
        from scd_serve.decode.consumer_codecs import ConsumerCodecs
        from scd_serve.decode.kv_fill import RemoteKVFill
        from scd_serve.decode.peers import PeerSet
        from scd_serve.model.threads import in_passing_thread

        rt, config = self.rt, self.config
        codecs = ConsumerCodecs(rt, config.codebook)
        if codecs.codebook is not None:
            try:
                said = await asyncio.to_thread(in_passing_thread, codecs.fill_prior_table, config.prior_table,
                                              config.prior_table_budget_s)
            except ScdError as exc:  # a codebook that does not load: each method says so when built
                said = f"no feature prior table: {exc.message}"
            if said:
                log.info("%s", said)
        self.peers = PeerSet(rt, codecs, config, client_factory=self.client_factory)
        await self.peers.check_all()
        if health_loop:
            self.peers.start()
        self.fill = RemoteKVFill(rt, self.peers, codecs, config, self.metrics)
        self.auto = AutoMethod(rt.spec, rt.fingerprint, self.peers, self.fill, config,
                               QualityFigures.load(codecs.codebook), self.metrics)
        return self

    async def start(self, health_loop: bool = True) -> DecodeWorker:
        """connect(), then the engine loop, the backend and the app, ready to serve."""
        from scd_serve.api.app import create_app
        from scd_serve.decode.backend import DecodeBackend
        from scd_serve.engine.engine import Engine

        await self.connect(health_loop)
        self.engine = Engine(self.runtime_wrap(self.rt) if self.runtime_wrap else self.rt, self.engine_config)
        self.engine.start()
        self.auto.cached_prefix = self.engine.cached_prefix
        self.backend = DecodeBackend(self.engine, self.model_name, self.fill, self.peers, self.config.method, self.auto)
        self.app = create_app(self.api_config, self.backend, self.metrics)
        return self

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; running ones get grace_s, then end with `shutting_down`."""
        if self.engine is not None:
            await self.engine.stop(grace_s=grace_s)

    async def close(self) -> None:
        """After the drain: transfers and peer channels."""
        if self.fill is not None:
            self.fill.close()
        if self.peers is not None:
            await self.peers.close()

    async def stop(self, grace_s: float) -> None:
        await self.drain(grace_s)
        await self.close()
