"""One request/response exchange with an upstream server, sans-IO (we are the client).

Theory of operation
===================

`UpstreamExchange` sends one request that passed the gate
(`tlsedge._http.gate.UpstreamRequest`: `request_head`, then `request_data`
and `request_end` for its body) and parses the answer from the bytes the
driver feeds it (`receive_data`, ``b""`` for EOF; `next_event`). One object
per exchange: a kept-alive connection gets a new one for its next request, and
`reusable` says whether it may.

The request's framing is checked as it goes, not trusted: a sized body must
bring exactly its Content-Length (more, or an end before it, raises
`RequestRejectedError` and leaves the request incomplete), and trailers pass
the gate's field rules. Only a request whose framing was completed
(`request_complete`) leaves the connection reusable: one that ended half-way
would have the upstream read the next client's request as its body.

The response head is read up to the first CRLFCRLF (at most
`MAX_RESPONSE_HEAD_BYTES`) and parsed by
`tlsedge._http.head.parse_response_head`: anything we could not relay safely
(ambiguous framing, bad bytes, a version or status we do not speak) is an
`UpstreamError`, which the driver turns into 502. 1xx heads come as
`Informational`, at most `tlsedge._http.gate.MAX_INFORMATIONAL` of them
(after 101 the exchange stops parsing and `trailing_data` holds the new
protocol's first bytes); the final head as `Response` with its body's
framing (RFC 9112 section 6.3): none for HEAD, 204 and 304, chunked, a
Content-Length, or until the server closes. A Content-Length body already
buffered whole may be taken at once (`rest_of_body`) instead of as events.
Chunked bodies go through a strict `ChunkedDecoder`. EOF before the response
is complete is an `UpstreamError` whose ``empty`` says whether the server sent
nothing at all (a stale kept-alive connection: the driver may send the
request again).
"""

from __future__ import annotations

from typing import Final

from tlsedge._http.body import (
    CHUNKED_BODY,
    LENGTH_BODY,
    NO_BODY,
    NO_BODY_STATUSES,
    UNTIL_CLOSE_BODY,
    ChunkedDecoder,
    encode_chunk,
)
from tlsedge._http.events import (
    NEED_DATA,
    Body,
    EndOfBody,
    Informational,
    NeedData,
    Response,
)
from tlsedge._http.gate import MAX_INFORMATIONAL, UpstreamRequest
from tlsedge._http.head import (
    HeadRejectedError,
    RequestRejectedError,
    ResponseRejectedError,
    parse_response_head,
)

__all__ = [
    "MAX_RESPONSE_HEADERS",
    "MAX_RESPONSE_HEAD_BYTES",
    "UpstreamError",
    "UpstreamExchange",
]

Header = tuple[bytes, bytes]

#: A response head from a backend may be larger than a request head (cookies).
MAX_RESPONSE_HEAD_BYTES: Final = 65536
#: Most fields in a response head or its trailers.
MAX_RESPONSE_HEADERS: Final = 1000


class UpstreamError(Exception):
    """The upstream's answer cannot be relayed (bad bytes, or closed too early).

    Attributes:
        empty: The server sent no byte at all in this exchange.
    """

    def __init__(self, reason: str, *, empty: bool = False) -> None:
        super().__init__(reason)
        self.empty = empty


def _rejected(status: int, reason: str) -> HeadRejectedError:
    return ResponseRejectedError(f"bad chunked response body: {reason}")


