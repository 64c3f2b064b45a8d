"""Connection timeouts uvicorn does not have: a request's headers must arrive within `headers` seconds and its
whole body within `request` seconds, counted from the connection or from the end of the last response; a
connection that sends nothing is closed after `headers` seconds. Without them a slow-header or trickling-body
client holds its connection (a file descriptor) for ever. Idle keep-alive connections are uvicorn's
(`timeout_keep_alive`)."""
import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

CHECK_EVERY = 0.5  # seconds between a connection's checks


class TimedH11Protocol(H11Protocol):
    headers_timeout = 10.0
    request_timeout = 600.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._request_began: float | None = self.loop.time()
        self._check_handle = self.loop.call_later(CHECK_EVERY, self._check)

    def data_received(self, data: bytes) -> None:
        if self._request_began is None and self.conn.their_state is h11.IDLE:
            self._request_began = self.loop.time()  # the first bytes of the next request on this connection
        super().data_received(data)
        if self.conn.their_state is h11.DONE:
            self._request_began = None  # the request is in; its response may take as long as it takes

    def _check(self) -> None:
        began = self._request_began
        state = self.conn.their_state
        if state is h11.DONE:
            self._request_began = None
        elif began is not None and not self.transport.is_closing():
            waited = self.loop.time() - began
            if (state is h11.IDLE and waited > self.headers_timeout) or waited > self.request_timeout:
                self.transport.close()
                return
        if not self.transport.is_closing():
            self._check_handle = self.loop.call_later(CHECK_EVERY, self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        self._check_handle.cancel()
        super().connection_lost(exc)


def timed_protocol(headers: float, request: float) -> type[TimedH11Protocol]:
    return type("TimedH11", (TimedH11Protocol,), dict(headers_timeout=headers, request_timeout=request))


