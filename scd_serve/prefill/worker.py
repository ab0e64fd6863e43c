"""PrefillWorker: one prefill worker's serving parts (a PrefillServicer behind a grpc.aio
server with grpc.health.v1), built in one place for `scd-serve prefill`, the soak's
LocalStack and the test harnesses; what a test changes goes in as an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scd_serve.config.address import join_host_port
from scd_serve.config.prefill import PrefillConfig
from scd_serve.prefill.service import PrefillServicer
from scd_serve.transport.proto import SERVICE_NAME, pb_grpc
from scd_serve.transport.security import CallGuard
from scd_serve.transport.server import bind, make_server, set_serving


class PrefillWorker:
    def __init__(self, runtime: Any, codecs: dict, config: PrefillConfig, *, servicer_cls=PrefillServicer,
                 servicer_wrap: Callable[[PrefillServicer], Any] | None = None, max_concurrent_rpcs: int | None = None,
                 experts: list[dict] = ()):
        self.config = config
        self.servicer = servicer_cls(runtime, codecs, config, **({"experts": list(experts)} if experts else {}))
        self.served = servicer_wrap(self.servicer) if servicer_wrap else self.servicer  # what gRPC calls
        self.guard = CallGuard(config.transport.worker_token)  # refused calls: scd_prefill_refused_calls_total
        self.server, self.health = make_server(config.transport, max_concurrent_rpcs, self.guard)
        if getattr(self.servicer, "metrics", None) is not None:
            self.servicer.metrics.watch_calls(self.guard)
        pb_grpc.add_PrefillServiceServicer_to_server(self.served, self.server)
        self.port = 0
        self.address = ""

    async def start(self) -> str:
        """Listen, start, report SERVING; -> HOST:PORT as bound (port 0 = the OS picked)."""
        self.port = bind(self.server, self.config.host, self.config.port, self.config.transport)
        await self.server.start()
        await set_serving(self.health, SERVICE_NAME, True)
        self.address = join_host_port(self.config.host, self.port)
        return self.address

    async def drain(self) -> None:
        """NOT_SERVING first: probes and decode workers see it before the listener closes."""
        await set_serving(self.health, SERVICE_NAME, False)

    async def stop(self, grace_s: float | None = None) -> None:
        """grace_s None: at once (transfers in flight end now); else they may finish within it."""
        if grace_s is None:
            self.servicer.close()
            await self.server.stop(grace=None)
        else:
            await self.server.stop(grace=grace_s)
            self.servicer.close()
