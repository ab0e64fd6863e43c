"""StepAhead: a filled request's first decode step, run a layer at a time as its K/V lands.

Runs in the writing thread: when the fill's last layer arrives, only that layer and the LM
head are left, and the engine samples the first token from the logits that are ready
instead of decoding that sequence again (engine/runner.py takes them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("scd_serve.engine")


class StepAhead:
    """Runs each layer of the step once it and all before it have landed; the logits go to
    `on_logits`. A failure only loses the head start (logged): the engine decodes as usual."""

    def __init__(self, begin: Callable[[], Any], num_layers: int, on_logits: Callable[[Any], None],
                 request_id: str = ""):
        self._begin = begin  # -> a DecodeStep (runtime.begin_decode_step); its setup runs in start()
        self._landed = [False] * num_layers
        self._on_logits = on_logits
        self._step: Any = None
        self._failed, self._delivered, self.request_id = False, False, request_id
        self.elapsed_s = 0.0  # time spent in the step (setup, layers, head): what it costs the writer

    def start(self) -> None:
        """Set the step up now (while the K/V is still on its way), not at the first layer."""
        if self._step is None and not self._failed and not self._delivered:
            self._guard(self._set_up)

    def landed(self, layer: int) -> None:
        if self._delivered:
            return  # the logits are out; the engine may be decoding this sequence already
        if self._step is not None and layer < self._step.layer:
            # a layer the step already read was written again (a retry from another prefill
            # worker): start over, on the K/V as it is now
            self._step, self._landed = None, [False] * len(self._landed)
        self._landed[layer] = True
        self.start()
        if self._step is not None:
            self._guard(self._advance)

    def _set_up(self) -> None:
        self._step = self._begin()

    def _advance(self) -> None:
        step = self._step
        while not step.done and self._landed[step.layer]:
            step.run_layer()
        if step.done:
            self._step, self._delivered = None, True
            self._on_logits(step.logits())  # [1, vocab]

    def _guard(self, work: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - a lost head start, never a lost request
            self._step, self._failed = None, True
            log.warning("request_id=%s first step ahead of the fill failed (%s: %s); decoding it as usual",
                        self.request_id, type(exc).__name__, exc)
        finally:
            self.elapsed_s += time.perf_counter() - t0
