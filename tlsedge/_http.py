"""HTTP/1.1 reverse proxy mode: h11 on both sides, pooled upstream keep-alive.

Theory of operation
===================

`serve_http` runs one client connection (after PROXY unwrap and TLS) as a loop of
*exchanges*, one per request, answered strictly in order (pipelined requests
wait in our buffer or the kernel's until the previous response is complete).

Reading a request head (sans-IO checks first)
---------------------------------------------
The connection keeps its own byte buffer of client data not yet given to h11.
For every request we read until the buffer holds a complete head (the first
CRLFCRLF), and `tlsedge._http_head.parse_request_head` validates those exact
bytes *before* h11 sees them: size and field-count limits (431), bare LF / bare
CR / control characters, obs-fold, duplicate or malformed ``Content-Length``, both
``Content-Length`` and ``Transfer-Encoding``, any coding but ``chunked``, a
missing, repeated or malformed ``Host`` (400). h11 alone would let
``Transfer-Encoding`` win over ``Content-Length``, merge ``Content-Length: 5, 5``
and accept obs-fold and bare LF. Only then is the buffer handed to a *fresh*
``h11.Connection`` for this exchange (one per request, so the bytes h11 parses
are exactly the bytes we checked); what h11 does not consume (a pipelined next
request) comes back through ``trailing_data`` into our buffer afterwards.

A chunked request body is checked the same way as it streams: every byte given
to h11 first goes through a `ChunkedBodyScanner` (strict chunk-size lines, at
most 16 hex digits, CRLF after data, trailer lines like header lines), and when
h11 reports the end of the body the scanner must agree on where it ended.

Timeouts, each a cancel scope named after its ``[listeners.http]`` field:
``keepalive_timeout`` (waiting for the first byte of a next request: quiet
close), ``request_header_timeout`` (the rest of the head; for the first request
counted from the start of the connection: 408), ``response_timeout`` (from the
request fully sent upstream to the response head: 504). Body transfers in
either direction are bounded per read/write by the listener's ``idle_timeout``.
A request body must also keep up an average rate: after the grace of
``request_body_timeout`` it may take 1 s per ``request_body_min_rate`` bytes
received (Apache's mod_reqtimeout rule), so a body trickled a byte at a time,
never idle for long, still gets 408.

One exchange
------------
The upstream connection comes from the `KeepAlivePool` (idle connections per
backend server, LIFO, checked for EOF/readability before reuse) or is opened to
the server the balancer picked. With ``send_proxy`` the connection is instead
*dedicated* to this client connection: opened with the PROXY header first, kept
across its requests, never pooled (a PROXY header describes one client). To a
``protocol = "tls"`` backend the connection is a `TLSStream` whose handshake is
part of `BackendPool.connect` (a failed handshake is a failed, retried connect);
the PROXY header then goes raw before the handshake. Idle TLS connections are
checked through the TLS layer (`_is_idle_and_open`): session tickets are not
data, a close_notify is an EOF.

The target goes upstream in origin-form: an absolute-form target
(``http://host/x``) becomes ``/x`` and its authority the ``Host`` (`origin_form`,
RFC 9112 section 3.2.2); other targets but ``*`` for OPTIONS get 400. Header
fields named with ``_`` are dropped unless ``underscores_in_headers``.
Forwarded headers are rewritten by `tlsedge._forwarded`; hop-by-hop fields
(``Connection`` and the fields it names, ``Keep-Alive``, ``TE``, ...) are
dropped both ways. A second ``h11.Connection`` (client role) frames the request
upstream. The request body is pumped by a child task (read one chunk, send it,
only then read the next: backpressure) while the main task reads the response:
1xx are relayed (``100 Continue`` only to a client that asked for it), the
response head goes out, then the body, chunk by chunk, trailers included when
both framings allow them.

Reuse: the client connection continues only when its h11 connection ended the
exchange cleanly (both sides ``DONE``: keep-alive, whole request read) and we
are not draining; the upstream connection goes back to the pool only when *its*
h11 connection is ``DONE``/``DONE`` with no stray bytes.

Failures
--------
No healthy server: 503. Connect failure after retries: 502. Upstream closed or
reset before any response byte: 502, except that the request is sent again on
a fresh connection when the failed connection was a reused one (a pooled
connection the server had just closed) and the request has no body, and once
on another server when the method is idempotent and has no body. No response
head within ``response_timeout``: 504. Upstream dying after the response head
went out: the client connection is aborted with an RST
(`tlsedge._relay.set_abortive_close`), so a chunked response never gets its
last chunk and a Content-Length response stays short: the client sees a broken
response, never a complete-looking one. Error responses are tiny plain-text
bodies with ``Connection: close``, each with a log line saying what was wrong;
after one we *linger* (FIN, then read and discard for a moment) so the client's
unread upload does not turn our close into an RST that destroys the response.

``Expect: 100-continue`` is forwarded: the upstream decides (and can refuse
before the upload), its ``100`` is relayed. ``Upgrade``: after the upstream's
``101`` both h11 connections are ``SWITCHED_PROTOCOL``; the bytes each had
buffered beyond the heads (``trailing_data``) are forwarded first, byte-exact,
then `tlsedge._relay.relay` carries the rest with its half-close rules.
``CONNECT`` gets 501 (this is a reverse proxy, not a tunnel).

Drain: once ``drain`` is set, the next response of the connection carries
``Connection: close`` and the connection ends after it; a connection idle
between requests is closed at once.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import http
import json
import logging
import math
import re
import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Final

import h11
import trio

from tlsedge._accesslog import format_address, format_time
from tlsedge._balancer import Server, ServerLease
from tlsedge._config import HttpConfig, ListenerConfig
from tlsedge._forwarded import (
    FORWARDING_HEADERS,
    ForwardingContext,
    choose_request_id,
    forwarding_key,
    is_trusted_peer,
    rewrite_forwarding_headers,
)
from tlsedge._http_head import (
    BARE_CR_OR_LF_RE as _BARE_CR_OR_LF_RE,
    CONTROL_RE as _CONTROL_RE,
    HOST_RE as _HOST_RE,
    REQUEST_LINE_RE as _REQUEST_LINE_RE,
    TOKEN as _TOKEN,
    TOKEN_RE as _TOKEN_RE,
    RequestRejectedError,
    parse_request_head,
)
from tlsedge._relay import RelayStats, relay, set_abortive_close
from tlsedge._termination import Termination
from tlsedge._tls import SSLFacts
from tlsedge._tls_stream import TLSStream
from tlsedge._upstream import BackendPool, ConnectFailedError, NoServerError

__all__ = [
    "DEFAULT_MAX_IDLE_PER_SERVER",
    "DEFAULT_UPSTREAM_IDLE_TIMEOUT",
    "ChunkedBodyScanner",
    "HttpConnectionResult",
    "KeepAlivePool",
    "RequestLog",
    "RequestRejectedError",
    "origin_form",
    "serve_http",
]

LOGGER = logging.getLogger("tlsedge.http")
ACCESS_LOGGER = logging.getLogger("tlsedge.access")

Header = tuple[bytes, bytes]

# -- constants ------------------------------------------------------------------

#: Largest read from either side at once; also bounds what h11 buffers per read.
READ_SIZE: Final = 65536
#: Idle upstream connections kept per backend server (nginx's ``keepalive 32``).
DEFAULT_MAX_IDLE_PER_SERVER: Final = 32
#: How long an idle upstream connection is kept. Below the keep-alive timeouts
#: of common app servers (uvicorn and hypercorn 5 s, gunicorn 2 s is the odd one
#: out: its closes are caught by the EOF check and the stale-connection retry).
DEFAULT_UPSTREAM_IDLE_TIMEOUT: Final = 4.0
#: How often `KeepAlivePool.run` sweeps expired and closed idle connections.
POOL_SWEEP_INTERVAL: Final = 1.0
#: A response head from a backend may be larger than a request head (cookies).
MAX_RESPONSE_HEAD_BYTES: Final = 65536
#: After an error response: FIN, then read and discard the client's unread data
#: for up to this long / this much (nginx's lingering_close, much shorter), so
#: that closing with unread data (which sends an RST) cannot destroy the answer.
LINGER_TIMEOUT: Final = 2.0
LINGER_MAX_BYTES: Final = 1 << 20
#: A chunk-size line (size and extensions) longer than this is an attack.
MAX_CHUNK_LINE: Final = 4096
#: Chunk sizes beyond 16 hex digits overflow 64-bit parsers (a smuggling vector).
MAX_CHUNK_SIZE_DIGITS: Final = 16
#: Request targets and User-Agent values are cut to this many characters in the
#: access log.
MAX_LOGGED_TEXT: Final = 512
#: RFC 9110 section 9.2.2, as far as retrying without a body is concerned.
IDEMPOTENT_METHODS: Final = frozenset(
    {
        b"GET",
        b"HEAD",
        b"OPTIONS",
        b"PUT",
        b"DELETE",
        b"TRACE",
    }
)
#: Hop-by-hop fields (RFC 9110 section 7.6.1), never forwarded either way.
HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"upgrade",
    }
)
#: Fields a ``Connection`` header may not make us drop: framing and routing.
_PROTECTED: Final = frozenset({b"host", b"content-length", b"transfer-encoding"})
#: Fields dropped from trailers: framing, routing, hop-by-hop.
_NOT_IN_TRAILERS: Final = HOP_BY_HOP | _PROTECTED | {b"trailer", b"expect"}

_REASONS: Final = {
    400: b"Bad Request",
    408: b"Request Timeout",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}

# -- sans-IO request checks -----------------------------------------------------

# RFC 3986 scheme ":" hier-part (an absolute-form target; origin-form starts "/").
_ABSOLUTE_FORM_RE: Final = re.compile(rb"([A-Za-z][A-Za-z0-9+.-]*):(.*)")
_CHUNK_LINE_RE: Final = re.compile(
    rb"([0-9A-Fa-f]{1,%d})" % MAX_CHUNK_SIZE_DIGITS
    + rb"(?:;"
    + _TOKEN
    + rb"(?:=(?:"
    + _TOKEN
    + rb'|"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"))?)*'
)


def find_head_end(buffer: bytes | bytearray, start: int = 0) -> int:
    """Offset just past the first CRLFCRLF in *buffer*, or -1."""
    index = buffer.find(b"\r\n\r\n", max(0, start - 3))
    return -1 if index < 0 else index + 4


def origin_form(method: bytes, target: bytes) -> tuple[bytes, bytes | None]:
    """The request target to send upstream, and the authority to send as Host.

    Origin-form (``/path?query``) and, for OPTIONS, asterisk-form (``*``) go on
    as they are (no authority). An absolute-form target
    (``http://example.com:8080/path?query``) becomes origin-form (``/path?query``;
    ``/`` for an empty path, ``*`` for an OPTIONS request with neither path nor
    query) and its authority (``example.com:8080``, as sent) is returned to
    replace ``Host``: RFC 9112 section 3.2.2 has a server use the target's
    authority and ignore ``Host``, and a proxy send a ``Host`` made from the
    target. So the backend's target, its ``Host`` and ``Forwarded: host=``
    agree. The scheme does not change ``X-Forwarded-Proto`` (the listener's TLS
    does).

    Raises:
        RequestRejectedError: 400 for every other target: a scheme other than
            ``http``/``https``, no ``//authority``, an empty host, userinfo
            (``user@``), a malformed authority, a fragment (``#``), ``*`` with
            a method other than OPTIONS, or none of the forms at all. (CONNECT
            and its authority-form get 501 before this.)
    """
    if target[:1] == b"/":
        return target, None
    if target == b"*":
        if method == b"OPTIONS":
            return target, None
        raise RequestRejectedError(400, "the target '*' is only for OPTIONS")
    match = _ABSOLUTE_FORM_RE.fullmatch(target)
    if match is None:
        raise RequestRejectedError(
            400, "malformed request target: expected '/path' or 'http://host/path'"
        )
    scheme, rest = match.groups()
    if scheme.lower() not in {b"http", b"https"}:
        shown = scheme[:32].decode("ascii")
        raise RequestRejectedError(
            400, f"request target with scheme {shown!r}: expected http or https"
        )
    if not rest.startswith(b"//"):
        raise RequestRejectedError(400, "absolute-form target without '//host'")
    if b"#" in rest:
        raise RequestRejectedError(400, "fragment ('#') in the request target")
    ends = [i for i in (rest.find(b"/", 2), rest.find(b"?", 2)) if i >= 0]
    end = min(ends, default=len(rest))
    authority, path = rest[2:end], rest[end:]
    if b"@" in authority:
        raise RequestRejectedError(400, "userinfo ('user@') in the request target")
    if not _HOST_RE.fullmatch(authority):
        raise RequestRejectedError(400, "malformed host in the request target")
    if authority[:1] in {b"", b":"}:
        raise RequestRejectedError(400, "empty host in the request target")
    if not path:
        path = b"*" if method == b"OPTIONS" else b"/"
    elif path[:1] == b"?":
        path = b"/" + path
    return path, authority


class _ChunkState(enum.Enum):
    SIZE = "size"
    DATA = "data"
    DATA_END = "data_end"
    TRAILER = "trailer"
    DONE = "done"


class ChunkedBodyScanner:
    """Strict validation of a chunked body as it streams (no I/O, no copies of data).

    Feed it every byte of the body, in order, exactly as given to h11. It
    raises on the first framing error and knows where the body ended:
    ``excess`` counts the bytes fed after the end (the next request).

    Args:
        max_trailer_bytes: Total size limit of the trailer section.
        max_trailers: Most trailer fields.
    """

    __slots__ = (
        "_line",
        "_max_trailer_bytes",
        "_max_trailers",
        "_remaining",
        "_state",
        "_trailer_bytes",
        "_trailers",
        "excess",
    )

    def __init__(self, *, max_trailer_bytes: int, max_trailers: int) -> None:
        self._state = _ChunkState.SIZE
        self._line = bytearray()
        self._remaining = 0
        self._max_trailer_bytes = max_trailer_bytes
        self._max_trailers = max_trailers
        self._trailer_bytes = 0
        self._trailers = 0
        self.excess = 0

    @property
    def done(self) -> bool:
        """True once the last chunk and the trailer section were seen."""
        return self._state is _ChunkState.DONE

    def feed(self, data: bytes | bytearray) -> None:
        """Scan the next bytes of the body.

        Raises:
            RequestRejectedError: 400 for any framing error, 431 for trailers
                beyond the limits.
        """
        pos, end = 0, len(data)
        while pos < end:
            state = self._state
            if state is _ChunkState.DONE:
                self.excess += end - pos
                return
            if state is _ChunkState.DATA:
                take = min(self._remaining, end - pos)
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = _ChunkState.DATA_END
                continue
            newline = data.find(b"\n", pos)
            stop = end if newline < 0 else newline + 1
            self._line += data[pos:stop]
            pos = stop
            limit = (
                MAX_CHUNK_LINE
                if state is not _ChunkState.TRAILER
                else self._max_trailer_bytes
            )
            if len(self._line) > limit:
                raise RequestRejectedError(
                    431 if state is _ChunkState.TRAILER else 400,
                    "chunk line or trailer too long",
                )
            if newline < 0:
                return
            line = bytes(self._line)
            self._line.clear()
            if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
                raise RequestRejectedError(400, "bare CR or LF in chunked framing")
            self._line_done(line[:-2])

    def _line_done(self, line: bytes) -> None:
        state = self._state
        if state is _ChunkState.SIZE:
            match = _CHUNK_LINE_RE.fullmatch(line)
            if match is None:
                raise RequestRejectedError(400, "malformed chunk size line")
            size = int(match.group(1), 16)
            if size:
                self._remaining = size
                self._state = _ChunkState.DATA
            else:
                self._state = _ChunkState.TRAILER
        elif state is _ChunkState.DATA_END:
            if line:
                raise RequestRejectedError(400, "chunk data longer than its size")
            self._state = _ChunkState.SIZE
        elif not line:
            self._state = _ChunkState.DONE
        else:
            self._trailers += 1
            self._trailer_bytes += len(line) + 2
            if (
                self._trailers > self._max_trailers
                or self._trailer_bytes > self._max_trailer_bytes
            ):
                raise RequestRejectedError(431, "trailer section too large")
            name, colon, _ = line.partition(b":")
            if line[:1] in {b" ", b"\t"} or not colon or not _TOKEN_RE.fullmatch(name):
                raise RequestRejectedError(400, "malformed trailer field")
            if _CONTROL_RE.search(line):
                raise RequestRejectedError(400, "control character in a trailer")


def _connection_tokens(headers: Sequence[Header]) -> set[bytes]:
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return tokens


def strip_hop_by_hop(headers: Sequence[Header], *, keep_upgrade: bool) -> list[Header]:
    """*headers* without hop-by-hop fields and the fields ``Connection`` names.

    Framing and ``Host`` survive whatever ``Connection`` says (a client must not
    make us drop the framing we forward). With *keep_upgrade*, ``Upgrade`` stays
    and ``Connection: upgrade`` is the only connection option sent.
    """
    named = _connection_tokens(headers) - _PROTECTED
    drop = HOP_BY_HOP | named
    if keep_upgrade:
        drop = drop - {b"upgrade"}
    out = [(n, v) for n, v in headers if n.lower() not in drop]
    if keep_upgrade:
        out.append((b"Connection", b"upgrade"))
    return out


def _header_values(headers: Sequence[Header], name: bytes) -> list[bytes]:
    return [v for n, v in headers if n.lower() == name]


def error_response_bytes(
    status: int, message: str, *, head_only: bool = False
) -> bytes:
    """A complete small plain-text response with ``Connection: close``."""
    body = f"{status} {_REASONS.get(status, b'Error').decode()}: {message}\n".encode()
    head = (
        b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n"
        % (status, _REASONS.get(status, b"Error"), len(body))
    )
    return head if head_only else head + body


def _reason(status: int, reason: bytes) -> bytes:
    """The upstream's reason phrase, or the standard one when it sent none."""
    if reason:
        return reason
    try:
        return http.HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def _log_text(value: bytes) -> str:
    """A peer's bytes for the access log: latin-1, cut at `MAX_LOGGED_TEXT`."""
    text = value.decode("latin-1")
    if len(text) > MAX_LOGGED_TEXT:
        return text[:MAX_LOGGED_TEXT] + "..."
    return text


# -- upstream keep-alive pool ---------------------------------------------------


def _socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    current: object = stream
    for _ in range(8):  # SSLStream over PrefixedStream over SocketStream is 3
        if isinstance(current, trio.SocketStream):
            return current.socket
        current = getattr(current, "transport_stream", None)
        if current is None:
            return None
    return None


def _readable(sock: trio.socket.SocketType) -> bool:
    """Whether a read would not block (data, FIN, RST; or the socket is closed).

    ``poll`` (not ``select``) so that descriptors above 1023 work.
    """
    fd = sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


async def _is_idle_and_open(stream: trio.abc.Stream) -> bool:
    """False when the peer closed, reset or (unexpectedly) sent something.

    An idle HTTP/1.1 connection must have nothing to read: readability means a
    FIN, an RST or stray bytes, and each makes it unusable. Over TLS, the
    socket may also hold records without application data (a TLS 1.3 server
    sends its session tickets after the handshake): what the socket holds is
    read without blocking and decrypted, and only application data, a
    close_notify, an EOF or a TLS error make the connection unusable. Never
    blocks; checkpoints only over TLS with something to read.
    """
    sock = _socket_of(stream)
    if sock is None:
        return True
    if not isinstance(stream, TLSStream):
        return not _readable(sock)
    transport_data: bytes | None = None
    while True:
        try:
            stream.receive_nowait(transport_data)
        except trio.WouldBlock:
            pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        else:
            return False  # application data, close_notify or EOF
        if not _readable(sock):
            return True
        try:
            # Readable: returns at once (data, b"" for a FIN, or the RST).
            transport_data = bytes(
                await stream.transport_stream.receive_some(READ_SIZE)
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return False


class KeepAlivePool:
    """Idle upstream connections per backend server, shared by client connections.

    ``acquire(server)`` returns the most recently released idle connection to
    that server that is still usable (not expired after ``idle_timeout``, no
    EOF/RST/stray bytes pending; over TLS, no close_notify or application data
    either), or None. ``release(server, stream)`` parks a
    connection whose last exchange ended cleanly; beyond ``max_idle_per_server``
    the oldest one is closed. Expired connections are closed lazily on
    ``acquire``/``release``, and every ``POOL_SWEEP_INTERVAL`` by `run` when the
    owner runs it. Connections that carried a PROXY header never come here.

    Args:
        max_idle_per_server: Most idle connections kept per server (0: none).
        idle_timeout: Seconds an idle connection is kept.
    """

    def __init__(
        self,
        max_idle_per_server: int = DEFAULT_MAX_IDLE_PER_SERVER,
        idle_timeout: float = DEFAULT_UPSTREAM_IDLE_TIMEOUT,
    ) -> None:
        if max_idle_per_server < 0 or not idle_timeout >= 0:
            msg = "max_idle_per_server and idle_timeout must be >= 0"
            raise ValueError(msg)
        self.max_idle_per_server = max_idle_per_server
        self.idle_timeout = idle_timeout
        self._idle: dict[Server, collections.deque[tuple[float, trio.abc.Stream]]] = {}
        self._closed = False

    def idle_count(self, server: Server | None = None) -> int:
        """Idle connections kept (for *server*, or in total)."""
        if server is not None:
            return len(self._idle.get(server, ()))
        return sum(len(entries) for entries in self._idle.values())

    async def acquire(self, server: Server) -> trio.abc.Stream | None:
        """A usable idle connection to *server*, or None."""
        entries = self._idle.get(server)
        now = trio.current_time()
        while entries:
            released, stream = entries.pop()
            if not entries:
                del self._idle[server]
            if now - released < self.idle_timeout and await _usable(stream):
                return stream
            await trio.aclose_forcefully(stream)
            entries = self._idle.get(server)
        return None

    async def release(self, server: Server, stream: trio.abc.Stream) -> None:
        """Park *stream* (its last exchange ended cleanly) for reuse."""
        if self._closed or self.max_idle_per_server == 0:
            await trio.aclose_forcefully(stream)
            return
        entries = self._idle.setdefault(server, collections.deque())
        entries.append((trio.current_time(), stream))
        while len(entries) > self.max_idle_per_server:
            _, oldest = entries.popleft()
            await trio.aclose_forcefully(oldest)

    async def purge(self) -> None:
        """Close every idle connection that expired or that the server closed."""
        now = trio.current_time()
        for server in list(self._idle):
            # Taken out while checked (a TLS check checkpoints): concurrent
            # acquires and releases use a fresh deque meanwhile.
            entries = self._idle.pop(server, None) or collections.deque()
            keep: collections.deque[tuple[float, trio.abc.Stream]]
            keep = collections.deque()
            for released, stream in entries:
                if now - released < self.idle_timeout and await _usable(stream):
                    keep.append((released, stream))
                else:
                    await trio.aclose_forcefully(stream)
            keep.extend(self._idle.pop(server, ()))  # released meanwhile: newer
            if self._closed:
                for _, stream in keep:
                    await trio.aclose_forcefully(stream)
                continue
            while len(keep) > self.max_idle_per_server:
                _, oldest = keep.popleft()
                await trio.aclose_forcefully(oldest)
            if keep:
                self._idle[server] = keep

    async def run(self, *, interval: float = POOL_SWEEP_INTERVAL) -> None:
        """Sweep with `purge` every *interval* seconds until cancelled (optional)."""
        while True:
            await trio.sleep(interval)
            await self.purge()

    async def aclose(self) -> None:
        """Close every idle connection; later releases close at once."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for entries in idle.values():
            for _, stream in entries:
                await trio.aclose_forcefully(stream)


async def _usable(stream: trio.abc.Stream) -> bool:
    """`_is_idle_and_open`, shielded: it never blocks, and a connection taken
    out of the pool for the check must not be lost to a cancellation."""
    with trio.CancelScope(shield=True):
        usable = await _is_idle_and_open(stream)
    return usable


# -- results and logs -----------------------------------------------------------


#: Error responses that say the backend failed: logged at WARNING. Every other
#: error response (4xx, and 501/505 for what the client asked) is the client's
#: doing, logged at INFO: a client must not be able to raise warnings at will.
_BACKEND_FAILURES: Final = frozenset(
    {
        Termination.NO_SERVER,
        Termination.CONNECT_FAILED,
        Termination.SERVER_ERROR,
        Termination.RESPONSE_TIMEOUT,
    }
)


@dataclass(slots=True)
class HttpConnectionResult:
    """What `serve_http` reports for the connection-level access-log line.

    Updated in place while the connection runs (pass one in to see the counts
    of a connection that was cancelled).

    Attributes:
        requests: Requests answered (with any status).
        bytes_from_client: Raw bytes read from the client.
        bytes_to_client: Raw bytes written to the client.
        termination: Why it ended (see `Termination`).
        detail: A human-readable detail for errors, or None.
        server: The last upstream server used (``ip:port``), or None.
    """

    requests: int = 0
    bytes_from_client: int = 0
    bytes_to_client: int = 0
    termination: str = Termination.UNKNOWN
    detail: str | None = None
    server: str | None = None


@dataclass(slots=True)
class RequestLog:
    """One per-request access-log line (logger ``tlsedge.access``, JSON).

    The fields a connection's line has too (``listener``, ``client``, ``start``,
    ``tls``, ``sni``, ``backend``, ``server``, ``termination``, ``detail``)
    have its names and formats; docs/operations.md describes every field.
    ``start`` is a Unix time, written in RFC 3339 with milliseconds (UTC).
    """

    connection: str
    listener: str
    client: str | None
    start: float = 0.0
    method: str | None = None
    target: str | None = None
    version: str | None = None
    host: str | None = None
    user_agent: str | None = None
    status: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    connect: float | None = None
    first_byte: float | None = None
    total: float = 0.0
    backend: str | None = None
    server: str | None = None
    tls: str | None = None
    sni: str | None = None
    request_id: str | None = None
    termination: str = Termination.OK
    detail: str | None = None

    def emit(self) -> None:
        """Write the line (if the access logger is enabled)."""
        if not ACCESS_LOGGER.isEnabledFor(logging.INFO):
            return
        line: dict[str, object] = {"type": "http"}
        for name in _REQUEST_LOG_FIELDS:
            line[name] = getattr(self, name)
        line["start"] = format_time(self.start)
        for key in ("connect", "first_byte", "total"):
            value = line[key]
            if isinstance(value, float):
                line[key] = round(value, 6)
        ACCESS_LOGGER.info("%s", _ENCODE(line))


_REQUEST_LOG_FIELDS: Final = tuple(f.name for f in fields(RequestLog))
# json.dumps(obj, separators=...) builds a new JSONEncoder per call; reuse one.
_ENCODE: Final = json.JSONEncoder(separators=(",", ":")).encode


# -- the I/O layer: h11 <-> trio -----------------------------------------------


class _ClientGoneError(Exception):
    """The client reset, closed or stalled; nothing more can be sent to it."""


class _UpstreamGoneError(Exception):
    """The upstream reset, closed, stalled or spoke bad HTTP."""

    def __init__(self, reason: str, *, empty: bool = False) -> None:
        super().__init__(reason)
        self.empty = empty  # closed/reset before sending any response byte


@dataclass(slots=True)
class _Upstream:
    stream: trio.abc.Stream
    #: Held while an exchange uses the connection; a dedicated connection
    #: waiting for its client's next request holds a released one.
    lease: ServerLease
    reused: bool
    connect_time: float
    prefix: bytes = b""  # the PROXY header, sent with the first request head

    @property
    def server(self) -> Server:
        return self.lease.server


@dataclass(slots=True)
class _Failure:
    termination: str
    detail: str
    status: int | None  # the error response, if none was started
    retryable: bool = False  # upstream failed before any response byte


@dataclass(slots=True)
class _Exchange:
    """State of one request/response exchange, shared by the two pumps."""

    request: h11.Request
    target: bytes  # what goes upstream: origin-form (see `origin_form`)
    cconn: h11.Connection
    uconn: h11.Connection
    upstream: _Upstream
    log: RequestLog
    started: float
    has_body: bool
    chunked: bool
    length: int  # the Content-Length (0 when chunked or without a body)
    upgrade: bool
    scanner: ChunkedBodyScanner | None
    response_timeout_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    nursery_scope: trio.CancelScope | None = None
    request_read: bool = False  # the client's whole request has been read
    request_complete: bool = False  # ... and written to the upstream
    response_started: bool = False
    response_complete: bool = False
    upstream_bytes: int = 0  # received from the upstream in this exchange
    switched: bool = False
    body_bytes: int = 0
    body_started: float = 0.0  # when the request body pump started
    failure: _Failure | None = None

    def fail(self, failure: _Failure) -> None:
        if self.failure is None:
            self.failure = failure


class _HttpConnection:
    """One client connection in HTTP mode; see the module docstring."""

    def __init__(  # noqa: PLR0917
        self,
        client: trio.abc.Stream,
        listener: ListenerConfig,
        backend: BackendPool,
        keepalive: KeepAlivePool,
        client_address: tuple[str, int] | None,
        destination: tuple[str, int] | None,
        tls: bool,
        proxy_header: bytes | None,
        drain: trio.Event,
        connection_id: str,
        result: HttpConnectionResult,
        on_request: Callable[[RequestLog], None] | None = None,
        ssl_info: SSLFacts | None = None,
        *,
        initial_data: bytes = b"",
    ) -> None:
        self.client = client
        self.listener = listener
        self.http: HttpConfig = listener.http
        self.backend = backend
        self.keepalive = keepalive
        self.client_address = client_address
        self.client_ip = client_address[0] if client_address else None
        self.client_text = format_address(client_address)
        self.destination = destination
        self.tls = tls
        self.tls_text = f"{ssl_info.version} {ssl_info.cipher}" if ssl_info else None
        self.sni = ssl_info.server_name if ssl_info else None
        self.proxy_header = proxy_header
        self.drain = drain
        self.connection_id = connection_id
        self.result = result
        self.on_request = on_request
        self.trusted = is_trusted_peer(
            self.client_ip, listener.forwarded.trusted_proxies
        )
        rid = listener.forwarded.request_id
        self.request_id_name = rid.lower().encode() if rid else None
        self.buffer = bytearray(initial_data)
        result.bytes_from_client += len(initial_data)
        self.client_eof = False
        self.started = trio.current_time()
        # When the request being read began (trio clock, Unix time): the
        # connection's start for the first one, its first byte for later ones.
        self.request_started = self.started
        self.request_start_time = time.time()
        self.idle_scope: trio.CancelScope | None = None
        self.dedicated: _Upstream | None = None  # with send_proxy
        self.in_flight: _Upstream | None = None

    # -- client I/O -------------------------------------------------------

    async def receive_client(self) -> bytes:
        try:
            data = await self.client.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _ClientGoneError(f"client read failed: {exc}") from exc
        self.result.bytes_from_client += len(data)
        if not data:
            self.client_eof = True
        return bytes(data)

    async def send_client(self, data: bytes, log: RequestLog | None = None) -> None:
        if not data:
            return
        with trio.move_on_after(self.listener.idle_timeout) as idle_timeout_scope:
            try:
                await self.client.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _ClientGoneError(f"client write failed: {exc}") from exc
        if idle_timeout_scope.cancelled_caught:
            raise _ClientGoneError("client did not read for idle_timeout")
        self.result.bytes_to_client += len(data)
        if log is not None:
            log.bytes_out += len(data)

    async def linger(self) -> None:
        """Half-close, then discard what the client still sends, briefly."""
        with contextlib.suppress(
            trio.BrokenResourceError, trio.ClosedResourceError, OSError
        ):
            if isinstance(self.client, trio.abc.HalfCloseableStream):
                await self.client.send_eof()
            discarded = 0
            with trio.move_on_after(LINGER_TIMEOUT):
                while discarded < LINGER_MAX_BYTES and not self.client_eof:
                    chunk = await self.client.receive_some(READ_SIZE)
                    if not chunk:
                        return
                    discarded += len(chunk)

    # -- the connection loop ----------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_drain)
            try:
                await self._serve_requests()
            finally:
                nursery.cancel_scope.cancel()

    async def _watch_drain(self) -> None:
        await self.drain.wait()
        if self.idle_scope is not None:
            self.idle_scope.cancel()

    async def _serve_requests(self) -> None:
        first = True
        while True:
            try:
                head_length = await self._read_head(first=first)
            except RequestRejectedError as exc:
                await self._reject_head(exc)
                return
            except _ClientGoneError as exc:
                self._end(Termination.CLIENT_ERROR, str(exc))
                return
            if head_length is None:
                return
            first = False
            keep_going = await self._handle_request(head_length)
            if not keep_going:
                return

    def _emit(self, log: RequestLog) -> None:
        """The request's access-log line, and its metrics via *on_request*."""
        log.emit()
        if self.on_request is not None:
            self.on_request(log)

    def _end(self, termination: str, detail: str | None = None) -> None:
        self.result.termination = termination
        self.result.detail = detail

    async def _read_head(self, *, first: bool) -> int | None:
        """Read until the buffer holds a complete, checked request head.

        Returns its length, or None when the connection should end quietly
        (client closed, keep-alive timeout, drain).
        """
        limits = self.http
        while self.buffer[:2] == b"\r\n":  # RFC 9112 2.2: ignore leading CRLFs
            del self.buffer[:2]
        if not self.buffer:
            if self.client_eof:
                self._end(Termination.CLIENT_CLOSED)
                return None
            timeout = (
                limits.request_header_timeout if first else limits.keepalive_timeout
            )
            with trio.move_on_after(timeout) as keepalive_timeout_scope:
                if not first:
                    self.idle_scope = keepalive_timeout_scope
                    if self.drain.is_set():
                        keepalive_timeout_scope.cancel()
                try:
                    data = await self.receive_client()
                finally:
                    self.idle_scope = None
            if keepalive_timeout_scope.cancelled_caught:
                if self.drain.is_set() and not first:
                    self._end(Termination.DRAINED)
                else:
                    self._end(
                        Termination.REQUEST_HEADER_TIMEOUT
                        if first
                        else Termination.KEEPALIVE_TIMEOUT
                    )
                return None
            if not data:
                self._end(Termination.CLIENT_CLOSED)
                return None
            self.buffer += data
        deadline_base = self.started if first else trio.current_time()
        self.request_started = deadline_base
        self.request_start_time = time.time() - (trio.current_time() - deadline_base)
        with trio.move_on_at(
            deadline_base + limits.request_header_timeout
        ) as request_header_timeout_scope:
            scanned = 0
            while True:
                if self.buffer[:2] == b"\r\n":
                    while self.buffer[:2] == b"\r\n":
                        del self.buffer[:2]
                    scanned = 0
                first_byte = bytes(self.buffer[:1])
                if first_byte not in {b"", b"\r"} and not _TOKEN_RE.match(first_byte):
                    # Not even a method (TLS on a plain port, garbage): say so now.
                    raise RequestRejectedError(400, "not an HTTP request")
                end = find_head_end(self.buffer, scanned)
                # Scan only the head (a body may follow it) and not a final CR
                # whose LF has not arrived yet.
                stop = end if end >= 0 else len(self.buffer)
                if end < 0 and self.buffer.endswith(b"\r"):
                    stop -= 1
                if _BARE_CR_OR_LF_RE.search(self.buffer, max(0, scanned - 1), stop):
                    raise RequestRejectedError(400, "bare CR or LF in the request head")
                scanned = stop
                if end > limits.max_header_bytes or (
                    end < 0 and len(self.buffer) > limits.max_header_bytes
                ):
                    raise RequestRejectedError(
                        431, f"request head larger than {limits.max_header_bytes} bytes"
                    )
                if end >= 0:
                    parse_request_head(
                        bytes(self.buffer[:end]), max_headers=limits.max_headers
                    )
                    return end
                data = await self.receive_client()
                if not data:
                    self._end(Termination.CLIENT_CLOSED, "EOF inside a request head")
                    return None
                self.buffer += data
        if request_header_timeout_scope.cancelled_caught:  # pragma: no branch
            raise RequestRejectedError(
                408, "request head not complete within request_header_timeout"
            )
        return None  # pragma: no cover

    async def _reject_head(self, exc: RequestRejectedError) -> None:
        """Answer a request we could not even parse, then close."""
        log = RequestLog(
            connection=self.connection_id,
            listener=self.listener.name,
            client=self.client_text,
            start=self.request_start_time,
            tls=self.tls_text,
            sni=self.sni,
            status=exc.status,
            backend=self.backend.name,
            termination=(
                Termination.REQUEST_HEADER_TIMEOUT
                if exc.status == 408
                else Termination.BAD_REQUEST
            ),
            detail=exc.reason,
        )
        match = _REQUEST_LINE_RE.match(self.buffer)
        if match is not None:
            log.method = match.group(1).decode("ascii")
            log.target = _log_text(match.group(2))
        LOGGER.info(
            "listener %s: client %s: %d: %s",
            self.listener.name,
            log.client,
            exc.status,
            exc.reason,
        )
        self._end(log.termination, exc.reason)
        self.result.requests += 1
        with contextlib.suppress(_ClientGoneError):
            await self.send_client(error_response_bytes(exc.status, exc.reason), log)
            await self.linger()
        log.total = trio.current_time() - self.request_started
        self._emit(log)

    # -- one request -------------------------------------------------------

    def _new_log(self, request: h11.Request) -> RequestLog:
        headers = request.headers.raw_items()
        hosts = _header_values(headers, b"host")
        agents = _header_values(headers, b"user-agent")
        return RequestLog(
            connection=self.connection_id,
            listener=self.listener.name,
            client=self.client_text,
            start=self.request_start_time,
            method=request.method.decode("ascii"),
            target=_log_text(request.target),
            version=request.http_version.decode("ascii"),
            # Checked (_HOST_RE: ASCII only) before h11 saw it.
            host=hosts[0].decode("ascii") if hosts else None,
            user_agent=_log_text(agents[0]) if agents else None,
            backend=self.backend.name,
            tls=self.tls_text,
            sni=self.sni,
        )

    async def _handle_request(self, head_length: int) -> bool:
        """Serve one request whose head is at the start of the buffer.

        Returns True when the connection can carry on with the next request.
        """
        started = trio.current_time()
        cconn = h11.Connection(
            h11.SERVER, max_incomplete_event_size=self.http.max_header_bytes + 4
        )
        cconn.receive_data(bytes(self.buffer))
        if self.client_eof:
            cconn.receive_data(b"")
        self.buffer.clear()
        try:
            event = cconn.next_event()
        except h11.RemoteProtocolError as exc:
            LOGGER.debug("h11 refused a checked head: %s", exc)
            self.buffer[:0] = cconn.trailing_data[0]
            await self._reject_head(
                RequestRejectedError(exc.error_status_hint, "malformed request")
            )
            return False
        assert isinstance(event, h11.Request), event
        request = event
        log = self._new_log(request)
        log.bytes_in = head_length
        self.result.requests += 1
        try:
            return await self._exchange(cconn, request, log, started)
        finally:
            log.total = trio.current_time() - self.request_started
            self._emit(log)

    async def _refuse(
        self,
        cconn: h11.Connection,
        log: RequestLog,
        status: int,
        reason: str,
        termination: str,
    ) -> bool:
        """Send an error response through *cconn*, log it, close the connection."""
        log.status = status
        log.termination = termination
        log.detail = reason
        self._end(termination, reason)
        level = logging.WARNING if termination in _BACKEND_FAILURES else logging.INFO
        LOGGER.log(
            level,
            "listener %s: client %s: %s %s -> %d: %s",
            self.listener.name,
            log.client,
            log.method,
            log.target,
            status,
            reason,
        )
        body = error_response_bytes(status, reason)
        body = body[body.index(b"\r\n\r\n") + 4 :]
        try:
            data = cconn.send(
                h11.Response(
                    status_code=status,
                    reason=_REASONS.get(status, b"Error"),
                    headers=[
                        (b"Content-Type", b"text/plain; charset=utf-8"),
                        (b"Content-Length", str(len(body)).encode()),
                        (b"Connection", b"close"),
                    ],
                )
            )
            data += cconn.send(h11.Data(data=body)) or b""
            data += cconn.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:
            data = error_response_bytes(status, reason)
        try:
            await self.send_client(data, log)
            await self.linger()
        except _ClientGoneError:
            pass
        return False

    async def _exchange(
        self,
        cconn: h11.Connection,
        request: h11.Request,
        log: RequestLog,
        started: float,
    ) -> bool:
        headers = list(request.headers.raw_items())
        if request.method == b"CONNECT":
            return await self._refuse(
                cconn, log, 501, "CONNECT is not supported", Termination.BAD_REQUEST
            )
        try:
            target, authority = origin_form(request.method, request.target)
        except RequestRejectedError as exc:
            return await self._refuse(
                cconn, log, exc.status, exc.reason, Termination.BAD_REQUEST
            )
        if authority is not None:
            log.host = authority.decode("ascii")
        chunked = bool(_header_values(headers, b"transfer-encoding"))
        lengths = _header_values(headers, b"content-length")
        length = int(lengths[0]) if lengths else 0
        has_body = chunked or length > 0
        if not has_body:
            # h11 has the (empty) end of the request already: take it, so that
            # the client side is DONE (keep-alive) or MIGHT_SWITCH_PROTOCOL.
            end = cconn.next_event()
            assert isinstance(end, h11.EndOfMessage), end
        max_body = self.http.max_body_size
        if max_body and length > max_body:
            return await self._refuse(
                cconn,
                log,
                413,
                f"request body larger than {max_body} bytes",
                Termination.BAD_REQUEST,
            )
        upgrade = bool(_header_values(headers, b"upgrade")) and (
            b"upgrade" in _connection_tokens(headers)
        )
        scanner: ChunkedBodyScanner | None = None
        if chunked:
            scanner = ChunkedBodyScanner(
                max_trailer_bytes=self.http.max_header_bytes,
                max_trailers=self.http.max_headers,
            )
            try:
                scanner.feed(cconn.trailing_data[0])
            except RequestRejectedError as exc:
                return await self._refuse(
                    cconn, log, exc.status, exc.reason, Termination.BAD_REQUEST
                )
        upstream_headers, request_id = self._upstream_headers(
            request, upgrade=upgrade, authority=authority
        )
        if request_id is not None:
            log.request_id = request_id.decode("ascii")
        idempotent_retry = request.method in IDEMPOTENT_METHODS and not has_body
        exclude: Server | None = None
        fresh = False
        while True:
            connect_started = trio.current_time()
            try:
                upstream = await self._get_upstream(exclude, fresh=fresh)
            except NoServerError as exc:
                return await self._refuse(
                    cconn, log, 503, str(exc), Termination.NO_SERVER
                )
            except ConnectFailedError as exc:
                return await self._refuse(
                    cconn, log, 502, str(exc), Termination.CONNECT_FAILED
                )
            log.connect = trio.current_time() - connect_started
            log.server = format_address(upstream.server.address)
            self.result.server = log.server
            uconn = h11.Connection(
                h11.CLIENT, max_incomplete_event_size=MAX_RESPONSE_HEAD_BYTES
            )
            ex = _Exchange(
                request=request,
                target=target,
                cconn=cconn,
                uconn=uconn,
                upstream=upstream,
                log=log,
                started=started,
                has_body=has_body,
                chunked=chunked,
                length=length,
                upgrade=upgrade,
                scanner=scanner,
            )
            self.in_flight = upstream
            await self._proxy(ex, upstream_headers)
            failure = ex.failure
            retry = (
                failure is not None
                and failure.retryable
                and not ex.response_started
                and not has_body
                and (upstream.reused or idempotent_retry)
            )
            await self._finish_upstream(ex, reusable=failure is None and not retry)
            if retry:
                assert failure is not None
                LOGGER.info(
                    "listener %s: %s %s: retrying on a new connection: %s",
                    self.listener.name,
                    log.method,
                    log.target,
                    failure.detail,
                )
                fresh = True
                if not upstream.reused:
                    idempotent_retry = False
                    exclude = upstream.server
                continue
            break
        if ex.switched:
            return await self._relay_upgraded(ex)
        if failure is not None:
            return await self._after_failure(ex, failure)
        log.termination = Termination.OK
        if (
            cconn.our_state is h11.DONE
            and cconn.their_state is h11.DONE
            and not self.drain.is_set()
        ):
            self.buffer[:0] = cconn.trailing_data[0]
            return True
        self._end(Termination.DRAINED if self.drain.is_set() else Termination.CLOSED)
        if cconn.their_state is not h11.DONE:
            await self.linger()
        return False

    async def _after_failure(self, ex: _Exchange, failure: _Failure) -> bool:
        log = ex.log
        if failure.status is not None and not ex.response_started:
            return await self._refuse(
                ex.cconn, log, failure.status, failure.detail, failure.termination
            )
        log.termination = failure.termination
        log.detail = failure.detail
        self._end(failure.termination, failure.detail)
        if ex.response_started and not ex.response_complete:
            # Never let a cut response look complete: reset the connection.
            set_abortive_close(self.client)
            if failure.termination != Termination.SERVER_ABORTED:
                return False
            LOGGER.warning(
                "listener %s: client %s: %s %s: response cut, connection reset: %s",
                self.listener.name,
                log.client,
                log.method,
                log.target,
                failure.detail,
            )
        elif ex.response_complete:
            # The response went out whole; the request could not finish.
            await self.linger()
        return False

    def _upstream_headers(
        self, request: h11.Request, *, upgrade: bool, authority: bytes | None
    ) -> tuple[list[Header], bytes | None]:
        """The request's fields for the backend, and the request id (if any).

        *authority* (from an absolute-form target) replaces ``Host``. Fields
        named with ``_`` are dropped unless ``underscores_in_headers``.
        """
        headers = strip_hop_by_hop(request.headers.raw_items(), keep_upgrade=upgrade)
        if not self.http.underscores_in_headers:
            headers = [(n, v) for n, v in headers if b"_" not in n]
        if authority is not None:
            headers = [(b"Host", authority)] + [
                (n, v) for n, v in headers if n.lower() != b"host"
            ]
        hosts = _header_values(headers, b"host")
        context = ForwardingContext(
            client=self.client_address,
            destination=self.destination,
            tls=self.tls,
            trusted=self.trusted,
            host=hosts[0] if hosts else None,
        )
        request_id: bytes | None = None
        rid_header: tuple[bytes, bytes] | None = None
        if self.request_id_name is not None:
            request_id = choose_request_id(
                headers, self.request_id_name, trusted=self.trusted
            )
            rid_header = (self.listener.forwarded.request_id.encode(), request_id)
        headers = rewrite_forwarding_headers(
            headers, self.listener.forwarded, context, request_id=rid_header
        )
        return headers, request_id

    # -- upstream connections ---------------------------------------------

    async def _get_upstream(
        self, exclude: Server | None, *, fresh: bool = False
    ) -> _Upstream:
        """A connection for the next exchange: dedicated, pooled or new.

        The returned connection holds a lease on its server, given back by
        `_finish_upstream` (or `close_upstreams`).

        Raises:
            NoServerError: no healthy server.
            ConnectFailedError: every attempt failed.
        """
        if self.proxy_header is not None:
            if self.dedicated is not None:
                upstream, self.dedicated = self.dedicated, None
                if self._current(upstream.stream):
                    upstream.lease = self.backend.lease(upstream.server)
                    upstream.reused = True
                    return upstream
                await trio.aclose_forcefully(upstream.stream)
            return await self._connect(None, proxy_header=self.proxy_header)
        server = self.backend.balancer.pick(
            self.client_ip, exclude=(exclude,) if exclude is not None else ()
        )
        if server is None:
            if exclude is None:
                raise NoServerError(f"backend {self.backend.name}: no healthy server")
            return await self._connect(None)
        stream = None if fresh else await self.keepalive.acquire(server)
        if stream is not None:
            if self._current(stream):
                return _Upstream(
                    stream, self.backend.lease(server), reused=True, connect_time=0.0
                )
            await trio.aclose_forcefully(stream)
        return await self._connect(server)

    def _current(self, stream: trio.abc.Stream) -> bool:
        """Whether a kept connection was made with the backend's current TLS
        settings (none, or its client context): a reload that changed them
        must not leave requests on connections made with the old ones."""
        context = self.backend.tls_context
        if isinstance(stream, TLSStream):
            return stream.ssl_object.context is context
        return context is None

    async def _connect(
        self, server: Server | None, *, proxy_header: bytes | None = None
    ) -> _Upstream:
        """Open a new upstream connection (to *server* first, if given).

        The first attempt goes to the server the balancer picked for the pool
        lookup; `BackendPool.connect` retries as configured from there. To a
        TLS backend each attempt includes the handshake, and the PROXY header
        goes raw before it; without TLS the header goes with the first request
        head (one write).
        """
        started = trio.current_time()
        connected = await self.backend.connect(
            self.client_ip, first=server, proxy_header=proxy_header or b""
        )
        return _Upstream(
            connected.upstream,
            connected.lease,
            reused=False,
            connect_time=trio.current_time() - started,
            prefix=connected.pending,
        )

    async def _finish_upstream(self, ex: _Exchange, *, reusable: bool) -> None:
        """Pool, keep (dedicated) or close the exchange's upstream connection."""
        upstream = ex.upstream
        self.in_flight = None
        upstream.lease.release()
        uconn = ex.uconn
        clean = (
            reusable
            and ex.request_complete
            and not ex.switched
            and uconn.our_state is h11.DONE
            and uconn.their_state is h11.DONE
            and not uconn.trailing_data[0]
        )
        if clean and self.proxy_header is not None:
            self.dedicated = upstream
        elif clean:
            await self.keepalive.release(upstream.server, upstream.stream)
        elif not ex.switched:
            await trio.aclose_forcefully(upstream.stream)

    async def close_upstreams(self) -> None:
        for upstream in (self.in_flight, self.dedicated):
            if upstream is not None:
                upstream.lease.release()
                await trio.aclose_forcefully(upstream.stream)
        self.in_flight = self.dedicated = None

    # -- proxying one exchange ----------------------------------------------

    async def _send_upstream(self, ex: _Exchange, data: bytes) -> None:
        if not data:
            return
        with trio.move_on_after(self.listener.idle_timeout) as idle_timeout_scope:
            try:
                await ex.upstream.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _UpstreamGoneError(f"upstream write failed: {exc}") from exc
        if idle_timeout_scope.cancelled_caught:
            raise _UpstreamGoneError("upstream did not read for idle_timeout")

    async def _proxy(self, ex: _Exchange, headers: list[Header]) -> None:
        request = ex.request
        if not _header_values(headers, b"host"):
            # HTTP/1.0 without Host; HTTP/1.1 upstream needs one.
            server_name = format_address(ex.upstream.server.address) or ""
            headers = [*headers, (b"Host", server_name.encode("ascii"))]
        try:
            head = ex.uconn.send(
                h11.Request(
                    method=request.method,
                    target=ex.target,
                    headers=headers,
                    http_version=b"1.1",
                )
            )
            if not ex.has_body:
                head = (head or b"") + (ex.uconn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError as exc:
            ex.fail(_Failure(Termination.BAD_REQUEST, str(exc), 400))
            return
        prefix, ex.upstream.prefix = ex.upstream.prefix, b""
        try:
            await self._send_upstream(ex, prefix + (head or b""))
        except _UpstreamGoneError as exc:
            ex.fail(_Failure(Termination.SERVER_ERROR, str(exc), 502, retryable=True))
            return
        if not ex.has_body:
            # Nothing to pump upstream: no second task (nor a nursery) needed.
            ex.request_read = True
            self._request_sent(ex)
            await self._pump_response(ex)
            return
        async with trio.open_nursery() as nursery:
            ex.nursery_scope = nursery.cancel_scope
            nursery.start_soon(self._pump_request_body, ex)
            await self._pump_response(ex)
            if not ex.request_read:
                # Answered before the whole request arrived (an early error,
                # or an upgrade refused): stop reading it; the connection ends.
                # A request read in full is still delivered (bounded by
                # idle_timeout), so the upstream never holds half of one.
                nursery.cancel_scope.cancel()

    def _request_sent(self, ex: _Exchange) -> None:
        ex.request_complete = True
        ex.response_timeout_scope.deadline = (
            trio.current_time() + self.http.response_timeout
        )

    def _body_deadline(self, ex: _Exchange) -> float:
        """When the request body is too slow (``request_body_min_rate``)."""
        rate = self.http.request_body_min_rate
        if not rate:
            return math.inf
        return ex.body_started + self.http.request_body_timeout + ex.body_bytes / rate

    async def _next_client_event(self, ex: _Exchange) -> h11.Event:
        cconn = ex.cconn
        while True:
            event = cconn.next_event()
            if event is not h11.NEED_DATA:
                assert isinstance(event, h11.Event)
                return event
            now = trio.current_time()
            body_deadline = self._body_deadline(ex)
            with trio.move_on_at(
                min(now + self.listener.idle_timeout, body_deadline)
            ) as idle_timeout_scope:
                data = await self.receive_client()
            if idle_timeout_scope.cancelled_caught:
                if trio.current_time() >= body_deadline:
                    raise RequestRejectedError(
                        408,
                        f"request body slower than request_body_min_rate"
                        f" ({self.http.request_body_min_rate} bytes/s):"
                        f" {ex.body_bytes} bytes in"
                        f" {trio.current_time() - ex.body_started:.1f} s",
                    )
                raise RequestRejectedError(408, "request body stalled for idle_timeout")
            if ex.scanner is not None:
                ex.scanner.feed(data)
            cconn.receive_data(data)

    async def _pump_request_body(self, ex: _Exchange) -> None:
        """Client -> upstream: one chunk at a time (backpressure)."""
        max_body = self.http.max_body_size
        ex.body_started = trio.current_time()
        try:
            while True:
                try:
                    event = await self._next_client_event(ex)
                except h11.RemoteProtocolError as exc:
                    if self.client_eof:
                        raise _ClientGoneError(
                            "client closed in the middle of the request body"
                        ) from exc
                    raise RequestRejectedError(400, f"bad request body: {exc}") from exc
                if isinstance(event, h11.Data):
                    ex.body_bytes += len(event.data)
                    ex.log.bytes_in += len(event.data)
                    if max_body and ex.body_bytes > max_body:
                        raise RequestRejectedError(
                            413, f"request body larger than {max_body} bytes"
                        )
                    if not ex.chunked and ex.body_bytes == ex.length:
                        # The whole request is read (its EndOfMessage needs no
                        # more bytes). Say so before the write: the upstream may
                        # answer as soon as these bytes reach it, and the answer
                        # can be read before this task runs again.
                        ex.request_read = True
                    await self._send_upstream(
                        ex, ex.uconn.send(h11.Data(data=event.data)) or b""
                    )
                elif isinstance(event, h11.EndOfMessage):
                    scanner = ex.scanner
                    if scanner is not None and (
                        not scanner.done
                        or scanner.excess != len(ex.cconn.trailing_data[0])
                    ):
                        raise RequestRejectedError(400, "chunked framing ambiguity")
                    ex.request_read = True
                    trailers = self._clean_trailers(event.headers.raw_items())
                    await self._send_upstream(
                        ex,
                        ex.uconn.send(
                            h11.EndOfMessage(headers=trailers if ex.chunked else [])
                        )
                        or b"",
                    )
                    self._request_sent(ex)
                    return
        except RequestRejectedError as exc:
            ex.fail(_Failure(Termination.BAD_REQUEST, exc.reason, exc.status))
        except _ClientGoneError as exc:
            ex.fail(_Failure(Termination.CLIENT_ERROR, str(exc), None))
        except _UpstreamGoneError as exc:
            # The upstream may still have answered (e.g. 413 and close): let
            # the response pump find out; only stop sending.
            LOGGER.debug("request body not delivered: %s", exc)
            ex.response_timeout_scope.deadline = min(
                ex.response_timeout_scope.deadline,
                trio.current_time() + self.http.response_timeout,
            )
            return
        except h11.LocalProtocolError as exc:
            ex.fail(_Failure(Termination.BAD_REQUEST, str(exc), 400))
        assert ex.nursery_scope is not None
        ex.nursery_scope.cancel()

    def _clean_trailers(self, trailers: Sequence[Header]) -> list[Header]:
        """Trailers without framing, hop-by-hop and forwarding fields.

        The same name rules as the head's fields: untrusted peers' forwarding
        fields, the request id and every ``_`` spelling of those go; so does
        any name with ``_`` unless ``underscores_in_headers``.
        """
        underscores = self.http.underscores_in_headers
        rid = self.request_id_name
        out: list[Header] = []
        for name, value in trailers:
            lower, key = name.lower(), forwarding_key(name)
            if (
                lower in _NOT_IN_TRAILERS
                or (b"_" in name and not underscores)
                or (rid is not None and key == forwarding_key(rid))
                or (key in FORWARDING_HEADERS and (not self.trusted or key != lower))
            ):
                continue
            out.append((name, value))
        return out

    @staticmethod
    def _buffered_upstream_event(ex: _Exchange) -> h11.Event | None:
        """The next upstream event if h11 has it without reading, else None."""
        try:
            event = ex.uconn.next_event()
        except h11.RemoteProtocolError as exc:
            raise _UpstreamGoneError(
                f"bad response from upstream: {exc}",
                empty=not ex.upstream_bytes,
            ) from exc
        if event is h11.NEED_DATA:
            return None
        if isinstance(event, h11.ConnectionClosed):
            raise _UpstreamGoneError(
                "upstream closed the connection before responding",
                empty=not ex.upstream_bytes,
            )
        assert isinstance(event, h11.Event)
        return event

    async def _next_upstream_event(self, ex: _Exchange) -> h11.Event:
        uconn = ex.uconn
        while True:
            event = self._buffered_upstream_event(ex)
            if event is None:
                try:
                    data = bytes(await ex.upstream.stream.receive_some(READ_SIZE))
                except (
                    trio.BrokenResourceError,
                    trio.ClosedResourceError,
                    OSError,
                ) as exc:
                    raise _UpstreamGoneError(
                        f"upstream read failed: {exc}",
                        empty=not ex.upstream_bytes,
                    ) from exc
                ex.upstream_bytes += len(data)
                uconn.receive_data(data)
                continue
            return event

    async def _pump_response(self, ex: _Exchange) -> None:
        """Upstream -> client: 1xx, the head, the body; or record the failure."""
        try:
            response = await self._read_response_head(ex)
            if response is None:
                return
            if ex.switched:
                return
            await self._forward_response(ex, response)
        except _UpstreamGoneError as exc:
            if ex.response_started:
                ex.fail(_Failure(Termination.SERVER_ABORTED, str(exc), None))
            else:
                ex.fail(
                    _Failure(
                        Termination.SERVER_ERROR, str(exc), 502, retryable=exc.empty
                    )
                )
        except _ClientGoneError as exc:
            ex.fail(_Failure(Termination.CLIENT_ERROR, str(exc), None))
        except h11.LocalProtocolError as exc:
            # Something the upstream sent cannot be relayed to this client.
            ex.fail(
                _Failure(
                    Termination.SERVER_ABORTED
                    if ex.response_started
                    else Termination.SERVER_ERROR,
                    f"cannot relay the response: {exc}",
                    None if ex.response_started else 502,
                )
            )
        if ex.failure is not None and ex.nursery_scope is not None:
            ex.nursery_scope.cancel()

    async def _read_response_head(self, ex: _Exchange) -> h11.Response | None:
        cconn = ex.cconn
        with ex.response_timeout_scope:
            while True:
                event = await self._next_upstream_event(ex)
                if isinstance(event, h11.InformationalResponse):
                    if event.status_code == 101:
                        await self._switch(ex, event)
                        return None
                    if event.status_code == 100:
                        if not cconn.they_are_waiting_for_100_continue:
                            continue
                    elif ex.request.http_version != b"1.1":
                        continue
                    await self.send_client(
                        cconn.send(
                            h11.InformationalResponse(
                                status_code=event.status_code,
                                reason=_reason(event.status_code, event.reason),
                                headers=strip_hop_by_hop(
                                    event.headers.raw_items(), keep_upgrade=False
                                ),
                            )
                        )
                        or b"",
                        ex.log,
                    )
                    continue
                assert isinstance(event, h11.Response), event
                ex.log.first_byte = trio.current_time() - ex.started
                return event
        ex.fail(
            _Failure(
                Termination.RESPONSE_TIMEOUT,
                f"no response within response_timeout"
                f" ({self.http.response_timeout:g} s)",
                504,
            )
        )
        return None

    async def _switch(self, ex: _Exchange, event: h11.InformationalResponse) -> None:
        """The upstream accepted an upgrade: tell the client, switch both sides."""
        headers = strip_hop_by_hop(event.headers.raw_items(), keep_upgrade=True)
        try:
            data = ex.cconn.send(
                h11.InformationalResponse(
                    status_code=101, reason=_reason(101, event.reason), headers=headers
                )
            )
        except h11.LocalProtocolError as exc:
            raise _UpstreamGoneError(f"unexpected 101 from upstream: {exc}") from exc
        ex.log.first_byte = trio.current_time() - ex.started
        ex.log.status = 101
        ex.response_started = True
        await self.send_client(data or b"", ex.log)
        ex.switched = True

    async def _forward_response(self, ex: _Exchange, response: h11.Response) -> None:
        cconn = ex.cconn
        headers = strip_hop_by_hop(response.headers.raw_items(), keep_upgrade=False)
        # The backend may answer before our task forwarding the request's
        # last bytes has run again: what counts is whether the client's
        # request was read in full, not whether its write has returned.
        if self.drain.is_set() or not ex.request_read:
            headers.append((b"Connection", b"close"))
        ex.log.status = response.status_code
        data = cconn.send(
            h11.Response(
                status_code=response.status_code,
                reason=_reason(response.status_code, response.reason),
                headers=headers,
            )
        )
        ex.response_started = True
        # What h11 already has of the response (usually all of a small one)
        # goes out with the head in one write; we write before every read.
        pending = data or b""
        upstream_chunked = bool(_header_values(headers, b"transfer-encoding"))
        trailers_ok = (
            upstream_chunked
            and ex.request.http_version == b"1.1"
            and ex.request.method != b"HEAD"
        )
        while True:
            try:
                event = self._buffered_upstream_event(ex)
            except _UpstreamGoneError:
                await self.send_client(pending, ex.log)
                raise
            if event is None:
                await self.send_client(pending, ex.log)
                pending = b""
                with trio.move_on_after(
                    self.listener.idle_timeout
                ) as idle_timeout_scope:
                    event = await self._next_upstream_event(ex)
                if idle_timeout_scope.cancelled_caught:
                    raise _UpstreamGoneError(
                        "upstream response stalled for idle_timeout"
                    )
            if isinstance(event, h11.Data):
                pending += cconn.send(h11.Data(data=event.data)) or b""
            elif isinstance(event, h11.EndOfMessage):
                trailers = (
                    strip_hop_by_hop(event.headers.raw_items(), keep_upgrade=False)
                    if trailers_ok
                    else []
                )
                pending += cconn.send(h11.EndOfMessage(headers=trailers)) or b""
                await self.send_client(pending, ex.log)
                ex.response_complete = True
                return

    async def _relay_upgraded(self, ex: _Exchange) -> bool:
        """After a 101: forward what both h11s buffered, then relay bytes."""
        upstream = ex.upstream
        stats = RelayStats()
        try:
            from_upstream = ex.uconn.trailing_data[0]
            from_client = ex.cconn.trailing_data[0]
            try:
                await self.send_client(from_upstream, ex.log)
                await self._send_upstream(ex, from_client)
            except (_ClientGoneError, _UpstreamGoneError) as exc:
                self._end(Termination.CLIENT_ERROR, str(exc))
                set_abortive_close(self.client)
                set_abortive_close(upstream.stream)
                return False
            ex.log.bytes_in += len(from_client)
            await relay(
                self.client,
                upstream.stream,
                stats=stats,
                idle_timeout=self.listener.idle_timeout,
                client_fin_timeout=self.listener.client_fin_timeout,
                server_fin_timeout=self.backend.config.server_fin_timeout,
            )
        finally:
            self.result.bytes_from_client += stats.bytes_from_client
            self.result.bytes_to_client += stats.bytes_from_server
            ex.log.bytes_in += stats.bytes_from_client
            ex.log.bytes_out += stats.bytes_from_server
            cause = stats.termination or Termination.UNKNOWN
            ex.log.termination = f"{Termination.UPGRADED}:{cause}"
            self._end(ex.log.termination)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(upstream.stream)
        return False


async def serve_http(
    client: trio.abc.Stream,
    *,
    listener: ListenerConfig,
    backend: BackendPool,
    keepalive: KeepAlivePool,
    client_address: tuple[str, int] | None,
    destination: tuple[str, int] | None,
    tls: bool,
    proxy_header: bytes | None,
    drain: trio.Event,
    connection_id: str,
    result: HttpConnectionResult | None = None,
    on_request: Callable[[RequestLog], None] | None = None,
    initial_data: bytes = b"",
    ssl_info: SSLFacts | None = None,
) -> HttpConnectionResult:
    """Proxy HTTP/1.1 requests from *client* to *backend* until the connection ends.

    See the module docstring for the behaviour. Does not close *client* (the
    caller does, in its ``finally``); when the connection must end with a reset
    (an upstream died mid-response) the client socket is already set to close
    with an RST. Every upstream connection this call opened is closed or back
    in *keepalive* when it returns, also when cancelled.

    Args:
        client: The client connection after PROXY unwrap and TLS.
        listener: Its listener's settings (``http``, ``forwarded``, timeouts).
        backend: Where requests go.
        keepalive: Idle upstream connections of *backend*, shared.
        client_address: The real client (after PROXY unwrap).
        destination: The address the client connected to.
        tls: True when the listener terminated TLS.
        proxy_header: With ``send_proxy``: the PROXY header for this client;
            upstream connections are then dedicated to this client connection.
        drain: Set when the edge drains.
        connection_id: The connection's id, repeated in every request line.
        result: Updated in place (and returned); pass one in to see the counts
            of a connection that gets cancelled.
        on_request: Called with each request's `RequestLog` once it is complete
            (right after its access-log line), e.g. for metrics.
        initial_data: Client bytes an earlier stage read past its own data
            (what followed a PROXY header): the start of the first request.
        ssl_info: What the client's TLS handshake negotiated, for the
            request lines' ``tls`` and ``sni`` (None: no TLS).

    Returns:
        Requests served, bytes each way and why the connection ended.
    """
    if result is None:
        result = HttpConnectionResult()
    connection = _HttpConnection(
        client,
        listener,
        backend,
        keepalive,
        client_address,
        destination,
        tls,
        proxy_header,
        drain,
        connection_id,
        result,
        on_request,
        ssl_info,
        initial_data=initial_data,
    )
    try:
        await connection.run()
    except Exception as exc:  # a bug must not take the edge down
        LOGGER.exception("listener %s: HTTP connection failed", listener.name)
        result.termination = Termination.INTERNAL_ERROR
        result.detail = repr(exc)
        set_abortive_close(client)
    finally:
        if result.termination == Termination.UNKNOWN:  # cancelled: drain deadline
            result.termination = Termination.DRAINED
        with trio.CancelScope(shield=True):
            await connection.close_upstreams()
    return result
