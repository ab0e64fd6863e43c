"""Transfer: one request's KV transfer on the decode worker, from its method's choice to what it carried.

The backend makes one per request (the `auto` choice or the method named) and puts it on the
engine's request (`GenerationRequest.transfer`, opaque to the engine); the fill (kv_fill.py) and
the `auto` wiring (auto.py) read and write it; the routes report it. It ends with the request,
so nothing keyed by request id is left to clean up. vLLM carries the same facts on its request
(`kv_transfer_params`).

The handoff rule lives here too: the decode worker takes the K/V of every prompt token but the
last (its first decode step feeds that token and yields the first output token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scd_serve.config.methods import LOCAL
from scd_serve.decode.chooser import Choice


def handoff(prompt_token_ids: Sequence[int]) -> list[int]:
    """The prompt tokens whose K/V a transfer fills: all but the last."""
    return list(prompt_token_ids[:-1])


@dataclass
class Transfer:
    choice: Choice  # the method and why it was picked
    peer: str = ""  # the prefill worker to try first (the `auto` choice); taken by the first attempt
    local_if_cold: bool = False  # prefill here when that worker says it holds no codes (the `auto` choice)
    switched: Choice | None = None  # what `auto` made it when the worker held no codes: a local prefill
    failed: str | None = None  # why the transfer failed (the engine then prefilled here, or the request failed)
    carried: dict | None = None  # what the completed transfer carried (kv_fill's result)
    measured: tuple[float, bool] | None = None  # (the transfer's core seconds, warm): `auto` learns from its TTFT

    def take_peer(self) -> str:
        peer, self.peer = self.peer, ""
        return peer

    def reported(self, fallback_to_local: bool) -> Choice:
        """The method as the response tells it: `local` with reason "fallback" when the transfer
        failed and the engine prefilled the prompt here."""
        choice = self.switched or self.choice
        if not self.failed or choice.method == LOCAL or not fallback_to_local:
            return choice
        where = f"{choice.method}@{choice.peer}" if choice.peer else choice.method
        return Choice(LOCAL, reason="fallback", detail=f"{where} failed ({self.failed}): prefilled on this worker")
