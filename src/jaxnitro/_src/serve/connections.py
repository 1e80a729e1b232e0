"""Guards on the REST port's connections, around uvicorn's httptools parser:

- at most ``max_connections`` open at once: one more is answered 503 and closed at once
  (its file descriptor freed), instead of being held until it sends a request;
- a request line and headers complete within ``header_timeout`` seconds of the connection
  (or of the request's first byte, on a kept-alive connection), else 408 and closed;
- at most ``max_header_bytes`` of request line and headers, else 431 and closed;
- a connection whose request is answered before all of its body arrived (an error such as
  413 or 408, or an endpoint that reads no body) is closed after the answer: what it still
  sends would otherwise keep it open for good (uvicorn drops those bytes, and each one
  restarts its keep-alive timer), so a client trickling a body cannot hold a slot past the
  handler's body deadline (``--body-timeout``) on any endpoint.

uvicorn has none of these for httptools: its ``limit_concurrency`` answers 503 only once a
request's headers are in (a connection that never sends them holds its slot and its file
descriptor), ``h11_max_incomplete_event_size`` applies to the slower h11 parser only (and
answers 400), and its keep-alive timeout starts only after a first response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: The defaults of `jaxnitro serve --header-timeout` and `--max-connections`.
HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1000
#: The most bytes of request line and headers (Triton's and nginx's order of magnitude).
MAX_HEADER_BYTES = 64 << 10
#: Seconds a refused connection stays half-closed so that its answer reaches the client
#: (closing a socket with unread bytes sends a reset, which discards what is unsent), and
#: how many may linger at once (beyond, they close at once: a flood must not hold the file
#: descriptors the cap frees).
LINGER_S = 1.0
LINGER_MAX = 64


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = HEADER_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    max_header_bytes: int = MAX_HEADER_BYTES


def protocol_class(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP protocol (``uvicorn.Config(http=...)``) with ``limits`` applied."""
    return type("GuardedHttp", (GuardedHttp,), {"limits": limits})


class GuardedHttp(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    #: Refused connections lingering now (per server: each has its own subclass).
    lingering: ClassVar[int] = 0

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True  # from the connection, and from each request's start
        self._request_begun = False
        self._header_bytes = 0
        self._ended = False  # answered by a guard: whatever else arrives is dropped

    # -- the connection ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.limits.max_connections
        if len(self.connections) > limit:
            self._end(
                503,
                f"the server has {limit} connections open, its limit (jaxnitro serve "
                f"--max-connections); retry shortly, or reuse a kept-alive connection.",
            )
            return
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        # answered before its body was all in: close (after the answer reaches the client)
        self._unset_keepalive_if_required()
        self._ended = True
        self._awaiting_headers = False
        self._disarm()
        self.connections.discard(self)
        self._linger()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return
        # only a chunk that arrives while the headers are pending counts whole: one that
        # starts a request may end the previous one's body
        pending = self._awaiting_headers
        super().data_received(data)
        if pending and self._awaiting_headers and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._end(
                    431,
                    f"the request line and headers exceed {self.limits.max_header_bytes} "
                    f"bytes; send fewer or shorter headers.",
                )

    # -- httptools callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._awaiting_headers = self._request_begun = True
        self._arm()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = self._request_begun = False
        self._header_bytes = 0
        self._disarm()
        super().on_headers_complete()

    # -- the header deadline -----------------------------------------------------------------
    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(
                self.limits.header_timeout, self._header_deadline
            )

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if not self._awaiting_headers or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # a pipelined request: uvicorn reads it only once the one before is answered
            self._arm()
            return
        if not self._request_begun:  # nothing sent at all: close without an answer
            self.connections.discard(self)
            self.transport.close()
            return
        self._end(
            408,
            f"the request line and headers did not arrive within "
            f"{self.limits.header_timeout:g} s (jaxnitro serve --header-timeout).",
        )

    # -- answering and closing ---------------------------------------------------------------
    def _end(self, status: int, message: str) -> None:
        """Answer ``status`` with ``{"error": message}`` and close, dropping the rest."""
        self._ended = True
        self._awaiting_headers = False
        self._disarm()
        self.connections.discard(self)
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # mid-response: no second answer on this connection
            return
        body = json.dumps({"error": message}).encode()
        head = [
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            "connection: close",
        ]
        if status == 503:
            head.append("retry-after: 1")
        self.transport.write("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        self._linger()

    def _linger(self) -> None:
        """Half-close, and close ``LINGER_S`` later: closing with unread bytes at once would
        send a reset, which may discard the answer before the client reads it."""
        cls = type(self)
        if cls.lingering >= LINGER_MAX or not self.transport.can_write_eof():
            self.transport.close()
            return
        cls.lingering += 1
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self._linger_over)

    def _linger_over(self) -> None:
        type(self).lingering -= 1
        self.transport.close()
