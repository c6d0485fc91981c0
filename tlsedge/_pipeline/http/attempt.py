"""One request's upstream half, for HTTP/1.1 and HTTP/2 alike: the upstream attempt.

Theory of operation
===================

Both client sides (`tlsedge._pipeline.http.h1` for HTTP/1.1, `tlsedge._pipeline.http.h2`
for HTTP/2) turn a client's request into an `UpstreamRequest` through the gate
and hand it to an `UpstreamAttempt`, which drives it to the upstream and back:

    acquire -> begin -> pump body -> read the response -> end
      |          (head and the buffered body in one write)    |
      +-- a new connection: the host's job opens it           +-> hold / release
                                                                  / retry / fail

* **acquire**: a held or pooled connection (`UpstreamConnections.take`), or
  a connect job the host runs in a task (`AttemptHost.open_upstream`); no
  healthy server is 503, a failed connect 502.
* **begin**: the head, and the body pieces the client side already holds,
  go upstream in one write (the PROXY prefix of a new ``send_proxy``
  connection first).
* **pump body**: the client side's pieces (`_next_piece`) as the upstream
  takes them; the client side is told when the socket took what it was
  given (`_acknowledge`: HTTP/2's flow-control credit) or when the
  upstream takes no more (`_body_stopped`).
* **read**: the upstream's bytes into the `UpstreamExchange`; its events
  are the client side's to relay (`_relay_response`: bytes to an HTTP/1.1
  socket, frames within HTTP/2 windows). The client side says when its
  client has the whole response (`response_delivered`).
* **end**: after the response, a failure or a stall, once: the connection is
  held for the next request (`AttemptHost.hold`), pooled, or closed (clean
  or not, `tlsedge._pipeline.http.upstream_step.is_clean`); a failure before any
  response byte may go again on a new connection
  (`tlsedge._pipeline.http.upstream_step.should_retry`); else the client side answers
  the failure (`_failed`) or closes the exchange (`_done`).

Progress only moves forward, so it is two enums, not flags, each with its
legal transitions beside it (as h11's ``_state.py``); a retry starts both
afresh. `RequestProgress`: the head (and maybe the whole request) waits in
the socket's buffer, the head went out and the body follows, the request is
written, or the upstream stopped taking the body. `ResponseProgress`: no
final head yet, the head went to the client side, the whole response is
written to the client's socket (HTTP/1.1), the client side has all of it;
or, for HTTP/1.1's ``Upgrade``, the protocol switched.

Deadlines are timestamps; the host's one timer asks `upstream_due` what is
due on the upstream side: the upstream not reading for ``idle_timeout`` (502
before the head went out, else the body stops), no response head within
``response_timeout`` after the request went out (504), the response stalled
for ``idle_timeout`` while the client takes what it is given. The request
body's deadline (``idle_timeout`` after its last bytes, or behind
``request_body_min_rate`` after ``request_body_timeout``) is computed here
too (`body_due`); when it applies is the client side's to say.
"""

from __future__ import annotations

import abc
import enum
import logging
import math
from collections.abc import Callable, Reversible
from typing import Final, Protocol

import trio

from tlsedge._backends.upstream import NoServerError
from tlsedge._core.balancer import Server
from tlsedge._core.config import HttpConfig
from tlsedge._core.termination import Termination
from tlsedge._http.body import NO_BODY
from tlsedge._http.exchange import UpstreamError, UpstreamExchange
from tlsedge._http.gate import UpstreamRequest
from tlsedge._http.head import RequestRejectedError
from tlsedge._http.log import HttpConnectionResult, RequestLog
from tlsedge._http.rules import RequestRewriter
from tlsedge._http.session import ClientClosedMidRequestError
from tlsedge._pipeline.http.site import HttpSite
from tlsedge._pipeline.http.upstream_step import (
    IO_ERRORS,
    UPSTREAM_READ_STALLED,
    UPSTREAM_WRITE_STALLED,
    Failure,
    head_not_sent,
    is_clean,
    log_retry,
    should_retry,
    upstream_failure,
)
from tlsedge._pipeline.http.upstreams import (
    NewConnection,
    Upstream,
    UpstreamConnections,
)
from tlsedge._reactor.loop import ERROR, HANGUP, READABLE, WRITABLE
from tlsedge._reactor.raw_stream import RawStream

