"""The reactor connection both HTTP drivers are built on: one engine, two client sides.

Theory of operation
===================

A client connection in HTTP mode is a handler of the worker's reactor
(`tlsedge._reactor.loop`) and has no trio task of its own: the edge starts it
(``start()``), the reactor calls ``ready`` when one of its sockets is ready
and its timer when a deadline passes, and everything then happens in that
call without awaiting; its end calls *on_done*. `ReactorConnection` is that
handler for HTTP/1.1 (`tlsedge._pipeline.http.h1`) and HTTP/2
(`tlsedge._pipeline.http.h2`) alike; a driver adds only its client side
(reading requests, writing responses, flow control), and each request's
upstream half is an `tlsedge._pipeline.http.attempt.UpstreamAttempt`, whose host
(`AttemptHost`) this class is. It owns:

* **The sockets.** The client's `RawStream` and its registration
  (`_watch`: registrations persist; a socket that hung up is unregistered
  rather than watched for nothing), the upstream sockets of the attempts in
  flight (`by_fd`; `dirty` lists those whose interest may have to change),
  and the idle upstream connections *held* for the next requests (`held`,
  oldest first, at most ``max_held``: one for HTTP/1.1, one per concurrent
  stream for HTTP/2), each still registered and read on: a server that
  closes it or says anything while idle gets it closed (`_drop_held`). They
  go to the shared pool (`_park_held`) when the client has had no request
  for `PARK_AFTER` or ends. ``ready`` dispatches: the client's events to the
  client side, an attempt's to the attempt, a held one's to `_drop_held`.
* **One lazy timer.** Reads and writes store timestamps; `arm` pushes a
  reactor timer only for a deadline earlier than the one pending, and when
  it fires the client side expires what is due (`_expire`) and names the
  next deadline (`_earliest`).
* **The jobs that must await**, each in a task of its own started with the
  *spawn* the connection is given, under a cancel scope: opening an
  upstream connection (`open_upstream`, then the attempt begins on it), and
  for HTTP/1.1 the byte relay after an ``Upgrade``. A job whose scope was
  cancelled (its request or the connection ended) leaves no trace; a job
  cancelled from outside (the edge stops) ends the connection.
* **The outcome.** `_end` records why the connection ends (the first cause
  stands); `_finish` is the one way out: every request ended and logged,
  nothing registered, every upstream connection closed, pooled or handed
  over, then *on_done*, with ``drained`` for a connection that ended with
  no cause recorded (the drain deadline cancelled it).

States are one `ConnectionState` enum with each version's legal moves beside
it (`HTTP1_TRANSITIONS`, `HTTP2_TRANSITIONS`), as h11's ``_state.py``.
"""

from __future__ import annotations

import abc
import enum
import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import ClassVar, Final, Protocol

import trio

from tlsedge._backends.keepalive import close_now
from tlsedge._backends.upstream import ConnectFailedError
from tlsedge._core.accesslog import format_address
from tlsedge._core.downstream import Downstream
from tlsedge._core.termination import Termination
from tlsedge._http.log import HttpConnectionResult, RequestLines, RequestLog
from tlsedge._http.rules import RequestRewriter
from tlsedge._pipeline.http.attempt import UpstreamAttempt, upstream_socket
from tlsedge._pipeline.http.site import HttpSite
from tlsedge._pipeline.http.upstreams import (
    PARK_AFTER,
    NewConnection,
    Upstream,
    UpstreamConnections,
)
from tlsedge._reactor.loop import (
    ERROR,
    HANGUP,
    READABLE,
    WRITABLE,
    Cancellable,
    current_reactor,
)
from tlsedge._reactor.raw_stream import RawStream
from tlsedge._reactor.relay import set_abortive_close

__all__ = [
    "CLOSING",
    "DONE",
    "EXCHANGE",
    "HEAD",
    "HTTP1_TRANSITIONS",
    "HTTP2_TRANSITIONS",
    "LINGER",
    "OPEN",
    "UPGRADE",
    "WAIT",
    "ConnectionState",
    "ReactorConnection",
    "Spawn",
    "Startable",
    "run_to_end",
    "socket_backed",
]

LOGGER = logging.getLogger("tlsedge.http")

#: The connection's causes that mean the edge ended it (`_cut_short`).
_EDGE_ENDED: Final = frozenset({Termination.UNKNOWN, Termination.DRAINED})

#: How a connection starts a job that must await in a task of its own (a
#: nursery's ``start_soon``): the edge's connections nursery.
Spawn = Callable[[Callable[[], Awaitable[None]]], None]


