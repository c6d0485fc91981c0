"""HTTP/1.1 reverse proxy mode: the trio driver of the sans-IO session and exchange.

Theory of operation
===================

`serve_http` runs one client connection (after PROXY unwrap and TLS) as a loop
of *exchanges*, one per request, answered strictly in order (pipelined requests
wait in the session's buffer or the kernel's until the previous response is
complete). The framing is done by two sans-IO state machines, which this
module only feeds and drains: `tlsedge._http.session.ClientSession` (client
bytes to checked request events, our answers to client bytes) and
`tlsedge._http.exchange.UpstreamExchange` (a request to upstream bytes, the
upstream's bytes to response events). The header rules (origin-form target,
hop-by-hop fields, forwarding headers, trailers, retries) are pure functions
of `tlsedge._http.rules`.

Timeouts. Each phase arms one deadline on the scope that covers it, named
after its ``[listeners.http]`` field: ``keepalive_timeout`` (waiting for the
first byte of a next request: quiet close), ``request_header_timeout`` (the
rest of the head; for the first request counted from the start of the
connection: 408), ``response_timeout`` (from the request fully sent upstream
to the response head: 504), the listener's ``idle_timeout`` for each read or
write of the response and the request body. The head and the exchange each
have one cancel scope whose deadline moves as the phase changes (a scope per
I/O cost more than the rest of the request's bookkeeping); when it fires, the
failure armed with it says what timed out. A request body must also keep up an
average rate: after the grace of ``request_body_timeout`` it may take 1 s per
``request_body_min_rate`` bytes received (Apache's mod_reqtimeout rule), so a
body trickled a byte at a time, never idle for long, still gets 408.

One exchange. The upstream connection comes from the `KeepAlivePool` (idle
connections per backend server, LIFO, checked before reuse) or is opened to the
server the balancer picked. With ``send_proxy`` the connection is instead
*dedicated* to this client connection: opened with the PROXY header first,
kept across its requests, never pooled (a PROXY header describes one client).
`tlsedge._http.upstreams.UpstreamConnections` keeps that bookkeeping (the
HTTP/2 driver uses it too).
To a ``protocol = "tls"`` backend the connection is a `TLSStream` whose
handshake is part of `BackendPool.connect`. A request without a body is sent
and answered by this task alone; with a body a child task pumps it (read one
piece, send it, only then read the next: backpressure) while this task reads
the response: 1xx are relayed (``100 Continue`` only to a client that asked
for it), then the head, then the body, trailers included when both framings
allow them.

Reuse: the client connection continues only when the session says so
(`ClientSession.keep_alive`: the request read in full, the response complete,
no reason to close) and we are not draining; the upstream connection goes
back to the pool only when its exchange is `UpstreamExchange.reusable`.

Failures. No healthy server: 503. Connect failure after retries: 502.
Upstream closed or reset before any response byte: 502, except that the
request is sent again when `tlsedge._http.rules.may_retry` allows. No response
head within ``response_timeout``: 504. Upstream dying after the response head
went out: the client connection is aborted with an RST
(`tlsedge._relay.set_abortive_close`), so a cut response never looks complete.
Error responses are tiny plain-text bodies with ``Connection: close``, each
with a log line saying what was wrong; after one we *linger* (FIN, then read
and discard for a moment) so the client's unread upload does not turn our
close into an RST that destroys the response.

``Upgrade``: after the upstream's ``101`` the bytes each side had buffered
beyond the heads are forwarded first, byte-exact, then `tlsedge._relay.relay`
carries the rest with its half-close rules. ``CONNECT`` gets 501 (this is a
reverse proxy, not a tunnel). Drain: once ``drain`` is set, the next response
of the connection carries ``Connection: close`` and the connection ends after
it; a connection idle between requests is closed at once (its wait is
registered with the `tlsedge._drain.Drain`: no task per connection watches it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Final

import trio

from tlsedge import _sockio as sockio
from tlsedge._accesslog import format_address
from tlsedge._balancer import Server
from tlsedge._config import HttpConfig, ListenerConfig
from tlsedge._downstream import Downstream
from tlsedge._drain import Drain
from tlsedge._http.body import BodyKind
from tlsedge._http.events import (
    NEED_DATA,
    Body,
    ConnectionClosed,
    EndOfBody,
    Informational,
    Request,
    Response,
)
from tlsedge._http.exchange import UpstreamError, UpstreamExchange
from tlsedge._http.head import REQUEST_LINE_RE, RequestHead, RequestRejectedError
from tlsedge._http.log import HttpConnectionResult, RequestLog
from tlsedge._http.pool import KeepAlivePool
from tlsedge._http.rules import (
    RequestRewriter,
    log_text,
    may_retry,
    origin_form,
    reason_phrase,
    strip_hop_by_hop,
)
from tlsedge._http.session import ClientClosedMidRequestError, ClientSession
from tlsedge._http.upstreams import Upstream, UpstreamConnections
from tlsedge._relay import RelayStats, relay, set_abortive_close
from tlsedge._termination import Termination
from tlsedge._upstream import BackendPool, ConnectFailedError, NoServerError

__all__ = ["serve_http"]

LOGGER = logging.getLogger("tlsedge.http")

Header = tuple[bytes, bytes]

#: Largest read from either side at once.
READ_SIZE: Final = 65536
#: After an error response: FIN, then read and discard the client's unread data
#: for up to this long / this much (nginx's lingering_close, much shorter), so
#: that closing with unread data (which sends an RST) cannot destroy the answer.
LINGER_TIMEOUT: Final = 2.0
LINGER_MAX_BYTES: Final = 1 << 20


class _ClientGoneError(Exception):
    """The client reset, closed or stalled; nothing more can be sent to it."""


class _UpstreamGoneError(Exception):
    """The upstream reset, closed or stalled while we wrote to it."""


@dataclass(frozen=True, slots=True)
class _Failure:
    termination: str
    detail: str
    status: int | None  # the error response, if none was started
    retryable: bool = False  # upstream failed before any response byte


_UPSTREAM_WRITE_STALLED: Final = _Failure(
    Termination.SERVER_ERROR,
    "upstream did not read for idle_timeout",
    502,
    retryable=True,
)
_CLIENT_READ_STALLED: Final = _Failure(
    Termination.CLIENT_ERROR, "client did not read for idle_timeout", None
)
_UPSTREAM_READ_STALLED: Final = _Failure(
    Termination.SERVER_ABORTED, "upstream response stalled for idle_timeout", None
)


@dataclass(slots=True)
class _Exchange:
    """State of one request/response exchange, shared by the two pumps."""

    head: RequestHead
    conn: UpstreamExchange
    upstream: Upstream
    log: RequestLog
    started: float
    #: The exchange's deadline, first for sending the request head;
    #: `armed` is the failure when it passes.
    scope: trio.CancelScope
    armed: _Failure
    now: Callable[[], float]  # the connection's clock
    nursery_scope: trio.CancelScope | None = None
    #: When the response head is due: ``response_timeout`` after the
    #: request is sent (`_HttpConnection._request_sent`).
    head_deadline: float = math.inf
    #: Nothing to read from the upstream yet (the request was just sent, or
    #: the last read was short): its next read waits for readability first.
    upstream_drained: bool = True
    head_received: bool = False  # the final response head has arrived
    response_started: bool = False  # ... and gone out to the client
    response_complete: bool = False  # ... all of it
    switched: bool = False
    body_started: float = 0.0  # when the request body pump started
    failure: _Failure | None = None

    def fail(self, failure: _Failure) -> None:
        if self.failure is None:
            self.failure = failure

    def arm(self, seconds: float, failure: _Failure) -> None:
        """The deadline *seconds* from now; *failure* when it passes.

        A deadline within 1/64 of *seconds* of the current one is left as it
        is (moving a registered deadline costs more than the rest of a write):
        a timeout may fire that much early or late.
        """
        self._move_deadline(self.now() + seconds, seconds)
        self.armed = failure

    def await_head(self, failure: _Failure, response_timeout: float) -> None:
        """Arm the response head's deadline (infinite until the request is
        sent); *failure* is the connection's response-timeout failure. As in
        `arm`, a change smaller than 1/64 of the timeout is skipped."""
        self._move_deadline(self.head_deadline, response_timeout)
        self.armed = failure

    def _move_deadline(self, deadline: float, timeout: float) -> None:
        if abs(deadline - self.scope.deadline) > timeout / 64:
            self.scope.deadline = deadline


class _HttpConnection:
    """One client connection in HTTP mode; see the module docstring."""

    def __init__(
        self,
        client: trio.abc.Stream,
        downstream: Downstream,
        *,
        listener: ListenerConfig,
        backend: BackendPool,
        keepalive: KeepAlivePool,
        proxy_header: bytes | None,
        drain: Drain,
        result: HttpConnectionResult,
        on_request: Callable[[RequestLog], None] | None,
        initial_data: bytes,
    ) -> None:
        self.client = client
        self.listener = listener
        self.http: HttpConfig = listener.http
        self.backend = backend
        self.client_ip = downstream.client_ip
        self.client_text = format_address(downstream.client)
        ssl_info = downstream.tls
        self.tls_text = f"{ssl_info.version} {ssl_info.cipher}" if ssl_info else None
        self.sni = ssl_info.server_name if ssl_info else None
        self.drain = drain
        self.connection_id = downstream.id
        self.result = result
        self.on_request = on_request
        self.rewriter = RequestRewriter.for_connection(listener, downstream)
        self.session = ClientSession(
            max_header_bytes=self.http.max_header_bytes,
            max_headers=self.http.max_headers,
            max_body_size=self.http.max_body_size,
            initial_data=initial_data,
        )
        result.bytes_from_client += len(initial_data)
        # trio's clock, looked up once: ``self.now()`` costs four
        # calls, and a request reads the clock a dozen times.
        self.now: Callable[[], float] = trio.lowlevel.current_clock().current_time
        self.started = self.now()
        # When the request being read began (trio clock, Unix time): the
        # connection's start for the first one, its first byte for later ones.
        self.request_started = self.started
        self.request_start_time = time.time()
        # The last read from the client was short: it most likely emptied the
        # socket, so the next one waits for readability first.
        self.client_drained = False
        self._response_timeout_failure = _Failure(
            Termination.RESPONSE_TIMEOUT,
            f"no response within response_timeout ({self.http.response_timeout:g} s)",
            504,
        )
        self.upstreams = UpstreamConnections(
            backend, keepalive, self.client_ip, proxy_header
        )

    # -- client I/O -------------------------------------------------------

    async def receive_client(self) -> bytes:
        """Read from the client into the session (``b""``: it closed)."""
        try:
            data = await sockio.receive_some(
                self.client, READ_SIZE, wait_first=self.client_drained
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _ClientGoneError(f"client read failed: {exc}") from exc
        self.result.bytes_from_client += len(data)
        self.client_drained = len(data) < READ_SIZE
        self.session.receive_data(data)
        return data

    async def send_client(self, data: bytes, log: RequestLog | None = None) -> None:
        """Write to the client; the caller's scope bounds the wait."""
        if not data:
            return
        try:
            await sockio.send_all(self.client, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _ClientGoneError(f"client write failed: {exc}") from exc
        self.result.bytes_to_client += len(data)
        if log is not None:
            log.bytes_out += len(data)

    async def send_client_bounded(
        self, data: bytes, log: RequestLog | None = None
    ) -> None:
        """`send_client` bounded by the listener's ``idle_timeout``."""
        with trio.move_on_after(self.listener.idle_timeout) as idle_timeout_scope:
            await self.send_client(data, log)
        if idle_timeout_scope.cancelled_caught:
            raise _ClientGoneError("client did not read for idle_timeout")

    async def linger(self) -> None:
        """Half-close, then discard what the client still sends, briefly."""
        with contextlib.suppress(
            trio.BrokenResourceError, trio.ClosedResourceError, OSError
        ):
            if isinstance(self.client, trio.abc.HalfCloseableStream):
                await self.client.send_eof()
            discarded = 0
            with trio.move_on_after(LINGER_TIMEOUT):
                while discarded < LINGER_MAX_BYTES and not self.session.eof:
                    chunk = await self.client.receive_some(READ_SIZE)
                    if not chunk:
                        return
                    discarded += len(chunk)

    # -- the connection loop ----------------------------------------------

    async def serve_requests(self) -> None:
        first = True
        while True:
            try:
                request = await self._read_request(first=first)
            except RequestRejectedError as exc:
                await self._reject_head(exc)
                return
            except _ClientGoneError as exc:
                self._end(Termination.CLIENT_ERROR, str(exc))
                return
            if request is None:
                return
            first = False
            if not await self._handle_request(request):
                return
            self.session.start_next_cycle()

    def _emit(self, log: RequestLog) -> None:
        """The request's access-log line, and its metrics via *on_request*."""
        log.emit()
        if self.on_request is not None:
            self.on_request(log)

    def _end(self, termination: str, detail: str | None = None) -> None:
        self.result.termination = termination
        self.result.detail = detail

    async def _read_request(self, *, first: bool) -> Request | None:
        """Read until the session has a checked request head.

        Returns None when the connection should end quietly (client closed,
        keep-alive timeout, drain).
        """
        session = self.session
        limits = self.http
        idle = not session.buffered
        if not idle:  # pipelined: the request began with the previous one's end
            self._request_begins(first)
            deadline = self.request_started + limits.request_header_timeout
        elif first:
            deadline = self.started + limits.request_header_timeout
        else:
            deadline = self.now() + limits.keepalive_timeout
        with trio.CancelScope(deadline=deadline) as scope:
            # Idle between requests, the drain closes the connection at once;
            # waiting for the first request, or inside a head, it does not.
            with self.drain.cancels(scope) if idle and not first else nullcontext():
                while True:
                    event = session.next_event()
                    if event is not NEED_DATA or (idle and session.buffered):
                        break
                    await self.receive_client()
            while event is NEED_DATA:
                # Part of a head: the rest is due within request_header_timeout.
                if idle:
                    idle = False
                    self._request_begins(first)
                    scope.deadline = (
                        self.request_started + limits.request_header_timeout
                    )
                await self.receive_client()
                event = session.next_event()
        if scope.cancelled_caught:
            if not idle:
                raise RequestRejectedError(
                    408, "request head not complete within request_header_timeout"
                )
            if first:
                self._end(Termination.REQUEST_HEADER_TIMEOUT)
            elif self.drain.is_set():
                self._end(Termination.DRAINED)
            else:
                self._end(Termination.KEEPALIVE_TIMEOUT)
            return None
        if isinstance(event, ConnectionClosed):
            detail = "EOF inside a request head" if event.in_head else None
            self._end(Termination.CLIENT_CLOSED, detail)
            return None
        assert isinstance(event, Request), event
        if idle:  # the whole head came in the first read
            self._request_begins(first)
        return event

    def _request_begins(self, first: bool) -> None:
        now = self.now()
        self.request_started = self.started if first else now
        self.request_start_time = time.time() - (now - self.request_started)

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
        match = REQUEST_LINE_RE.match(self.session.trailing_data)
        if match is not None:
            log.method = match.group(1).decode("ascii")
            log.target = log_text(match.group(2))
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
            await self.send_client_bounded(
                self.session.send_error(exc.status, exc.reason), log
            )
            await self.linger()
        log.total = self.now() - self.request_started
        self._emit(log)

    # -- one request -------------------------------------------------------

    def _new_log(self, head: RequestHead) -> RequestLog:
        agent: bytes | None = None
        for name, value in head.headers:
            if name[0] in {85, 117} and name.lower() == b"user-agent":
                agent = value
                break
        return RequestLog(
            connection=self.connection_id,
            listener=self.listener.name,
            client=self.client_text,
            start=self.request_start_time,
            method=head.method.decode("ascii"),
            target=log_text(head.target),
            version=head.version.decode("ascii"),
            # Checked (HOST_RE: ASCII only) by the head parser.
            host=head.host.decode("ascii") if head.host is not None else None,
            user_agent=log_text(agent) if agent is not None else None,
            backend=self.backend.name,
            tls=self.tls_text,
            sni=self.sni,
        )

    async def _handle_request(self, request: Request) -> bool:
        """Serve one request; True when the connection can carry on."""
        started = self.now()
        log = self._new_log(request.head)
        log.bytes_in = request.size
        self.result.requests += 1
        try:
            return await self._exchange(request.head, log, started)
        finally:
            log.total = self.now() - self.request_started
            self._emit(log)

    async def _refuse(
        self, log: RequestLog, status: int, reason: str, termination: str
    ) -> bool:
        """Send an error response, log it, close the connection."""
        log.error_response(self.listener.name, status, reason, termination)
        self._end(termination, reason)
        with contextlib.suppress(_ClientGoneError):
            await self.send_client_bounded(self.session.send_error(status, reason), log)
            await self.linger()
        return False

    async def _exchange(
        self, head: RequestHead, log: RequestLog, started: float
    ) -> bool:
        if head.method == b"CONNECT":
            return await self._refuse(
                log, 501, "CONNECT is not supported", Termination.BAD_REQUEST
            )
        try:
            target, authority = origin_form(head.method, head.target)
        except RequestRejectedError as exc:
            return await self._refuse(
                log, exc.status, exc.reason, Termination.BAD_REQUEST
            )
        if authority is not None:
            log.host = authority.decode("ascii")
        length = head.content_length or 0
        max_body = self.http.max_body_size
        if max_body and length > max_body:
            return await self._refuse(
                log,
                413,
                f"request body larger than {max_body} bytes",
                Termination.BAD_REQUEST,
            )
        upgrade = head.upgrade and b"upgrade" in head.connection
        headers, request_id = self.rewriter.head_fields(
            head.headers,
            connection=head.connection,
            upgrade=upgrade,
            authority=authority,
            host=head.host,
        )
        if request_id is not None:
            log.request_id = request_id.decode("ascii")
        body = (
            BodyKind.CHUNKED
            if head.chunked
            else BodyKind.LENGTH
            if length
            else BodyKind.NONE
        )
        has_body = body is not BodyKind.NONE
        exclude: Server | None = None
        fresh = retried = False
        while True:
            connect_started = self.now()
            try:
                upstream = await self.upstreams.acquire(exclude, fresh=fresh)
            except NoServerError as exc:
                return await self._refuse(log, 503, str(exc), Termination.NO_SERVER)
            except ConnectFailedError as exc:
                return await self._refuse(
                    log, 502, str(exc), Termination.CONNECT_FAILED
                )
            connected = self.now()
            log.connect = connected - connect_started
            log.server = format_address(upstream.server.address)
            self.result.server = log.server
            ex = _Exchange(
                head=head,
                conn=UpstreamExchange(method=head.method),
                upstream=upstream,
                log=log,
                started=started,
                scope=trio.CancelScope(deadline=connected + self.listener.idle_timeout),
                armed=_UPSTREAM_WRITE_STALLED,
                now=self.now,
            )
            with ex.scope:
                await self._proxy(ex, target, headers, body)
            if ex.scope.cancelled_caught:
                ex.fail(ex.armed)
            failure = ex.failure
            retry = (
                failure is not None
                and failure.retryable
                and not ex.response_started
                and may_retry(
                    method=head.method,
                    has_body=has_body,
                    reused=upstream.reused,
                    retried=retried,
                )
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
                    retried = True
                    exclude = upstream.server
                continue
            break
        if ex.switched:
            return await self._relay_upgraded(ex)
        if failure is not None:
            return await self._after_failure(ex, failure)
        log.termination = Termination.OK
        if self.session.keep_alive and not self.drain.is_set():
            return True
        self._end(Termination.DRAINED if self.drain.is_set() else Termination.CLOSED)
        if not self.session.request_read:
            await self.linger()
        return False

    async def _after_failure(self, ex: _Exchange, failure: _Failure) -> bool:
        log = ex.log
        if failure.status is not None and not ex.response_started:
            return await self._refuse(
                log, failure.status, failure.detail, failure.termination
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

    # -- upstream connections ---------------------------------------------

    async def _finish_upstream(self, ex: _Exchange, *, reusable: bool) -> None:
        """Pool, keep (dedicated) or close the exchange's upstream connection."""
        await self.upstreams.release(
            ex.upstream,
            clean=reusable and not ex.switched and ex.conn.reusable,
            handed_over=ex.switched,
        )

    async def close_upstreams(self) -> None:
        await self.upstreams.close()

    # -- proxying one exchange ----------------------------------------------

    async def _send_upstream(self, ex: _Exchange, data: bytes) -> None:
        """Write to the upstream; the caller's scope bounds the wait."""
        try:
            await sockio.send_all(ex.upstream.stream, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _UpstreamGoneError(f"upstream write failed: {exc}") from exc

    async def _proxy(
        self, ex: _Exchange, target: bytes, headers: list[Header], body: BodyKind
    ) -> None:
        """Send the request and relay the response, under the exchange's scope."""
        if ex.head.host is None and not any(n.lower() == b"host" for n, _ in headers):
            # HTTP/1.0 without Host; HTTP/1.1 upstream needs one.
            server_name = format_address(ex.upstream.server.address) or ""
            headers = [*headers, (b"Host", server_name.encode("ascii"))]
        data = ex.conn.request_head(target, headers, body)
        complete = body is BodyKind.NONE
        if not complete:
            try:
                data, complete = self._take_buffered_body(ex, data)
            except RequestRejectedError as exc:
                ex.fail(_Failure(Termination.BAD_REQUEST, exc.reason, exc.status))
                return
            except ClientClosedMidRequestError as exc:
                ex.fail(_Failure(Termination.CLIENT_ERROR, str(exc), None))
                return
        prefix, ex.upstream.prefix = ex.upstream.prefix, b""
        try:
            await self._send_upstream(ex, prefix + data)
        except _UpstreamGoneError as exc:
            ex.fail(_Failure(Termination.SERVER_ERROR, str(exc), 502, retryable=True))
            return
        if complete:
            # Nothing left to pump upstream: no second task (nor a nursery).
            self._request_sent(ex)
            await self._pump_response(ex)
            return
        async with trio.open_nursery() as nursery:
            ex.nursery_scope = nursery.cancel_scope
            ex.await_head(
                self._response_timeout_failure, self.http.response_timeout
            )  # no deadline until sent
            nursery.start_soon(self._pump_request_body, ex)
            await self._pump_response(ex)
            if not self.session.request_read:
                # Answered before the whole request arrived (an early error,
                # or an upgrade refused): stop reading it; the connection ends.
                # A request read in full is still delivered (bounded by
                # idle_timeout), so the upstream never holds half of one.
                nursery.cancel_scope.cancel()

    def _take_buffered_body(self, ex: _Exchange, head: bytes) -> tuple[bytes, bool]:
        """*head* and the body bytes the session already holds, framed for the
        upstream, and whether that is the whole request (a small upload
        usually is: it then goes in one write, without the body pump)."""
        session = self.session
        pieces = [head]
        while True:
            event = session.next_event()
            if event is NEED_DATA:
                return b"".join(pieces), False
            assert isinstance(event, (Body, EndOfBody)), event
            pieces.append(self._upstream_bytes(ex, event))
            if isinstance(event, EndOfBody):
                return b"".join(pieces), True

    def _upstream_bytes(self, ex: _Exchange, event: Body | EndOfBody) -> bytes:
        """A piece of the client's body, or its end, framed for the upstream."""
        if isinstance(event, Body):
            ex.log.bytes_in += len(event.data)
            return ex.conn.request_data(event.data)
        return ex.conn.request_end(self.rewriter.clean_trailers(event.trailers))

    def _request_sent(self, ex: _Exchange) -> None:
        """The request is upstream: its answer's head is due within
        ``response_timeout`` (unless it already came)."""
        if ex.head_received:
            return
        ex.head_deadline = self.now() + self.http.response_timeout
        ex.await_head(self._response_timeout_failure, self.http.response_timeout)

    def _body_deadline(self, ex: _Exchange) -> float:
        """When the request body is too slow (``request_body_min_rate``)."""
        rate = self.http.request_body_min_rate
        if not rate:
            return math.inf
        return (
            ex.body_started
            + self.http.request_body_timeout
            + self.session.body_bytes / rate
        )

    async def _next_body_event(self, ex: _Exchange) -> Body | EndOfBody:
        session = self.session
        while True:
            event = session.next_event()
            if event is not NEED_DATA:
                assert isinstance(event, (Body, EndOfBody)), event
                return event
            now = self.now()
            body_deadline = self._body_deadline(ex)
            with trio.move_on_at(
                min(now + self.listener.idle_timeout, body_deadline)
            ) as idle_timeout_scope:
                await self.receive_client()
            if idle_timeout_scope.cancelled_caught:
                if self.now() >= body_deadline:
                    raise RequestRejectedError(
                        408,
                        f"request body slower than request_body_min_rate"
                        f" ({self.http.request_body_min_rate} bytes/s):"
                        f" {session.body_bytes} bytes in"
                        f" {self.now() - ex.body_started:.1f} s",
                    )
                raise RequestRejectedError(408, "request body stalled for idle_timeout")

    async def _send_body_upstream(self, ex: _Exchange, data: bytes) -> None:
        with trio.move_on_after(self.listener.idle_timeout) as idle_timeout_scope:
            await self._send_upstream(ex, data)
        if idle_timeout_scope.cancelled_caught:
            raise _UpstreamGoneError("upstream did not read for idle_timeout")

    async def _pump_request_body(self, ex: _Exchange) -> None:
        """Client -> upstream: one piece at a time (backpressure)."""
        ex.body_started = self.now()
        try:
            while True:
                event = await self._next_body_event(ex)
                # When this was the last piece, the session already says the
                # request is read: the upstream may answer as soon as these
                # bytes reach it, before this task runs again.
                await self._send_body_upstream(ex, self._upstream_bytes(ex, event))
                if isinstance(event, EndOfBody):
                    self._request_sent(ex)
                    return
        except RequestRejectedError as exc:
            ex.fail(_Failure(Termination.BAD_REQUEST, exc.reason, exc.status))
        except (_ClientGoneError, ClientClosedMidRequestError) as exc:
            ex.fail(_Failure(Termination.CLIENT_ERROR, str(exc), None))
        except _UpstreamGoneError as exc:
            # The upstream may still have answered (e.g. 413 and close): let
            # the response pump find out; only stop sending.
            LOGGER.debug("request body not delivered: %s", exc)
            if self.now() + self.http.response_timeout < ex.head_deadline:
                self._request_sent(ex)
            return
        assert ex.nursery_scope is not None
        ex.nursery_scope.cancel()

    async def _next_upstream_event(
        self, ex: _Exchange
    ) -> Informational | Response | Body | EndOfBody:
        conn = ex.conn
        while True:
            event = conn.next_event()
            if event is not NEED_DATA:
                return event
            try:
                data = await sockio.receive_some(
                    ex.upstream.stream, READ_SIZE, wait_first=ex.upstream_drained
                )
                ex.upstream_drained = len(data) < READ_SIZE
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise UpstreamError(
                    f"upstream read failed: {exc}", empty=not conn.received
                ) from exc
            conn.receive_data(data)

    async def _pump_response(self, ex: _Exchange) -> None:
        """Upstream -> client: 1xx, the head, the body; or record the failure."""
        session = self.session
        try:
            while True:
                event = await self._next_upstream_event(ex)
                if isinstance(event, Response):
                    break
                assert isinstance(event, Informational), event
                head = event.head
                if head.status == 101:
                    await self._switch(ex, head.reason, head.headers)
                    return
                if head.status == 100:
                    if not session.expects_continue:
                        continue
                elif ex.head.version != b"1.1":
                    continue
                data = session.send_informational(
                    head.status,
                    reason_phrase(head.status, head.reason),
                    strip_hop_by_hop(head.headers, keep_upgrade=False),
                )
                await self._send_client_armed(ex, data)
                ex.await_head(
                    self._response_timeout_failure, self.http.response_timeout
                )
            ex.head_received = True
            ex.log.first_byte = self.now() - ex.started
            await self._forward_response(ex, event)
        except UpstreamError as exc:
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
        if ex.failure is not None and ex.nursery_scope is not None:
            ex.nursery_scope.cancel()

    async def _send_client_armed(self, ex: _Exchange, data: bytes) -> None:
        """Write to the client, the exchange's deadline set to ``idle_timeout``."""
        if data:
            ex.arm(self.listener.idle_timeout, _CLIENT_READ_STALLED)
            await self.send_client(data, ex.log)

    async def _switch(
        self, ex: _Exchange, reason: bytes, headers: list[Header]
    ) -> None:
        """The upstream accepted an upgrade: tell the client, switch both sides."""
        if not (ex.head.upgrade and b"upgrade" in ex.head.connection):
            raise UpstreamError("unexpected 101 from upstream: no upgrade was asked")
        data = self.session.send_informational(
            101,
            reason_phrase(101, reason),
            strip_hop_by_hop(headers, keep_upgrade=True),
        )
        ex.log.first_byte = self.now() - ex.started
        ex.log.status = 101
        ex.response_started = True
        await self._send_client_armed(ex, data)
        ex.switched = True

    async def _forward_response(self, ex: _Exchange, response: Response) -> None:
        session = self.session
        head = response.head
        headers = strip_hop_by_hop(
            head.headers, keep_upgrade=False, connection=head.connection
        )
        ex.log.status = head.status
        # The backend may answer before our task forwarding the request's
        # last bytes has run again: what counts is whether the client's
        # request was read in full, not whether its write has returned.
        pending = session.send_response(
            head.status,
            reason_phrase(head.status, head.reason),
            headers,
            response.body,
            close=self.drain.is_set() or not session.request_read,
        )
        ex.response_started = True
        trailers_ok = response.body is BodyKind.CHUNKED
        conn = ex.conn
        # What the exchange already has of the response (usually all of a
        # small one) goes out with the head in one write; we write before
        # every read.
        while True:
            try:
                event = conn.next_event()
            except UpstreamError:
                await self._send_client_armed(ex, pending)
                raise
            if event is NEED_DATA:
                await self._send_client_armed(ex, pending)
                pending = b""
                ex.arm(self.listener.idle_timeout, _UPSTREAM_READ_STALLED)
                event = await self._next_upstream_event(ex)
            if isinstance(event, Body):
                pending += session.send_data(event.data)
            elif isinstance(event, EndOfBody):
                trailers = (
                    strip_hop_by_hop(event.trailers, keep_upgrade=False)
                    if trailers_ok and event.trailers
                    else []
                )
                pending += session.send_end(trailers)
                await self._send_client_armed(ex, pending)
                ex.response_complete = True
                return

    async def _relay_upgraded(self, ex: _Exchange) -> bool:
        """After a 101: forward what both sides buffered, then relay bytes."""
        upstream = ex.upstream
        stats = RelayStats()
        try:
            from_upstream = ex.conn.trailing_data
            from_client = self.session.trailing_data
            try:
                await self.send_client_bounded(from_upstream, ex.log)
                if from_client:
                    await self._send_body_upstream(ex, from_client)
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
    downstream: Downstream,
    *,
    listener: ListenerConfig,
    backend: BackendPool,
    keepalive: KeepAlivePool,
    proxy_header: bytes | None,
    drain: Drain,
    result: HttpConnectionResult | None = None,
    on_request: Callable[[RequestLog], None] | None = None,
    initial_data: bytes = b"",
) -> HttpConnectionResult:
    """Proxy HTTP/1.1 requests from *client* to *backend* until the connection ends.

    See the module docstring for the behaviour. Does not close *client* (the
    caller does, in its ``finally``); when the connection must end with a reset
    (an upstream died mid-response) the client socket is already set to close
    with an RST. Every upstream connection this call opened is closed or back
    in *keepalive* when it returns, also when cancelled.

    Args:
        client: The client connection after PROXY unwrap and TLS.
        downstream: What the earlier stages learnt of it: the real client, the
            destination, its id (repeated in every request line), its TLS
            facts (``X-Forwarded-Proto``, the request lines' ``tls`` and ``sni``).
        listener: Its listener's settings (``http``, ``forwarded``, timeouts).
        backend: Where requests go.
        keepalive: Idle upstream connections of *backend*, shared.
        proxy_header: With ``send_proxy``: the PROXY header for this client;
            upstream connections are then dedicated to this client connection.
        drain: The edge's drain signal.
        result: Updated in place (and returned); pass one in to see the counts
            of a connection that gets cancelled.
        on_request: Called with each request's `RequestLog` once it is complete
            (right after its access-log line), e.g. for metrics.
        initial_data: Client bytes an earlier stage read past its own data
            (what followed a PROXY header): the start of the first request.

    Returns:
        Requests served, bytes each way and why the connection ended.
    """
    if result is None:
        result = HttpConnectionResult()
    connection = _HttpConnection(
        client,
        downstream,
        listener=listener,
        backend=backend,
        keepalive=keepalive,
        proxy_header=proxy_header,
        drain=drain,
        result=result,
        on_request=on_request,
        initial_data=initial_data,
    )
    try:
        await connection.serve_requests()
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