__all__ = [
    "BODY",
    "DELIVERED",
    "HEAD_QUEUED",
    "NOT_SENT",
    "QUEUED",
    "REQUEST_TRANSITIONS",
    "RESPONSE_TRANSITIONS",
    "STARTED",
    "STOPPED",
    "SWITCHED",
    "WAITING",
    "WHOLE_QUEUED",
    "WRITTEN",
    "AttemptHost",
    "Due",
    "RequestProgress",
    "ResponseProgress",
    "UpstreamAttempt",
    "upstream_socket",
]

LOGGER = logging.getLogger("tlsedge.http")

Header = tuple[bytes, bytes]

#: A deadline and what to call when it passes (None: nothing is due).
Due = tuple[float, Callable[[], None] | None]


class RequestProgress(enum.Enum):
    """How far the request went upstream in the current attempt."""

    #: No connection yet (acquiring, or connecting).
    NOT_SENT = "not sent"
    #: The head, with the body pieces that were there, waits in the
    #: socket's buffer; more body follows.
    HEAD_QUEUED = "head queued"
    #: The whole request went in the first write and waits in the buffer.
    WHOLE_QUEUED = "whole queued"
    #: The head went out; the body follows as the client sends it.
    BODY = "body"
    #: The whole request is written (the last bytes may still wait).
    WRITTEN = "written"
    #: The upstream took no more of the body (it may still answer).
    STOPPED = "stopped"

    # Members are singletons: hashed by identity, in C (`enum.Enum`'s own
    # hash runs Python code on every table lookup).
    __hash__ = object.__hash__


# The members as module constants: looking a member up on its enum class
# costs several times a global's lookup, and the hot path compares
# progress on every event.
NOT_SENT: Final = RequestProgress.NOT_SENT
HEAD_QUEUED: Final = RequestProgress.HEAD_QUEUED
WHOLE_QUEUED: Final = RequestProgress.WHOLE_QUEUED
BODY: Final = RequestProgress.BODY
WRITTEN: Final = RequestProgress.WRITTEN
STOPPED: Final = RequestProgress.STOPPED


#: The legal moves of `RequestProgress` (a retry starts at NOT_SENT again).
REQUEST_TRANSITIONS: Final[dict[RequestProgress, frozenset[RequestProgress]]] = {
    NOT_SENT: frozenset({HEAD_QUEUED, WHOLE_QUEUED}),
    HEAD_QUEUED: frozenset({BODY}),
    WHOLE_QUEUED: frozenset({WRITTEN}),
    BODY: frozenset({WRITTEN, STOPPED}),
    WRITTEN: frozenset({STOPPED}),
    STOPPED: frozenset(),
}

#: The request's head went out (the body, if any, follows or went too).
_HEAD_OUT: Final = frozenset({BODY, WRITTEN, STOPPED})
#: All of the request was handed to the socket.
_ALL_GIVEN: Final = frozenset({WHOLE_QUEUED, WRITTEN})


class ResponseProgress(enum.Enum):
    """How far the response came back in the current attempt."""

    #: No final response head yet (1xx may have passed).
    WAITING = "waiting"
    #: The final head arrived and went to the client side; the body follows.
    STARTED = "started"
    #: All of the response is written to the client's socket (HTTP/1.1:
    #: some may still wait for the client to read it).
    QUEUED = "queued"
    #: The client side has the whole response (HTTP/2: its END_STREAM is
    #: queued).
    DELIVERED = "delivered"
    #: 101: the protocol switched (HTTP/1.1 ``Upgrade``); bytes are relayed.
    SWITCHED = "switched"

    __hash__ = object.__hash__  # (as `RequestProgress`)


