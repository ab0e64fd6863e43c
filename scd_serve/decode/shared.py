"""One transfer for every request that needs the same prompt's K/V at the same time.

`n` > 1, `best_of` and bursts of identical prompts make several engine requests with one
prompt and method. The first fill runs the transfer and tees each rebuilt layer here; fills
that start meanwhile copy the layers into their own blocks as they land. The layers are
dropped when the last of those fills ends and held within `MAX_BYTES` in all. A failed
transfer lets each waiting request run its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

MAX_BYTES = 1 << 30  # layers held at once, all transfers together; beyond it a transfer is not shared


class Shared:
    """One transfer's rebuilt layers, filled from the writing thread, read by the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_layers: int):
        self.loop = loop
        self.layers: list[tuple[Any, Any] | None] = [None] * num_layers  # (k_pre, v) [filled, kv_heads, hd]
        self.landed = asyncio.Event()  # set (and cleared by readers) whenever a layer lands or it ends
        self.result: dict | None = None
        self.failed = False
        self.readers = 0  # fills using it now (the leader included)
        self.num_bytes = 0

    def tee(self, sink) -> "_Tee":
        return _Tee(sink, self)

    def put(self, layer: int, k_pre, v) -> None:  # in the writing thread
        self.layers[layer] = (k_pre, v)
        self.num_bytes += k_pre.numel() * k_pre.element_size() * 2
        self.loop.call_soon_threadsafe(self.landed.set)

    def end(self, result: dict | None) -> None:
        self.result, self.failed = result, result is None
        self.landed.set()

    async def replay(self, sink) -> dict | None:
        """Write every layer into `sink` as it lands; the leader's result (marked shared), or
        None when its transfer failed (the caller then runs its own)."""
        sink.prepare()
        done = 0
        while done < len(self.layers):
            if self.layers[done] is not None:
                k_pre, v = self.layers[done]
                if k_pre.shape[0] != sink.num_tokens - sink.start:  # the leader's codec replays a tail
                    sink.limit(sink.start + k_pre.shape[0])
                sink.write_layer(done, k_pre, v)
                done += 1
                continue
            if self.failed:
                return None
            self.landed.clear()
            if self.layers[done] is None and not self.failed:
                await self.landed.wait()
        return {**(self.result or {}), "shared": True, "payload_bytes": 0, "cache_hit": False}


class _Tee:
    """A sink (what a transfer uses of engine/sink.LayerSink) that also hands each written layer
    to a Shared."""

    def __init__(self, sink, shared: Shared):
        self._sink, self._shared = sink, shared

    @property
    def closed(self) -> bool:
        return self._sink.closed

    @property
    def start(self) -> int:
        return self._sink.start

    def prepare(self) -> None:
        self._sink.prepare()

    def limit(self, num_tokens: int) -> None:
        self._sink.limit(num_tokens)

    @property
    def takes_last_row(self) -> bool:
        return self._sink.takes_last_row

    def write_last_row(self, layer: int, k_pre, v, h=None) -> None:
        self._sink.write_last_row(layer, k_pre, v, h)  # not kept: a copy runs its own first step

    def write_layer(self, layer: int, k_pre, v) -> None:
        self._sink.write_layer(layer, k_pre, v)
        self._shared.put(layer, k_pre, v)


class SharedTransfers:
    """(method, prompt, first position) -> the Shared of a transfer some fill is still using."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.live: dict[tuple, Shared] = {}
        self.num_shared = 0  # fills served from another request's transfer

    def join(self, key: tuple) -> tuple[Shared | None, bool]:
        """-> (its Shared, True if the caller leads the transfer); (None, True) when over MAX_BYTES."""
        shared = self.live.get(key)
        if shared is not None and not shared.failed:
            shared.readers += 1
            return shared, False
        if sum(s.num_bytes for s in self.live.values()) >= MAX_BYTES:
            return None, True
        shared = self.live[key] = Shared(asyncio.get_running_loop(), self.num_layers)
        shared.readers += 1
        return shared, True

    def leave(self, key: tuple, shared: Shared) -> None:
        shared.readers -= 1
        if shared.readers == 0 and self.live.get(key) is shared:
            del self.live[key]