class ConnectionState(enum.Enum):
    """Where a client connection is (both versions; see the transitions)."""

    # HTTP/1.1 (`tlsedge._pipeline.http.h1`).
    #: Reading a request head (between requests: waiting for one).
    HEAD = "head"
    #: One request's exchange with the upstream.
    EXCHANGE = "exchange"
    #: After a 101: the bytes each side sent past the heads are handed over.
    UPGRADE = "upgrade"
    #: A job runs (a connect, the relay after an upgrade); the sockets rest.
    WAIT = "wait"
    #: After an error answer: FIN sent, the client's leftovers discarded.
    LINGER = "linger"
    # HTTP/2 (`tlsedge._pipeline.http.h2`).
    #: Streams come and go.
    OPEN = "open"
    #: The last frames (a GOAWAY) go out.
    CLOSING = "closing"
    # Both.
    DONE = "done"

    # Members are singletons: hashed by identity, in C (as
    # `tlsedge._pipeline.http.attempt.RequestProgress`).
    __hash__ = object.__hash__


# The members as module constants (as in `tlsedge._pipeline.http.attempt`).
HEAD: Final = ConnectionState.HEAD
EXCHANGE: Final = ConnectionState.EXCHANGE
UPGRADE: Final = ConnectionState.UPGRADE
WAIT: Final = ConnectionState.WAIT
LINGER: Final = ConnectionState.LINGER
OPEN: Final = ConnectionState.OPEN
CLOSING: Final = ConnectionState.CLOSING
DONE: Final = ConnectionState.DONE

#: HTTP/1.1's moves: a request, its exchange (a job may open its upstream
#: connection), then the next request, an upgrade, or the end (after an
#: error answer, lingering).
HTTP1_TRANSITIONS: Final[dict[ConnectionState, frozenset[ConnectionState]]] = {
    HEAD: frozenset({EXCHANGE, LINGER, DONE}),
    EXCHANGE: frozenset({HEAD, WAIT, UPGRADE, LINGER, DONE}),
    WAIT: frozenset({EXCHANGE, DONE}),
    UPGRADE: frozenset({WAIT, DONE}),
    LINGER: frozenset({DONE}),
    DONE: frozenset(),
}
#: HTTP/2's moves: open, closing (GOAWAY out), done.
HTTP2_TRANSITIONS: Final[dict[ConnectionState, frozenset[ConnectionState]]] = {
    OPEN: frozenset({CLOSING, DONE}),
    CLOSING: frozenset({DONE}),
    DONE: frozenset(),
}


class Startable(Protocol):
    """A connection that no task waits for: `tlsedge._pipeline.http.h1.http_connection`,
    `tlsedge._pipeline.http.h2.h2_connection`."""

    def start(self) -> None: ...
    def drain(self) -> None: ...


class _Builder(Protocol):
    def __call__(
        self, *, spawn: Spawn, on_done: Callable[[HttpConnectionResult], None]
    ) -> Startable: ...


def socket_backed(client: trio.abc.Stream) -> RawStream:
    """The non-blocking I/O over *client*, for either driver.

    Raises:
        TypeError: *client* is not a `trio.SocketStream` or an established
            `TLSStream` over one.
    """
    raw = RawStream.of(client)
    if raw is None:
        msg = (
            "an HTTP connection needs a trio.SocketStream or an established"
            f" TLSStream over one, not {client!r}"
        )
        raise TypeError(msg)
    return raw


async def run_to_end(build: _Builder) -> None:
    """Start a connection (*build* makes it) and wait until it ended, its
    jobs in a nursery of this task; cancelled, the connection ends as
    ``drained``."""
    ended = trio.Event()
    async with trio.open_nursery() as jobs:
        connection = build(spawn=jobs.start_soon, on_done=lambda _: ended.set())
        try:
            connection.start()
            await ended.wait()
        finally:
            if not ended.is_set():
                connection.drain()