WAITING: Final = ResponseProgress.WAITING
STARTED: Final = ResponseProgress.STARTED
QUEUED: Final = ResponseProgress.QUEUED
DELIVERED: Final = ResponseProgress.DELIVERED
SWITCHED: Final = ResponseProgress.SWITCHED


#: The legal moves of `ResponseProgress`.
RESPONSE_TRANSITIONS: Final[dict[ResponseProgress, frozenset[ResponseProgress]]] = {
    WAITING: frozenset({STARTED, SWITCHED}),
    STARTED: frozenset({QUEUED, DELIVERED}),
    QUEUED: frozenset({DELIVERED}),
    DELIVERED: frozenset(),
    SWITCHED: frozenset(),
}


class AttemptHost(Protocol):
    """What an attempt needs from its client connection (the reactor
    connection that owns the sockets, the timer and the jobs)."""

    #: trio's clock.
    now: Callable[[], float]
    idle_timeout: float
    http: HttpConfig
    rewriter: RequestRewriter
    upstreams: UpstreamConnections
    result: HttpConnectionResult
    #: What every connection of the listener is served with.
    site: HttpSite

    @property
    def idle_upstreams(self) -> Reversible[Upstream]:
        """The idle connections held for the next requests, oldest first."""

    #: The earliest deadline the timer is armed for (`arm` does nothing
    #: for a later one).
    armed: float

    def arm(self, deadline: float) -> None:
        """Have the timer look at the deadlines again at *deadline*."""

    def hold(
        self, attempt: UpstreamAttempt, upstream: Upstream, raw: RawStream
    ) -> bool:
        """Keep the clean connection the attempt leaves, its socket watched
        for the server closing it, for the next requests; False if not."""

    def open_upstream(self, attempt: UpstreamAttempt, new: NewConnection) -> None:
        """Open *new* in a job, then `UpstreamAttempt.begin` on it (or
        `UpstreamAttempt.connect_failed`)."""

    def attach(self, attempt: UpstreamAttempt, upstream: Upstream) -> RawStream:
        """*upstream*'s socket (held until now, or `upstream_socket`), the
        attempt's from now on (to watch)."""

    def detach(self, attempt: UpstreamAttempt, raw: RawStream) -> None:
        """Stop watching the attempt's socket *raw*."""

    def interest_changed(self, attempt: UpstreamAttempt) -> None:
        """What the attempt's socket waits for may have changed."""


def upstream_socket(upstream: Upstream) -> RawStream:
    """The non-blocking I/O over a new or pooled upstream connection.

    Raises:
        TypeError: its stream is not socket-backed (a bug).
    """
    raw = RawStream.of(upstream.stream)
    if raw is None:
        msg = f"upstream stream not socket-backed: {upstream.stream!r}"
        raise TypeError(msg)
    return raw


