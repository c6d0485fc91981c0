"""One client connection, stage by stage, in the order they run.

Theory of operation
-------------------
The edge's accept loop hands each accepted socket to `Pipeline.accepted`
(stage *accept*: count it, start its access-log record, its exit stack), and
the connection then goes through its stages (docs/architecture.md), one
module each, data flowing forward only::

    accept -> unwrap -> admit -> handshake -> serve (tcp | http) -> close

    unwrap      the PROXY header (`tlsedge._pipeline.unwrap`), read on the reactor
    admit       the listener's allow/deny networks judge the real client
                (`tlsedge._core.admission`)
    handshake   the client's TLS handshake (`tlsedge._pipeline.handshake`), on the
                reactor
    serve       tcp: a server, our PROXY header, the relay
                (`tlsedge._pipeline.tcp`); http: the HTTP/1.1 or HTTP/2 driver
                (`tlsedge._pipeline.http`)
    close       how it ended, its metrics and access-log line
                (`tlsedge._pipeline.close`), from the connection's exit stack

Every stage has the same contract (`Stage`): it takes the `Connection`,
records what it found there (the unwrapped addresses, a denial, the TLS
stream and facts, the bytes read past its own data), and says how the
connection goes on (`Step`): `Next.STAGE` (the next stage, now),
`Next.PARKED` (it runs on the reactor with no task, and its end goes on
with the next stage: `Pipeline._on_reactor`), `Next.DONE` (the relay or the HTTP
driver took the connection over, or it ended), or a `Wait`: what must await
(finishing a backend connect, reading the h2c preface, answering 403), which
the connection's task runs to the end. A stage refuses a connection by
raising `Refused`; a stage on the reactor hands its refusal to its end as a
value (a reactor callback cannot raise to anyone). Both go to one place,
`tlsedge._pipeline.close.failed`, and the connection's exit stack then closes its
socket and writes its line. A connection gets a task only for a `Wait`: a
tcp-mode connection to a loopback backend goes from ``accept()`` to the
reactor's relay in the accept loop's call.

Bytes a stage read past its own data (what followed a PROXY header) go to the
next stage as its ``initial_data``, whatever that stage is
(`Connection.leftover`). What the stages learnt about the client is one
frozen `Downstream` record, built for the serve stage.

`InFlight` holds what runs on the reactor with no task while it is not yet
a relay: PROXY header reads, handshakes, HTTP connections (and an h2c
preface read in a task): drain waits for them within the connections'
deadline, then ends the rest (a stage ended so goes on with nothing: the
connection closes as ``drained``). Relays are the edge's `DetachedRelays`.
"""

from __future__ import annotations

import enum
import functools
import os
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeAlias, TypeVar

import trio

from proxyproto import TrustPolicy
from tlsedge._backends.keepalive import KeepAlivePool
from tlsedge._backends.upstream import BackendPool, set_stream_options
from tlsedge._core.accesslog import ConnectionLog, format_address
from tlsedge._core.admission import AccessRules
from tlsedge._core.cleanup import Cleanup
from tlsedge._core.config import ListenerConfig
from tlsedge._core.downstream import Downstream, SSLFacts
from tlsedge._core.metrics import EdgeMetrics
from tlsedge._core.proxy_wrap import proxy_header_for
from tlsedge._core.termination import Refused, Termination
from tlsedge._http.log import HttpConnectionResult
from tlsedge._pipeline.close import closed, failed, settle_health_check
from tlsedge._pipeline.handshake import ReactorHandshake
from tlsedge._pipeline.http.h1 import http_connection
from tlsedge._pipeline.http.h2 import h2_connection, sniff_preface
from tlsedge._pipeline.http.site import HttpSite
from tlsedge._pipeline.tcp import serve_tcp, serve_tcp_now
from tlsedge._pipeline.unwrap import ReactorHeaderRead, Unwrapped
from tlsedge._reactor.drain import Drain
from tlsedge._reactor.relay import DetachedRelays
from tlsedge._tls.contexts import ServerTLS
from tlsedge._tls.stream import TLSStream

__all__ = [
    "INHERITED_TCP_OPTIONS",
    "Connection",
    "InFlight",
    "ListenerState",
    "Pipeline",
    "socket_address",
]


