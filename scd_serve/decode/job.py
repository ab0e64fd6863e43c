"""TransferJob: one transfer's gRPC stream, opened on the event loop and read in a transfer thread.

The thread receives, verifies and rebuilds each chunk as it arrives (receive.py) and settles the
event loop's future with the outcome; the event loop watches for stalls and cancels.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress

import torch

from scd_serve.decode.receive import drain, receive
from scd_serve.transport.chunking import StreamVerifier
from scd_serve.transport.proto import pb

log = logging.getLogger("scd_serve.decode")


class TransferJob:
    """One transfer: its stream is opened on the event loop (start, cancel), read in a thread (run)."""

    def __init__(self, peer, request: pb.PrefillRequest, deadline: float):
        self.peer, self.request, self.deadline = peer, request, deadline
        self._call = None
        self.reading = False  # a transfer thread reads the stream (set there)
        self.last_message = time.monotonic()  # when the stream last gave a message (or reading began)

    def start(self) -> None:
        """Open the stream (non-blocking): the request leaves while a thread wakes up to read
        the answer (one waiting for a thread past its deadline fails with DEADLINE_EXCEEDED)."""
        timeout = max(0.001, self.deadline - time.monotonic())
        self.request.timeout_ms = max(1, int(timeout * 1e3))  # the worker bounds its side too
        self._call = self.peer.client.stream(self.request, timeout=timeout)

    def run(self, loop, done: asyncio.Future, verifier: StreamVerifier, prepare, rebuild_layer) -> None:
        """Transfer thread: the transfer, its outcome to `done`, then the stream's end (drain)."""
        self.last_message, self.reading = time.monotonic(), True
        try:
            with torch.inference_mode():
                got = receive(self._heard(self._call), verifier, prepare, rebuild_layer)
        except BaseException as exc:  # noqa: BLE001 - the event loop re-raises it
            _settle(loop, done, exc=exc)
            return
        _settle(loop, done, result=got)
        if why := drain(self._call):
            log.debug("request_id=%s: after its last chunk: %s", self.request.request_id, why)

    def _heard(self, call):
        """The stream's messages, each stamped on arrival (the event loop's stall watch reads it)."""
        for msg in call:
            self.last_message = time.monotonic()
            yield msg

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()


def _settle(loop, fut: asyncio.Future, result=None, exc: BaseException | None = None) -> None:
    """From a thread: complete `fut` on its loop, unless it was cancelled (or the loop closed)."""
    def settle() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    with suppress(RuntimeError):  # the event loop is closed: nobody is waiting
        loop.call_soon_threadsafe(settle)
