"""The HTTP server of the gateway and the decode workers: uvicorn with a request-header deadline.

uvicorn times out idle keep-alive connections, but not a request whose headers arrive slowly:
a client that sends one header line every few seconds (slowloris) held its connection as long
as it liked (100 of them stayed open 75 s in the attack run). `HeaderDeadline` closes a
connection whose request headers are not complete `header_timeout_s` after it opened, or
after its previous response ended. It is uvicorn's h11 protocol with one timer, so it is used
even where httptools is installed.
"""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadline(H11Protocol):
    header_timeout_s = 10.0  # per server: a subclass made by `http_config` sets it
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's head is complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may already have read a pipelined request's head
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def http_config(app, host: str, port: int, *, header_timeout_s: float, **options) -> uvicorn.Config:
    """uvicorn.Config for `app` whose connections get `header_timeout_s` to send a request's headers."""
    protocol = type("HeaderDeadline", (HeaderDeadline,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, log_level="warning", **options)