class ReactorConnection(abc.ABC):
    """One client connection in HTTP mode, either version; see the module
    docstring. Subclasses are the client sides: they implement the abstract
    methods and set ``state`` (an initial state of their transitions)."""

    __slots__ = (
        "armed",
        "by_fd",
        "client",
        "client_progress",
        "client_text",
        "connection_id",
        "dirty",
        "held",
        "held_fds",
        "http",
        "idle_timeout",
        "idle_upstreams",
        "max_held",
        "now",
        "on_done",
        "reactor",
        "request_lines",
        "result",
        "rewriter",
        "site",
        "sni",
        "spawn",
        "started",
        "state",
        "timer",
        "tls_text",
        "upstreams",
    )

    #: Where the connection is (the subclass sets the initial state).
    state: ConnectionState
    #: The version, as the log says it ("HTTP", "HTTP/2").
    KIND: ClassVar[str]
    #: The legal moves of ``state``.
    TRANSITIONS: ClassVar[dict[ConnectionState, frozenset[ConnectionState]]]

    def __init__(
        self,
        client: RawStream,
        downstream: Downstream,
        site: HttpSite,
        *,
        proxy_header: bytes | None,
        result: HttpConnectionResult,
        spawn: Spawn,
        on_done: Callable[[HttpConnectionResult], None],
        max_held: int,
    ) -> None:
        self.client = client
        self.site = site
        # Read on every request: kept here, one load away.
        self.http = site.http
        self.idle_timeout = site.idle_timeout
        self.result = result
        self.connection_id = downstream.id
        self.client_text = format_address(downstream.client)
        ssl_info = downstream.tls
        self.tls_text = f"{ssl_info.version} {ssl_info.cipher}" if ssl_info else None
        self.sni = ssl_info.server_name if ssl_info else None
        self.request_lines = RequestLines(
            connection=self.connection_id,
            listener=site.listener_name,
            client=self.client_text,
            backend=site.backend_name,
            tls=self.tls_text,
            sni=self.sni,
        )
        self.rewriter = RequestRewriter.for_connection(site.listener, downstream)
        self.upstreams = UpstreamConnections(
            site.backend, site.keepalive, downstream.client_ip, proxy_header
        )
        self.spawn = spawn
        self.on_done = on_done
        self.reactor = current_reactor()
        self.now = self.reactor.now
        self.started = self.now()
        self.client_progress = 0.0  # since when the client owes a read
        #: The upstream sockets of the attempts in flight, by descriptor.
        self.by_fd: dict[int, UpstreamAttempt] = {}
        #: Attempts whose upstream socket's interest may have to change
        #: (a dict as an ordered set: cleared, an empty one is small again).
        self.dirty: dict[UpstreamAttempt, None] = {}
        #: The clean upstream connections held (sockets still registered)
        #: for the next requests, oldest first: each with its socket and
        #: since when; and by descriptor.
        self.held: dict[Upstream, tuple[RawStream, float]] = {}
        self.held_fds: dict[int, Upstream] = {}
        self.idle_upstreams = self.held  # (as `UpstreamConnections.take` wants it)
        self.max_held = max_held
        self.armed = math.inf  # the earliest pending timer of ours
        # Cancelled at the end: the reactor's heap keeps what it is given
        # until the deadline, and this connection must not live that long.
        self.timer = Cancellable(self._timer)

    # -- the client side's part ------------------------------------------------

    @abc.abstractmethod
    def _start(self) -> None:
        """Begin serving (the first bytes may be there already)."""

    @abc.abstractmethod
    def _read_client(self) -> None:
        """The client's socket is readable."""

    @abc.abstractmethod
    def _flush_client(self) -> None:
        """The client's socket takes bytes again (some wait in its ``out``)."""

    @abc.abstractmethod
    def _client_failed(self, detail: str) -> None:
        """The client's connection failed (*detail* says how)."""

    @abc.abstractmethod
    def _ready_done(self) -> None:
        """After the reactor's events for one socket: the interest update
        (now, or once the batch is done)."""

    @abc.abstractmethod
    def _settle(self) -> None:
        """After a round of work: what is queued goes out, and each socket
        is watched for what it waits for."""

    @abc.abstractmethod
    def _expire(self, now: float) -> None:
        """The timer fired: act on what is due by *now*."""

    @abc.abstractmethod
    def _earliest(self) -> float:
        """The next deadline (``math.inf``: none)."""

    @abc.abstractmethod
    def _drained(self) -> None:
        """The edge drains (a `Drain` callback)."""

    @abc.abstractmethod
    def _end_requests(self) -> None:
        """The connection ends: every request still open ends and is logged."""

    @abc.abstractmethod
    def _connecting(self, attempt: UpstreamAttempt) -> None:
        """A job opens *attempt*'s upstream connection."""

    @abc.abstractmethod
    def _connected(self, attempt: UpstreamAttempt) -> None:
        """The job ended (the attempt begins, or fails, next)."""

    # -- the edge's calls ------------------------------------------------------

    def start(self) -> None:
        """Serve from the reactor; *on_done* is called once the connection
        ended (maybe before this returns)."""
        try:
            self._start()
        except Exception as exc:  # noqa: BLE001 (a bug: logged, this connection ends)
            self._crashed(exc)

    def drain(self) -> None:
        """End the connection now, as ``drained`` (the drain deadline, or the
        edge cancelled from outside): its jobs are cancelled."""
        self._end(Termination.DRAINED)
        self._finish()

    # -- the reactor's calls ---------------------------------------------------

    def ready(self, fd: int, events: int) -> None:
        client = self.client
        if fd == client.fd:
            acted = False
            if client.out and events & (WRITABLE | ERROR | HANGUP):
                acted = True
                self._flush_client()
            state = self.state
            if (
                state is not DONE
                and state is not CLOSING
                and client.interest
                and client.interest & READABLE
                and events & (READABLE | ERROR | HANGUP)
            ):
                acted = True
                self._read_client()
            if not acted and self.state is not DONE:
                if events & ERROR:
                    self._client_failed("client connection reset")
                elif events & HANGUP:
                    client.hung_up = True
        else:
            attempt = self.by_fd.get(fd)
            if attempt is not None:
                attempt.ready(events)
            else:
                held = self.held_fds.get(fd)
                if held is not None:
                    # An idle connection has nothing to say: the server
                    # closed it, reset it or sent stray bytes.
                    self._drop_held(held, close=True)
                # (Else a stale event of an upstream already let go.)
        self._ready_done()

    def failed(self, exc: Exception) -> None:
        """A bug (logged by the reactor): end this connection with an RST."""
        self._end(Termination.INTERNAL_ERROR, repr(exc))
        set_abortive_close(self.client.sock)
        self._finish()

    def ended(self) -> bool:
        """Whether the connection is over (`_finish` ran)."""
        return self.state is DONE

    def _crashed(self, exc: Exception) -> None:
        LOGGER.error(
            "listener %s: %s connection failed",
            self.site.listener_name,
            self.KIND,
            exc_info=exc,
        )
        self.failed(exc)

    def _watch(self, raw: RawStream, interest: int | None) -> None:
        if interest == 0 and raw.hung_up:
            interest = None  # a level-triggered hang-up would wake us in a loop
        raw.interest = self.reactor.watch(raw.fd, raw.interest, interest, self)

    # -- the timer -------------------------------------------------------------

    def arm(self, deadline: float) -> None:
        """Have the timer look at the deadlines again at *deadline*."""
        if deadline < self.armed:
            self.armed = deadline
            self.reactor.call_at(deadline, self.timer)

    def _timer(self) -> None:
        if self.state is DONE:
            return
        now = self.now()
        if self.armed <= now:
            self.armed = math.inf  # this was the earliest pending timer
        try:
            self._expire(now)
            if self.ended():
                return
            self._settle()
            if self.ended():
                return
            deadline = self._earliest()
            if deadline < math.inf:
                self.arm(deadline)
        except Exception as exc:  # a bug: end this connection alone
            LOGGER.exception(
                "listener %s: %s connection failed", self.site.listener_name, self.KIND
            )
            self.failed(exc)

    # -- jobs ------------------------------------------------------------------

    def _start_job(
        self, job: Callable[[], Awaitable[None]], scope: trio.CancelScope
    ) -> None:
        """Run *job* in a task of its own under *scope* (cancelled before
        the task starts, the job meets the cancellation at its first wait)."""
        self.spawn(partial(self._run_job, job, scope))

    async def _run_job(
        self, job: Callable[[], Awaitable[None]], scope: trio.CancelScope
    ) -> None:
        try:
            with scope:
                await job()
        except trio.Cancelled:  # the edge stopped
            self._finish()
            raise
        except Exception as exc:  # noqa: BLE001 (a bug: logged, this connection ends)
            self._crashed(exc)

    def open_upstream(self, attempt: UpstreamAttempt, new: NewConnection) -> None:
        """A task opens *new* for *attempt* (cancelled with the attempt)."""
        attempt.scope = scope = trio.CancelScope()
        self._connecting(attempt)
        self._start_job(partial(self._connect, attempt, new, scope), scope)

    async def _connect(
        self, attempt: UpstreamAttempt, new: NewConnection, scope: trio.CancelScope
    ) -> None:
        failure = ""
        upstream: Upstream | None = None
        try:
            upstream = await self.upstreams.connect(new)
        except ConnectFailedError as exc:
            failure = str(exc)
        attempt.scope = None
        if scope.cancel_called:
            # The request or the connection ended meanwhile.
            if upstream is not None:
                self.upstreams.release(upstream, clean=False)
            return
        self._connected(attempt)
        if upstream is None:
            attempt.connect_failed(failure)
        else:
            attempt.begin(upstream)
        self._settle()

    # -- upstream sockets (`AttemptHost`) --------------------------------------

    def attach(self, attempt: UpstreamAttempt, upstream: Upstream) -> RawStream:
        entry = self.held.pop(upstream, None)
        if entry is None:
            raw = upstream_socket(upstream)
        else:
            raw, _ = entry
            del self.held_fds[raw.fd]
        self.by_fd[raw.fd] = attempt
        self.dirty[attempt] = None
        return raw

    def detach(self, attempt: UpstreamAttempt, raw: RawStream) -> None:
        if raw.interest is not None:
            self.reactor.unregister(raw.fd)
            raw.interest = None
        del self.by_fd[raw.fd]
        self.dirty.pop(attempt, None)

    def interest_changed(self, attempt: UpstreamAttempt) -> None:
        self.dirty[attempt] = None

    def hold(
        self, attempt: UpstreamAttempt, upstream: Upstream, raw: RawStream
    ) -> bool:
        """Keep a clean upstream connection for the next requests, its
        socket registered: no pool round trip, no re-registration, and the
        reactor tells if the server closes it meanwhile."""
        held = self.held
        state = self.state
        if (
            self.upstreams.proxy_header is not None
            or len(held) >= self.max_held
            or state is CLOSING
            or state is DONE
        ):
            return False
        del self.by_fd[raw.fd]
        self.dirty.pop(attempt, None)
        self.upstreams.hold(upstream)
        now = self.now()
        # Parked once the client has had no request for PARK_AFTER; the
        # timer then also sees the oldest one's idle timeout.
        park = now + PARK_AFTER
        if park < self.armed:
            self.arm(park)
        held[upstream] = (raw, now)
        self.held_fds[raw.fd] = upstream
        if raw.interest != READABLE:
            self._watch(raw, READABLE)
        return True

    def _oldest_held(self) -> float:
        """Since when the oldest held connection is idle (some is held)."""
        _, since = next(iter(self.held.values()))
        return since

    def _drop_held(self, upstream: Upstream, *, close: bool) -> None:
        """Stop holding *upstream*: closed, or to the shared pool."""
        raw, _ = self.held.pop(upstream)
        del self.held_fds[raw.fd]
        if raw.interest is not None:
            self.reactor.unregister(raw.fd)
            raw.interest = None
        raw.detach()
        if close:
            close_now(upstream.stream)
        else:
            self.upstreams.park_held(upstream)

    def _park_held(self) -> None:
        """The client has had no request for `PARK_AFTER` (or ended): the
        held upstream connections go to the shared pool."""
        for upstream in list(self.held):
            self._drop_held(upstream, close=False)
        # An idle connection keeps empty tables small (emptied, a dict keeps
        # its table until cleared).
        self.held.clear()
        self.held_fds.clear()
        if not self.by_fd:
            self.by_fd.clear()

    def _expire_held(self) -> None:
        """The oldest held connection was idle for the pool's idle timeout,
        as one in the pool would be: closed."""
        self._drop_held(next(iter(self.held)), close=True)

    # -- the end ---------------------------------------------------------------

    def _end(self, termination: str, detail: str | None = None) -> None:
        """Why the connection ends: the first cause recorded stands."""
        result = self.result
        if result.termination == Termination.UNKNOWN:
            result.termination = termination
            result.detail = detail

    def _cut_short(self, log: RequestLog) -> None:
        """*log*'s request is still open as the connection ends. Unless it
        has a cause of its own, it is ``drained`` when the edge ended it (a
        drain, or no cause recorded: the edge was cancelled),
        ``internal_error`` after a bug, else ``client_error``."""
        if log.termination != Termination.OK:
            return
        cause = self.result.termination
        if self.site.drain.is_set() or cause in _EDGE_ENDED:
            log.termination = Termination.DRAINED
        elif cause == Termination.INTERNAL_ERROR:
            log.termination = cause
        else:
            log.termination = Termination.CLIENT_ERROR
        log.detail = "the connection ended before the response did"

    def _finish(self) -> None:
        """The connection is over: every request ended and logged, every
        upstream socket let go (closed unless clean), nothing registered,
        then *on_done*. Its owner closes the client."""
        if self.state is DONE:
            return
        assert DONE in self.TRANSITIONS[self.state]
        try:
            self._end_requests()  # the last one's end may finish us
        finally:
            if not self.ended():
                self.state = DONE
                try:
                    self.timer.cancel()
                    self.site.drain.forget(self._drained)
                    client = self.client
                    if client.interest is not None:
                        self.reactor.unregister(client.fd)
                        client.interest = None
                    self._park_held()
                finally:
                    self.client.detach()
                    self.upstreams.close()
                    result = self.result
                    if result.termination == Termination.UNKNOWN:
                        # The one place an ending without a cause is
                        # decided: the drain deadline cancelled it.
                        result.termination = Termination.DRAINED
                    self.on_done(result)