class UpstreamExchange:
    """One request and its response on an upstream connection.

    Args:
        request: The request, as the gate built it.
    """

    __slots__ = (
        "_body",
        "_buffer",
        "_chunked",
        "_eof",
        "_informational",
        "_keep_alive",
        "_remaining",
        "_request_left",
        "_state",
        "_trailers",
        "method",
        "received",
        "request",
        "request_complete",
        "switched",
    )

    def __init__(self, request: UpstreamRequest) -> None:
        self.request = request
        self.method = request.method
        self._buffer = bytearray()
        self._eof = False
        self._state = "head"  # "head", "body", "end", "done", "switched"
        self._body = NO_BODY
        self._remaining = 0
        self._chunked: ChunkedDecoder | None = None
        self._trailers: list[Header] = []
        self._keep_alive = True
        self._informational = 0
        #: Body bytes a sized request still owes its Content-Length.
        self._request_left = request.content_length or 0
        self.received = 0
        self.request_complete = False
        self.switched = False

    # -- the request --------------------------------------------------------

    def request_head(self, server: str) -> bytes:
        """The request head for *server* (``host:port``, the Host of a request
        that has none); a request without a body is complete with it.

        Raises:
            RequestRejectedError: 400, the server's address cannot be a Host.
        """
        head = self.request.head_for(server)
        if self.request.body is NO_BODY:
            self.request_complete = True
        return head

    def request_data(self, data: bytes) -> bytes:
        """Request body bytes, framed (*data* not empty).

        Raises:
            RequestRejectedError: 400, more bytes than the Content-Length.
        """
        if self.request.body is CHUNKED_BODY:
            return encode_chunk(data)
        self._request_left -= len(data)
        if self._request_left < 0:
            raise RequestRejectedError(
                400, "request body longer than its Content-Length"
            )
        return data

    def request_end(self, trailers: list[Header]) -> bytes:
        """The end of the request body (trailers only when chunked).

        Raises:
            RequestRejectedError: 400, the body ended short of its
                Content-Length, or a trailer the gate refuses.
        """
        if self.request.body is CHUNKED_BODY:
            data = UpstreamRequest.last_chunk(trailers)
        elif self._request_left:
            raise RequestRejectedError(
                400,
                f"request body ended {self._request_left} bytes short of its "
                "Content-Length",
            )
        else:
            data = b""
        self.request_complete = True
        return data

    # -- the response -------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Add bytes from the upstream; ``b""`` means it closed its side."""
        if data:
            self.received += len(data)
            self._buffer += data
        else:
            self._eof = True

    def next_event(self) -> Informational | Response | Body | EndOfBody | NeedData:
        """The next event from the upstream's bytes, or `NEED_DATA`.

        Raises:
            UpstreamError: a response we cannot relay, or EOF before its end.
        """
        state = self._state
        if state == "body":
            return self._body_event()
        if state == "head":
            return self._head_event()
        if state == "end":
            self._state = "done"
            return EndOfBody(self._trailers)
        return NEED_DATA

    def _head_event(self) -> Informational | Response | Body | EndOfBody | NeedData:
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n") + 4  # (3: no CRLFCRLF yet)
        if end < 4:
            if len(buffer) > MAX_RESPONSE_HEAD_BYTES:
                raise UpstreamError(
                    f"response head larger than {MAX_RESPONSE_HEAD_BYTES} bytes"
                )
            if b"\n\n" in buffer:
                raise UpstreamError("bad response from upstream: bare LF in the head")
            if self._eof:
                if not buffer:
                    raise UpstreamError(
                        "upstream closed the connection before responding",
                        empty=not self.received,
                    )
                raise UpstreamError("upstream closed the connection inside a head")
            return NEED_DATA
        if end > MAX_RESPONSE_HEAD_BYTES:
            raise UpstreamError(
                f"response head larger than {MAX_RESPONSE_HEAD_BYTES} bytes"
            )
        try:
            head = parse_response_head(
                bytes(buffer[:end]), max_headers=MAX_RESPONSE_HEADERS
            )
        except ResponseRejectedError as exc:
            raise UpstreamError(f"bad response from upstream: {exc.reason}") from exc
        del buffer[:end]
        status = head.status
        if status < 200:
            self._informational += 1
            if self._informational > MAX_INFORMATIONAL:
                raise UpstreamError(
                    f"more than {MAX_INFORMATIONAL} informational (1xx) responses"
                )
            if status == 101:
                self._state = "switched"
                self.switched = True
            return Informational(head)
        self._keep_alive = head.version == b"1.1" and b"close" not in head.connection
        if self.method == b"HEAD" or status in NO_BODY_STATUSES:
            body = NO_BODY
        elif head.chunked:
            body = CHUNKED_BODY
            self._chunked = ChunkedDecoder(
                max_trailer_bytes=MAX_RESPONSE_HEAD_BYTES,
                max_trailers=MAX_RESPONSE_HEADERS,
                rejected=_rejected,
            )
        elif head.content_length is not None:
            body = LENGTH_BODY
            self._remaining = head.content_length
        else:
            body = UNTIL_CLOSE_BODY
            self._keep_alive = False
        self._body = body
        if body is NO_BODY or (body is LENGTH_BODY and not self._remaining):
            self._state = "end"
        else:
            self._state = "body"
        return tuple.__new__(Response, (head, body))  # (as the heads: in C)

    def _body_event(self) -> Body | EndOfBody | NeedData:
        buffer = self._buffer
        body = self._body
        if not buffer:
            if not self._eof:
                return NEED_DATA
            if body is UNTIL_CLOSE_BODY:
                self._state = "done"
                return EndOfBody([])
            raise UpstreamError("upstream closed the connection mid-response")
        if body is LENGTH_BODY:
            take = min(self._remaining, len(buffer))
            data = bytes(buffer[:take])
            del buffer[:take]
            self._remaining -= take
            if not self._remaining:
                self._state = "end"
            return Body(data)
        if body is UNTIL_CLOSE_BODY:
            data = bytes(buffer)
            buffer.clear()
            return Body(data)
        decoder = self._chunked
        assert decoder is not None
        try:
            data = decoder.take(buffer)
        except ResponseRejectedError as exc:
            raise UpstreamError(exc.reason) from exc
        if decoder.done:
            self._trailers = decoder.trailers
            self._state = "end"
        if data:
            return Body(data)
        if decoder.done:
            self._state = "done"
            return EndOfBody(self._trailers)
        return self._body_event() if self._eof else NEED_DATA

    def rest_of_body(self) -> bytes | None:
        """Right after a `Response` with a Content-Length body: the whole
        body at once when it is all buffered (the response is then complete:
        no `Body` or `EndOfBody` follows), else None (the events bring it)."""
        remaining = self._remaining
        buffer = self._buffer
        if (
            self._state != "body"
            or self._body is not LENGTH_BODY
            or len(buffer) < remaining
        ):
            return None
        data = bytes(buffer[:remaining])
        del buffer[:remaining]
        self._remaining = 0
        self._state = "done"
        return data

    @property
    def response_complete(self) -> bool:
        """True once the whole response was read."""
        return self._state == "done"

    @property
    def reusable(self) -> bool:
        """Whether the connection may carry another exchange: request and
        response complete, the server keeps it alive, no stray bytes."""
        return (
            self.request_complete
            and self._state == "done"
            and self._keep_alive
            and not self._buffer
            and not self._eof
        )

    @property
    def trailing_data(self) -> bytes:
        """Upstream bytes beyond the response head (after a 101: the new protocol's)."""
        return bytes(self._buffer)