# The answer of ``denied = "403"``, and how long (and how many bytes) the
# client may go on sending before the close; see `_answer_forbidden`.
_FORBIDDEN = (
    b"HTTP/1.1 403 Forbidden\r\n"
    b"Content-Type: text/plain\r\n"
    b"Content-Length: 10\r\n"
    b"Connection: close\r\n"
    b"\r\n"
    b"Forbidden\n"
)
_DENIED_LINGER = 2.0
_DENIED_LINGER_BYTES = 65536

# Linux gives an accepted socket the TCP options of its listening socket.
INHERITED_TCP_OPTIONS = sys.platform == "linux"

# Connection ids: 64 random bits, 16 hex digits. From a generator seeded from
# os.urandom (again in a forked child): unique and unguessable enough for logs
# and the PROXY header's unique id, without a getrandom() syscall each.
_IDS = random.Random()  # noqa: S311 (not a secret)
os.register_at_fork(after_in_child=_IDS.seed)


def _connection_id() -> str:
    """A new connection's id: 16 hex digits."""
    return f"{_IDS.getrandbits(64):016x}"


@dataclass(frozen=True, slots=True)
class ListenerState:
    """What a new connection on a listener is served with; replaced on reload,
    so a connection keeps the settings it started with."""

    config: ListenerConfig
    trust: TrustPolicy | None
    tls: ServerTLS | None
    access: AccessRules | None  # None: no allow or deny networks
    #: What its HTTP connections are served with (`Pipeline.http_site`;
    #: None: not an HTTP listener).
    site: HttpSite | None = None


@dataclass(slots=True)
class Connection:
    """One client connection while its stages run: what it was accepted
    with, then what each stage found, in the order they run."""

    state: ListenerState
    pool: BackendPool
    #: The accepted socket.
    raw: socket.socket
    peer: tuple[str, int] | None
    local: tuple[str, int] | None
    log: ConnectionLog
    #: What the connection gives back when it ends (its socket, an
    #: upstream, a server's lease, its slots; the last to run: `closed`).
    exits: Cleanup
    #: The index of the next stage to run (`Pipeline._run`).
    stage: int = 0
    #: unwrap: the real client and where it connected.
    unwrapped: Unwrapped | None = None
    #: admit: the refusal to answer after TLS (``denied = "403"``).
    denial: Refused | None = None
    #: handshake: the client as the serve stage reads it (the accepted
    #: socket, or its TLS stream), and what TLS negotiated.
    client: trio.abc.Stream | socket.socket | None = None
    tls: SSLFacts | None = None
    #: Client bytes a stage read past its own data, for the next one.
    leftover: bytes = b""


class Next(enum.Enum):
    """How a stage lets the connection go on (besides a `Wait`)."""

    STAGE = "stage"
    """Run the next stage now."""
    PARKED = "parked"
    """The stage runs on the reactor; its end goes on (`Pipeline._on_reactor`)."""
    DONE = "done"
    """Taken over (by the relay, the HTTP driver) or ended: close what the
    connection's exit stack still holds."""


#: What must await, run by the connection's task to the connection's end.
Wait: TypeAlias = Callable[[], Awaitable[None]]
#: What a stage says: how the connection goes on.
Step: TypeAlias = Next | Wait
#: A stage: records what it found in the connection, says how it goes on.
Stage: TypeAlias = Callable[[Connection], Step]

#: What a reactor stage finds (`Pipeline._on_reactor`).
_T = TypeVar("_T")


class _Running(Protocol):
    """Something running on the reactor with no task (`ReactorHeaderRead`,
    `ReactorHandshake`, an HTTP connection), that drain can end."""

    def start(self) -> None: ...
    def drain(self) -> None: ...


class InFlight:
    """What runs on the reactor with no task, so that drain can wait for it
    and end the rest."""

    def __init__(self) -> None:
        self._running: set[_Running] = set()
        self._empty = trio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._running)

    def __iter__(self) -> Iterator[_Running]:
        return iter(self._running)

    def start(self, running: _Running) -> None:
        """Start *running*, whose end (maybe before this returns) calls `ended`."""
        if not self._running:
            self._empty = trio.Event()
        self._running.add(running)
        running.start()

    def ended(self, running: _Running) -> None:
        self._running.discard(running)
        if not self._running:
            self._empty.set()

    async def wait_empty(self) -> None:
        """Wait until nothing started here runs. (One end may start the next
        stage of its connection: that one is waited for too.)"""
        while self._running:
            await self._empty.wait()

    def drain_all(self) -> None:
        """End everything still running."""
        for running in list(self._running):
            running.drain()


