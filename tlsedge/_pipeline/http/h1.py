"""HTTP/1.1 reverse proxy mode, driven by the reactor.

Theory of operation
===================

`http_connection` serves one client connection (after PROXY unwrap and TLS) as
a loop of *exchanges*, one per request, answered strictly in order (pipelined
requests wait in the session's buffer or the kernel's until the previous
response is complete). Two sans-IO state machines do the framing, and this
module only feeds and drains them: `tlsedge._http.session.ClientSession`
(client bytes to checked request events, our answers to client bytes) and
`tlsedge._http.exchange.UpstreamExchange` (a request to upstream bytes, the
upstream's bytes to response events). The header rules (origin-form target,
hop-by-hop fields, forwarding headers, trailers, retries) are pure functions of
`tlsedge._http.rules`. The upstream half of an exchange (a connection, the
request sent, the response read, hold / release / retry / fail) is the
`tlsedge._pipeline.http.attempt.UpstreamAttempt` HTTP/2 uses too; this module is its
HTTP/1.1 client side (`_Exchange`: the body from the session's events, the
response written to the client's socket) and the connection around it.

Who runs what. The connection is a handler of the worker's reactor
(`tlsedge._reactor.loop`), built on
`tlsedge._pipeline.http.connection.ReactorConnection` like HTTP/2's: the
reactor calls ``ready`` when the client's or the upstream's socket is ready,
and everything the proxying needs then happens in that call, without awaiting:
non-blocking reads and writes through `tlsedge._reactor.raw_stream.RawStream`
(TLS included), the session and the exchange, the next request. A keep-alive
request over a pooled upstream connection thus costs no trio task switch at
all, and the connection has no trio task of its own: the edge starts it
(``start()``) and its end calls *on_done*. Only what must await runs in a
task, started with the *spawn* it is given (the edge's connections nursery)
and gone once done: opening an upstream connection (connect, retries, a TLS
handshake), and after an ``Upgrade`` the byte relay
(`tlsedge._reactor.relay.relay`). While a job runs, neither socket is
registered (state ``WAIT``); ``drain()`` (the drain deadline) ends the
connection as ``drained`` and cancels a connect, and a relay so cancelled ends
it the same way. `serve_http` is the same connection with a task waiting for
its end (for library users and tests). An idle keep-alive connection held
through the edge cost about 4.6-5.0 KiB of RSS in plain HTTP (7.4-7.6 KiB with
the parked task it had before; 2,000 held, 2026-11-24).

States (``_HttpConnection.state``, a
`tlsedge._pipeline.http.connection.ConnectionState`; the legal moves are
`tlsedge._pipeline.http.connection.HTTP1_TRANSITIONS`)::

    HEAD --request--> EXCHANGE --response complete, keep-alive--> HEAD
      |                 |  \\--needs a new upstream connection--> WAIT (job)
      |                 |  \\--101--> UPGRADE --buffers flushed--> WAIT (relay)
      +--error answer---+--> LINGER --> DONE

Flow control. Bytes a socket does not take wait in its `RawStream.out`; while
the client's does, the upstream is not read (a response is relayed no faster
than the client reads it), and while the upstream's does, the client's body is
not read. Between requests, the next request is read only once the previous
response went out. During an exchange the client is read ahead by at most one
read (a pipelined request), so a client closing early is seen.

Timeouts. Reads and writes store timestamps only; the connection's one lazy
reactor timer fires at the earliest deadline armed so far and recomputes what
is due from the state (`_HttpConnection._deadline`, with the upstream side's
from `UpstreamAttempt.upstream_due`), named after the
``[listeners.http]`` fields: ``keepalive_timeout`` (waiting for the first byte
of a next request: quiet close), ``request_header_timeout`` (the rest of the
head; for the first request counted from the start of the connection: 408),
``response_timeout`` (from the request fully sent upstream to the response
head: 504), the listener's ``idle_timeout`` for a socket that does not take
our bytes and for the response body. A request body must also keep up an
average rate: after the grace of ``request_body_timeout`` it may take 1 s per
``request_body_min_rate`` bytes received (Apache's mod_reqtimeout rule), so a
body trickled a byte at a time, never idle for long, still gets 408.

Upstream connections come from `tlsedge._pipeline.http.upstreams.UpstreamConnections`:
the backend's `KeepAlivePool` (idle connections per server, LIFO, checked
before reuse) or, with ``send_proxy``, the connection *dedicated* to this
client connection (opened with the PROXY header first, never pooled). A
connection whose exchange left it clean (`UpstreamExchange.reusable`) is
*held* for the client's next request, its socket still registered (read on:
anything it says while idle, a FIN or stray bytes, closes it), and goes to the
pool once the client has had no request for `PARK_AFTER` or ends.
A request's body goes upstream as it arrives; 1xx are relayed (``100
Continue`` only to a client that asked for it), then the head, then the body,
trailers included when both framings allow them. The client connection
continues only when the session says so (`ClientSession.keep_alive`) and the
edge is not draining.

Failures. No healthy server: 503. Connect failure after retries: 502. Upstream
closed or reset before any response byte: 502, except that the request is sent
again when `tlsedge._http.rules.may_retry` allows. No response head within
``response_timeout``: 504. Upstream dying after the response head went out: the
client connection is aborted with an RST (`tlsedge._reactor.relay.set_abortive_close`),
so a cut response never looks complete. Error responses are tiny plain-text
bodies with ``Connection: close``, each with a log line saying what was wrong;
after one we *linger* (FIN, then read and discard for a moment) so the client's
unread upload does not turn our close into an RST that destroys the response.

``Upgrade``: after the upstream's ``101`` the bytes each side had buffered
beyond the heads are forwarded first, byte-exact, then `tlsedge._reactor.relay.relay`
carries the rest with its half-close rules. ``CONNECT`` gets 501 (this is a
reverse proxy, not a tunnel). Drain: once ``drain`` is set, the next response
of the connection carries ``Connection: close`` and the connection ends after
it; a connection idle between requests is closed at once (a callback
registered with the `tlsedge._reactor.drain.Drain` for the connection's life, which
acts only between requests).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Final

import trio

from tlsedge._backends.keepalive import close_now
from tlsedge._core.downstream import Downstream
from tlsedge._core.termination import RelayStats, Termination
from tlsedge._http.body import CHUNKED_BODY
from tlsedge._http.events import (
    NEED_DATA,
    Body,
    ConnectionClosed,
    EndOfBody,
    Informational,
    Request,
    Response,
)
from tlsedge._http.exchange import UpstreamError
from tlsedge._http.gate import from_http1
from tlsedge._http.head import (
    REQUEST_LINE_RE,
    RequestHead,
    RequestRejectedError,
    ResponseHead,
)
from tlsedge._http.log import HttpConnectionResult, RequestLog
from tlsedge._http.rules import (
    end_to_end_fields,
    log_text,
    reason_phrase,
    response_trailers,
    strip_hop_by_hop,
)
from tlsedge._http.session import ClientSession, Phase
from tlsedge._pipeline.http.attempt import (
    BODY,
    DELIVERED,
    QUEUED,
    RESPONSE_TRANSITIONS,
    STARTED,
    SWITCHED,
    WAITING,
    WRITTEN,
    Due,
    UpstreamAttempt,
)
from tlsedge._pipeline.http.connection import (
    DONE,
    EXCHANGE,
    HEAD,
    HTTP1_TRANSITIONS,
    LINGER,
    UPGRADE,
    WAIT,
    ReactorConnection,
    Spawn,
    Startable,
    run_to_end,
    socket_backed,
)
from tlsedge._pipeline.http.site import HttpSite
from tlsedge._pipeline.http.upstream_step import IO_ERRORS, Failure
from tlsedge._pipeline.http.upstreams import (
    PARK_AFTER,
)
from tlsedge._reactor.loop import (
    READABLE,
    WRITABLE,
)
from tlsedge._reactor.raw_stream import RawStream
from tlsedge._reactor.relay import relay, set_abortive_close

__all__ = [
    "Spawn",
    "Startable",
    "http_connection",
    "run_to_end",
    "serve_http",
    "socket_backed",
]

LOGGER = logging.getLogger("tlsedge.http")

Header = tuple[bytes, bytes]

#: After an error response: FIN, then read and discard the client's unread data
#: for up to this long / this much (nginx's lingering_close, much shorter), so
#: that closing with unread data (which sends an RST) cannot destroy the answer.
LINGER_TIMEOUT: Final = 2.0
LINGER_MAX_BYTES: Final = 1 << 20

# (As `tlsedge._http.body`'s constants: a global, not a lookup on the enum.)
_BODY_PHASE: Final = Phase.BODY

#: The request's head went out and its body still goes upstream.
_BODY_GOES: Final = frozenset({BODY, WRITTEN})

_CLIENT_READ_STALLED: Final = Failure(
    Termination.CLIENT_ERROR, "client did not read for idle_timeout", None
)


class _Exchange(UpstreamAttempt):
    """One request and its answer: the upstream attempt, with HTTP/1.1's
    client side (body pieces from the session's events, the response
    relayed as bytes to the client's socket)."""

    __slots__ = ("head",)

    host: _HttpConnection
    #: The request as the client sent it.
    head: RequestHead

    def _next_piece(self) -> bytes | list[Header] | None:
        event = self.host.session.next_event()
        if event is NEED_DATA:
            return None
        if isinstance(event, Body):
            return event.data
        assert isinstance(event, EndOfBody), event
        return event.trailers

    def _body_stopped(self) -> None:
        """The rest of the body stays unread (the exchange ends the
        connection, or the response decides)."""

    def _request_read(self) -> bool:
        return self.host.session.request_read

    def _body_bytes(self) -> int:
        return self.host.session.body_bytes

    def flush(self) -> None:
        if self.response is SWITCHED:
            self.host._flush_upgraded(self)
        else:
            UpstreamAttempt.flush(self)

    def _failed(self, failure: Failure) -> None:
        self.host._after_failure(self, failure)

    def _relay_response(self) -> None:
        """Upstream -> client: every event the exchange has, in one write."""
        ex = self
        connection = self.host
        conn = ex.conn
        assert conn is not None
        session = connection.session
        pending: list[bytes] = []
        try:
            while True:
                event = conn.next_event()
                if event is NEED_DATA:
                    break
                if isinstance(event, Response):
                    # (`UpstreamAttempt.read` set ``read_progress`` just now.)
                    ex.log.first_byte = ex.read_progress - ex.started
                    pending.append(connection._response_head(ex, event))
                    stall = ex.read_progress + connection.idle_timeout
                    if stall < connection.armed:
                        connection.arm(stall)
                    # The common case: the whole sized body came with the
                    # head (no events for it).
                    body = conn.rest_of_body()
                    if body is not None:
                        pending.append(session.send_data(body))
                        pending.append(session.send_end([]))
                        assert QUEUED in RESPONSE_TRANSITIONS[ex.response]
                        ex.response = QUEUED
                        break
                elif isinstance(event, Body):
                    pending.append(session.send_data(event.data))
                elif isinstance(event, EndOfBody):
                    trailers = (
                        response_trailers(event.trailers)
                        if ex.trailers_ok and event.trailers
                        else []
                    )
                    pending.append(session.send_end(trailers))
                    assert QUEUED in RESPONSE_TRANSITIONS[ex.response]
                    ex.response = QUEUED
                    break
                else:
                    assert isinstance(event, Informational), event
                    head = event.head
                    if head.status == 101:
                        connection._switch(ex, head, pending)
                        return
                    if head.status == 100:
                        if not session.expects_continue:
                            continue
                    elif ex.head.version != b"1.1":
                        continue
                    pending.append(
                        session.send_informational(
                            head.status,
                            reason_phrase(head.status, head.reason),
                            strip_hop_by_hop(head.headers, keep_upgrade=False),
                        )
                    )
        except UpstreamError as exc:
            if connection._send_pending(ex, pending):
                ex.upstream_failed(exc)
            return
        if (
            connection._send_pending(ex, pending)
            and ex.response is QUEUED
            and not connection.client.out
        ):
            ex.response_delivered()

    def _done(self) -> None:
        """The exchange ended well: the next request, or the end."""
        self.log.termination = Termination.OK
        connection = self.host
        session = connection.session
        connection._request_done()
        if session.keep_alive and not connection.site.drain.is_set():
            session.start_next_cycle()
            connection._await_request()
            return
        connection._end(
            Termination.DRAINED
            if connection.site.drain.is_set()
            else Termination.CLOSED
        )
        if session.request_read:
            connection._finish()
        else:
            connection._linger()


class _HttpConnection(ReactorConnection):
    """One client connection in HTTP mode; see the module docstring."""

    __slots__ = (
        "client_stream",
        "ex",
        "first",
        "head_deadline",
        "idle",
        "linger_deadline",
        "lingered",
        "log",
        "relay_scope",
        "request_start_time",
        "request_started",
        "session",
    )

    KIND = "HTTP"
    TRANSITIONS = HTTP1_TRANSITIONS

    def __init__(
        self,
        client_stream: trio.abc.Stream,
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
            max_held=1,
        )
        self.client_stream = client_stream
        http = self.http
        self.session = ClientSession(
            max_header_bytes=http.max_header_bytes,
            max_headers=http.max_headers,
            max_body_size=http.max_body_size,
            initial_data=initial_data,
        )
        result.bytes_from_client += len(initial_data)
        self.state = HEAD
        self.first = True  # reading the connection's first request
        self.idle = True  # no byte of the request being read yet
        # When the request being read began (trio clock, Unix time): the
        # connection's start for the first one, its first byte for later ones.
        self.request_started = self.started
        self.request_start_time = time.time()
        self.head_deadline = self.started + http.request_header_timeout
        self.ex: _Exchange | None = None
        self.log: RequestLog | None = None  # the request's, until written
        self.linger_deadline = math.inf
        self.lingered = 0
        #: The relay's scope after an ``Upgrade``, once it runs.
        self.relay_scope: trio.CancelScope | None = None

    def drain(self) -> None:
        """End the connection now, as ``drained`` (the drain deadline): a
        running relay is cancelled (its task ends the connection)."""
        if self.relay_scope is not None:
            self.relay_scope.cancel()
        else:
            self._finish()

    def _start(self) -> None:
        self.arm(self.head_deadline)
        # For the connection's life (`_drained` acts only between requests):
        # no registration per request.
        self.site.drain.call_on_set(self._drained)
        if self.client.tls is not None:
            # Records its engine read past the handshake.
            self._read_client(read_socket=False)
        if self.state is HEAD:
            self._advance_head()
        self._update_interest()

    def _end_requests(self) -> None:
        ex = self.ex
        if ex is not None:
            ex.abandon()
            self._cut_short(ex.log)
        self._request_done()

    # -- the reactor's calls -------------------------------------------------

    def _flush_upgraded(self, ex: _Exchange) -> None:
        """After a 101: the client's bytes past its head go upstream."""
        raw = ex.raw
        assert raw is not None
        try:
            if raw.flush():
                ex.upstream_progress = self.now()
        except IO_ERRORS as exc:
            self._upgrade_failed(f"upstream write failed: {exc}")
            return
        if not raw.out:
            self._relay_if_flushed()

    def _update_interest(self) -> None:
        """Watch each socket for what its state waits for."""
        state = self.state
        if state is DONE:
            return
        client = self.client
        ex = self.ex
        raw = ex.raw if ex is not None else None
        want_client: int | None = None
        want_upstream: int | None = None
        if state is HEAD:
            want_client = WRITABLE if client.out else READABLE
        elif state is EXCHANGE:
            assert ex is not None
            if self.session.phase is _BODY_PHASE:
                read = (
                    raw is not None
                    and ex.request_progress in _BODY_GOES
                    and not raw.out
                )
            else:  # read ahead by one read at most
                read = not self.session.buffered and not client.out
            want_client = (READABLE if read and not client.eof else 0) | (
                WRITABLE if client.out else 0
            )
            if raw is not None:
                # Read on after the response (anything more makes the
                # connection unusable): no interest change per request.
                read = not raw.eof and not client.out
                want_upstream = (READABLE if read else 0) | (WRITABLE if raw.out else 0)
        elif state is LINGER:
            read = not client.eof and not client.out
            want_client = (READABLE if read else 0) | (WRITABLE if client.out else 0)
        elif state is UPGRADE:
            want_client = WRITABLE if client.out else 0
            if raw is not None:
                want_upstream = WRITABLE if raw.out else 0
        # (Registrations persist: most events change nothing.)
        if want_client != client.interest or client.hung_up:
            self._watch(client, want_client)
        if raw is not None and (want_upstream != raw.interest or raw.hung_up):
            self._watch(raw, want_upstream)
        if self.dirty:  # (the attempt's socket, watched just now)
            self.dirty.clear()

    _ready_done = _settle = _update_interest

    # -- timers ------------------------------------------------------------

    def _expire(self, now: float) -> None:
        deadline, expire = self._deadline()
        if expire is not None and now >= deadline:
            expire()

    def _earliest(self) -> float:
        return self._deadline()[0]

    def _deadline(self) -> Due:
        """What is due next, and when (see Timeouts)."""
        state = self.state
        client = self.client
        idle = self.idle_timeout
        if state is HEAD:
            if client.out:
                return self.client_progress + idle, self._client_stalled
            if self.held:
                park = self._oldest_held() + PARK_AFTER
                if park < self.head_deadline:
                    return park, self._park_held
            return self.head_deadline, self._head_timed_out
        if state is LINGER:
            if client.out:
                return self.client_progress + idle, self._finish
            return self.linger_deadline, self._finish
        ex = self.ex
        if ex is None or (state is not EXCHANGE and state is not UPGRADE):
            return math.inf, None
        raw = ex.raw
        if state is UPGRADE:
            since = min(
                self.client_progress if client.out else math.inf,
                ex.upstream_progress if raw is not None and raw.out else math.inf,
            )
            return since + idle, self._upgrade_stalled
        due: Due = (math.inf, None)
        if client.out:
            due = (self.client_progress + idle, self._client_stalled)
        due = ex.upstream_due(due, client_holds=bool(client.out))
        if self.session.phase is _BODY_PHASE and ex.request_progress in _BODY_GOES:
            body_due = ex.body_due()
            if body_due < due[0]:
                due = (body_due, ex.body_timed_out)
        return due

    def _head_timed_out(self) -> None:
        if not self.idle:
            self._reject_head(
                RequestRejectedError(
                    408, "request head not complete within request_header_timeout"
                )
            )
            return
        self._end(
            Termination.REQUEST_HEADER_TIMEOUT
            if self.first
            else Termination.KEEPALIVE_TIMEOUT
        )
        self._finish()

    def _drained(self) -> None:
        if self.state is HEAD and self.idle and not self.first:
            self._end(Termination.DRAINED)
            self._finish()

    def _client_stalled(self) -> None:
        self._client_failed(_CLIENT_READ_STALLED.detail)

    def _upgrade_stalled(self) -> None:
        self._upgrade_failed("a side did not read for idle_timeout")

    # -- the client ----------------------------------------------------------

    def _read_client(self, *, read_socket: bool = True) -> None:
        client = self.client
        try:
            data = client.receive(read_socket=read_socket)
        except IO_ERRORS as exc:
            self._client_failed(f"client read failed: {exc}")
            return
        if data is None:
            return
        state = self.state
        if state is LINGER:
            self.lingered += len(data)
            if client.eof or self.lingered >= LINGER_MAX_BYTES:
                self._finish()
            return
        self.result.bytes_from_client += len(data)
        self.session.receive_data(data)
        if data and client.eof:
            # The EOF came in the same read (a close_notify right behind
            # the bytes): no socket event will say it again.
            self.session.receive_data(b"")
        if state is HEAD:
            self._advance_head()
        elif state is EXCHANGE and self.session.phase is _BODY_PHASE:
            ex = self.ex
            assert ex is not None
            ex.body_progress = self.now()
            ex.pump_body()

    def _send_client(self, data: bytes, log: RequestLog | None = None) -> None:
        """Write to the client (raises on failure); what it does not take now
        waits for it, under ``idle_timeout``."""
        client = self.client
        if client.out:
            client.send(data)
        else:
            client.send(data)
            if client.out:
                self.client_progress = self.now()
                self.arm(self.client_progress + self.idle_timeout)
        self.result.bytes_to_client += len(data)
        if log is not None:
            log.bytes_out += len(data)

    def _flush_client(self) -> None:
        client = self.client
        try:
            if client.flush():
                self.client_progress = self.now()
        except IO_ERRORS as exc:
            self._client_failed(f"client write failed: {exc}")
            return
        if client.out:
            return
        state = self.state
        if state is HEAD:
            self._advance_head()
        elif state is EXCHANGE:
            ex = self.ex
            assert ex is not None
            if ex.response is QUEUED:
                ex.response_delivered()
        elif state is LINGER:
            if client.eof:
                self._finish()
        elif state is UPGRADE:
            self._relay_if_flushed()

    def _client_failed(self, detail: str) -> None:
        state = self.state
        if state is EXCHANGE:
            ex = self.ex
            assert ex is not None
            ex.fail(Failure(Termination.CLIENT_ERROR, detail, None))
        elif state is UPGRADE:
            self._upgrade_failed(detail)
        elif state is HEAD:
            self._end(Termination.CLIENT_ERROR, detail)
            self._finish()
        else:
            self._finish()

    # -- reading a request head ------------------------------------------------

    def _await_request(self) -> None:
        """Between requests: the next one's first byte is due within
        ``keepalive_timeout``, and a drain closes the connection."""
        assert HEAD in HTTP1_TRANSITIONS[self.state]
        self.state = HEAD
        self.first = False
        self.idle = True
        self.head_deadline = deadline = self.now() + self.http.keepalive_timeout
        if deadline < self.armed:
            self.arm(deadline)
        session = self.session
        if session.buffered or session.eof:
            # A pipelined request or the client's end: else the session
            # has nothing to say until the client's next bytes.
            self._advance_head()

    def _request_begins(self) -> None:
        now = self.now()
        self.idle = False
        self.request_started = self.started if self.first else now
        self.request_start_time = time.time() - (now - self.request_started)
        self.head_deadline = deadline = (
            self.request_started + self.http.request_header_timeout
        )
        if deadline < self.armed:
            self.arm(deadline)

    def _advance_head(self) -> None:
        """Take the next request from the session, if it has one whole."""
        if self.client.out:
            return  # the previous answer goes out first
        session = self.session
        try:
            event = session.next_event()
        except RequestRejectedError as exc:
            if self.idle:
                self._request_begins()
            self._reject_head(exc)
            return
        if event is NEED_DATA:
            if self.idle and session.buffered:
                self._request_begins()
            return
        if isinstance(event, ConnectionClosed):
            detail = "EOF inside a request head" if event.in_head else None
            self._end(Termination.CLIENT_CLOSED, detail)
            self._finish()
            return
        assert isinstance(event, Request), event
        if self.idle:  # the whole head came in one read
            self._request_begins()
        self._handle_request(event)

    def _reject_head(self, exc: RequestRejectedError) -> None:
        """Answer a request we could not even parse, then close."""
        log = self.request_lines.new(self.request_start_time)
        log.status = exc.status
        log.termination = (
            Termination.REQUEST_HEADER_TIMEOUT
            if exc.status == 408
            else Termination.BAD_REQUEST
        )
        log.detail = exc.reason
        match = REQUEST_LINE_RE.match(self.session.trailing_data)
        if match is not None:
            log.method = match.group(1).decode("ascii")
            log.target = log_text(match.group(2))
        LOGGER.info(
            "listener %s: client %s: %d: %s",
            self.site.listener_name,
            log.client,
            exc.status,
            exc.reason,
        )
        self._end(log.termination, exc.reason)
        self.result.requests += 1
        self.log = log
        self._answer_and_linger(exc.status, exc.reason)

    # -- one request ---------------------------------------------------------

    def _new_log(self, head: RequestHead) -> RequestLog:
        agent = head.user_agent
        return self.request_lines.new(
            self.request_start_time,
            head.method.decode("ascii"),
            log_text(head.target),
            head.version.decode("ascii"),
            # Checked (HOST_RE: ASCII only) by the head parser.
            host=head.host.decode("ascii") if head.host is not None else None,
            user_agent=log_text(agent) if agent is not None else None,
        )

    def _handle_request(self, request: Request) -> None:
        started = self.now()
        head = request.head
        log = self.log = self._new_log(head)
        log.bytes_in = request.size
        self.result.requests += 1
        try:
            upstream_request = from_http1(
                head, self.rewriter, max_body_size=self.http.max_body_size
            )
        except RequestRejectedError as exc:
            self._refuse(exc.status, exc.reason, Termination.BAD_REQUEST)
            return
        if upstream_request.host is not None:
            # Checked (HOST_RE: ASCII only) by the head parser.
            log.host = upstream_request.host.decode("ascii")
        if upstream_request.request_id is not None:
            log.request_id = upstream_request.request_id.decode("ascii")
        self.ex = ex = _Exchange(self, upstream_request, log, started)
        ex.head = head
        assert EXCHANGE in HTTP1_TRANSITIONS[self.state]
        self.state = EXCHANGE
        ex.acquire()

    # -- what the upstream attempt asks of its host (`AttemptHost`) ----------

    def _connecting(self, attempt: UpstreamAttempt) -> None:
        assert WAIT in HTTP1_TRANSITIONS[self.state]
        assert WAIT in HTTP1_TRANSITIONS[self.state]
        self.state = WAIT

    def _connected(self, attempt: UpstreamAttempt) -> None:
        assert EXCHANGE in HTTP1_TRANSITIONS[self.state]
        assert EXCHANGE in HTTP1_TRANSITIONS[self.state]
        self.state = EXCHANGE

    def _send_pending(self, ex: _Exchange, pending: list[bytes]) -> bool:
        """Write *pending* to the client; False if it failed (and the
        exchange with it)."""
        if not pending:
            return True
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        if not data:
            return True
        try:
            self._send_client(data, ex.log)
        except IO_ERRORS as exc:
            ex.fail(
                Failure(Termination.CLIENT_ERROR, f"client write failed: {exc}", None)
            )
            return False
        return True

    def _response_head(self, ex: _Exchange, response: Response) -> bytes:
        head = response.head
        ex.log.status = head.status
        assert STARTED in RESPONSE_TRANSITIONS[ex.response]
        ex.response = STARTED
        ex.trailers_ok = response.body is CHUNKED_BODY
        # The backend may answer before the request's last bytes left our
        # buffer: what counts is whether the client's request was read in
        # full, not whether all of it went upstream yet.
        session = self.session
        close = self.site.drain.is_set() or not session.request_read
        if head.forward is not None:
            return session.send_response_head(
                head.forward, head.status, response.body, close=close
            )
        return session.send_response(
            head.status,
            reason_phrase(head.status, head.reason),
            end_to_end_fields(head, keep_upgrade=False),
            response.body,
            close=close,
        )

    # -- held upstream connections, the end of an exchange ---------------------

    def _after_failure(self, ex: _Exchange, failure: Failure) -> None:
        log = ex.log
        response = ex.response
        if failure.status is not None and response is WAITING:
            self._refuse(failure.status, failure.detail, failure.termination)
            return
        log.termination = failure.termination
        log.detail = failure.detail
        self._end(failure.termination, failure.detail)
        self._request_done()
        if response is DELIVERED:
            # The response went out whole; the request could not finish.
            self._linger()
        elif response is not WAITING:
            # Never let a cut response look complete: reset the connection.
            set_abortive_close(self.client.sock)
            if failure.termination == Termination.SERVER_ABORTED:
                LOGGER.warning(
                    "listener %s: client %s: %s %s: response cut, connection reset: %s",
                    self.site.listener_name,
                    log.client,
                    log.method,
                    log.target,
                    failure.detail,
                )
            self._finish()
        else:
            self._finish()

    def _request_done(self) -> None:
        """The request's access-log line, and its metrics via *on_request*."""
        log = self.log
        if log is None:
            return
        self.log = None
        self.ex = None
        log.total = self.now() - self.request_started
        self.request_lines.emit(log)
        on_request = self.site.on_request
        if on_request is not None:
            on_request(log)

    def _refuse(self, status: int, reason: str, termination: str) -> None:
        """Answer with an error response, log it, close the connection."""
        log = self.log
        assert log is not None
        log.error_response(self.site.listener_name, status, reason, termination)
        self._end(termination, reason)
        self._answer_and_linger(status, reason)

    def _answer_and_linger(self, status: int, reason: str) -> None:
        data = self.session.send_error(status, reason)
        try:
            self._send_client(data, self.log)
        except IO_ERRORS:
            self._request_done()
            self._finish()
            return
        self._request_done()
        self._linger()

    def _linger(self) -> None:
        """Half-close, then discard what the client still sends, briefly."""
        assert LINGER in HTTP1_TRANSITIONS[self.state]
        self.state = LINGER
        self.ex = None
        client = self.client
        try:
            client.send_eof()
        except IO_ERRORS:
            self._finish()
            return
        if client.eof and not client.out:
            self._finish()
            return
        self.lingered = 0
        self.linger_deadline = self.now() + LINGER_TIMEOUT
        self.arm(self.linger_deadline)

    # -- Upgrade -------------------------------------------------------------

    def _switch(self, ex: _Exchange, head: ResponseHead, pending: list[bytes]) -> None:
        """The upstream accepted an upgrade: tell the client, hand over what
        each side sent past the heads, then relay bytes."""
        if not ex.request.upgrade:
            if self._send_pending(ex, pending):
                ex.upstream_failed(
                    UpstreamError("unexpected 101 from upstream: no upgrade was asked")
                )
            return
        assert ex.conn is not None
        assert ex.raw is not None
        pending.append(
            self.session.send_informational(
                101,
                reason_phrase(101, head.reason),
                strip_hop_by_hop(head.headers, keep_upgrade=True),
            )
        )
        ex.log.first_byte = self.now() - ex.started
        ex.log.status = 101
        assert SWITCHED in RESPONSE_TRANSITIONS[ex.response]
        ex.response = SWITCHED
        if not self._send_pending(ex, pending):
            return
        assert UPGRADE in HTTP1_TRANSITIONS[self.state]
        self.state = UPGRADE
        from_upstream = ex.conn.trailing_data
        from_client = self.session.trailing_data
        try:
            if from_upstream:
                self._send_client(from_upstream, ex.log)
            if from_client:
                ex.raw.send(from_client)
                if ex.raw.out:
                    ex.upstream_progress = self.now()
                    self.arm(ex.upstream_progress + self.idle_timeout)
        except IO_ERRORS as exc:
            self._upgrade_failed(str(exc))
            return
        ex.log.bytes_in += len(from_client)
        self._relay_if_flushed()

    def _relay_if_flushed(self) -> None:
        ex = self.ex
        assert ex is not None
        assert ex.raw is not None
        if self.client.out or ex.raw.out:
            return
        ex.let_go()
        assert WAIT in HTTP1_TRANSITIONS[self.state]
        self.state = WAIT
        self.relay_scope = scope = trio.CancelScope()
        self._start_job(partial(self._relay_upgraded, ex), scope)

    def _upgrade_failed(self, detail: str) -> None:
        ex = self.ex
        assert ex is not None
        assert ex.upstream is not None
        self._end(Termination.CLIENT_ERROR, detail)
        ex.log.termination = Termination.CLIENT_ERROR
        set_abortive_close(self.client.sock)
        if ex.raw is not None:
            set_abortive_close(ex.raw.sock)
        ex.abandon()
        self._finish()

    async def _relay_upgraded(self, ex: _Exchange) -> None:
        upstream, ex.upstream = ex.upstream, None
        assert upstream is not None
        self.upstreams.release(upstream, clean=False, handed_over=True)
        stats = self.result.upgraded = RelayStats()  # counted as it flows
        try:
            await relay(
                self.client_stream,
                upstream.stream,
                stats=stats,
                idle_timeout=self.idle_timeout,
                client_fin_timeout=self.site.listener.client_fin_timeout,
                server_fin_timeout=self.site.backend.config.server_fin_timeout,
            )
        finally:
            self.result.upgraded = None
            self.result.bytes_from_client += stats.bytes_from_client
            self.result.bytes_to_client += stats.bytes_from_server
            ex.log.bytes_in += stats.bytes_from_client
            ex.log.bytes_out += stats.bytes_from_server
            cause = stats.termination or Termination.UNKNOWN
            ex.log.termination = f"{Termination.UPGRADED}:{cause}"
            self._end(ex.log.termination)
            close_now(upstream.stream)
            self._finish()


def http_connection(
    client: trio.abc.Stream,
    downstream: Downstream,
    site: HttpSite,
    *,
    proxy_header: bytes | None,
    spawn: Spawn,
    on_done: Callable[[HttpConnectionResult], None],
    result: HttpConnectionResult | None = None,
    initial_data: bytes = b"",
) -> _HttpConnection:
    """An HTTP/1.1 connection that no task waits for: ``start()`` it, and
    the reactor serves it; *on_done* is called with its result once it
    ended (maybe within ``start()``), every upstream connection it opened
    closed or back in the site's ``keepalive``. ``drain()`` ends it at once.

    The arguments are `serve_http`'s, and: *spawn* starts what must await
    (opening an upstream connection, the relay after an ``Upgrade``) in a
    task of its own, e.g. a nursery's ``start_soon``; a job cancelled from
    outside ends the connection as ``drained``.

    Raises:
        TypeError: *client* is not socket-backed.
    """
    return _HttpConnection(
        client,
        socket_backed(client),
        downstream,
        site,
        proxy_header=proxy_header,
        result=HttpConnectionResult() if result is None else result,
        initial_data=initial_data,
        spawn=spawn,
        on_done=on_done,
    )


async def serve_http(
    client: trio.abc.Stream,
    downstream: Downstream,
    site: HttpSite,
    *,
    proxy_header: bytes | None,
    result: HttpConnectionResult | None = None,
    initial_data: bytes = b"",
) -> HttpConnectionResult:
    """Proxy HTTP/1.1 requests from *client* to the site's backend until the
    connection ends.

    See the module docstring for the behaviour; this task waits for the end
    of an `http_connection` (the edge starts one with no task of its own).
    Does not close *client* (the caller does, in its ``finally``); when the
    connection must end with a reset (an upstream died mid-response) the
    client socket is already set to close with an RST. Every upstream
    connection this call opened is closed or back in the site's
    ``keepalive`` when it returns, also when cancelled.

    Args:
        client: The client connection after PROXY unwrap and TLS: a
            `trio.SocketStream` or an established `TLSStream` over one.
        downstream: What the earlier stages learnt of it: the real client, the
            destination, its id (repeated in every request line), its TLS
            facts (``X-Forwarded-Proto``, the request lines' ``tls`` and ``sni``).
        site: What every connection of its listener is served with: the
            listener's settings, the backend, its idle upstream connections,
            the drain signal, the request hook.
        proxy_header: With ``send_proxy``: the PROXY header for this client;
            upstream connections are then dedicated to this client connection.
        result: Updated in place (and returned); pass one in to see the counts
            of a connection that gets cancelled.
        initial_data: Client bytes an earlier stage read past its own data
            (what followed a PROXY header): the start of the first request.

    Returns:
        Requests served, bytes each way and why the connection ended.

    Raises:
        TypeError: *client* is not socket-backed.
    """
    if result is None:
        result = HttpConnectionResult()
    await run_to_end(
        partial(
            http_connection,
            client,
            downstream,
            site,
            proxy_header=proxy_header,
            result=result,
            initial_data=initial_data,
        )
    )
    return result
