"""Messages to the engine's step loop: one type per event, from request coroutines (any event
loop) and from the threads that write a fill's K/V. The loop applies them between steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scd_serve.errors import ScdError


@dataclass(frozen=True, eq=False)
class Add:
    handle: Any  # engine._Handle: the sequence and where its events go


@dataclass(frozen=True, eq=False)
class Filled:
    """Every layer of the request's K/V is in: sent once, by its sink, from the writing thread."""

    handle: Any


@dataclass(frozen=True, eq=False)
class FillFailed:
    """The fill failed and the engine may prefill the prompt itself."""

    handle: Any


@dataclass(frozen=True, eq=False)
class Abort:
    """End the request (a no-op when it already finished); `error` goes to its stream."""

    handle: Any
    error: ScdError | None = None


Message = Add | Filled | FillFailed | Abort