class _Sniffing:
    """An h2c preface read in a task, in flight: drain waits for it, and at
    the deadline cancels it."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()

    def start(self) -> None:
        """Nothing to start: the task runs it."""

    def drain(self) -> None:
        self.scope.cancel()


def socket_address(address: object) -> tuple[str, int] | None:
    """A socket address as ``(host, port)`` (None: not an IP address)."""
    if isinstance(address, tuple) and len(address) >= 2:
        return (str(address[0]), int(address[1]))
    return None


def _admission(state: ListenerState, unwrapped: Unwrapped) -> Refused | None:
    """The refusal of a client the listener's ``allow``/``deny`` networks deny.

    A connection whose trusted PROXY header names no client (LOCAL, v1
    UNKNOWN) is the load balancer's own (its health check): admitted, as its
    peer is in ``proxy_protocol.trusted`` and could name any source anyway.
    """
    if state.access is None or unwrapped.health_check:
        return None
    client = unwrapped.client
    verdict = state.access.check(None if client is None else client[0])
    if verdict.admitted:
        return None
    return Refused(Termination.DENIED, verdict.reason)


def _downstream(conn: Connection) -> Downstream:
    """What the stages learnt about the client, once admitted (and the
    backend it goes to, in the log)."""
    log = conn.log
    config = conn.state.config
    unwrapped = conn.unwrapped
    assert unwrapped is not None  # the unwrap stage ran
    log.backend = config.backend
    return Downstream(
        id=log.id,
        listener=config.name,
        peer=conn.peer,
        client=unwrapped.client,
        destination=unwrapped.destination,
        health_check=unwrapped.health_check,
        tls=conn.tls,
    )


async def _answer_forbidden(
    client: trio.abc.HalfCloseableStream, log: ConnectionLog
) -> None:
    """Answer a denied HTTP client 403 and close (``denied = "403"``).

    No request is parsed: the answer goes out at once, then what the client
    still sends (its request) is read and dropped until it closes, for up to
    `_DENIED_LINGER` s: closing with unread bytes would reset the connection,
    and the reset can destroy the answer before the client read it.
    """
    with trio.move_on_after(_DENIED_LINGER):
        try:
            await client.send_all(_FORBIDDEN)
            log.bytes_from_server = len(_FORBIDDEN)
            await client.send_eof()
            while log.bytes_from_client < _DENIED_LINGER_BYTES:
                chunk = await client.receive_some(_DENIED_LINGER_BYTES)
                if not chunk:
                    break
                log.bytes_from_client += len(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went first: nothing more to say to it


def _http_ended(
    log: ConnectionLog, downstream: Downstream, result: HttpConnectionResult
) -> None:
    """Fill an HTTP-mode connection's log from its *result*."""
    log.bytes_from_client = result.bytes_from_client
    log.bytes_from_server = result.bytes_to_client
    log.server = result.server
    log.requests = result.requests
    log.termination = result.termination
    log.detail = result.detail
    settle_health_check(log, health_check=downstream.health_check)


