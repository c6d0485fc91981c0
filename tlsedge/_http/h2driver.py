"""HTTP/2 to clients in HTTP mode: the trio driver of `H2Session` (docs/http2.md).

Theory of operation
===================

`serve_h2` runs one client connection that negotiated ``h2`` through ALPN, or
opened with the HTTP/2 preface on a listener with ``[listeners.http2]
cleartext = "prior-knowledge"`` (`sniff_preface` tells). The sans-IO
`tlsedge._http.h2session.H2Session` does the framing and the defences; this
module does the I/O with three kinds of task:

* the connection's task reads the client, feeds the session and dispatches
  its events: a new stream starts a stream task (at most
  ``max_concurrent_streams``: the session refuses more), body pieces go to the
  stream's queue, a reset cancels the stream's task;
* the writer sends what the session has queued (one task, so frames never
  interleave); stream tasks wait while more than `HIGH_WATER` bytes are
  queued, so a client that reads slowly slows the upstreams down;
* one task per stream drives an `UpstreamExchange` exactly as the HTTP/1.1
  driver does for a request: the same `UpstreamConnections` (pool, dedicated
  ``send_proxy`` connections, TLS backends), the same `RequestRewriter`
  (forwarding headers, request id, stripping), the same retry rule
  (`tlsedge._http.rules.may_retry`), the same error statuses (503 no server,
  502 connect failure or a bad answer, 504 ``response_timeout``) and the same
  access-log line (``version`` ``2.0``). The upstream request is HTTP/1.1:
  ``host`` first, ``transfer-encoding: chunked`` when the client sent no
  ``content-length`` and a body (so trailers can follow).

Flow control and backpressure. A request body piece is written upstream
first and only then acknowledged (`H2Session.acknowledge`: the client's
window reopens), so a slow upstream holds the client to its window. Response
data is read from the upstream one piece at a time and each piece goes out
only as the client's windows allow (`H2Session.sendable`): the upstream is
read no faster than the client takes it.

Timeouts (the ``[listeners.http]`` ones, per connection and per stream).
Connection: the first request's header block within
``request_header_timeout`` of the connection's start, any later header block
within ``request_header_timeout`` of its first frame (a CONTINUATION trickle
ends there), no stream open for ``keepalive_timeout`` (GOAWAY, close).
Stream: a request body or a response write (a zero window) stalled for the
listener's ``idle_timeout``, no response head within ``response_timeout``
(504). A stream that times out with its response started is reset.

Drain: GOAWAY (NO_ERROR) with the last stream accepted; the streams before it
finish, later ones are refused (REFUSED_STREAM), the connection closes when
none is left (or is cancelled at the drain deadline).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import trio

from tlsedge import _sockio as sockio
from tlsedge._accesslog import format_address
from tlsedge._balancer import Server
from tlsedge._config import ListenerConfig
from tlsedge._downstream import Downstream
from tlsedge._drain import Drain
from tlsedge._http.body import BodyKind
from tlsedge._http.events import (
    NEED_DATA,
    Body,
    EndOfBody,
    Informational,
    Response,
)
from tlsedge._http.exchange import UpstreamError, UpstreamExchange
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
from tlsedge._http.log import HttpConnectionResult, RequestLog
from tlsedge._http.pool import KeepAlivePool
from tlsedge._http.rules import (
    RequestRewriter,
    error_body,
    log_text,
    may_retry,
    strip_hop_by_hop,
)
from tlsedge._http.upstreams import PARK_AFTER, Upstream, UpstreamConnections
from tlsedge._termination import Termination
from tlsedge._upstream import BackendPool, ConnectFailedError, NoServerError

__all__ = ["serve_h2", "sniff_preface"]

LOGGER = logging.getLogger("tlsedge.http")

Header = tuple[bytes, bytes]

READ_SIZE: Final = 65536
#: Stream tasks wait while more than this many bytes wait for the writer.
HIGH_WATER: Final = 65536
#: Response fields that HTTP/2 forbids (RFC 9113 section 8.2.2), beyond the
#: hop-by-hop ones `strip_hop_by_hop` drops.
_NOT_IN_H2: Final = frozenset({b"transfer-encoding", b"keep-alive", b"upgrade"})


async def sniff_preface(
    client: trio.abc.Stream, initial_data: bytes, *, header_timeout: float
) -> tuple[bool, bytes]:
    """Read until the client's first bytes are, or cannot be, the HTTP/2
    preface (h2c with prior knowledge). Returns whether they are, and every
    byte read (for whichever driver serves the connection)."""
    data = initial_data
    with trio.move_on_after(header_timeout):
        while len(data) < len(PREFACE) and PREFACE.startswith(data):
            chunk = await sockio.receive_some(client, READ_SIZE)
            if not chunk:
                break
            data += chunk
    return data[: len(PREFACE)] == PREFACE, data


class _StreamGoneError(Exception):
    """The stream was reset or the connection ended: stop serving it."""


@dataclass(frozen=True, slots=True)
class _Failure:
    termination: str
    detail: str
    status: int | None  # the error response, if none was started
    retryable: bool = False
    code: int = ErrorCodes.INTERNAL_ERROR  # the RST_STREAM after a started response


@dataclass(slots=True, eq=False)
class _Stream:
    """One request stream and its task's state."""

    id: int
    request: H2Request
    log: RequestLog
    started: float
    #: The work in progress or next (an attempt, an error response), which
    #: a reset cancels; one scope per attempt, also its deadline (`deadline`).
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: The client reset the stream, or the connection ended: stop.
    cancelled: bool = False
    body: deque[RequestData | RequestEnd] = field(default_factory=deque)
    wakeup: trio.Event = field(default_factory=trio.Event)
    request_read: bool = False  # the client's END_STREAM arrived
    #: The last upstream read most likely emptied the socket (or the request
    #: just went out): the next read waits for readability first.
    upstream_drained: bool = False
    response_started: bool = False
    failure: _Failure | None = None
    #: The deadline of the exchange in progress, and what it means.
    deadline: trio.CancelScope | None = None
    armed: _Failure | None = None

    def fail(self, failure: _Failure) -> None:
        if self.failure is None:
            self.failure = failure

    def cancel(self) -> None:
        """Stop serving the stream (reset, or the connection ended)."""
        self.cancelled = True
        self.scope.cancel()

    def clear_failure(self) -> None:
        """A new attempt (a retry) starts."""
        self.failure = None


