"""The client side of an HTTP/1.1 connection, sans-IO (we are the server).

Theory of operation
===================

`ClientSession` turns the client's bytes into events and the proxy's answers
into bytes, one request/response cycle at a time; it does no I/O and keeps no
clock (the driver picks a deadline from `phase`).

Reading. The session keeps the client's bytes not yet consumed. Between
requests (`Phase.IDLE`) leading CRLFs are skipped (RFC 9112 section 2.2). Once
a byte of a head is there (`Phase.HEAD`) every arrival is checked at once:
the first byte must start a method (TLS on a plain port, garbage: 400 now,
not after a timeout), no bare CR or LF may appear (checked incrementally, so a
head without CRLFCRLF cannot hide one), and the head may not outgrow
``max_header_bytes`` (431). When the first CRLFCRLF arrives the exact bytes up
to it go to `tlsedge._http.head.parse_request_head` (every smuggling rule), and
`next_event` returns a `Request`. The body follows (`Phase.BODY`), framed as
the head said: Content-Length bytes, or chunks through a `ChunkedDecoder`;
`Body` events carry the data, `EndOfBody` the trailers. Bytes after the end
stay buffered: a pipelined request, read only after this one is answered.

Writing. `send_response` frames the answer for *this* client: a body that came
chunked or delimited by the upstream's close goes chunked to an HTTP/1.1
client and delimited by our close to an HTTP/1.0 one; HEAD answers, 204 and
304 have none (and a 204 or 1xx no framing field, an HTTP/1.0 client never
``Transfer-Encoding``). It adds ``Connection: close`` whenever the connection
cannot go on (HTTP/1.0, the client asked, or the driver says so). `keep_alive`
says whether a next cycle may start once both directions are complete.

Upgrade. After `send_informational` with 101 the session is done;
`trailing_data` is what the client sent beyond the head, to relay as is.
"""

from __future__ import annotations

import enum
import re
from typing import Final

from tlsedge._http.body import (
    CHUNKED_BODY,
    LENGTH_BODY,
    NO_BODY,
    NO_BODY_STATUSES,
    UNTIL_CLOSE_BODY,
    BodyKind,
    ChunkedDecoder,
    encode_chunk,
    encode_fields,
    encode_last_chunk,
)
from tlsedge._http.events import (
    NEED_DATA,
    Body,
    ConnectionClosed,
    EndOfBody,
    NeedData,
    Request,
)
from tlsedge._http.head import (
    BARE_CR_OR_LF_RE,
    TOKEN_RE,
    RequestHead,
    RequestRejectedError,
    find_head_end,
    parse_request_head,
)
from tlsedge._http.rules import error_response_bytes

__all__ = ["ClientClosedMidRequestError", "ClientSession", "Phase"]

Header = tuple[bytes, bytes]

# A Transfer-Encoding field line, in field lines a head parser validated.
_TRANSFER_ENCODING_LINE_RE: Final = re.compile(
    rb"^transfer-encoding:[^\r]*\r\n", re.IGNORECASE | re.MULTILINE
)
# A framing field line (Content-Length or Transfer-Encoding), the same way.
_FRAMING_LINE_RE: Final = re.compile(
    rb"^(?:content-length|transfer-encoding):[^\r]*\r\n", re.IGNORECASE | re.MULTILINE
)
#: Fields a 1xx response may not carry (RFC 9112 sections 6.1 and 6.2).
_FRAMING_FIELDS: Final = frozenset({b"content-length", b"transfer-encoding"})


# The bytes a token (a method) is made of: what a request's first byte must be.
_TOKEN_BYTES: Final = frozenset(c for c in range(256) if TOKEN_RE.fullmatch(bytes([c])))


class ClientClosedMidRequestError(Exception):
    """The client closed its side in the middle of a request body."""


class Phase(enum.Enum):
    """Where the session is in reading the current request."""

    IDLE = "idle"  # between requests: no byte of the next one yet
    HEAD = "head"  # part of a head has arrived
    BODY = "body"  # the head is read, the body is arriving
    DONE = "done"  # the whole request is read
    SWITCHED = "switched"  # 101 sent: no longer HTTP


# The members as module constants (as `tlsedge._http.body`'s `BodyKind`).
_IDLE: Final = Phase.IDLE
_HEAD: Final = Phase.HEAD
_BODY: Final = Phase.BODY
_DONE: Final = Phase.DONE
_SWITCHED: Final = Phase.SWITCHED