class Pipeline:
    """Runs the stages of every connection the edge accepts.

    Attributes:
        active: The connections accepted and not ended yet.
        in_flight: What runs on the reactor with no task (not relays).
        nursery: Where connections' tasks and the HTTP connections' jobs
            run (the edge's connections nursery, set while it runs).
    """

    def __init__(
        self,
        *,
        metrics: EdgeMetrics,
        relays: DetachedRelays,
        edge_limiter: trio.CapacityLimiter,
        drain: Drain,
        keepalive: Callable[[str], KeepAlivePool],
    ) -> None:
        """
        Args:
            metrics: The edge's metrics.
            relays: The edge's relays on the reactor (tcp mode's end).
            edge_limiter: The edge's ``max_connections`` slots.
            drain: Set when the edge drains (HTTP connections close).
            keepalive: The idle upstream HTTP connections of a backend.
        """
        self.in_flight = InFlight()
        self.active = 0
        self.nursery: trio.Nursery | None = None
        self._metrics = metrics
        self._relays = relays
        self._edge_limiter = edge_limiter
        self._drain = drain
        self._keepalive = keepalive
        #: The stages after accept, in the order they run.
        self._stages: tuple[Stage, ...] = (
            self._unwrap,
            self._admit,
            self._handshake,
            self._serve,
        )

    # -- accept ------------------------------------------------------------

    def accepted(  # noqa: PLR0917
        self,
        state: ListenerState,
        pool: BackendPool,
        limiter: trio.CapacityLimiter,
        token: object,
        raw: socket.socket,
        peer_address: object,
        local: tuple[str, int] | None,
    ) -> None:
        """Take charge of an accepted connection (holding *token*'s slots of
        *limiter* and the edge's): count it, then run its stages.

        Everything the stages open or take (the client's socket, an upstream's
        socket, a server's lease, the connection slots) is given back by the
        connection's exit stack, whichever way it ends; its first callback,
        the last to run, is the close (`_closed`).
        """
        # accept() told us who the peer is: no getpeername() (which also fails
        # once the peer reset the connection, as HAProxy's health checks do).
        peer = socket_address(peer_address)
        if local is None:  # a wildcard bind: where did this client connect?
            try:
                local = socket_address(raw.getsockname())
            except OSError:
                local = None
        log = ConnectionLog(
            id=_connection_id(),
            listener=state.config.name,
            peer=format_address(peer),
            start=time.time(),
        )
        # The stages read and relay from the socket itself (which has the
        # listener's TCP options where they are inherited), also under TLS:
        # its handshake runs on the socket itself.
        raw.setblocking(False)
        if not INHERITED_TCP_OPTIONS:
            set_stream_options(raw)
        conn = Connection(state, pool, raw, peer, local, log, Cleanup())
        self.active += 1
        self._metrics.connection_opened(log.listener)
        conn.exits.callback(
            functools.partial(self._closed, log, trio.current_time(), limiter, token)
        )
        # The client's socket, whatever stages wrap it (closing the wrappers
        # could send nothing more: the connection is over).
        conn.exits.callback(raw.close)
        self._run(conn)

    # -- running the stages --------------------------------------------------

    def _run(self, conn: Connection) -> None:
        """Run *conn*'s stages from the next one on, until one parks it on
        the reactor, hands it over, ends it, or must wait (in a task)."""
        step: Step = Next.STAGE
        try:
            while step is Next.STAGE:
                stage = self._stages[conn.stage]
                conn.stage += 1
                step = stage(conn)
        except Exception as exc:  # noqa: BLE001 (a Refused, or logged as a bug)
            failed(conn.log, exc, self._metrics)
            step = Next.DONE
        except BaseException:
            conn.exits.close()
            raise
        if isinstance(step, Next):  # PARKED (the reactor has it) or DONE
            if step is Next.DONE:
                conn.exits.close()
            return
        assert self.nursery is not None
        try:
            self.nursery.start_soon(self._wait_in_task, conn, step)
        except BaseException:
            conn.exits.close()
            raise

    async def _wait_in_task(self, conn: Connection, wait: Wait) -> None:
        """Run what *conn* waits for, then close it. (Cancelled at the drain
        deadline: it ends with no cause recorded, ``drained``.)"""
        with conn.exits:
            try:
                await wait()
            except Exception as exc:  # noqa: BLE001 (a Refused, or logged as a bug)
                failed(conn.log, exc, self._metrics)

    def _on_reactor(
        self,
        conn: Connection,
        make: Callable[[Callable[[_T | Exception | None], None]], _Running],
        found: Callable[[Connection, _T], None],
    ) -> Step:
        """Park *conn* on a reactor stage (*make* builds it around its end's
        callback). Its end records what it *found* and goes on with the next
        stage (`_run`); a refusal (or a bug) ends the connection, and so does
        None (the edge stopped: ``drained``)."""

        def ended(result: _T | Exception | None) -> None:
            self.in_flight.ended(running)
            if result is None:
                conn.exits.close()
            elif isinstance(result, Exception):
                failed(conn.log, result, self._metrics)
                conn.exits.close()
            else:
                found(conn, result)
                self._run(conn)

        running = make(ended)
        self.in_flight.start(running)
        return Next.PARKED

    def _closed(
        self,
        log: ConnectionLog,
        started: float,
        limiter: trio.CapacityLimiter,
        token: object,
    ) -> None:
        """The connection's end, whichever way it went: its slots back, then
        `closed`."""
        self.active -= 1
        limiter.release_on_behalf_of(token)
        self._edge_limiter.release_on_behalf_of(token)
        closed(log, self._metrics, trio.current_time() - started)

    # -- the stages, in the order they run -----------------------------------

    def _unwrap(self, conn: Connection) -> Step:
        """The PROXY header of a trusted load balancer (``proxy_protocol``),
        read on the reactor; without one, the socket's endpoints."""
        trust, settings = conn.state.trust, conn.state.config.proxy_protocol
        if settings is None or trust is None:
            conn.unwrapped = Unwrapped(
                client=conn.peer,
                destination=conn.local,
                health_check=False,
                leftover=b"",
            )
            return Next.STAGE
        return self._on_reactor(
            conn,
            lambda on_done: ReactorHeaderRead(
                conn.raw,
                trust=trust,
                settings=settings,
                peer=conn.peer,
                local=conn.local,
                on_done=on_done,
            ),
            _unwrapped,
        )

    def _admit(self, conn: Connection) -> Step:
        """Judge the real client (and log who it is). A denied client is
        refused here, before TLS (it gets no ServerHello), or with
        ``denied = "403"`` answered after TLS (`_serve_http`)."""
        unwrapped = conn.unwrapped
        assert unwrapped is not None  # the unwrap stage ran
        log = conn.log
        log.client = format_address(unwrapped.client)
        log.destination = format_address(unwrapped.destination)
        denial = _admission(conn.state, unwrapped)
        if denial is not None and conn.state.config.denied == "close":
            raise denial
        conn.denial = denial
        return Next.STAGE

    def _handshake(self, conn: Connection) -> Step:
        """The client's TLS handshake (``[listeners.tls]``), on the reactor,
        from the bytes that came after the PROXY header; without TLS, the
        client is its socket."""
        state = conn.state
        if state.tls is None or state.config.tls is None:
            conn.client = conn.raw
            return Next.STAGE
        server_tls, timeout = state.tls, state.config.tls.handshake_timeout
        initial_data, conn.leftover = conn.leftover, b""
        unwrapped = conn.unwrapped
        assert unwrapped is not None  # the unwrap stage ran
        return self._on_reactor(
            conn,
            lambda on_done: ReactorHandshake(
                conn.raw,
                server_tls,
                initial_data=initial_data,
                handshake_timeout=timeout,
                health_check=unwrapped.health_check,
                on_done=on_done,
            ),
            _handshaken,
        )

    def _serve(self, conn: Connection) -> Step:
        """The listener's mode: tcp or http."""
        downstream = _downstream(conn)
        if conn.state.config.mode == "http":
            return self._serve_http(conn, downstream)
        return self._serve_tcp(conn, downstream)

    # -- serve: tcp ------------------------------------------------------------

    def _serve_tcp(self, conn: Connection, downstream: Downstream) -> Step:
        """tcp mode (`tlsedge._pipeline.tcp`): as far as it goes without waiting
        (a loopback backend: all the way to the relay), then in a task."""
        client = conn.client
        assert client is not None  # the handshake stage ran
        # The socket under the client's stream, TLS or not (a client given
        # as its socket is relayed as it is).
        client_socket = None if client is conn.raw else conn.raw
        begun = serve_tcp_now(
            client,
            downstream,
            pool=conn.pool,
            listener=conn.state.config,
            initial_data=conn.leftover,
            log=conn.log,
            exits=conn.exits,
            relays=self._relays,
            metering=self._metrics.metering,
            client_socket=client_socket,
        )
        if begun is None:
            return Next.DONE
        return functools.partial(
            serve_tcp,
            client,
            downstream,
            pool=conn.pool,
            listener=conn.state.config,
            initial_data=conn.leftover,
            log=conn.log,
            exits=conn.exits,
            relays=self._relays,
            metering=self._metrics.metering,
            client_socket=client_socket,
            begun=begun,
        )

    # -- serve: http -----------------------------------------------------------

    def _serve_http(self, conn: Connection, downstream: Downstream) -> Step:
        """HTTP mode: the connection goes to the reactor (`_start_http`),
        except a client to answer 403 and one that may open with the h2c
        preface: their task goes on."""
        client = conn.client
        if isinstance(client, socket.socket):
            client = trio.SocketStream(trio.socket.from_stdlib_socket(client))
        assert client is not None  # the handshake stage ran
        if conn.denial is not None:
            return functools.partial(
                self._answer_denied, conn, client, conn.leftover, conn.denial
            )
        if downstream.tls is None and conn.state.config.h2_cleartext:
            return functools.partial(
                self._sniff_then_serve, conn, client, downstream, conn.leftover
            )
        h2 = downstream.tls is not None and downstream.tls.alpn == "h2"
        self._start_http(conn, client, downstream, conn.leftover, h2=h2)
        return Next.DONE

    async def _answer_denied(
        self,
        conn: Connection,
        client: trio.abc.Stream,
        leftover: bytes,
        denial: Refused,
    ) -> None:
        """``denied = "403"``: refuse the client, then answer it. (Refused
        first: a drain deadline or a stop that cuts the answer's linger
        leaves the connection ``denied``, not ``drained``.)"""
        assert isinstance(client, trio.abc.HalfCloseableStream)
        conn.log.bytes_from_client = len(leftover)
        refusal = Refused(denial.termination, f"{denial.detail}; answered 403")
        failed(conn.log, refusal, self._metrics)
        await _answer_forbidden(client, conn.log)

    async def _sniff_then_serve(
        self,
        conn: Connection,
        client: trio.abc.Stream,
        downstream: Downstream,
        leftover: bytes,
    ) -> None:
        """Read a plain client's first bytes until they are, or cannot be,
        the h2c preface, then `_start_http`. Drain waits for it (and cancels
        it at the deadline) among what is in flight."""
        sniffing = _Sniffing()
        self.in_flight.start(sniffing)
        try:
            with sniffing.scope:
                is_h2, leftover = await sniff_preface(
                    client,
                    leftover,
                    header_timeout=conn.state.config.http.request_header_timeout,
                )
                # In flight before the sniff leaves.
                self._start_http(conn, client, downstream, leftover, h2=is_h2)
        finally:
            self.in_flight.ended(sniffing)

    def _start_http(
        self,
        conn: Connection,
        client: trio.abc.Stream,
        downstream: Downstream,
        leftover: bytes,
        *,
        h2: bool,
    ) -> None:
        """Start serving HTTP/1.x (`tlsedge._pipeline.http.h1`) or HTTP/2
        (`tlsedge._pipeline.http.h2`: ALPN ``h2``, or the h2c preface) on the
        reactor, with no task: what must await runs in a task of the
        nursery. Its end takes over what the connection gives back
        (`_http_ended`). The metrics read its byte counts while it runs
        (`HttpConnectionResult.traffic`)."""
        assert self.nursery is not None
        site = conn.state.site
        assert site is not None  # an HTTP listener
        backend = site.backend.config
        build = h2_connection if h2 else http_connection
        log = conn.log
        result = HttpConnectionResult()

        def ended(result: HttpConnectionResult) -> None:
            self.in_flight.ended(connection)
            with owned:
                _http_ended(log, downstream, result)

        connection = build(
            client,
            downstream,
            site,
            proxy_header=proxy_header_for(
                downstream, backend.send_proxy, backend.proxy_tlvs
            ),
            spawn=self.nursery.start_soon,
            on_done=ended,
            result=result,
            initial_data=leftover,
        )
        owned = conn.exits.pop_all()
        self._metrics.metering(log, result)
        try:
            self.in_flight.start(connection)
        except BaseException:
            conn.exits.callback(owned.close)  # nothing started: the owner cleans up
            raise

    def http_site(self, listener: ListenerConfig, backend: BackendPool) -> HttpSite:
        """What every HTTP connection of *listener* is served with, its
        requests going to *backend* (made once per listener, and again
        when a reload changes it: `ListenerState.site`)."""
        return HttpSite(
            listener=listener,
            backend=backend,
            keepalive=self._keepalive(backend.name),
            drain=self._drain,
            on_request=self._metrics.http_requests(listener.name, backend.name).record,
        )


def _unwrapped(conn: Connection, unwrapped: Unwrapped) -> None:
    """What the unwrap stage found on the reactor."""
    conn.unwrapped = unwrapped
    conn.leftover = unwrapped.leftover


def _handshaken(conn: Connection, result: tuple[TLSStream, SSLFacts]) -> None:
    """What the handshake stage found on the reactor."""
    client, tls = result
    conn.client, conn.tls = client, tls
    # One string per version and cipher, not one per connection.
    conn.log.tls = sys.intern(f"{tls.version} {tls.cipher}")
    conn.log.sni = tls.server_name
