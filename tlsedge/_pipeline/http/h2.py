"""HTTP/2 to clients in HTTP mode: the reactor driver of `H2Session` (docs/http2.md).

Theory of operation
===================

`h2_connection` serves one client connection that negotiated ``h2`` through ALPN, or
opened with the HTTP/2 preface on a listener with ``[listeners.http2]
cleartext = "prior-knowledge"`` (`sniff_preface` tells). The sans-IO
`tlsedge._http.h2session.H2Session` does the framing and the defences; this
module feeds it and drains it.

Who runs what. As in HTTP/1.1 (`tlsedge._pipeline.http.h1`), the connection is a
`tlsedge._pipeline.http.connection.ReactorConnection`, a handler of the worker's
reactor (`tlsedge._reactor.loop`), and so is every upstream socket its streams
use: the reactor calls ``ready`` when the
client's or an upstream's socket is ready, and everything then happens in that
call without awaiting: client bytes into the session, its events dispatched
(a new stream, body pieces, resets, window updates), request bytes written
upstream, upstream bytes read into the stream's `UpstreamExchange` and its
events turned into frames, and what the session queued written to the client
in one write at the end of the call. All I/O goes through
`tlsedge._reactor.raw_stream.RawStream` (TLS included). The connection has no trio
task of its own (the edge starts it, its end calls *on_done*); only what must
await runs in a task, started with the *spawn* it is given: opening an
upstream connection (`UpstreamConnections.connect`: connect, retries, a TLS
handshake), one task per stream that needs one, so a slow or failing server
does not hold up the streams behind it (one at a time, ten new streams on a
cold pool would pay ten connect times in a row). A stream reset meanwhile
cancels its connect; ``drain()`` (the drain deadline) ends the connection
and cancels every connect. Stream phases are `StreamPhase`, with
`STREAM_TRANSITIONS`; the connection's states are
`tlsedge._pipeline.http.connection.HTTP2_TRANSITIONS`.

Each stream's request goes upstream through the same
`tlsedge._pipeline.http.attempt.UpstreamAttempt` as an HTTP/1.1 request (one
`UpstreamExchange` at a time, the decisions of
`tlsedge._pipeline.http.upstream_step`); `_StreamAttempt` is its HTTP/2 client side
(the body from the stream's queue, the response as frames). The same
`UpstreamConnections` (pool,
dedicated ``send_proxy`` connections, TLS backends), the same
`RequestRewriter` (forwarding headers, request id, stripping), the same retry
rule (`tlsedge._http.rules.may_retry`), the same error statuses (503 no
server, 502 connect failure or a bad answer, 504 ``response_timeout``) and the
same access-log line (``version`` ``2.0``). The upstream request is HTTP/1.1:
``host`` first, ``transfer-encoding: chunked`` when the client sent no
``content-length`` and a body (so trailers can follow). A clean upstream
connection is *held* for the connection's next streams (at most
``max_concurrent_streams``), its socket still registered and read on (the
server closing it, or anything it sends, closes it); held ones go to the
shared pool after `PARK_AFTER` without a stream and when the connection ends,
and each is closed once unused for the pool's idle timeout.

Flow control and backpressure. A request body piece is written upstream first
and only then acknowledged (`H2Session.acknowledge`: the client's window
reopens); a piece the upstream's socket did not take at once is acknowledged
when it did (`RawStream.out` flushed), so a slow upstream holds the client to
its window. Response data goes out only as far as the client's windows allow
(`H2Session.sendable`) and while fewer than `HIGH_WATER` bytes wait for the
client's socket; a stream holding a piece it could not send does not read its
upstream (its socket is not watched for reading), so the upstream is read no
faster than the client takes the response.

Timeouts (the ``[listeners.http]`` ones, per connection and per stream), as
timestamps checked by the connection's one lazy reactor timer
(`_H2Connection._expire`, the streams' upstream side from
`UpstreamAttempt.upstream_due`). Connection: the first request's header block within
``request_header_timeout`` of the connection's start, any later header block
within ``request_header_timeout`` of its first frame (a CONTINUATION trickle
ends there), no stream open for ``keepalive_timeout`` (GOAWAY, close), a
client that does not read for the listener's ``idle_timeout``. Stream: a
request body or a response write (a zero window) stalled for ``idle_timeout``,
an upstream that does not read the request or stalls the response for
``idle_timeout``, no response head within ``response_timeout`` (504). A
stream that times out with its response started is reset.

Drain: GOAWAY (NO_ERROR) with the last stream accepted; the streams before it
finish, later ones are refused (REFUSED_STREAM), the connection closes when
none is left (or is ended at the drain deadline).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import trio

from tlsedge._core.downstream import Downstream
from tlsedge._core.termination import Termination
from tlsedge._http.body import CHUNKED_BODY
from tlsedge._http.events import (
    NEED_DATA,
    Body,
    EndOfBody,
    Informational,
    NeedData,
    Response,
)
from tlsedge._http.exchange import UpstreamError, UpstreamExchange
from tlsedge._http.gate import from_http2
from tlsedge._http.h2session import (
    PREFACE,
    ConnectionEnded,
    ErrorCodes,
    Event,
    H2Request,
    H2Session,
    RequestData,
    RequestEnd,
    StreamCancelled,
    StreamMalformed,
    StreamOpened,
    WindowOpened,
)
from tlsedge._http.head import (
    HOP_BY_HOP,
    NOT_NAMED_AWAY,
    RequestRejectedError,
    ResponseHead,
)
from tlsedge._http.log import HttpConnectionResult, RequestLog
from tlsedge._http.rules import (
    error_body,
    log_text,
    response_trailers,
)
from tlsedge._pipeline.http.attempt import (
    BODY,
    DELIVERED,
    RESPONSE_TRANSITIONS,
    STARTED,
    STOPPED,
    WAITING,
    Due,
    UpstreamAttempt,
)
from tlsedge._pipeline.http.connection import (
    CLOSING,
    DONE,
    HTTP2_TRANSITIONS,
    OPEN,
    ReactorConnection,
    Spawn,
    socket_backed,
)
from tlsedge._pipeline.http.site import HttpSite
from tlsedge._pipeline.http.upstream_step import (
    IO_ERRORS,
    Failure,
)
from tlsedge._pipeline.http.upstreams import (
    PARK_AFTER,
)
from tlsedge._reactor.loop import (
    READABLE,
    WRITABLE,
    Cancellable,
    Reactor,
    current_reactor,
)
from tlsedge._reactor.raw_stream import RawStream

__all__ = ["h2_connection", "sniff_preface"]

LOGGER = logging.getLogger("tlsedge.http")

Header = tuple[bytes, bytes]
#: What an upstream exchange gives a stream's response.
_ResponseEvent = Informational | Response | Body | EndOfBody

#: Streams stop sending response data while this many bytes wait for the
#: client's socket.
HIGH_WATER: Final = 65536
#: Response fields that HTTP/2 forbids (RFC 9113 section 8.2.2), beyond the
#: hop-by-hop ones `strip_hop_by_hop` drops.
_NOT_IN_H2: Final = frozenset({b"transfer-encoding", b"keep-alive", b"upgrade"})
#: The response fields a head's fields lose in HTTP/2 whatever its
#: ``Connection`` says: the hop-by-hop ones and those.
_DROPPED_IN_H2: Final = HOP_BY_HOP | _NOT_IN_H2
# ... and from a 1xx or a 204 its content-length too, which no response of
# those may carry (RFC 9110 section 8.6), as the HTTP/1.1 client side does.
_DROPPED_WITHOUT_CONTENT: Final = _DROPPED_IN_H2 | {b"content-length"}
#: How a stream fails whose response the client does not take.
_CLIENT_STALL: Final = Failure(
    Termination.CLIENT_ERROR,
    "client did not read (or open its window) for idle_timeout",
    None,
)

# -- h2c with prior knowledge: the preface, read on the reactor ----------------


class _PrefaceSniffer:
    """Reads a plain client's first bytes on the reactor until they are, or
    cannot be, the HTTP/2 preface (or the header timeout passes)."""

    __slots__ = ("data", "raw", "reactor", "task", "timer")

    def __init__(self, raw: RawStream, data: bytes, reactor: Reactor) -> None:
        self.raw = raw
        self.data = data
        self.reactor = reactor
        self.task: trio.lowlevel.Task | None = None
        self.timer = Cancellable(self._done)

    @property
    def decided(self) -> bool:
        data = self.data
        return len(data) >= len(PREFACE) or not PREFACE.startswith(data)

    def ready(self, fd: int, events: int) -> None:
        try:
            chunk = self.raw.receive()
        except IO_ERRORS:
            chunk = b""  # the driver sees the failure again
        if chunk is None:
            return
        self.data += chunk
        if not chunk or self.decided:
            self._done()

    def failed(self, exc: Exception) -> None:
        self._done()

    def _done(self) -> None:
        raw = self.raw
        if raw.interest is not None:
            self.reactor.unregister(raw.fd)
            raw.interest = None
        self.timer.cancel()
        if self.task is not None:
            trio.lowlevel.reschedule(self.task)
            self.task = None

    async def wait(self, header_timeout: float) -> None:
        reactor = self.reactor
        reactor.call_at(reactor.now() + header_timeout, self.timer)
        self.raw.interest = READABLE
        reactor.register(self.raw.fd, READABLE, self)
        self.task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self.task = None
            self._done()
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


async def sniff_preface(
    client: trio.abc.Stream, initial_data: bytes, *, header_timeout: float
) -> tuple[bool, bytes]:
    """Read until the client's first bytes are, or cannot be, the HTTP/2
    preface (h2c with prior knowledge). Returns whether they are, and every
    byte read (for whichever driver serves the connection).

    Raises:
        TypeError: *client* is not a `trio.SocketStream`.
    """
    raw = RawStream.of(client)
    if raw is None or raw.tls is not None:
        msg = f"sniff_preface needs a plain trio.SocketStream, not {client!r}"
        raise TypeError(msg)
    sniffer = _PrefaceSniffer(raw, initial_data, current_reactor())
    try:
        if not sniffer.decided:
            await sniffer.wait(header_timeout)
    finally:
        raw.detach()
    data = sniffer.data
    return data[: len(PREFACE)] == PREFACE, data


# -- one stream ----------------------------------------------------------------


class StreamPhase(enum.Enum):
    """What a stream is doing."""

    #: Its request goes upstream (an `UpstreamAttempt` on a connection).
    EXCHANGE = "exchange"
    #: A job opens its upstream connection.
    CONNECTING = "connecting"
    #: Our own error response goes out.
    ANSWERING = "answering"
    CLOSED = "closed"

    __hash__ = object.__hash__  # (as `tlsedge._pipeline.http.attempt.RequestProgress`)


# The members as module constants (as in `tlsedge._pipeline.http.attempt`).
_EXCHANGE: Final = StreamPhase.EXCHANGE
_CONNECTING: Final = StreamPhase.CONNECTING
_ANSWERING: Final = StreamPhase.ANSWERING
_CLOSED: Final = StreamPhase.CLOSED

#: The legal moves of `StreamPhase` (a retry may connect again).
STREAM_TRANSITIONS: Final[dict[StreamPhase, frozenset[StreamPhase]]] = {
    _EXCHANGE: frozenset({_CONNECTING, _ANSWERING, _CLOSED}),
    _CONNECTING: frozenset({_EXCHANGE, _CLOSED}),
    _ANSWERING: frozenset({_CLOSED}),
    _CLOSED: frozenset(),
}


class _Stream:
    """One request stream: the client side of its exchange (the request's
    body pieces, the response's bytes waiting for a window)."""

    __slots__ = (
        "attempt",
        "blocked_since",
        "body",
        "body_bytes",
        "cancelled",
        "connection",
        "id",
        "log",
        "lookahead",
        "out",
        "out_end",
        "phase",
        "request",
        "request_read",
        "started",
    )

    def __init__(
        self,
        connection: _H2Connection,
        stream_id: int,
        request: H2Request,
        log: RequestLog,
        started: float,
    ) -> None:
        self.connection = connection
        self.id = stream_id
        self.request = request
        self.log = log
        self.started = started
        self.phase = _EXCHANGE
        #: Its way upstream, once the gate let the request through.
        self.attempt: _StreamAttempt | None = None
        #: Client body events not written upstream yet (not acknowledged).
        self.body: deque[RequestData | RequestEnd] = deque()
        self.body_bytes = 0  # body bytes the client sent (request_body_min_rate)
        self.request_read = request.end_stream  # the client's END_STREAM came
        self.cancelled = False  # reset by the client, or the connection ended
        #: Response body bytes the client's windows did not take yet, and
        #: whether the last of them ends the response.
        self.out: bytes | memoryview | None = None
        self.out_end = False
        self.blocked_since = math.inf  # since when `out` waits for the client
        #: The response event `_H2Connection._peek` looked at.
        self.lookahead: _ResponseEvent | None = None

    def to(self, phase: StreamPhase) -> None:
        assert phase in STREAM_TRANSITIONS[self.phase], (self.phase, phase)
        self.phase = phase

    def stalled(self) -> None:
        """The client did not take the stream's response for ``idle_timeout``."""
        self.connection._stream_stalled(self)


class _StreamAttempt(UpstreamAttempt):
    """A stream's upstream attempt, with HTTP/2's client side: body pieces
    from the stream's queue, acknowledged (the client's window reopens)
    once the upstream took them; the response relayed as frames within the
    client's windows."""

    __slots__ = ("stream",)

    host: _H2Connection
    stream: _Stream

    def _next_piece(self) -> bytes | list[Header] | None:
        body = self.stream.body
        if not body:
            return None
        event = body.popleft()
        if isinstance(event, RequestEnd):
            return event.trailers
        self.unacked += event.flow_length
        return event.data

    def _acknowledge(self) -> None:
        self.host.session.acknowledge(self.stream.id, self.unacked)
        self.unacked = 0

    def _body_stopped(self) -> None:
        self.host._acknowledge_held(self.stream)

    def _request_read(self) -> bool:
        return self.stream.request_read

    def _body_bytes(self) -> int:
        return self.stream.body_bytes

    def _relay_response(self) -> None:
        self.host._pump_response(self.stream)

    def _failed(self, failure: Failure) -> None:
        self.host._after_failure(self.stream, failure)

    def _done(self) -> None:
        self.host._close_stream(self.stream)


def _reset_code(failure: Failure) -> int:
    """The RST_STREAM for a stream that fails with its response started: the
    client's fault (a stall, a late body) CANCEL, the upstream's INTERNAL_ERROR."""
    if failure.termination in {Termination.CLIENT_ERROR, Termination.BAD_REQUEST}:
        return ErrorCodes.CANCEL
    return ErrorCodes.INTERNAL_ERROR


# -- the connection ------------------------------------------------------------


class _H2Connection(ReactorConnection):
    """One HTTP/2 client connection; see the module docstring."""

    KIND = "HTTP/2"
    TRANSITIONS = HTTP2_TRANSITIONS

    def __init__(
        self,
        client: RawStream,
        downstream: Downstream,
        site: HttpSite,
        *,
        proxy_header: bytes | None,
        result: HttpConnectionResult,
        initial_data: bytes,
        spawn: Spawn,
        on_done: Callable[[HttpConnectionResult], None],
    ) -> None:
        super().__init__(
            client,
            downstream,
            site,
            proxy_header=proxy_header,
            result=result,
            spawn=spawn,
            on_done=on_done,
            max_held=site.listener.http2.max_concurrent_streams,
        )
        self.session = H2Session(site.listener.http2, max_headers=self.http.max_headers)
        self.state = OPEN
        self.streams: dict[int, _Stream] = {}
        #: Streams whose response data waits for a window or the client.
        self.blocked: set[_Stream] = set()
        #: Response DATA given to the session since its bytes last went out.
        self.unflushed = 0
        self.any_stream = False
        self.idle_since = self.started
        self.header_block_since: float | None = None
        self.client_broken: str | None = None  # a write failed: why
        self.draining = False
        self.settling = False  # a _settle is deferred to the batch's end
        self.initial_data = initial_data

    def _start(self) -> None:
        initial_data, self.initial_data = self.initial_data, b""
        self.arm(self.started + self.http.request_header_timeout)
        if initial_data and self.state is OPEN:
            self._received(initial_data)
        if self.client.tls is not None and self.state is OPEN:
            # Records its engine read past the handshake.
            self._read_client(read_socket=False)
        if self.state is OPEN:
            # After the first bytes: when the edge drains already, the
            # streams they open are served and named by the GOAWAY.
            self.site.drain.call_on_set(self._drained)
        self._settle()

    def _connecting(self, attempt: UpstreamAttempt) -> None:
        """A task per stream that connects: a slow server does not hold up
        the streams behind it."""
        assert isinstance(attempt, _StreamAttempt)
        attempt.stream.to(_CONNECTING)

    def _connected(self, attempt: UpstreamAttempt) -> None:
        assert isinstance(attempt, _StreamAttempt)
        attempt.stream.to(_EXCHANGE)

    def _cancel_streams(self) -> None:
        """End every stream: nothing more can be read for them."""
        active = self.session.active
        for stream in list(self.streams.values()):
            stream.cancelled = True
            if stream.id in active:
                self._cut_short(stream.log)
            self._close_stream(stream)

    _end_requests = _cancel_streams

    def _shut_down(self) -> None:
        """The session ended or is ended now: every stream stops, the last
        frames (a GOAWAY) go out, then the connection closes."""
        if self.state is not OPEN:
            return
        assert CLOSING in HTTP2_TRANSITIONS[self.state]
        self.state = CLOSING
        self._cancel_streams()
        self.session.close()
        self._flush_session()
        if self.client_broken is not None or not self.client.out:
            self._finish()
        else:
            self.arm(self.client_progress + self.idle_timeout)

    # -- the reactor's calls ---------------------------------------------------

    def _ready_done(self) -> None:
        # Once per batch: the streams' frames ready in it go out together.
        if not self.settling:
            self.settling = True
            self.reactor.defer(self._settle_deferred, self)

    def _settle_deferred(self) -> None:
        self.settling = False
        self._settle()

    def _settle(self) -> None:
        """After a round of work: what the session queued goes out, and each
        socket is watched for what it waits for."""
        if self.state is DONE:
            return
        self._flush_session()
        if self.client_broken is not None:
            self._end(Termination.CLIENT_ERROR, self.client_broken)
            self._finish()
            return
        if self.state is CLOSING and not self.client.out:
            self._finish()
            return
        client = self.client
        read = self.state is OPEN and not client.eof
        want = (READABLE if read else 0) | (WRITABLE if client.out else 0)
        # (Registrations persist: most rounds change nothing.)
        if want != client.interest or client.hung_up:
            self._watch(client, want)
        dirty = self.dirty
        while dirty:
            attempt, _ = dirty.popitem()
            assert isinstance(attempt, _StreamAttempt)
            raw = attempt.raw
            if raw is None:
                continue
            stream = attempt.stream
            read = (
                not raw.eof
                and stream.out is None
                and attempt.response is not DELIVERED
                and stream.phase is _EXCHANGE
            )
            want = (READABLE if read else 0) | (WRITABLE if raw.out else 0)
            if want != raw.interest or raw.hung_up:
                self._watch(raw, want)

    # -- timers ----------------------------------------------------------------

    def _expire(self, now: float) -> None:
        deadline, expire = self._deadline()
        if expire is not None and now >= deadline:
            expire()
        for stream in list(self.streams.values()):
            if stream.phase is _CLOSED or self.state is not OPEN:
                continue
            deadline, stream_expire = self._stream_deadline(stream)
            if stream_expire is not None and now >= deadline:
                stream_expire()

    def _earliest(self) -> float:
        earliest, _ = self._deadline()
        for stream in self.streams.values():
            earliest = min(earliest, self._stream_deadline(stream)[0])
        return earliest

    def _deadline(self) -> Due:
        """What is due next for the connection, and when (see Timeouts)."""
        idle = self.idle_timeout
        if self.client.out:
            return self.client_progress + idle, self._client_stalled
        if self.state is not OPEN:
            return math.inf, None
        http = self.http
        if self.header_block_since is not None:
            return (
                self.header_block_since + http.request_header_timeout,
                self._timed_out,
            )
        if not self.any_stream:
            return self.started + http.request_header_timeout, self._timed_out
        due: Due = (math.inf, None)
        if not self.session.active and not self.streams:
            due = (self.idle_since + http.keepalive_timeout, self._timed_out)
            park = self.idle_since + PARK_AFTER
            if self.held and park < due[0]:
                due = (park, self._park_held)
        if self.held:
            # The oldest held connection goes at the pool's idle timeout, as
            # one in the pool would.
            expiry = self._oldest_held() + self.upstreams.keepalive.idle_timeout
            if expiry < due[0]:
                due = (expiry, self._expire_held)
        return due

    def _stream_deadline(self, stream: _Stream) -> Due:
        """What is due next for *stream*, and when (see Timeouts)."""
        due: Due = (math.inf, None)
        if stream.out is not None:
            due = (stream.blocked_since + self.idle_timeout, stream.stalled)
        attempt = stream.attempt
        if stream.phase is not _EXCHANGE or attempt is None:
            return due
        raw = attempt.raw
        if raw is None:
            return due
        if not raw.out and attempt.request_progress is BODY and not stream.body:
            body_due = attempt.body_due()
            if body_due < due[0]:
                due = (body_due, attempt.body_timed_out)
        return attempt.upstream_due(due, client_holds=stream.out is not None)

    def _client_stalled(self) -> None:
        self._client_failed("client did not read for idle_timeout")

    def _timed_out(self) -> None:
        if self.draining:
            self._end(Termination.DRAINED)
        elif self.header_block_since is not None or not self.any_stream:
            self._end(
                Termination.REQUEST_HEADER_TIMEOUT,
                "no complete request header block within request_header_timeout",
            )
        else:
            self._end(Termination.KEEPALIVE_TIMEOUT)
        self._shut_down()

    def _stream_stalled(self, stream: _Stream) -> None:
        attempt = stream.attempt
        if stream.phase is _ANSWERING or attempt is None:
            self.session.reset(stream.id, ErrorCodes.CANCEL)
            self._close_stream(stream)
        else:
            attempt.fail(_CLIENT_STALL)

    def _drained(self) -> None:
        """The edge drains: GOAWAY, the streams in flight finish."""
        if self.state is not OPEN or self.draining:
            return
        self.draining = True
        self.session.goaway()
        if not self.streams:
            self._end(Termination.DRAINED)
            self._shut_down()
        self._settle()

    # -- the client ------------------------------------------------------------

    def _read_client(self, *, read_socket: bool = True) -> None:
        try:
            data = self.client.receive(read_socket=read_socket)
        except IO_ERRORS as exc:
            self._client_failed(f"client read failed: {exc}")
            return
        if data is None:
            return
        if data:
            self._received(data)
        # (With data: the EOF came in the same read, a close_notify right
        # behind the bytes, and no socket event will say it again.)
        if self.client.eof and self.state is OPEN:
            self._end(Termination.CLIENT_CLOSED)
            self._shut_down()

    def _received(self, data: bytes) -> None:
        """Client bytes to the session, its events dispatched."""
        session = self.session
        self.result.bytes_from_client += len(data)
        now = self.now()
        self._dispatch(session.receive_data(data, now), now)
        if session.ended:
            self._shut_down()
            return
        if session.in_header_block:
            if self.header_block_since is None:
                self.header_block_since = now
                self.arm(now + self.http.request_header_timeout)
        else:
            self.header_block_since = None

    def _client_failed(self, detail: str) -> None:
        self._end(Termination.CLIENT_ERROR, detail)
        self._finish()

    def _flush_session(self) -> None:
        """What the session queued, to the client (what its socket does not
        take now waits for it, under ``idle_timeout``)."""
        self.unflushed = 0
        data = self.session.data_to_send()
        if not data or self.client_broken is not None:
            return
        client = self.client
        waiting = bool(client.out)
        try:
            client.send(data)
        except IO_ERRORS as exc:
            # Acted on in `_settle`: a stream may be mid-way here.
            self.client_broken = f"client write failed: {exc}"
            return
        self.result.bytes_to_client += len(data)
        if client.out and not waiting:
            self.client_progress = self.now()
            self.arm(self.client_progress + self.idle_timeout)

    def _flush_client(self) -> None:
        client = self.client
        try:
            if client.flush():
                self.client_progress = self.now()
        except IO_ERRORS as exc:
            self._client_failed(f"client write failed: {exc}")
            return
        if len(client.out) < HIGH_WATER and self.state is OPEN:
            self._resume()

    def _congested(self) -> bool:
        """Too much waits for the client's socket: response data waits."""
        if len(self.client.out) + self.unflushed >= HIGH_WATER:
            self._flush_session()
        return self.client_broken is not None or len(self.client.out) >= HIGH_WATER

    def _resume(self) -> None:
        """A window opened or the client read: the streams waiting go on."""
        for stream in list(self.blocked):
            if stream not in self.blocked:
                continue  # ended by an earlier one's failure
            if stream.phase is _ANSWERING:
                self._pump_answer(stream)
            elif (
                stream.phase is _EXCHANGE
                and stream.attempt is not None
                and stream.attempt.conn is not None
            ):
                self._pump_response(stream)

    # -- session events --------------------------------------------------------

    def _dispatch(self, events: list[Event], now: float) -> None:
        """The session's events for client bytes read at *now*."""
        for event in events:
            if isinstance(event, StreamOpened):
                self._open(event, now)
            elif isinstance(event, RequestData | RequestEnd):
                self._request_body(event, now)
            elif isinstance(event, WindowOpened):
                if self.blocked:
                    self._resume()
            elif isinstance(event, StreamCancelled):
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    self._cancelled(stream, event.error_code)
            elif isinstance(event, StreamMalformed):
                self._malformed(event)
            else:
                assert isinstance(event, ConnectionEnded), event
                self._ended(event)

    def _request_body(self, event: RequestData | RequestEnd, now: float) -> None:
        stream = self.streams.get(event.stream_id)
        attempt = None if stream is None else stream.attempt
        if (
            stream is None
            or attempt is None  # answering (the gate refused the request)
            or attempt.request_progress is STOPPED
            or stream.phase is _ANSWERING
        ):
            if isinstance(event, RequestData):
                self.session.acknowledge(event.stream_id, event.flow_length)
            if stream is not None and isinstance(event, RequestEnd):
                stream.request_read = True
            return
        if isinstance(event, RequestEnd):
            stream.request_read = True
        else:
            stream.body_bytes += len(event.data)
        stream.body.append(event)
        attempt.body_progress = now
        raw = attempt.raw
        if (
            stream.phase is _EXCHANGE
            and raw is not None
            and attempt.request_progress is BODY
            and not raw.out
        ):
            attempt.pump_body()

    def _cancelled(self, stream: _Stream, code: int) -> None:
        """The client reset the stream: its upstream connection, holding half
        an exchange, is closed."""
        stream.cancelled = True
        log = stream.log
        if stream.attempt is None or stream.attempt.failure is None:
            log.termination = Termination.CLIENT_ERROR
            log.detail = f"client reset the stream (error code {code})"
        self._close_stream(stream)

    def _ended(self, event: ConnectionEnded) -> None:
        if event.by_client:
            self._end(Termination.CLIENT_CLOSED, event.reason)
            return
        self._end(Termination.CLIENT_ERROR, event.reason)
        LOGGER.info(
            "listener %s: client %s: HTTP/2 connection closed: %s",
            self.site.listener_name,
            self.client_text,
            event.reason,
        )

    def _new_log(self, method: bytes | None, target: bytes | None) -> RequestLog:
        return self.request_lines.new(
            time.time(),
            method.decode("latin-1") if method is not None else None,
            log_text(target) if target is not None else None,
            "2.0",
        )

    def _emit(self, log: RequestLog) -> None:
        self.request_lines.emit(log)
        on_request = self.site.on_request
        if on_request is not None:
            on_request(log)

    def _malformed(self, event: StreamMalformed) -> None:
        """A malformed request: a new stream's (logged here), or the trailers
        or length of one being served (it ends, its upstream connection,
        holding half a request, closed)."""
        LOGGER.info(
            "listener %s: client %s: HTTP/2 stream %d reset: %s",
            self.site.listener_name,
            self.client_text,
            event.stream_id,
            event.reason,
        )
        detail = f"malformed request, stream reset: {event.reason}"
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.cancelled = True
            stream.log.termination = Termination.BAD_REQUEST
            stream.log.detail = detail
            self._close_stream(stream)
            return
        log = self._new_log(event.method, event.target)
        log.termination = Termination.BAD_REQUEST
        log.detail = detail
        self.result.requests += 1
        self._emit(log)

    def _open(self, event: StreamOpened, now: float) -> None:
        request = event.request
        log = self._new_log(request.method, request.target)
        # Checked (HOST_RE: ASCII only) by the session.
        log.host = request.host.decode("ascii")
        if request.user_agent is not None:
            log.user_agent = log_text(request.user_agent)
        log.bytes_in = request.size
        stream = _Stream(self, event.stream_id, request, log, now)
        self.streams[stream.id] = stream
        self.any_stream = True
        self.result.requests += 1
        if event.error is not None:
            status, reason = event.error
            self._respond_error(stream, status, reason, Termination.BAD_REQUEST)
        else:
            self._exchange(stream)

    # -- one stream's exchange -------------------------------------------------

    def _exchange(self, stream: _Stream) -> None:
        try:
            request = from_http2(
                stream.request, self.rewriter, max_body_size=self.http.max_body_size
            )
        except RequestRejectedError as exc:
            self._after_failure(
                stream, Failure(Termination.BAD_REQUEST, exc.reason, exc.status)
            )
            return
        if request.request_id is not None:
            stream.log.request_id = request.request_id.decode("ascii")
        stream.attempt = attempt = _StreamAttempt(
            self, request, stream.log, stream.started
        )
        attempt.stream = stream
        attempt.acquire()

    def _acknowledge_held(self, stream: _Stream) -> None:
        """Body the stream holds will not go upstream: the client's window
        gets it back."""
        session = self.session
        attempt = stream.attempt
        if attempt is not None and attempt.unacked:
            attempt._acknowledge()
        for event in stream.body:
            if isinstance(event, RequestData):
                session.acknowledge(stream.id, event.flow_length)
        stream.body.clear()

    # -- what the upstream attempts ask of their host (`AttemptHost`) ----------

    # -- the response ----------------------------------------------------------

    @staticmethod
    def _peek(stream: _Stream, conn: UpstreamExchange) -> _ResponseEvent | NeedData:
        """The response's next event, left for the next read of the stream's
        `_pump_response` (which takes it before reading *conn* again)."""
        event = conn.next_event()
        if event is not NEED_DATA:
            assert not isinstance(event, NeedData)
            stream.lookahead = event
        return event

    def _pump_response(self, stream: _Stream) -> None:
        """Upstream -> client: 1xx, the head, the body, trailers, as far as
        the windows allow."""
        attempt = stream.attempt
        assert attempt is not None
        conn = attempt.conn
        assert conn is not None
        session = self.session
        sid = stream.id
        try:
            while True:
                if stream.out is not None:
                    if not self._send_out(stream):
                        return
                    if stream.out_end:
                        self._response_sent(stream)
                        return
                if attempt.response is DELIVERED:
                    return
                event: _ResponseEvent | NeedData | None = stream.lookahead
                if event is None:
                    event = conn.next_event()
                    if event is NEED_DATA:
                        return
                else:
                    stream.lookahead = None
                if isinstance(event, Body):
                    # The last piece carries END_STREAM when no trailers follow.
                    following = self._peek(stream, conn)
                    last = isinstance(following, EndOfBody) and not (
                        attempt.trailers_ok and following.trailers
                    )
                    if last:
                        stream.lookahead = None
                    stream.out = event.data
                    stream.out_end = last
                elif isinstance(event, EndOfBody):
                    trailers = _h2_fields(event.trailers) if attempt.trailers_ok else []
                    session.send_end(sid, trailers)
                    self._response_sent(stream)
                    return
                elif isinstance(event, Response):
                    if self._response_head(stream, attempt, conn, event):
                        self._response_sent(stream)
                        return
                else:
                    assert isinstance(event, Informational), event
                    head = event.head
                    if head.status == 101:
                        raise UpstreamError(
                            "unexpected 101 from upstream: no upgrade was asked"
                        )
                    if head.status == 100 and not stream.request.expects_continue:
                        continue
                    session.send_headers(
                        sid, head.status, _response_fields(head), end_stream=False
                    )
        except UpstreamError as exc:
            attempt.upstream_failed(exc)

    def _response_head(
        self,
        stream: _Stream,
        attempt: _StreamAttempt,
        conn: UpstreamExchange,
        event: Response,
    ) -> bool:
        """Send the response head; True if it ends the response."""
        head = event.head
        log = stream.log
        # (The head's last bytes were read then, in this reactor call.)
        log.first_byte = attempt.read_progress - stream.started
        log.status = head.status
        fields = _response_fields(head)
        attempt.trailers_ok = event.body is CHUNKED_BODY
        following = self._peek(stream, conn)
        assert STARTED in RESPONSE_TRANSITIONS[attempt.response]
        attempt.response = STARTED
        if isinstance(following, EndOfBody) and not following.trailers:
            stream.lookahead = None
            self.session.send_headers(stream.id, head.status, fields, end_stream=True)
            return True
        self.session.send_headers(stream.id, head.status, fields, end_stream=False)
        self.arm(attempt.read_progress + self.idle_timeout)
        return False

    def _send_out(self, stream: _Stream) -> bool:
        """Send what the stream holds of the response body, as far as the
        windows allow; False if some waits (or the stream is gone: then it
        failed)."""
        out = stream.out
        assert out is not None
        session = self.session
        sid = stream.id
        sent = False
        while out:
            size = session.sendable(sid)
            if size <= 0 or self._congested():
                if not session.open(sid):
                    stream.out = None
                    self._stream_gone(stream)
                    return False
                stream.out = out
                if sent or stream not in self.blocked:
                    # The stall counts from the last progress, not the
                    # last window update (it may be another stream's).
                    stream.blocked_since = self.now()
                    self.arm(stream.blocked_since + self.idle_timeout)
                self.blocked.add(stream)
                if stream.attempt is not None:
                    self.dirty[stream.attempt] = None
                return False
            if len(out) <= size:
                chunk, out = bytes(out), b""  # (no copy of a whole bytes)
            else:
                view = memoryview(out)
                chunk, out = bytes(view[:size]), view[size:]
            last = stream.out_end and not out
            session.send_data(sid, chunk, end_stream=last)
            stream.log.bytes_out += len(chunk)
            self.unflushed += len(chunk)
            sent = True
        stream.out = None
        self.blocked.discard(stream)
        if stream.attempt is not None:
            self.dirty[stream.attempt] = None
        return True

    def _stream_gone(self, stream: _Stream) -> None:
        """The session no longer takes the stream's response (it ended)."""
        attempt = stream.attempt
        if stream.phase is _ANSWERING or attempt is None:
            self._close_stream(stream)
        else:
            attempt.fail(
                Failure(
                    Termination.CLIENT_ERROR, "the stream or the connection ended", None
                )
            )

    def _response_sent(self, stream: _Stream) -> None:
        """The whole response is queued; the rest of a request not read in
        full is not wanted (see `UpstreamAttempt.response_delivered`)."""
        if not stream.request_read:
            self.session.stop_request(stream.id)
        attempt = stream.attempt
        assert attempt is not None
        attempt.response_delivered()

    # -- the end of a stream ---------------------------------------------------

    def _after_failure(self, stream: _Stream, failure: Failure) -> None:
        self.blocked.discard(stream)
        stream.out = None
        log = stream.log
        log.termination = failure.termination
        log.detail = failure.detail
        attempt = stream.attempt
        if attempt is not None and attempt.response is not WAITING:
            self.session.reset(stream.id, _reset_code(failure))
        elif failure.status is not None and not stream.cancelled:
            self._respond_error(
                stream, failure.status, failure.detail, failure.termination
            )
            return
        else:
            self.session.reset(stream.id, ErrorCodes.CANCEL)
        self._close_stream(stream)

    def _respond_error(
        self, stream: _Stream, status: int, reason: str, termination: str
    ) -> None:
        """A small plain-text error response (as HTTP/1.1's, without close)."""
        stream.log.error_response(self.site.listener_name, status, reason, termination)
        stream.to(_ANSWERING)
        body = error_body(status, reason)
        self.session.send_headers(
            stream.id,
            status,
            [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ],
            end_stream=False,
        )
        if stream.request.method == b"HEAD":
            self.session.send_end(stream.id, [])
            self._answered(stream)
            return
        stream.out = body
        stream.out_end = True
        self._pump_answer(stream)

    def _pump_answer(self, stream: _Stream) -> None:
        if self._send_out(stream):
            self._answered(stream)

    def _answered(self, stream: _Stream) -> None:
        if not stream.request_read:
            self.session.stop_request(stream.id)
        self._close_stream(stream)

    def _close_stream(self, stream: _Stream) -> None:
        """The stream is over: its upstream socket let go (closed: it holds
        half an exchange), its unused body given back to the window, its
        line logged."""
        if stream.phase is _CLOSED:
            return
        stream.to(_CLOSED)
        attempt = stream.attempt
        if attempt is not None:
            attempt.abandon()
            self.dirty.pop(attempt, None)
        session = self.session
        self._acknowledge_held(stream)
        session.forget(stream.id)
        del self.streams[stream.id]
        self.blocked.discard(stream)
        stream.out = None
        now = self.now()
        if not session.active and not self.streams:
            self.idle_since = now
            self.arm(now + min(PARK_AFTER, self.http.keepalive_timeout))
        log = stream.log
        log.total = now - stream.started
        self._emit(log)
        if self.draining and not self.streams and self.state is OPEN:
            self._end(Termination.DRAINED)
            self._shut_down()


def _h2_fields(headers: list[Header]) -> list[Header]:
    """Trailer fields for HTTP/2: `response_trailers` (no hop-by-hop,
    connection-specific, framing or routing field), names in lowercase."""
    return [(name.lower(), value) for name, value in response_trailers(headers)]


def _response_fields(head: ResponseHead) -> list[Header]:
    """A response head's fields for HTTP/2, in one pass over them: what
    `_h2_fields` keeps, with the ``Connection`` tokens the head's parser
    gathered (a token naming framing or ``host`` drops nothing, as in
    `strip_hop_by_hop`), and no ``content-length`` in a 1xx or a 204."""
    status = head.status
    drop = _DROPPED_WITHOUT_CONTENT if status < 200 or status == 204 else _DROPPED_IN_H2
    named = head.connection - NOT_NAMED_AWAY
    if named:
        drop = drop | named
    return [
        (lower, value)
        for name, value in head.headers
        if (lower := name.lower()) not in drop
    ]


def h2_connection(
    client: trio.abc.Stream,
    downstream: Downstream,
    site: HttpSite,
    *,
    proxy_header: bytes | None,
    spawn: Spawn,
    on_done: Callable[[HttpConnectionResult], None],
    result: HttpConnectionResult | None = None,
    initial_data: bytes = b"",
) -> _H2Connection:
    """An HTTP/2 connection that no task waits for, as
    `tlsedge._pipeline.http.h1.http_connection` (the same arguments): *spawn*
    starts a stream's upstream connect in a task of its own.

    Raises:
        TypeError: *client* is not socket-backed.
    """
    return _H2Connection(
        socket_backed(client),
        downstream,
        site,
        proxy_header=proxy_header,
        result=HttpConnectionResult() if result is None else result,
        initial_data=initial_data,
        spawn=spawn,
        on_done=on_done,
    )