class _H2Connection:
    """One HTTP/2 client connection; see the module docstring."""

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
    ) -> None:
        self.client = client
        self.listener = listener
        self.http = listener.http
        self.backend = backend
        self.drain = drain
        self.result = result
        self.on_request = on_request
        self.connection_id = downstream.id
        self.client_text = format_address(downstream.client)
        ssl_info = downstream.tls
        self.tls_text = f"{ssl_info.version} {ssl_info.cipher}" if ssl_info else None
        self.sni = ssl_info.server_name if ssl_info else None
        self.rewriter = RequestRewriter.for_connection(listener, downstream)
        # The connections its streams release are kept back for its next
        # streams (at most one per concurrent stream), until `PARK_AFTER`.
        self.upstreams = UpstreamConnections(
            backend,
            keepalive,
            downstream.client_ip,
            proxy_header,
            keep=listener.http2.max_concurrent_streams,
        )
        self.session = H2Session(listener.http2, max_headers=self.http.max_headers)
        self.now: Callable[[], float] = trio.lowlevel.current_clock().current_time
        self.started = self.now()
        self.streams: dict[int, _Stream] = {}
        self.any_stream = False
        self.idle_since = self.started
        self.header_block_since: float | None = None
        self.outbox = bytearray()
        self.out_ready = trio.Event()
        self.out_drained = trio.Event()
        self.window = trio.Event()
        self.read_scope: trio.CancelScope | None = None
        # What the timeouts armed on each stream mean (`_arm`).
        self._upstream_write_stall = _Failure(
            Termination.SERVER_ERROR,
            "upstream did not read for idle_timeout",
            502,
            retryable=True,
        )
        self._response_timeout = _Failure(
            Termination.RESPONSE_TIMEOUT,
            f"no response within response_timeout ({self.http.response_timeout:g} s)",
            504,
        )
        self._upstream_read_stall = _Failure(
            Termination.SERVER_ABORTED,
            "upstream response stalled for idle_timeout",
            None,
        )
        self._client_stall = _Failure(
            Termination.CLIENT_ERROR,
            "client did not read (or open its window) for idle_timeout",
            None,
            code=ErrorCodes.CANCEL,
        )
        self.draining = False
        self.writer_done = False

    # -- the connection ---------------------------------------------------

    def _end(self, termination: str, detail: str | None = None) -> None:
        if self.result.termination == Termination.UNKNOWN:
            self.result.termination = termination
            self.result.detail = detail

    async def serve(self, initial_data: bytes) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, nursery.cancel_scope)
            async with trio.open_nursery() as streams:
                try:
                    await self._read_loop(streams, initial_data)
                finally:
                    # Nothing more is read: a stream still open cannot finish
                    # (the client closed, broke the protocol or sent GOAWAY).
                    for stream in list(self.streams.values()):
                        stream.cancel()
            # Every stream is done: what is queued (a GOAWAY) goes out.
            self.session.close()
            self.writer_done = True
            self._kick()

    def _kick(self) -> None:
        """Wake the writer: the session queued bytes (the writer takes all
        there are when it runs, so what the streams of one scheduling round
        queued goes out in one write)."""
        self.out_ready.set()

    def _pull(self) -> int:
        """Move what the session queued to the outbox; the outbox's size."""
        data = self.session.data_to_send()
        if data:
            self.outbox += data
        return len(self.outbox)

    async def _writer(self, connection_scope: trio.CancelScope) -> None:
        idle_timeout = self.listener.idle_timeout
        while True:
            if not self._pull():
                self.out_drained.set()
                if self.writer_done:
                    return
                await self.out_ready.wait()
                self.out_ready = trio.Event()
                continue
            data = bytes(self.outbox)
            self.outbox.clear()
            try:
                with trio.move_on_after(idle_timeout) as scope:
                    await sockio.send_all(self.client, data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._end(Termination.CLIENT_ERROR, f"client write failed: {exc}")
                connection_scope.cancel()
                return
            if scope.cancelled_caught:
                self._end(
                    Termination.CLIENT_ERROR, "client did not read for idle_timeout"
                )
                connection_scope.cancel()
                return
            self.result.bytes_to_client += len(data)
            if len(self.outbox) < HIGH_WATER:
                self.out_drained.set()

    async def _wait_writable(self) -> None:
        """Wait while the outbox is above `HIGH_WATER`."""
        while self._pull() >= HIGH_WATER:
            if self.out_drained.is_set():
                self.out_drained = trio.Event()
            await self.out_drained.wait()

    def _read_deadline(self) -> float:
        http = self.http
        if self.draining and not self.streams:
            return -math.inf  # the GOAWAY went out and nothing is left
        if self.header_block_since is not None:
            return self.header_block_since + http.request_header_timeout
        if not self.any_stream:
            return self.started + http.request_header_timeout
        if not self.session.active:
            deadline = self.idle_since + http.keepalive_timeout
            if self.upstreams.kept:
                return min(deadline, self.idle_since + PARK_AFTER)
            return deadline
        return math.inf

    def _update_read_deadline(self) -> None:
        scope = self.read_scope
        if scope is not None:
            deadline = self._read_deadline()
            if deadline != scope.deadline:  # setting it costs, even unchanged
                scope.deadline = deadline

    async def _read_loop(self, nursery: trio.Nursery, initial_data: bytes) -> None:
        session = self.session
        self._kick()  # our SETTINGS
        if initial_data:
            self.result.bytes_from_client += len(initial_data)
            self._dispatch(session.receive_data(initial_data, self.now()), nursery)
        while not session.ended:
            # One scope for as many reads as come before it is cancelled (a
            # deadline, the drain); `_update_read_deadline` moves its deadline.
            with trio.CancelScope(deadline=self._read_deadline()) as scope:
                self.read_scope = scope
                watch = self.drain.cancels(scope) if not self.draining else None
                with watch or contextlib.nullcontext():
                    while not session.ended:
                        try:
                            data = await sockio.receive_some(self.client, READ_SIZE)
                        except (
                            trio.BrokenResourceError,
                            trio.ClosedResourceError,
                            OSError,
                        ) as exc:
                            self._end(
                                Termination.CLIENT_ERROR, f"client read failed: {exc}"
                            )
                            return
                        if not data:
                            self._end(Termination.CLIENT_CLOSED)
                            return
                        self._received(data, nursery)
            self.read_scope = None
            if scope.cancelled_caught:
                if self.drain.is_set() and not self.draining:
                    self.draining = True
                    session.goaway()
                    self._kick()
                    continue
                if self._park_due():
                    self.upstreams.park()
                    continue
                self._timed_out()
                return

    def _received(self, data: bytes, nursery: trio.Nursery) -> None:
        """Client bytes to the session, its events dispatched."""
        session = self.session
        self.result.bytes_from_client += len(data)
        self._dispatch(session.receive_data(data, self.now()), nursery)
        if session.in_header_block:
            if self.header_block_since is None:
                self.header_block_since = self.now()
        else:
            self.header_block_since = None
        self._update_read_deadline()
        self._kick()

    def _park_due(self) -> bool:
        """No stream for `PARK_AFTER`: the upstream connections kept back
        go to the shared pool."""
        return (
            self.upstreams.kept > 0
            and not self.session.active
            and self.now() >= self.idle_since + PARK_AFTER
        )

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
        self.session.close()
        self._kick()

    def _dispatch(self, events: list[Event], nursery: trio.Nursery) -> None:
        for event in events:
            if isinstance(event, RequestData | RequestEnd):
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    if isinstance(event, RequestEnd):
                        stream.request_read = True
                    stream.body.append(event)
                    stream.wakeup.set()
                elif isinstance(event, RequestData):
                    self.session.acknowledge(event.stream_id, event.flow_length)
            elif isinstance(event, WindowOpened):
                self.window.set()
                self.window = trio.Event()
            elif isinstance(event, StreamOpened):
                self._open(event, nursery)
            elif isinstance(event, StreamCancelled):
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream.fail(
                        _Failure(
                            Termination.CLIENT_ERROR,
                            f"client reset the stream (error code {event.error_code})",
                            None,
                        )
                    )
                    stream.cancel()
            elif isinstance(event, StreamMalformed):
                self._malformed(event)
            else:
                assert isinstance(event, ConnectionEnded), event
                self._ended(event)

    def _ended(self, event: ConnectionEnded) -> None:
        if event.by_client:
            self._end(Termination.CLIENT_CLOSED, event.reason)
            return
        self._end(Termination.CLIENT_ERROR, event.reason)
        LOGGER.info(
            "listener %s: client %s: HTTP/2 connection closed: %s",
            self.listener.name,
            self.client_text,
            event.reason,
        )

    def _new_log(self, method: bytes | None, target: bytes | None) -> RequestLog:
        return RequestLog(
            connection=self.connection_id,
            listener=self.listener.name,
            client=self.client_text,
            start=time.time(),
            method=method.decode("latin-1") if method is not None else None,
            target=log_text(target) if target is not None else None,
            version="2.0",
            backend=self.backend.name,
            tls=self.tls_text,
            sni=self.sni,
        )

    def _emit(self, log: RequestLog) -> None:
        log.emit()
        if self.on_request is not None:
            self.on_request(log)

    def _malformed(self, event: StreamMalformed) -> None:
        log = self._new_log(event.method, event.target)
        log.termination = Termination.BAD_REQUEST
        log.detail = f"malformed request, stream reset: {event.reason}"
        self.result.requests += 1
        LOGGER.info(
            "listener %s: client %s: HTTP/2 stream %d reset: %s",
            self.listener.name,
            self.client_text,
            event.stream_id,
            event.reason,
        )
        self._emit(log)

    def _open(self, event: StreamOpened, nursery: trio.Nursery) -> None:
        request = event.request
        log = self._new_log(request.method, request.target)
        # Checked (HOST_RE: ASCII only) by the session.
        log.host = request.host.decode("ascii")
        if request.user_agent is not None:
            log.user_agent = log_text(request.user_agent)
        log.bytes_in = request.size
        stream = _Stream(event.stream_id, request, log, self.now())
        self.streams[stream.id] = stream
        self.any_stream = True
        self.result.requests += 1
        self._update_read_deadline()
        nursery.start_soon(self._serve_stream, stream, event.error)

    # -- one stream ---------------------------------------------------------

    async def _serve_stream(
        self, stream: _Stream, error: tuple[int, str] | None
    ) -> None:
        log = stream.log
        try:
            if error is not None:
                with stream.scope:
                    await self._respond_error(stream, *error, Termination.BAD_REQUEST)
            else:
                await self._exchange(stream)
            failure = stream.failure
            if failure is not None:
                log.termination = failure.termination
                log.detail = failure.detail
                if stream.response_started:
                    self.session.reset(stream.id, failure.code)
                elif failure.status is not None and not stream.cancelled:
                    await self._respond_error(
                        stream, failure.status, failure.detail, failure.termination
                    )
                else:
                    self.session.reset(stream.id, ErrorCodes.CANCEL)
        finally:
            if log.termination == Termination.OK and stream.id in self.session.active:
                # Cancelled with the connection (closed, broken, drain deadline).
                log.termination = (
                    Termination.DRAINED
                    if self.drain.is_set()
                    else Termination.CLIENT_ERROR
                )
                log.detail = "the connection ended before the response did"
            # Request data never passed on still reopens the connection's window.
            for event in stream.body:
                if isinstance(event, RequestData):
                    self.session.acknowledge(stream.id, event.flow_length)
            self.session.active.discard(stream.id)
            del self.streams[stream.id]
            self._kick()
            if not self.session.active:
                self.idle_since = self.now()
            self._update_read_deadline()
            log.total = self.now() - stream.started
            self._emit(log)

    async def _respond_error(
        self, stream: _Stream, status: int, reason: str, termination: str
    ) -> None:
        """A small plain-text error response (as HTTP/1.1's, without close)."""
        stream.log.error_response(self.listener.name, status, reason, termination)
        body = error_body(status, reason)
        head_only = stream.request.method == b"HEAD"
        self.session.send_headers(
            stream.id,
            status,
            [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ],
            end_stream=False,
        )
        stream.response_started = True
        with trio.move_on_after(self.listener.idle_timeout):
            with contextlib.suppress(_StreamGoneError):
                if head_only:
                    self.session.send_end(stream.id, [])
                else:
                    await self._send_body(stream, body, end_stream=True)
                if not stream.request_read:
                    self.session.stop_request(stream.id)
        self._kick()

    def _arm(self, stream: _Stream, seconds: float, failure: _Failure) -> None:
        scope = stream.deadline
        assert scope is not None
        deadline = self.now() + seconds
        if abs(deadline - scope.deadline) > seconds / 64:
            scope.deadline = deadline
        stream.armed = failure

    async def _exchange(self, stream: _Stream) -> None:
        request = stream.request
        http = self.http
        length = request.content_length
        max_body = http.max_body_size
        if max_body and (length or 0) > max_body:
            stream.fail(
                _Failure(
                    Termination.BAD_REQUEST,
                    f"request body larger than {max_body} bytes",
                    413,
                )
            )
            return
        fields = request.headers
        if length:
            body = BodyKind.LENGTH
        elif request.end_stream or length == 0:
            body = BodyKind.NONE
        else:
            # As an HTTP/1.1 client would frame it: trailers can follow.
            body = BodyKind.CHUNKED
            fields = [*fields, (b"transfer-encoding", b"chunked")]
        headers, request_id = self.rewriter.head_fields(
            fields,
            connection=frozenset(),
            upgrade=False,
            authority=None,
            host=request.host,
        )
        if request_id is not None:
            stream.log.request_id = request_id.decode("ascii")
        has_body = body is not BodyKind.NONE
        exclude: Server | None = None
        fresh = retried = False
        log = stream.log
        # One scope per attempt, made before anything awaits (a reset cancels
        # it, also before the attempt starts); `_arm` sets its deadline (a
        # timeout ends the attempt, and may retry).
        scope = stream.scope
        while True:
            upstream: Upstream | None = None
            conn = UpstreamExchange(method=request.method)
            stream.clear_failure()
            with scope:
                stream.deadline = scope
                if not scope.cancel_called:
                    connect_started = self.now()
                    try:
                        upstream = await self.upstreams.acquire(exclude, fresh=fresh)
                    except NoServerError as exc:
                        stream.fail(_Failure(Termination.NO_SERVER, str(exc), 503))
                    except ConnectFailedError as exc:
                        stream.fail(_Failure(Termination.CONNECT_FAILED, str(exc), 502))
                    else:
                        log.connect = self.now() - connect_started
                        log.server = format_address(upstream.server.address)
                        self.result.server = log.server
                        await self._proxy(stream, upstream, conn, headers, body)
            stream.deadline = None
            if stream.cancelled:
                if upstream is not None:
                    # It holds half an exchange: closed now, not with the client.
                    self.upstreams.release(upstream, clean=False)
                return
            if upstream is None:
                return  # no connection: the failure says why
            if scope.cancelled_caught and stream.armed is not None:
                stream.fail(stream.armed)
            failure = stream.failure
            retry = (
                failure is not None
                and failure.retryable
                and not stream.response_started
                and may_retry(
                    method=request.method,
                    has_body=has_body,
                    reused=upstream.reused,
                    retried=retried,
                )
            )
            scope = stream.scope = trio.CancelScope()
            self.upstreams.release(upstream, clean=failure is None and conn.reusable)
            if not retry:
                return
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

    async def _proxy(
        self,
        stream: _Stream,
        upstream: Upstream,
        conn: UpstreamExchange,
        headers: list[Header],
        body: BodyKind,
    ) -> None:
        idle = self.listener.idle_timeout
        data = conn.request_head(stream.request.target, headers, body)
        prefix, upstream.prefix = upstream.prefix, b""
        self._arm(stream, idle, self._upstream_write_stall)
        # Nothing to read before the upstream has the request: wait first.
        stream.upstream_drained = True
        try:
            await sockio.send_all(upstream.stream, prefix + data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            stream.fail(
                _Failure(
                    Termination.SERVER_ERROR,
                    f"upstream write failed: {exc}",
                    502,
                    retryable=True,
                )
            )
            return
        if body is BodyKind.NONE:
            self._await_head(stream)
            await self._pump_response(stream, upstream, conn)
            return
        async with trio.open_nursery() as nursery:
            stream.armed = None
            assert stream.deadline is not None
            stream.deadline.deadline = math.inf
            nursery.start_soon(self._pump_body, stream, upstream, conn, nursery)
            await self._pump_response(stream, upstream, conn)
            if stream.failure is not None or not stream.request_read:
                nursery.cancel_scope.cancel()

    def _await_head(self, stream: _Stream) -> None:
        self._arm(stream, self.http.response_timeout, self._response_timeout)

    async def _next_body_event(self, stream: _Stream) -> RequestData | RequestEnd:
        idle = self.listener.idle_timeout
        while not stream.body:
            stream.wakeup = trio.Event()
            with trio.move_on_after(idle) as scope:
                await stream.wakeup.wait()
            if scope.cancelled_caught:
                raise _StreamGoneError("request body stalled for idle_timeout")
        return stream.body.popleft()

    async def _send_body_upstream(self, upstream: Upstream, data: bytes) -> None:
        with trio.move_on_after(self.listener.idle_timeout) as scope:
            await sockio.send_all(upstream.stream, data)
        if scope.cancelled_caught:
            raise OSError("upstream did not read for idle_timeout")

    async def _pump_body(
        self,
        stream: _Stream,
        upstream: Upstream,
        conn: UpstreamExchange,
        nursery: trio.Nursery,
    ) -> None:
        """Client -> upstream, each piece acknowledged once written."""
        try:
            while True:
                event = await self._next_body_event(stream)
                if isinstance(event, RequestEnd):
                    trailers = self.rewriter.clean_trailers(event.trailers)
                    await self._send_body_upstream(upstream, conn.request_end(trailers))
                    if not stream.response_started:
                        self._await_head(stream)
                    return
                stream.log.bytes_in += len(event.data)
                try:
                    data = conn.request_data(event.data)
                    await self._send_body_upstream(upstream, data)
                finally:
                    # Passed on (or the stream is over): the client may send more.
                    self.session.acknowledge(stream.id, event.flow_length)
                    self._kick()
        except _StreamGoneError as exc:
            stream.fail(
                _Failure(Termination.BAD_REQUEST, str(exc), 408, code=ErrorCodes.CANCEL)
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # The upstream may still answer (413 and close): only stop sending.
            LOGGER.debug("request body not delivered: %s", exc)
            if not stream.response_started:
                self._await_head(stream)
            return
        nursery.cancel_scope.cancel()

    async def _next_upstream_event(
        self, stream: _Stream, upstream: Upstream, conn: UpstreamExchange
    ) -> Informational | Response | Body | EndOfBody:
        while True:
            event = conn.next_event()
            if event is not NEED_DATA:
                return event
            try:
                data = await sockio.receive_some(
                    upstream.stream, READ_SIZE, wait_first=stream.upstream_drained
                )
                stream.upstream_drained = len(data) < READ_SIZE
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise UpstreamError(
                    f"upstream read failed: {exc}", empty=not conn.received
                ) from exc
            conn.receive_data(data)

    async def _pump_response(
        self, stream: _Stream, upstream: Upstream, conn: UpstreamExchange
    ) -> None:
        """Upstream -> client: 1xx, the head, the body, trailers."""
        try:
            await self._forward_response(stream, upstream, conn)
        except UpstreamError as exc:
            if stream.response_started:
                stream.fail(_Failure(Termination.SERVER_ABORTED, str(exc), None))
            else:
                stream.fail(
                    _Failure(
                        Termination.SERVER_ERROR, str(exc), 502, retryable=exc.empty
                    )
                )
        except _StreamGoneError as exc:
            stream.fail(_Failure(Termination.CLIENT_ERROR, str(exc), None))

    async def _forward_response(
        self, stream: _Stream, upstream: Upstream, conn: UpstreamExchange
    ) -> None:
        session = self.session
        log = stream.log
        idle = self.listener.idle_timeout
        expects_continue = any(
            n == b"expect" and v.lower() == b"100-continue"
            for n, v in stream.request.headers
        )
        while True:
            event = await self._next_upstream_event(stream, upstream, conn)
            if isinstance(event, Response):
                break
            assert isinstance(event, Informational), event
            head = event.head
            if head.status == 101:
                raise UpstreamError(
                    "unexpected 101 from upstream: no upgrade was asked"
                )
            if head.status == 100 and not expects_continue:
                continue
            session.send_headers(
                stream.id, head.status, _h2_fields(head.headers), end_stream=False
            )
            self._kick()
        head = event.head
        log.first_byte = self.now() - stream.started
        log.status = head.status
        fields = _h2_fields(head.headers, connection=head.connection)
        trailers_ok = event.body is BodyKind.CHUNKED
        following = conn.next_event()
        if isinstance(following, EndOfBody) and not following.trailers:
            session.send_headers(stream.id, head.status, fields, end_stream=True)
            stream.response_started = True
            self._end_stream_sent(stream)
            return
        session.send_headers(stream.id, head.status, fields, end_stream=False)
        stream.response_started = True
        self._kick()
        stall = self._upstream_read_stall
        while True:
            if following is NEED_DATA:
                self._arm(stream, idle, stall)
                following = await self._next_upstream_event(stream, upstream, conn)
            if isinstance(following, Body):
                data = following.data
                following = conn.next_event()
                # The last piece carries END_STREAM when no trailers follow.
                last = isinstance(following, EndOfBody) and not (
                    trailers_ok and following.trailers
                )
                await self._send_body(stream, data, end_stream=last)
                if last:
                    self._end_stream_sent(stream)
                    return
                continue
            assert isinstance(following, EndOfBody), following
            trailers = _h2_fields(following.trailers) if trailers_ok else []
            session.send_end(stream.id, trailers)
            self._end_stream_sent(stream)
            return

    def _end_stream_sent(self, stream: _Stream) -> None:
        if not stream.request_read:
            self.session.stop_request(stream.id)
        self._kick()

    async def _send_body(
        self, stream: _Stream, data: bytes, *, end_stream: bool = False
    ) -> None:
        """Response body bytes, as the client's windows allow (*end_stream*:
        the last frame ends the response)."""
        session = self.session
        view = memoryview(data)
        while view:
            size = session.sendable(stream.id)
            if size <= 0:
                if not session.open(stream.id):
                    raise _StreamGoneError("the stream or the connection ended")
                await self._wait_window(stream)
                continue
            if self._pull() >= HIGH_WATER:
                if stream.deadline is not None:
                    self._arm(stream, self.listener.idle_timeout, self._client_stall)
                await self._wait_writable()
                continue  # the windows, or the stream, may have changed meanwhile
            if size >= len(view):
                chunk = data if len(view) == len(data) else bytes(view)
                view = view[len(view) :]
            else:
                view, chunk = view[size:], bytes(view[:size])
            session.send_data(stream.id, chunk, end_stream=end_stream and not view)
            stream.log.bytes_out += len(chunk)
            self._kick()

    async def _wait_window(self, stream: _Stream) -> None:
        """Wait until the client opens a window (`idle_timeout` at most)."""
        idle = self.listener.idle_timeout
        window = self.window
        if stream.deadline is None:
            with trio.move_on_after(idle) as scope:
                await window.wait()
            if scope.cancelled_caught:
                raise _StreamGoneError(self._client_stall.detail)
        else:
            self._arm(stream, idle, self._client_stall)
            await window.wait()


def _h2_fields(
    headers: list[Header], *, connection: frozenset[bytes] | None = None
) -> list[Header]:
    """Response fields for HTTP/2: no hop-by-hop or connection-specific
    field, names in lowercase."""
    fields = []
    for name, value in strip_hop_by_hop(
        headers, keep_upgrade=False, connection=connection
    ):
        lower = name.lower()
        if lower not in _NOT_IN_H2:
            fields.append((lower, value))
    return fields


async def serve_h2(
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
    """Proxy HTTP/2 streams from *client* to *backend* until the connection ends.

    The arguments are `tlsedge._http.driver.serve_http`'s; *initial_data*
    holds what was read before (with h2c, at least the preface). See the
    module docstring for the behaviour. Does not close *client*; every
    upstream connection it opened is closed or pooled when it returns.
    """
    if result is None:
        result = HttpConnectionResult()
    connection = _H2Connection(
        client,
        downstream,
        listener=listener,
        backend=backend,
        keepalive=keepalive,
        proxy_header=proxy_header,
        drain=drain,
        result=result,
        on_request=on_request,
    )
    try:
        await connection.serve(initial_data)
    except Exception as exc:  # a bug must not take the edge down
        LOGGER.exception("listener %s: HTTP/2 connection failed", listener.name)
        result.termination = Termination.INTERNAL_ERROR
        result.detail = repr(exc)
    finally:
        if result.termination == Termination.UNKNOWN:  # cancelled: drain deadline
            result.termination = Termination.DRAINED
        connection.upstreams.close()
    return result