class UpstreamAttempt(abc.ABC):
    """One request's way to the upstream and back, retries included; the
    fields set in `_restart` describe the current attempt. Subclasses are
    the client sides: they implement the abstract hooks."""

    __slots__ = (
        "body_progress",
        "body_started",
        "conn",
        "connect_started",
        "exclude",
        "failure",
        "fresh",
        "head_deadline",
        "host",
        "log",
        "raw",
        "read_progress",
        "request",
        "request_progress",
        "response",
        "retried",
        "scope",
        "started",
        "trailers_ok",
        "unacked",
        "upstream",
        "upstream_progress",
    )

    def __init__(
        self,
        host: AttemptHost,
        request: UpstreamRequest,
        log: RequestLog,
        started: float,
    ) -> None:
        self.host = host
        self.request = request
        self.log = log
        self.started = started
        self.exclude: Server | None = None  # the server a failed attempt used
        self.fresh = False  # a retry: a new connection, not a pooled one
        self.retried = False
        self.connect_started = 0.0
        #: The connect job's scope, while one runs.
        self.scope: trio.CancelScope | None = None
        # The current attempt (as `_restart`, written out: one call less
        # per request).
        self.upstream: Upstream | None = None
        self.raw: RawStream | None = None
        self.conn: UpstreamExchange | None = None
        self.request_progress = NOT_SENT
        self.response = WAITING
        self.body_started = 0.0  # the head went upstream: the body's clock
        self.body_progress = 0.0  # the last body bytes from the client
        self.upstream_progress = 0.0  # since when the upstream owes a write
        self.read_progress = 0.0  # the last response bytes from the upstream
        self.head_deadline = math.inf  # response_timeout once the request is sent
        self.trailers_ok = False  # the response is chunked: trailers may follow
        #: Flow-control credit of the pieces handed to the socket and not
        #: acknowledged yet (`_next_piece` adds it: HTTP/2's flow lengths).
        self.unacked = 0
        self.failure: Failure | None = None

    def _restart(self) -> None:
        """A retry: the current attempt's fields afresh."""
        self.upstream = None
        self.raw = None
        self.conn = None
        self.request_progress = NOT_SENT
        self.response = WAITING
        self.body_started = self.body_progress = 0.0
        self.upstream_progress = self.read_progress = 0.0
        self.head_deadline = math.inf
        self.trailers_ok = False
        self.unacked = 0
        self.failure = None

    # -- progress ----------------------------------------------------------

    @property
    def head_out(self) -> bool:
        """The request's head went out (so a failure no longer retries)."""
        return self.request_progress in _HEAD_OUT

    # -- the client side's hooks --------------------------------------------

    @abc.abstractmethod
    def _next_piece(self) -> bytes | list[Header] | None:
        """The client's next body bytes, or its trailers at the end of the
        body, or None when it has none now.

        Raises:
            RequestRejectedError: the piece breaks the request's framing.
            ClientClosedMidRequestError: the client closed mid-body.
        """

    def _acknowledge(self) -> None:
        """The socket took (or the attempt dropped) the pieces worth
        ``unacked`` credit: give it back (HTTP/2 overrides this: a
        WINDOW_UPDATE). Called only when ``unacked`` is not zero."""
        self.unacked = 0

    @abc.abstractmethod
    def _body_stopped(self) -> None:
        """The upstream takes no more of the body."""

    @abc.abstractmethod
    def _request_read(self) -> bool:
        """Whether the client's whole request was read."""

    @abc.abstractmethod
    def _body_bytes(self) -> int:
        """Request body bytes the client sent so far."""

    @abc.abstractmethod
    def _relay_response(self) -> None:
        """The exchange has new events: relay them to the client."""

    @abc.abstractmethod
    def _failed(self, failure: Failure) -> None:
        """The request failed for good: answer or cut the response."""

    @abc.abstractmethod
    def _done(self) -> None:
        """The exchange ended well (its connection is held, pooled or closed)."""

    # -- acquire and begin ------------------------------------------------------

    def acquire(self) -> None:
        """Begin on a reused connection, or have the host open one."""
        host = self.host
        self.connect_started = host.now()
        try:
            taken = host.upstreams.take(
                self.exclude, fresh=self.fresh, held=host.idle_upstreams
            )
        except NoServerError as exc:
            self._failed(Failure(Termination.NO_SERVER, str(exc), 503))
            return
        if isinstance(taken, NewConnection):
            host.open_upstream(self, taken)
        else:
            self.begin(taken)

    def connect_failed(self, detail: str) -> None:
        """The host's connect job failed (after its retries): 502."""
        self._failed(Failure(Termination.CONNECT_FAILED, detail, 502))

    def begin(self, upstream: Upstream) -> None:
        """Send the request head and the body pieces already there, in one
        write."""
        host = self.host
        now = host.now()
        log = self.log
        log.connect = now - self.connect_started
        log.server = server = upstream.server.name  # (its address, written once)
        host.result.server = server
        self.upstream = upstream
        self.raw = raw = host.attach(self, upstream)
        self.conn = conn = UpstreamExchange(self.request)
        try:
            # HTTP/1.0 without Host: the server's address, per attempt.
            pieces = [conn.request_head(server)]
            complete = conn.request_complete
            while not complete:
                piece = self._next_piece()
                if piece is None:
                    break
                pieces.append(self._frame(piece))
                complete = not isinstance(piece, bytes)
        except RequestRejectedError as exc:
            if self.unacked:
                self._acknowledge()
            self.fail(Failure(Termination.BAD_REQUEST, exc.reason, exc.status))
            return
        except ClientClosedMidRequestError as exc:
            if self.unacked:
                self._acknowledge()
            self.fail(Failure(Termination.CLIENT_ERROR, str(exc), None))
            return
        assert self.request_progress is NOT_SENT
        self.request_progress = WHOLE_QUEUED if complete else HEAD_QUEUED
        prefix, upstream.prefix = upstream.prefix, b""
        if prefix:
            pieces.insert(0, prefix)
        try:
            raw.send(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        except IO_ERRORS as exc:
            if self.unacked:
                self._acknowledge()
            self.fail(head_not_sent(exc))
            return
        if raw.out:
            self.upstream_progress = now
            host.arm(now + host.idle_timeout)
        else:
            if self.unacked:
                self._acknowledge()
            self._head_sent()

    def _frame(self, piece: bytes | list[Header]) -> bytes:
        """A piece of the client's body, or its end, framed for the upstream.

        Raises:
            RequestRejectedError: the exchange refuses it (a length that does
                not add up, a trailer the gate refuses).
        """
        conn = self.conn
        assert conn is not None
        if isinstance(piece, bytes):
            self.log.bytes_in += len(piece)
            return conn.request_data(piece)
        return conn.request_end(self.host.rewriter.clean_trailers(piece))

    def _head_sent(self) -> None:
        if self.request_progress is WHOLE_QUEUED:
            assert WRITTEN in REQUEST_TRANSITIONS[self.request_progress]
            self.request_progress = WRITTEN
            self._request_sent()
            return
        assert BODY in REQUEST_TRANSITIONS[self.request_progress]
        self.request_progress = BODY
        # The body's clock starts now: until the head went out, the client's
        # body waits.
        self.body_started = self.body_progress = self.host.now()
        self.host.arm(self.body_due())
        self.pump_body()

    def _request_sent(self) -> None:
        """The request is upstream: its answer's head is due within
        ``response_timeout`` (unless it already came)."""
        if self.response is DELIVERED:
            self.end()
            return
        if self.response is not WAITING:
            return
        host = self.host
        self.head_deadline = deadline = host.now() + host.http.response_timeout
        if deadline < host.armed:  # (`arm`'s own test, a call less per request)
            host.arm(deadline)

    # -- the body ----------------------------------------------------------------

    def pump_body(self) -> None:
        """Client -> upstream: the pieces the client side has, while the
        upstream takes them (backpressure)."""
        raw = self.raw
        assert raw is not None
        while self.request_progress is BODY and not raw.out:
            try:
                piece = self._next_piece()
                if piece is None:
                    return
                data = self._frame(piece)
            except RequestRejectedError as exc:
                if self.unacked:
                    self._acknowledge()
                self.fail(Failure(Termination.BAD_REQUEST, exc.reason, exc.status))
                return
            except ClientClosedMidRequestError as exc:
                if self.unacked:
                    self._acknowledge()
                self.fail(Failure(Termination.CLIENT_ERROR, str(exc), None))
                return
            end = not isinstance(piece, bytes)
            if end:
                assert WRITTEN in REQUEST_TRANSITIONS[self.request_progress]
                self.request_progress = WRITTEN
            try:
                if data:
                    raw.send(data)
            except IO_ERRORS as exc:
                if self.unacked:
                    self._acknowledge()
                self._undeliverable(f"upstream write failed: {exc}")
                return
            if raw.out:
                host = self.host
                self.upstream_progress = host.now()
                host.arm(self.upstream_progress + host.idle_timeout)
                host.interest_changed(self)
                return
            if self.unacked:
                self._acknowledge()
            if end:
                self._request_sent()

    def _undeliverable(self, reason: str) -> None:
        """The upstream takes no more of the body. It may still have
        answered (e.g. 413 and close): the response decides; only stop
        sending."""
        raw = self.raw
        assert raw is not None
        LOGGER.debug("request body not delivered: %s", reason)
        assert STOPPED in REQUEST_TRANSITIONS[self.request_progress]
        self.request_progress = STOPPED
        raw.out.clear()
        self.host.interest_changed(self)
        self._body_stopped()
        if self.head_deadline == math.inf:
            self._request_sent()
        elif self.response is DELIVERED:
            self.end()

    # -- the upstream socket ------------------------------------------------------

    def ready(self, events: int) -> None:
        """The reactor's events for the attempt's socket."""
        raw = self.raw
        assert raw is not None
        acted = False
        if raw.out and events & (WRITABLE | ERROR | HANGUP):
            acted = True
            self.flush()
            if self.raw is not raw:
                return
        if (
            raw.interest
            and raw.interest & READABLE
            and events & (READABLE | ERROR | HANGUP)
        ):
            self.read()
        elif not acted and events & ERROR:
            conn = self.conn
            self.upstream_failed(
                UpstreamError(
                    "upstream connection reset", empty=conn is None or not conn.received
                )
            )
        elif not acted and events & HANGUP:
            raw.hung_up = True
            self.host.interest_changed(self)

    def flush(self) -> None:
        """The socket takes bytes again: what waits, then what follows."""
        raw = self.raw
        assert raw is not None
        host = self.host
        try:
            if raw.flush():
                self.upstream_progress = host.now()
        except IO_ERRORS as exc:
            if self.head_out:
                self._undeliverable(f"upstream write failed: {exc}")
            else:
                self.fail(head_not_sent(exc))
            return
        if raw.out:
            return
        host.interest_changed(self)
        if self.unacked:
            self._acknowledge()
        progress = self.request_progress
        if progress is HEAD_QUEUED or (progress is WHOLE_QUEUED):
            self._head_sent()
        elif progress is WRITTEN:
            self._request_sent()
        else:
            self.pump_body()

    def read(self) -> None:
        """The upstream's bytes into the exchange, its events relayed."""
        raw = self.raw
        conn = self.conn
        assert raw is not None
        assert conn is not None
        try:
            data = raw.receive()
        except IO_ERRORS as exc:
            self.upstream_failed(
                UpstreamError(f"upstream read failed: {exc}", empty=not conn.received)
            )
            return
        if data is None:
            return
        eof = raw.eof  # with data: a close_notify right behind it (RawStream)
        if eof:
            self.host.interest_changed(self)
        self.read_progress = self.host.now()
        conn.receive_data(data)
        if data and eof:
            conn.receive_data(b"")
        self._relay_response()

    def upstream_failed(self, exc: UpstreamError) -> None:
        self.fail(upstream_failure(exc, response_started=self.response is not WAITING))

    def response_delivered(self) -> None:
        """The client side has the whole response. A request read in full is
        still delivered upstream (under ``idle_timeout``) before the attempt
        ends, so the upstream never holds half of one; the rest of a request
        not read in full is not wanted."""
        assert DELIVERED in RESPONSE_TRANSITIONS[self.response]
        self.response = DELIVERED
        raw = self.raw
        progress = self.request_progress
        if (
            raw is not None
            and progress is not STOPPED
            and (raw.out or progress not in _ALL_GIVEN)
            and self._request_read()
        ):
            return
        self.end()

    # -- deadlines ---------------------------------------------------------------

    def upstream_due(self, due: Due, *, client_holds: bool) -> Due:
        """*due*, or what is due earlier on the upstream side (see the
        module docstring); *client_holds*: response bytes wait for the
        client (the response is not stalled then)."""
        idle = self.host.idle_timeout
        raw = self.raw
        if raw is not None and raw.out and self.upstream_progress + idle < due[0]:
            due = (self.upstream_progress + idle, self.write_stalled)
        response = self.response
        if response is WAITING:
            if self.head_deadline < due[0]:
                due = (self.head_deadline, self.response_timed_out)
        elif (
            response is STARTED
            and not client_holds
            and self.read_progress + idle < due[0]
        ):
            due = (self.read_progress + idle, self.response_stalled)
        return due

    def body_due(self) -> float:
        """When the client's request body is late: ``idle_timeout`` after its
        last bytes, or behind ``request_body_min_rate``."""
        host = self.host
        deadline = self.body_progress + host.idle_timeout
        rate = host.http.request_body_min_rate
        if rate:
            deadline = min(
                deadline,
                self.body_started
                + host.http.request_body_timeout
                + self._body_bytes() / rate,
            )
        return deadline

    def body_timed_out(self) -> None:
        host = self.host
        rate = host.http.request_body_min_rate
        now = host.now()
        body_bytes = self._body_bytes()
        reason = "request body stalled for idle_timeout"
        if rate and now >= (
            self.body_started + host.http.request_body_timeout + body_bytes / rate
        ):
            reason = (
                f"request body slower than request_body_min_rate ({rate} bytes/s):"
                f" {body_bytes} bytes in {now - self.body_started:.1f} s"
            )
        self.fail(Failure(Termination.BAD_REQUEST, reason, 408))

    def write_stalled(self) -> None:
        if self.head_out:
            self._undeliverable("upstream did not read for idle_timeout")
        else:
            self.fail(UPSTREAM_WRITE_STALLED)

    def response_timed_out(self) -> None:
        self.fail(self.host.site.response_timeout_failure)

    def response_stalled(self) -> None:
        self.fail(UPSTREAM_READ_STALLED)

    # -- the end -------------------------------------------------------------------

    def fail(self, failure: Failure) -> None:
        """End the attempt with *failure* (the first one counts)."""
        if self.failure is None:
            self.failure = failure
        self.end()

    def let_go(self) -> None:
        """Stop watching the attempt's socket."""
        raw = self.raw
        if raw is not None:
            self.host.detach(self, raw)
            raw.detach()
            self.raw = None

    def abandon(self) -> None:
        """The request is gone mid-attempt: a connect job is cancelled, the
        connection (holding half an exchange) closed."""
        if self.scope is not None:
            self.scope.cancel()
        upstream = self.upstream
        if upstream is not None:
            self.let_go()
            self.host.upstreams.release(upstream, clean=False)
            self.upstream = None

    def end(self) -> None:
        """The attempt is over: hold, pool or close its connection, then
        retry, or end the request (failed, or done)."""
        host = self.host
        upstream = self.upstream
        failure = self.failure
        request = self.request
        retry = failure is not None and should_retry(
            failure,
            upstream,
            response_started=self.response is not WAITING,
            method=request.method,
            has_body=request.body is not NO_BODY,
            retried=self.retried,
        )
        if upstream is not None:
            raw = self.raw
            clean = is_clean(
                failure,
                self.conn,
                raw,
                body_stopped=self.request_progress is STOPPED,
            )
            if clean and raw is not None and host.hold(self, upstream, raw):
                self.raw = None
            else:
                self.let_go()
                host.upstreams.release(upstream, clean=clean)
            self.upstream = None
        if retry:
            assert failure is not None
            assert upstream is not None
            log_retry(host.site.listener_name, self.log, failure)
            if not upstream.reused:
                self.retried = True
                self.exclude = upstream.server
            self.fresh = True
            self._restart()
            self.acquire()
            return
        if failure is not None:
            self._failed(failure)
            return
        self._done()