class ClientSession:
    """One client connection's HTTP/1.1 framing; see the module docstring.

    Args:
        max_header_bytes: Longest request head (431 beyond).
        max_headers: Most fields in a head or trailer section (431 beyond).
        max_body_size: Most body bytes per request (413 beyond); 0: no limit.
        initial_data: Bytes an earlier stage read past its own data.
    """

    __slots__ = (
        "_body_kind",
        "_buffer",
        "_chunked",
        "_eof",
        "_remaining",
        "_response_body",
        "_scanned",
        "_trailers",
        "body_bytes",
        "close_after_response",
        "expects_continue",
        "max_body_size",
        "max_header_bytes",
        "max_headers",
        "phase",
        "request",
        "response_complete",
        "response_started",
    )

    def __init__(
        self,
        *,
        max_header_bytes: int,
        max_headers: int,
        max_body_size: int = 0,
        initial_data: bytes = b"",
    ) -> None:
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.max_body_size = max_body_size
        self._buffer = bytearray(initial_data)
        self._eof = False
        self._scanned = 0
        self.phase = _IDLE
        self._start_cycle()

    def _start_cycle(self) -> None:
        self.request: RequestHead | None = None
        self._body_kind = NO_BODY
        self._remaining = 0
        self._chunked: ChunkedDecoder | None = None
        self._trailers: list[Header] | None = None
        self.body_bytes = 0
        self.expects_continue = False
        self.response_started = False
        self.response_complete = False
        self._response_body = NO_BODY
        self.close_after_response = False
        self._scanned = 0

    # -- reading ----------------------------------------------------------

    @property
    def eof(self) -> bool:
        """True once the client closed its sending side."""
        return self._eof

    @property
    def buffered(self) -> bool:
        """True when client bytes are waiting to be read as events."""
        return bool(self._buffer)

    def receive_data(self, data: bytes) -> None:
        """Add bytes from the client; ``b""`` means it closed its side."""
        if data:
            self._buffer += data
        else:
            self._eof = True

    def next_event(
        self,
    ) -> Request | Body | EndOfBody | ConnectionClosed | NeedData:
        """The next event from the client's bytes, or `NEED_DATA`.

        Between requests, a `ConnectionClosed` when the client closed (with
        ``in_head`` when it left part of a head unsent).

        Raises:
            RequestRejectedError: the request is refused (its status says how).
            ClientClosedMidRequestError: EOF inside a request body.
        """
        phase = self.phase
        if phase is _BODY:
            return self._body_event()
        if phase is _IDLE or phase is _HEAD:
            return self._head_event()
        if phase is _DONE and self._trailers is not None:
            trailers, self._trailers = self._trailers, None
            return EndOfBody(trailers)
        return NEED_DATA

    def _head_event(self) -> Request | ConnectionClosed | NeedData:
        buffer = self._buffer
        while buffer.startswith(b"\r\n"):
            del buffer[:2]
            self._scanned = 0
        if not buffer:
            if self._eof:
                return ConnectionClosed(in_head=self.phase is _HEAD)
            return NEED_DATA
        self.phase = _HEAD
        first = buffer[0]
        if first != 13 and first not in _TOKEN_BYTES:
            # Not even a method (TLS on a plain port, garbage): say so now.
            raise RequestRejectedError(400, "not an HTTP request")
        end = find_head_end(buffer, self._scanned)
        limit = self.max_header_bytes
        if end < 0 or end > limit:
            # Scan only the head (a body may follow it) and not a final CR
            # whose LF has not arrived yet. (A whole head within the limit is
            # not scanned here: its parse finds a bare CR or LF first.)
            stop = end if end >= 0 else len(buffer)
            if end < 0 and buffer[-1:] == b"\r":
                stop -= 1
            if BARE_CR_OR_LF_RE.search(buffer, max(0, self._scanned - 1), stop):
                raise RequestRejectedError(400, "bare CR or LF in the request head")
            self._scanned = stop
            if end > limit or len(buffer) > limit:
                raise RequestRejectedError(
                    431, f"request head larger than {limit} bytes"
                )
            if self._eof:
                return ConnectionClosed(in_head=True)
            return NEED_DATA
        head = parse_request_head(bytes(buffer[:end]), max_headers=self.max_headers)
        del buffer[:end]
        self.request = head
        if head.chunked:
            self._body_kind = CHUNKED_BODY
            self._chunked = ChunkedDecoder(
                max_trailer_bytes=self.max_header_bytes,
                max_trailers=self.max_headers,
            )
            self.phase = _BODY
        elif head.content_length:
            self._body_kind = LENGTH_BODY
            self._remaining = head.content_length
            self.phase = _BODY
        else:
            self.phase = _DONE
            self._trailers = []
        if head.version == b"1.1" and head.expect is not None:
            self.expects_continue = head.expect.lower() == b"100-continue"
        return tuple.__new__(Request, (head, end))  # (as the heads: in C)

    def _body_event(self) -> Body | EndOfBody | NeedData:
        buffer = self._buffer
        if not buffer:
            if self._eof:
                raise ClientClosedMidRequestError(
                    "client closed in the middle of the request body"
                )
            return NEED_DATA
        if self._body_kind is LENGTH_BODY:
            take = min(self._remaining, len(buffer))
            data = bytes(buffer[:take])
            del buffer[:take]
            self._remaining -= take
            if not self._remaining:
                self.phase = _DONE
                self._trailers = []
        else:
            decoder = self._chunked
            assert decoder is not None
            data = decoder.take(buffer)
            if decoder.done:
                self.phase = _DONE
                self._trailers = decoder.trailers
            if not data:
                if decoder.done:
                    trailers, self._trailers = decoder.trailers, None
                    return EndOfBody(trailers)
                return self._body_event()
        self.body_bytes += len(data)
        self.expects_continue = False
        limit = self.max_body_size
        if limit and self.body_bytes > limit:
            raise RequestRejectedError(413, f"request body larger than {limit} bytes")
        return Body(data)

    @property
    def request_read(self) -> bool:
        """True once the current request was read in full (body included)."""
        return self.phase is _DONE

    # -- writing ----------------------------------------------------------

    def _head_bytes(self, status: int, reason: bytes, headers: list[Header]) -> bytes:
        return encode_fields(b"HTTP/1.1 %d %s\r\n" % (status, reason), headers)

    def send_informational(
        self, status: int, reason: bytes, headers: list[Header]
    ) -> bytes:
        """A 1xx head for the client (101 switches the connection to bytes),
        without framing fields: a 1xx has no body, and a client or an
        intermediary that believed an upstream's ``Content-Length`` or
        ``Transfer-Encoding`` there would read the final response as one."""
        self.expects_continue = False
        if status == 101:
            self.phase = _SWITCHED
            self.response_started = True
        headers = [(n, v) for n, v in headers if n.lower() not in _FRAMING_FIELDS]
        return self._head_bytes(status, reason, headers)

    def send_response(
        self,
        status: int,
        reason: bytes,
        field_lines: bytes,
        body: BodyKind,
        *,
        close: bool = False,
    ) -> bytes:
        """The final response head, framed for this client.

        Args:
            status, reason: The status line's.
            field_lines: The fields, encoded (``name: value`` CRLF each, as
                `tlsedge._http.rules.end_to_end_fields` gives them: hop-by-hop
                fields already gone, ``Content-Length`` or
                ``Transfer-Encoding`` as the upstream sent them).
            body: How the upstream framed the body.
            close: End the connection after this response.
        """
        return self.send_response_head(
            b"HTTP/1.1 %d %b\r\n%b" % (status, reason, field_lines),
            status,
            body,
            close=close,
        )

    def send_response_head(
        self, head: bytes, status: int, body: BodyKind, *, close: bool = False
    ) -> bytes:
        """`send_response` of a head already written: *head* is an HTTP/1.1
        status line and its field lines, no blank line (a
        `tlsedge._http.head.ResponseHead`'s ``forward``, spliced from the
        upstream's head), and *status* its status."""
        request = self.request
        assert request is not None
        self.expects_continue = False
        self.response_started = True
        version_11 = request.version == b"1.1"
        if request.method == b"HEAD" or status in NO_BODY_STATUSES:
            body = NO_BODY
            # No framing field in a 204, no Transfer-Encoding to an HTTP/1.0
            # client (RFC 9112 sections 6.1 and 6.2): whoever believed it
            # would read the next response as this one's body.
            if status == 204:
                head = _FRAMING_LINE_RE.sub(b"", head)
            elif not version_11:
                head = _TRANSFER_ENCODING_LINE_RE.sub(b"", head)
        elif body is UNTIL_CLOSE_BODY or body is CHUNKED_BODY:
            if version_11:
                if body is UNTIL_CLOSE_BODY:
                    head += b"Transfer-Encoding: chunked\r\n"
                body = CHUNKED_BODY
            else:
                head = _TRANSFER_ENCODING_LINE_RE.sub(b"", head)
                body = UNTIL_CLOSE_BODY
                close = True
        if close or not version_11 or b"close" in request.connection:
            close = True
            head += b"Connection: close\r\n"
        self.close_after_response = close
        self._response_body = body
        if body is NO_BODY:
            self.response_complete = True
        return head + b"\r\n"

    def send_data(self, data: bytes) -> bytes:
        """Response body bytes, framed (never empty: that would end a chunked body)."""
        if self._response_body is CHUNKED_BODY:
            return encode_chunk(data)
        if self._response_body is NO_BODY:
            return b""
        return data

    def send_end(self, trailers: list[Header]) -> bytes:
        """The end of the response body (trailers only where chunked allows)."""
        self.response_complete = True
        if self._response_body is CHUNKED_BODY:
            return encode_last_chunk(trailers)
        return b""

    def send_error(self, status: int, message: str) -> bytes:
        """A complete error response; the connection ends after it."""
        self.response_started = self.response_complete = True
        self.close_after_response = True
        head_only = self.request is not None and self.request.method == b"HEAD"
        return error_response_bytes(status, message, head_only=head_only)

    @property
    def keep_alive(self) -> bool:
        """Whether the connection may carry a next request now."""
        return (
            self.phase is _DONE
            and self.response_complete
            and not self.close_after_response
        )

    def start_next_cycle(self) -> None:
        """Begin the next request (requires `keep_alive`)."""
        assert self.keep_alive
        self.phase = _IDLE
        self._start_cycle()

    @property
    def trailing_data(self) -> bytes:
        """Client bytes not consumed (after a 101: the new protocol's first bytes)."""
        return bytes(self._buffer)
