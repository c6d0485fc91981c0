"""The edge: listeners, the per-connection pipeline, drain and reload.

Theory of operation
-------------------
``Edge.run()`` owns two nurseries. The *services* nursery runs the accept loops
and the backends' health checks; the *connections* nursery runs the tasks of
client connections that must wait for something (below), the jobs of HTTP
connections that must await (an upstream connect, an ``Upgrade`` relay), and
the task of each ``mode = "udp"`` listener, which lasts as long as its flows
(they run on the reactor: `tlsedge._pipeline.udp`). Splitting them is what makes
drain work: ``drain()`` closes the listening sockets (new connections are
refused by the kernel, not left hanging), the accept loops end, and the
connections nursery gets a deadline of ``drain_timeout``. Connections that
finish before it end normally; those still open are cancelled at the deadline
and logged as ``drained``. ``run()`` returns once the last connection has gone.
A tcp-mode connection's task ends once its relay runs on the reactor
(`tlsedge._reactor.relay.DetachedRelays`): ``run()`` waits for those relays with the
same deadline, then ends the rest the same way. PROXY header reads, TLS
handshakes and HTTP connections on the reactor (``Edge._http``) are waited for
within the connections' deadline (one may still need a task of that nursery),
then ended as ``drained``.

A connection gets no task where none is needed: the accept loop runs the stages
itself (`Edge._accepted`, `Edge._serve_now`), and a tcp-mode connection goes
straight from ``accept()`` to the reactor when its backend connect completes
within ``connect()`` (loopback, a fast network). Its sockets stay stdlib
sockets: no trio stream is built for them. With ``proxy_protocol`` the reactor
reads the header first (`tlsedge._pipeline.unwrap.ReactorHeaderRead`, held in
``Edge._header_reads`` for drain) and its end goes on with admission
(`Edge._admit_now`); with TLS the client's handshake runs on the reactor next,
from the bytes that came after the header
(`tlsedge._pipeline.handshake.ReactorHandshake`, held in ``Edge._handshakes``), and its
end goes on the same way (`Edge._handshaken`). Only where something must wait
(a connect in progress, a retry, a send that would block) does a task go on
from where the reactor or the accept loop stopped (`Edge._handle_connection`).
An http-mode listener reads the PROXY header and runs the handshake the same
way, then starts the HTTP/1.1 or HTTP/2 driver on the reactor with no task
(`Edge._start_http`): its end fills the connection's log and closes it, and
only its jobs that must await get a task, while they do. A task remains for
a client denied with ``denied = "403"`` (it answers it) and, on a listener
serving h2c with prior knowledge, for reading a plain client's first bytes
until they tell HTTP/2 from HTTP/1.1 (`Edge._sniff_then_serve`).

Each accept loop waits for a client, takes a slot from the listener's and the
edge's ``max_connections`` limiters, then accepts: at the limit it simply stops
accepting, and the kernel's backlog holds new clients (HAProxy's behaviour)
instead of resetting them. (Taking the slots before a client is there would let
idle accept loops hold slots that connections on other listeners need.)

One connection goes through the stages of DESIGN.md section 2, one module
each, data flowing forward only:

  accept (here) -> PROXY unwrap (`tlsedge._pipeline.unwrap`: policy from the peer
  address, header within ``proxy_protocol.timeout``) -> admission (the
  listener's ``allow``/``deny`` networks judge the real client,
  `tlsedge._core.admission`; a denied client is closed here, or answered 403 after
  TLS with ``denied = "403"``) -> TLS (`tlsedge._pipeline.handshake`) -> the mode:
  tcp (`tlsedge._pipeline.tcp`: connect a server, send our PROXY header, hand
  the relay to the reactor) or http (`tlsedge._http`) -> close: one
  access-log line with the termination cause.

Bytes a stage read past its own data (what followed a PROXY header) go to the
next stage as its ``initial_data``, whatever that stage is. A stage that
refuses the connection raises `Refused` with a `Termination`; the owner
(`Edge._handle_connection`) logs it. The owner's exit stack closes the client's
socket and whatever the stages registered (an upstream, a server's lease) and
writes the access-log line, however the connection ends. What the stages learnt
about the client is one frozen `Downstream` record.

Reload swaps the configuration object the accept loops read at each accept, so
existing connections keep the settings they started with. It has two steps:
``Edge.prepare_reload`` does everything that can fail (resolve the backends,
load certificates, bind new listeners and a moved ``edge.admin``) and changes
nothing the edge serves with; `PreparedReload.commit` swaps it in and cannot
fail, `PreparedReload.abort` closes what was opened. A supervisor prepares a
reload in every worker before it commits it in any (`tlsedge._control.workers`).

Whatever reports on the edge reads ``Edge.snapshot()``: frozen records
(`tlsedge._core.snapshot`) copied from the listeners, pools and health state at one
instant. The admin endpoint and the metrics' live collector are given the
``snapshot`` method, never the edge, so they cannot reach into it (and they
import nothing from this module).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import math
import os
import random
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import trio

from proxyproto import Policy, TrustPolicy
from tlsedge._backends.keepalive import KeepAlivePool
from tlsedge._backends.preflight import load_listener_tls
from tlsedge._backends.upstream import (
    BackendPool,
    Connected,
    Opening,
    PoolUpdate,
    set_stream_options,
)
from tlsedge._control.admin import AdminServer, bind_admin
from tlsedge._control.logs import run_access_log_flusher
from tlsedge._core.accesslog import ConnectionLog, format_address
from tlsedge._core.admission import AccessRules
from tlsedge._core.cleanup import Cleanup
from tlsedge._core.config import Config, ConfigError, ListenerConfig
from tlsedge._core.downstream import Downstream, SSLFacts
from tlsedge._core.metrics import EdgeMetrics
from tlsedge._core.proxy_wrap import proxy_header_for
from tlsedge._core.snapshot import (
    BackendSnapshot,
    CheckRecord,
    HealthCheckSettings,
    ListenerSnapshot,
    ListenerTls,
    ProxyProtocolSettings,
    ServerSnapshot,
    Snapshot,
)
from tlsedge._core.termination import Refused, Termination
from tlsedge._http.log import HttpConnectionResult, RequestLog
from tlsedge._pipeline.handshake import HandshakeResult, ReactorHandshake
from tlsedge._pipeline.http.h1 import http_connection
from tlsedge._pipeline.http.h2 import h2_connection, sniff_preface
from tlsedge._pipeline.tcp import serve_tcp, serve_tcp_now
from tlsedge._pipeline.udp import UdpListener
from tlsedge._pipeline.unwrap import (
    ReactorHeaderRead,
    Unwrapped,
)
from tlsedge._reactor.drain import Drain
from tlsedge._reactor.listen import open_datagram_sockets, open_listening_sockets
from tlsedge._reactor.loop import current_reactor
from tlsedge._reactor.relay import DetachedRelays
from tlsedge._tls.contexts import ServerTLS, watch_certificates
from tlsedge._tls.stream import TLSStream
from tlsedge._version import __version__

__all__ = ["Edge", "PreparedReload", "serve"]

LOGGER = logging.getLogger("tlsedge.server")

# accept() errors that mean "out of resources right now": wait and retry
# instead of dying (trio.serve_listeners does the same).
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_ACCEPT_RETRY_DELAY = 0.1
# Clients accepted per wake-up at most (HAProxy's tune.maxaccept idea): a
# burst costs one scheduler round trip, and other tasks still run between.
_ACCEPT_BATCH = 64
# Ask for the largest accept queue; the kernel caps it at net.core.somaxconn.
_LISTEN_BACKLOG = 65535
# How an HTTP connection ends when the client goes first; see ``health_check``.
_CLIENT_ENDED = frozenset({Termination.CLIENT_CLOSED, Termination.CLIENT_ERROR})

# Refusals logged above INFO (the backend's trouble) or not at all (0): a load
# balancer's check, a client that went away while sending its PROXY header.
_REFUSAL_LOG_LEVELS = {
    Termination.NO_SERVER: logging.WARNING,
    Termination.CONNECT_FAILED: logging.WARNING,
    Termination.HEALTH_CHECK: 0,
    Termination.CLIENT_ERROR: 0,
}


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


@dataclass(frozen=True, slots=True)
class _ListenerState:
    """What a new connection on a listener is served with; replaced on reload,
    so a connection keeps the settings it started with."""

    config: ListenerConfig
    trust: TrustPolicy | None
    tls: ServerTLS | None
    access: AccessRules | None  # None: no allow or deny networks


@dataclass(slots=True)
class _Listener:
    """A configured listener at run time: its sockets and current settings."""

    state: _ListenerState
    sockets: list[trio.socket.SocketType]
    limiter: trio.CapacityLimiter
    #: The bound ``(host, port)`` of each socket, read once when bound (a
    #: closed socket, after a drain, has no address to ask for).
    addresses: list[tuple[str, int]]
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: A ``mode = "udp"`` listener's flows, once started.
    udp: UdpListener | None = None

    @property
    def config(self) -> ListenerConfig:
        return self.state.config

    def snapshot(self) -> ListenerSnapshot:
        """What the status page and metrics show of this listener."""
        config = self.config
        pp = config.proxy_protocol
        return ListenerSnapshot(
            name=config.name,
            mode=config.mode,
            backend=config.backend,
            bind=str(config.bind),
            addresses=tuple(self.addresses),
            max_connections=config.max_connections,
            connections=self.limiter.borrowed_tokens,
            tls=None
            if config.tls is None
            else ListenerTls(
                policy=config.tls.policy, client_auth=config.tls.client_auth
            ),
            proxy_protocol=None
            if pp is None
            else ProxyProtocolSettings(
                versions=tuple(sorted(pp.versions)), untrusted=pp.untrusted
            ),
        )


def _backend_snapshot(pool: BackendPool, now: float) -> BackendSnapshot:
    """What the status page and metrics show of a backend, at *now* (the
    health clock, `time.monotonic`)."""
    config = pool.config
    health = config.health
    servers = []
    for entry in pool.servers:
        server, state = entry.server, entry.state
        servers.append(
            ServerSnapshot(
                address=server.address,
                weight=server.weight,
                healthy=server.healthy,
                active=server.active,
                failures=state.failures,
                successes=state.successes,
                trial_in=None
                if server.down_until is None
                else max(0.0, server.down_until - now),
                history=tuple(
                    CheckRecord(
                        age=max(0.0, now - result.time),
                        ok=result.ok,
                        detail=result.detail,
                        source=result.source,
                    )
                    for result in state.history
                ),
            )
        )
    return BackendSnapshot(
        name=pool.name,
        balance=config.balance,
        retries=config.retries,
        health=None
        if health is None
        else HealthCheckSettings(
            kind=health.kind,
            interval=health.interval,
            healthy_threshold=health.healthy_threshold,
            unhealthy_threshold=health.unhealthy_threshold,
        ),
        servers=tuple(servers),
    )


def _socket_address(address: object) -> tuple[str, int] | None:
    if isinstance(address, tuple) and len(address) >= 2:
        return (str(address[0]), int(address[1]))
    return None


def _fixed_local_address(sock: trio.socket.SocketType) -> tuple[str, int] | None:
    """The local address of every client *sock* accepts, if it has only one.

    A socket bound to one address accepts only for it: the accepted socket's
    ``getsockname()`` would say the same, a syscall per connection. A wildcard
    bind (``0.0.0.0``, ``::``) accepts for every address of the host: ``None``,
    so each connection asks its own socket.
    """
    bound = _socket_address(sock.getsockname())
    if bound is None or ipaddress.ip_address(bound[0]).is_unspecified:
        return None
    return bound


def _listener_state(config: ListenerConfig, path: str) -> _ListenerState:
    """Build what a listener needs per connection (loads its certificates).

    Args:
        config: The listener.
        path: Its dotted path in the configuration, ``listeners[0]``.

    Raises:
        ConfigError: a certificate or key cannot be used.
    """
    tls = None
    if config.tls is not None:
        tls = load_listener_tls(config.tls, f"{path}.tls")
    access = None
    if config.allow or config.deny:
        access = AccessRules(config.allow, config.deny)
    return _ListenerState(
        config=config, trust=_trust_policy(config), tls=tls, access=access
    )


def _admission(state: _ListenerState, unwrapped: Unwrapped) -> Refused | None:
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


# Linux gives an accepted socket the TCP options of its listening socket.
_INHERITED_TCP_OPTIONS = sys.platform == "linux"

# Connection ids: 64 random bits, 16 hex digits. From a generator seeded from
# os.urandom (again in a forked child): unique and unguessable enough for logs
# and the PROXY header's unique id, without a getrandom() syscall each.
_IDS = random.Random()  # noqa: S311 (not a secret)
os.register_at_fork(after_in_child=_IDS.seed)


def _connection_id() -> str:
    """A new connection's id: 16 hex digits."""
    return f"{_IDS.getrandbits(64):016x}"


@dataclass(slots=True)
class _Connection:
    """One client connection while its stages run (see `Edge._accepted`)."""

    state: _ListenerState
    pool: BackendPool
    #: The accepted socket.
    raw: socket.socket
    peer: tuple[str, int] | None
    local: tuple[str, int] | None
    log: ConnectionLog
    exits: Cleanup


#: What a reactor stage hands on (`Edge._run_stage`).
_T = TypeVar("_T")

#: Where `Edge._serve_now` stopped: what the connection's task goes on with
#: (`Edge._handle_connection`): finishing a backend connect (or sending the
#: first bytes that did not all go), reading the h2c preface, or answering a
#: client denied with ``denied = "403"``.
_Begun = Callable[[], Awaitable[None]]


class _Stage(Protocol):
    """A stage the reactor runs with no task (`ReactorHeaderRead`,
    `ReactorHandshake`)."""

    def start(self) -> None: ...
    def drain(self) -> None: ...


class _ReactorStages:
    """The stages of one kind the reactor runs for connections with no task,
    so that drain can wait for them and end the rest (their result is None)."""

    def __init__(self) -> None:
        self._running: set[_Stage] = set()
        self._empty = trio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._running)

    def start(self, stage: _Stage) -> None:
        """Start *stage*, whose end (maybe before this returns) calls `ended`."""
        if not self._running:
            self._empty = trio.Event()
        self._running.add(stage)
        stage.start()

    def ended(self, stage: _Stage) -> None:
        self._running.discard(stage)
        if not self._running:
            self._empty.set()

    async def wait_empty(self) -> None:
        """Wait until every stage started here has ended."""
        await self._empty.wait()

    def drain_all(self) -> None:
        """End every stage still running."""
        for stage in list(self._running):
            stage.drain()


class _Sniffing:
    """An h2c preface read in a task, among the HTTP connections: drain
    waits for it, and at the deadline cancels it."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()

    def start(self) -> None:
        """Nothing to start: the task runs it."""

    def drain(self) -> None:
        self.scope.cancel()


def _stage_result(
    conn: _Connection,
    result: _T | Exception | None,
    then: Callable[[_Connection, _T], _Begun | None],
) -> _Begun | None:
    """Go on from a reactor stage's *result* (see `Edge._run_stage`)."""
    if result is None:  # the edge stopped meanwhile
        if conn.log.termination == Termination.UNKNOWN:
            conn.log.termination = Termination.DRAINED
        return None
    if isinstance(result, Exception):
        raise result  # a Refused (or a bug, logged as one)
    return then(conn, result)


def _direct(conn: _Connection) -> Unwrapped:
    """The connection's endpoints as the socket gives them (no PROXY header)."""
    return Unwrapped(
        client=conn.peer, destination=conn.local, health_check=False, leftover=b""
    )


def _admitted(conn: _Connection, unwrapped: Unwrapped) -> Refused | None:
    """Judge the real client (and log who it is). A denied client is refused
    here (raised), or with ``denied = "403"`` the refusal is returned, to
    answer after TLS."""
    log = conn.log
    log.client = format_address(unwrapped.client)
    log.destination = format_address(unwrapped.destination)
    denial = _admission(conn.state, unwrapped)
    if denial is not None and conn.state.config.denied == "close":
        raise denial  # before TLS: a denied client gets no ServerHello
    return denial


def _downstream(
    conn: _Connection, unwrapped: Unwrapped, tls: SSLFacts | None
) -> Downstream:
    """What the stages learnt about the client, once admitted (and the
    backend it goes to, in the log)."""
    log = conn.log
    config = conn.state.config
    log.backend = config.backend
    return Downstream(
        id=log.id,
        listener=config.name,
        peer=conn.peer,
        client=unwrapped.client,
        destination=unwrapped.destination,
        health_check=unwrapped.health_check,
        tls=tls,
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
    """Fill an HTTP-mode connection's log from its *result*. A load
    balancer's check that connects and closes (no byte, no request) is a
    health check."""
    log.bytes_from_client = result.bytes_from_client
    log.bytes_from_server = result.bytes_to_client
    log.server = result.server
    log.requests = result.requests
    log.termination = result.termination
    log.detail = result.detail
    if (
        downstream.health_check
        and result.requests == 0
        and result.bytes_from_client == 0
        and result.termination in _CLIENT_ENDED
    ):
        log.termination = Termination.HEALTH_CHECK


def _trust_policy(config: ListenerConfig) -> TrustPolicy | None:
    pp = config.proxy_protocol
    if pp is None:
        return None
    untrusted = Policy.SKIP if pp.untrusted == "direct" else Policy.REJECT
    return TrustPolicy.from_cidrs(pp.trusted, untrusted=untrusted)


async def _bind(
    config: ListenerConfig, *, reuse_port: bool
) -> list[trio.socket.SocketType]:
    """Open the listening sockets of *config* (all addresses its host has)."""
    if config.mode == "udp":
        return await open_datagram_sockets(
            config.bind.host, config.bind.port, reuse_port=reuse_port
        )
    return await open_listening_sockets(
        config.bind.host,
        config.bind.port,
        reuse_port=reuse_port,
        backlog=_LISTEN_BACKLOG,
    )


class PreparedReload:
    """A reload of an `Edge` with everything that can fail done
    (`Edge.prepare_reload`): backends resolved, certificates loaded, new
    listening sockets and a moved admin endpoint bound. Nothing the edge
    serves with has changed yet.

    Call `commit` (swap it in: nothing can fail) or `abort` (close what was
    opened), once. Preparing in every worker first, then committing in all or
    aborting in all, is how workers never end up with different
    configurations (`tlsedge._control.workers`).

    Attributes:
        config: The configuration it applies.
    """

    def __init__(self, edge: Edge, config: Config) -> None:
        self.config = config
        self._edge = edge
        self.pools: dict[str, BackendPool] = {}
        self.updates: list[tuple[BackendPool, PoolUpdate]] = []
        self.states: dict[str, _ListenerState] = {}
        self.opened: dict[str, _Listener] = {}
        #: The admin endpoint at a changed ``edge.admin`` (None: none or unchanged).
        self.admin: AdminServer | None = None
        self._settled = False

    async def prepare(self) -> None:
        """Open and check everything (`Edge.prepare_reload` calls it).

        Raises:
            ConfigError: something cannot be used; the caller aborts.
        """
        edge, config = self._edge, self.config
        for index, backend in enumerate(config.backends):
            path = f"backends[{index}]"
            pool = edge._pools.get(backend.name)
            if pool is None:
                pool = await BackendPool.create(
                    backend, observer=edge._metrics, path=path
                )
            else:
                self.updates.append(
                    (pool, await pool.prepare_update(backend, path=path))
                )
            self.pools[backend.name] = pool
        self.states = {
            lconf.name: _listener_state(lconf, f"listeners[{index}]")
            for index, lconf in enumerate(config.listeners)
        }
        for index, lconf in enumerate(config.listeners):
            old = edge._listeners.get(lconf.name)
            if (
                old is None
                or old.config.bind != lconf.bind
                # A UDP socket cannot serve TCP, nor the other way round.
                or (old.config.mode == "udp") != (lconf.mode == "udp")
            ):
                try:
                    sockets = await _bind(lconf, reuse_port=edge._reuse_port)
                except OSError as exc:
                    raise ConfigError(
                        f"listeners[{index}].bind: {exc.strerror or exc}"
                    ) from exc
                self.opened[lconf.name] = edge._make_listener(
                    self.states[lconf.name], sockets
                )
        admin = config.edge.admin
        if admin is not None and admin != edge.config.edge.admin:
            try:
                sockets = await bind_admin(admin, reuse_port=edge._reuse_port)
            except OSError as exc:  # its message starts with edge.admin
                raise ConfigError(exc.strerror or str(exc)) from exc
            self.admin = AdminServer(edge.snapshot, edge._metrics, sockets)

    def commit(self) -> None:
        """Serve new connections with the new configuration. On an edge that
        started draining since it was prepared, this aborts instead."""
        if self._settled:
            return
        if self._edge.draining:
            self.abort()
            return
        self._settled = True
        self._edge._commit(self)

    def abort(self) -> None:
        """Close what `prepare` opened; the running configuration stays."""
        if self._settled:
            return
        self._settled = True
        for listener in self.opened.values():
            Edge._close_listener(listener)
        if self.admin is not None:
            for sock in self.admin.sockets:
                sock.close()


class Edge:
    """A running tlsedge: use ``serve(config)`` or ``Edge(config).run()``.

    Attributes:
        config: the configuration in force (replaced by ``reload``).
        draining: True once ``drain()`` was called.
        ready: True while listeners are up and the edge is not draining.
    """

    def __init__(self, config: Config, *, reuse_port: bool | None = None) -> None:
        self.config = config
        self.draining = False
        self.ready = False
        self.active_connections = 0
        self._started = time.time()
        self._reuse_port = config.edge.workers > 1 if reuse_port is None else reuse_port
        self._listeners: dict[str, _Listener] = {}
        self._pools: dict[str, BackendPool] = {}
        self._keepalive: dict[str, KeepAlivePool] = {}
        self._edge_limiter = trio.CapacityLimiter(config.edge.max_connections)
        self._drain_event = Drain()
        # tcp-mode connections whose relay the reactor runs (their tasks
        # ended), and when they are cut at the latest (set by drain/stop).
        self._relays = DetachedRelays()
        # PROXY header reads and TLS handshakes on the reactor (no task
        # yet): see `_serve_now`.
        self._header_reads = _ReactorStages()
        self._handshakes = _ReactorStages()
        # HTTP-mode connections on the reactor (no task; those with a job
        # running have a task of the connections nursery): see `_start_http`.
        self._http = _ReactorStages()
        self._relays_deadline = math.inf
        self._background_scope = trio.CancelScope()
        self._services: trio.Nursery | None = None
        self._connections: trio.Nursery | None = None
        self._metrics = EdgeMetrics(self.snapshot)
        self.admin: AdminServer | None = None  # the edge.admin endpoint, once bound
        self._admin_scope = trio.CancelScope()  # cancelled when edge.admin moves

    # -- public API -------------------------------------------------------

    @property
    def metrics(self) -> EdgeMetrics:
        """The edge's metrics (``/metrics``, the status page); its ``reloads``
        record is kept by whoever reloads the edge (`tlsedge._control.run`,
        `tlsedge._control.worker`)."""
        return self._metrics

    @property
    def listen_addresses(self) -> dict[str, list[tuple[str, int]]]:
        """The bound ``(host, port)`` of each listener, by name."""
        return {name: list(lst.addresses) for name, lst in self._listeners.items()}

    def snapshot(self) -> Snapshot:
        """A read-only view of the edge's state now (see `tlsedge._core.snapshot`):
        what the admin endpoint and the metrics report."""
        now = time.monotonic()
        return Snapshot(
            version=__version__,
            pid=os.getpid(),
            workers=self.config.edge.workers,
            started=self._started,
            taken=time.time(),
            ready=self.ready,
            draining=self.draining,
            active_connections=self.active_connections,
            max_connections=self.config.edge.max_connections,
            listeners=tuple(lst.snapshot() for lst in self._listeners.values()),
            backends=tuple(
                _backend_snapshot(pool, now) for pool in self._pools.values()
            ),
        )

    def drain(self) -> None:
        """Stop accepting now; let connections finish until ``drain_timeout``."""
        if self.draining:
            return
        self.draining = True
        self.ready = False
        LOGGER.info(
            "draining: listeners closed, %d connections get up to %g s to finish",
            self.active_connections,
            self.config.edge.drain_timeout,
        )
        for listener in self._listeners.values():
            self._close_listener(listener)
        deadline = trio.current_time() + self.config.edge.drain_timeout
        if self._connections is not None:
            self._connections.cancel_scope.deadline = deadline
        self._relays_deadline = deadline
        self._drain_event.set()

    def stop(self) -> None:
        """Close everything at once (a second SIGTERM, or SIGINT)."""
        self.drain()
        if self._connections is not None:
            self._connections.cancel_scope.cancel()
        self._relays_deadline = -math.inf
        self._drain_stages()
        self._relays.drain_all()

    async def reload(self, config: Config) -> None:
        """Apply a new configuration to new connections.

        `prepare_reload`, then `PreparedReload.commit`.

        Raises:
            ConfigError: the new configuration cannot be applied (a name does
                not resolve, an address cannot be bound); the old one stays.
        """
        (await self.prepare_reload(config)).commit()
        LOGGER.info(
            "configuration reloaded: %d listeners, %d backends",
            len(config.listeners),
            len(config.backends),
        )

    async def prepare_reload(self, config: Config) -> PreparedReload:
        """Do everything that can fail in applying *config*, changing nothing
        the edge serves with: resolve the backends' servers, load the
        certificates, bind new listeners and a moved ``edge.admin``.

        Listeners are matched by name: an unchanged ``bind`` keeps its sockets,
        a new or changed one is opened, a removed one closed. Backends keep the
        state of servers whose address is unchanged. Open connections carry on
        with the settings they started with. ``edge.workers`` is not the
        edge's business (the supervisor's, `tlsedge._control.workers`).

        Returns:
            The prepared reload: call its ``commit`` or its ``abort``.

        Raises:
            ConfigError: the new configuration cannot be applied; nothing was
                changed and nothing stays open.
        """
        if self.draining or self._services is None:
            raise ConfigError("edge: cannot reload while draining or stopped")
        prepared = PreparedReload(self, config)
        try:
            await prepared.prepare()
        except BaseException:
            prepared.abort()
            raise
        return prepared

    def _commit(self, prepared: PreparedReload) -> None:
        """Swap in a prepared reload (`PreparedReload.commit`)."""
        config = prepared.config
        for pool, update in prepared.updates:
            pool.apply_update(update)
        listeners: dict[str, _Listener] = {}
        for lconf in config.listeners:
            if lconf.name in prepared.opened:
                listeners[lconf.name] = prepared.opened[lconf.name]
            else:
                kept = self._listeners[lconf.name]
                kept.state = prepared.states[lconf.name]
                kept.limiter.total_tokens = lconf.max_connections
                listeners[lconf.name] = kept
        for name, listener in self._listeners.items():
            if listeners.get(name) is not listener:
                self._close_listener(listener)
        if config.edge.admin != self.config.edge.admin:
            self._admin_scope.cancel()
            moved, self.admin = self.admin, prepared.admin
            if self.admin is not None:
                if moved is not None:
                    self.admin.rates = moved.rates
                self._serve_admin(self.admin)
        self.config = config
        self._pools = prepared.pools
        self._listeners = listeners
        self._edge_limiter.total_tokens = config.edge.max_connections
        for listener in listeners.values():
            self._configure_udp(listener)
        for listener in prepared.opened.values():
            self._start_listener(listener)
        self._restart_background_tasks()

    async def run(
        self, *, task_status: trio.TaskStatus[Edge] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until drained (or stopped); reports itself when listening.

        Raises:
            ConfigError: a listener cannot bind, a backend does not resolve, a
                certificate cannot be used; the message starts with the
                dotted path of the value at fault.
        """
        # The worker's reactor (its epoll descriptor) exists from the start,
        # not from the first connection on: the edge's resources at rest.
        current_reactor()
        for index, backend in enumerate(self.config.backends):
            self._pools[backend.name] = await BackendPool.create(
                backend, observer=self._metrics, path=f"backends[{index}]"
            )
        states = [
            _listener_state(lconf, f"listeners[{index}]")
            for index, lconf in enumerate(self.config.listeners)
        ]
        try:
            for index, state in enumerate(states):
                try:
                    sockets = await _bind(state.config, reuse_port=self._reuse_port)
                except OSError as exc:
                    raise ConfigError(
                        f"listeners[{index}].bind: {exc.strerror or exc}"
                    ) from exc
                self._listeners[state.config.name] = self._make_listener(state, sockets)
            if (admin := self.config.edge.admin) is not None:
                try:
                    sockets = await bind_admin(admin, reuse_port=self._reuse_port)
                except OSError as exc:  # its message starts with edge.admin
                    raise ConfigError(exc.strerror or str(exc)) from exc
                self.admin = AdminServer(self.snapshot, self._metrics, sockets)
        except ConfigError:
            for listener in self._listeners.values():
                self._close_listener(listener)
            raise
        try:
            async with trio.open_nursery() as services:
                self._services = services
                services.start_soon(self._metrics.flush_periodically)
                self._restart_background_tasks()
                if self.admin is not None:
                    await services.start(self._run_admin, self.admin, self._admin_scope)
                async with trio.open_nursery() as connections:
                    self._connections = connections
                    for listener in self._listeners.values():
                        self._start_listener(listener)
                    self.ready = True
                    for name, addresses in self.listen_addresses.items():
                        LOGGER.info(
                            "listener %s on %s",
                            name,
                            ", ".join(format_address(a) for a in addresses),
                        )
                    task_status.started(self)
                    await self._drain_event.wait()
                    # A header read or handshake on the reactor may still go
                    # on in a task of this nursery: within its deadline, like
                    # the tasks; so may an HTTP connection. (A header read
                    # may start a handshake, a handshake an HTTP connection.)
                    try:
                        await self._header_reads.wait_empty()
                        await self._handshakes.wait_empty()
                        await self._http.wait_empty()
                    finally:
                        self._drain_stages()
                # Relays on the reactor get the rest of the drain timeout.
                with trio.move_on_at(self._relays_deadline):
                    await self._relays.wait_empty()
                self._relays.drain_all()
                services.cancel_scope.cancel()
        finally:
            # Cancelled from outside: close them now.
            self._drain_stages()
            self._relays.drain_all()
            self._services = None
            for listener in self._listeners.values():
                for sock in listener.sockets:
                    sock.close()
            for keepalive in self._keepalive.values():
                keepalive.close()
            self._metrics.flush()  # the counts since the last flush, for workers
        LOGGER.info("all connections closed; stopped")

    def _drain_stages(self) -> None:
        """End the header reads, handshakes and HTTP connections on the
        reactor (a header read ended so starts no handshake, a handshake no
        HTTP connection)."""
        self._header_reads.drain_all()
        self._handshakes.drain_all()
        self._http.drain_all()

    # -- listeners --------------------------------------------------------

    @staticmethod
    def _make_listener(
        state: _ListenerState, sockets: list[trio.socket.SocketType]
    ) -> _Listener:
        return _Listener(
            state=state,
            sockets=sockets,
            limiter=trio.CapacityLimiter(state.config.max_connections),
            addresses=[
                (str(s.getsockname()[0]), int(s.getsockname()[1])) for s in sockets
            ],
        )

    def _start_listener(self, listener: _Listener) -> None:
        assert self._services is not None
        if listener.config.mode == "udp":
            assert self._connections is not None
            listener.udp = UdpListener(
                listener.sockets,
                listener.limiter,
                self._edge_limiter,
                self._metrics,
                self._count_flows,
            )
            self._configure_udp(listener)
            # Among the connections: drain waits for its flows.
            self._connections.start_soon(listener.udp.run)
            return
        for sock in listener.sockets:
            self._services.start_soon(self._accept_loop, listener, sock)

    def _configure_udp(self, listener: _Listener) -> None:
        if listener.udp is not None:
            state = listener.state
            pool = self._pools[state.config.backend]
            listener.udp.configure(state.config, state.trust, state.access, pool)

    def _count_flows(self, delta: int) -> None:
        self.active_connections += delta

    @staticmethod
    def _close_listener(listener: _Listener) -> None:
        """Stop taking clients. A udp listener's sockets stay open for the
        replies of its flows, and close when the last flow ended."""
        if listener.udp is not None:
            listener.udp.close()
            return
        listener.cancel_scope.cancel()
        for sock in listener.sockets:
            sock.close()

    async def _run_admin(
        self,
        admin: AdminServer,
        scope: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve *admin* until *scope* is cancelled (``edge.admin`` moved) or
        the services end."""
        with scope:
            await admin.serve(task_status=task_status)

    def _serve_admin(self, admin: AdminServer) -> None:
        """Start serving the admin endpoint of a reload (`_commit`)."""
        assert self._services is not None
        self._admin_scope = trio.CancelScope()
        self._services.start_soon(self._run_admin, admin, self._admin_scope)

    def _restart_background_tasks(self) -> None:
        """(Re)start the access-log flusher, health checks, DNS discovery
        refreshes and certificate watchers for the current configuration."""
        assert self._services is not None
        self._background_scope.cancel()
        self._background_scope = scope = trio.CancelScope()

        async def run_tasks() -> None:
            with scope:
                async with trio.open_nursery() as nursery:
                    # Restarted with the rest: a reload may have switched the
                    # access log from "off" (where it returned) to a file.
                    nursery.start_soon(run_access_log_flusher)
                    for pool in self._pools.values():
                        nursery.start_soon(pool.run_health_checks)
                        nursery.start_soon(pool.run_discovery)  # DNS refresh
                    for listener in self._listeners.values():
                        if listener.state.tls is not None:
                            nursery.start_soon(watch_certificates, listener.state.tls)

        self._services.start_soon(run_tasks)

    async def _accept_loop(
        self, listener: _Listener, sock: trio.socket.SocketType
    ) -> None:
        assert self._connections is not None
        connections = self._connections
        # A stdlib object on the same descriptor (no dup; detached, never
        # closed): its accept() does not checkpoint, so one wake-up accepts
        # every queued client (up to _ACCEPT_BATCH), not one per round trip.
        if sock.fileno() == -1:
            return  # closed (drain, reload) before this loop started
        local = _fixed_local_address(sock)
        raw = socket.socket(sock.family, sock.type, sock.proto, fileno=sock.fileno())
        if _INHERITED_TCP_OPTIONS:
            # What trio's SocketStream sets on each connection, set once
            # (connections relayed from their socket build no stream).
            set_stream_options(raw)
        try:
            with listener.cancel_scope:
                await self._accept_batches(listener, sock, raw, connections, local)
        finally:
            raw.detach()

    async def _accept_batches(
        self,
        listener: _Listener,
        sock: trio.socket.SocketType,
        raw: socket.socket,
        connections: trio.Nursery,
        local: tuple[str, int] | None,
    ) -> None:
        while True:
            # Take the slots only once a client is waiting: a loop idling
            # in accept() with a slot would keep it from the other accept
            # loops (other listeners, other addresses of this one).
            if sock.fileno() == -1:  # closed by drain() or reload()
                return
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError:
                return
            for _ in range(_ACCEPT_BATCH):
                token = object()
                try:
                    self._edge_limiter.acquire_on_behalf_of_nowait(token)
                except trio.WouldBlock:
                    await self._edge_limiter.acquire_on_behalf_of(token)
                try:
                    listener.limiter.acquire_on_behalf_of_nowait(token)
                except trio.WouldBlock:
                    try:
                        await listener.limiter.acquire_on_behalf_of(token)
                    except BaseException:
                        self._edge_limiter.release_on_behalf_of(token)
                        raise
                try:
                    if sock.fileno() == -1:  # closed while we waited for a slot
                        raise trio.ClosedResourceError
                    conn, peer_address = raw.accept()
                except (OSError, trio.ClosedResourceError) as exc:
                    listener.limiter.release_on_behalf_of(token)
                    self._edge_limiter.release_on_behalf_of(token)
                    if isinstance(exc, BlockingIOError):
                        break  # queue empty: back to waiting
                    if (
                        isinstance(exc, OSError)
                        and exc.errno in _ACCEPT_CAPACITY_ERRNOS
                    ):
                        LOGGER.error(
                            "listener %s: accept failed (%s); retrying in %g s",
                            listener.config.name,
                            os.strerror(exc.errno or 0),
                            _ACCEPT_RETRY_DELAY,
                        )
                        await trio.sleep(_ACCEPT_RETRY_DELAY)
                        break
                    if isinstance(exc, trio.ClosedResourceError) or sock.fileno() == -1:
                        return
                    raise
                # The backend is looked up now: a reload may remove it while
                # this connection still reads its PROXY header.
                self._accepted(
                    listener.state,
                    self._pools[listener.config.backend],
                    listener.limiter,
                    token,
                    conn,
                    peer_address,
                    local,
                    connections,
                )

    # -- one connection ---------------------------------------------------

    def _accepted(  # noqa: PLR0917
        self,
        state: _ListenerState,
        pool: BackendPool,
        limiter: trio.CapacityLimiter,
        token: object,
        raw: socket.socket,
        peer_address: object,
        local: tuple[str, int] | None,
        connections: trio.Nursery,
    ) -> None:
        """Take charge of an accepted connection: count it, run the stages
        that need no wait here, and hand the rest to a task.

        Everything the stages open or take (the client's socket, an upstream's
        socket, a server's lease, the connection slots) is given back by the
        connection's exit stack, whichever way it ends. A stage that refuses
        the connection raises `Refused`.
        """
        # accept() told us who the peer is: no getpeername() (which also fails
        # once the peer reset the connection, as HAProxy's health checks do).
        peer = _socket_address(peer_address)
        if local is None:  # a wildcard bind: where did this client connect?
            try:
                local = _socket_address(raw.getsockname())
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
        if not _INHERITED_TCP_OPTIONS:
            set_stream_options(raw)
        conn = _Connection(state, pool, raw, peer, local, log, Cleanup())
        exits = conn.exits
        self.active_connections += 1
        self._metrics.connection_opened(log.listener)
        started = trio.current_time()
        exits.callback(
            functools.partial(self._connection_ended, log, started, limiter, token)
        )
        # The client's socket, whatever stages wrap it (closing the wrappers
        # could send nothing more: the connection is over).
        exits.callback(raw.close)
        self._go_on(conn, self._serve_now)

    def _go_on(
        self, conn: _Connection, step: Callable[[_Connection], _Begun | None]
    ) -> None:
        """Run *step*, stages of *conn* that do not wait; a task goes on
        from where it stopped if it had to (`_handle_connection`)."""
        exits = conn.exits
        begun: _Begun | None = None
        try:
            begun = step(conn)
        except Exception as exc:  # noqa: BLE001 (a Refused, or logged as a bug)
            self._stage_failed(conn, exc)
        except BaseException:
            exits.close()
            raise
        if begun is None:  # done: the reactor has it, or the connection ended
            exits.close()
            return
        assert self._connections is not None
        try:
            self._connections.start_soon(self._handle_connection, conn, begun)
        except BaseException:
            exits.close()
            raise

    async def _handle_connection(self, conn: _Connection, begun: _Begun) -> None:
        """Go on with *conn* from where `_serve_now` stopped, then close and
        log it."""
        with conn.exits:
            try:
                await begun()
            except trio.Cancelled:
                if conn.log.termination == Termination.UNKNOWN:
                    conn.log.termination = Termination.DRAINED
                raise
            except Exception as exc:  # noqa: BLE001 (a Refused, or logged as a bug)
                self._stage_failed(conn, exc)

    def _stage_failed(self, conn: _Connection, exc: Exception) -> None:
        """Log why a stage ended the connection: a refusal, or a bug (a bug on
        one connection's path must not take the edge, and every other
        connection, down with it: logged, and this connection closed)."""
        log = conn.log
        if isinstance(exc, Refused):
            self._refused(log, exc)
            return
        log.termination = Termination.INTERNAL_ERROR
        log.detail = f"{type(exc).__name__}: {exc}"
        LOGGER.exception(
            "listener %s: internal error on connection %s", log.listener, log.id
        )

    def _connection_ended(
        self,
        log: ConnectionLog,
        started: float,
        limiter: trio.CapacityLimiter,
        token: object,
    ) -> None:
        self.active_connections -= 1
        limiter.release_on_behalf_of(token)
        self._edge_limiter.release_on_behalf_of(token)
        log.duration = trio.current_time() - started
        self._metrics.record(log)
        log.emit()

    def _refused(self, log: ConnectionLog, refused: Refused) -> None:
        """Log a connection a stage refused (the access log follows)."""
        log.termination, log.detail = refused.termination, refused.detail
        if refused.reason is not None:
            self._metrics.proxy_header_error(log.listener, refused.reason)
        level = _REFUSAL_LOG_LEVELS.get(refused.termination, logging.INFO)
        if level:
            LOGGER.log(
                level,
                "listener %s: closing %s: %s: %s",
                log.listener,
                log.client or log.peer,
                refused.termination,
                refused.detail,
            )

    def _serve_now(self, conn: _Connection) -> _Begun | None:
        """The stages of *conn* (PROXY unwrap, admission, TLS, then the mode:
        tcp relay or http), as far as they go without waiting: None once done
        (or handed to the reactor's PROXY header read or TLS handshake), else
        where the connection's task goes on (`_handle_connection`)."""
        state = conn.state
        config = state.config
        if config.proxy_protocol is None or state.trust is None:
            return self._admit_now(conn, _direct(conn))
        trust, settings = state.trust, config.proxy_protocol
        self._run_stage(
            conn,
            self._header_reads,
            lambda on_done: ReactorHeaderRead(
                conn.raw,
                trust=trust,
                settings=settings,
                peer=conn.peer,
                local=conn.local,
                on_done=on_done,
            ),
            self._admit_now,
        )
        return None

    def _run_stage(
        self,
        conn: _Connection,
        stages: _ReactorStages,
        make: Callable[[Callable[[_T | Exception | None], None]], _Stage],
        then: Callable[[_Connection, _T], _Begun | None],
    ) -> None:
        """Run a reactor stage of *conn* (*make* builds it around its end's
        callback), then go on with *then* from its result. The stage's end
        takes over what the connection gives back; its end goes on like
        `_go_on`: an exception (a `Refused`, or a bug) ends the connection,
        None (the edge stopped) ends it as ``drained``."""
        owned = conn.exits.pop_all()

        def ended(result: _T | Exception | None) -> None:
            stages.ended(stage)
            conn.exits = owned
            self._go_on(conn, lambda conn: _stage_result(conn, result, then))

        stage = make(ended)
        try:
            stages.start(stage)
        except BaseException:
            conn.exits.callback(owned.close)  # nothing started: the owner cleans up
            raise

    def _admit_now(self, conn: _Connection, unwrapped: Unwrapped) -> _Begun | None:
        """From admission on, for `_serve_now`: the client's first bytes
        (past its PROXY header) go to the handshake, or to the backend (to
        the task's HTTP session in http mode)."""
        denial = _admitted(conn, unwrapped)
        state = conn.state
        if state.tls is None:
            if state.config.mode == "http":
                client = trio.SocketStream(trio.socket.from_stdlib_socket(conn.raw))
                return self._serve_http_now(
                    conn,
                    client,
                    _downstream(conn, unwrapped, None),
                    unwrapped.leftover,
                    denial,
                )
            return self._serve_tcp_now(
                conn, unwrapped, conn.raw, None, unwrapped.leftover
            )
        assert state.config.tls is not None
        server_tls, timeout = state.tls, state.config.tls.handshake_timeout

        def handshake(on_done: Callable[[HandshakeResult], None]) -> _Stage:
            return ReactorHandshake(
                conn.raw,
                server_tls,
                initial_data=unwrapped.leftover,
                handshake_timeout=timeout,
                health_check=unwrapped.health_check,
                on_done=on_done,
            )

        def handshaken(
            conn: _Connection, result: tuple[TLSStream, SSLFacts]
        ) -> _Begun | None:
            return self._handshaken(conn, unwrapped, denial, result)

        self._run_stage(conn, self._handshakes, handshake, handshaken)
        return None

    def _handshaken(
        self,
        conn: _Connection,
        unwrapped: Unwrapped,
        denial: Refused | None,
        result: tuple[TLSStream, SSLFacts],
    ) -> _Begun | None:
        """Go on from the end of a `_serve_now` TLS handshake."""
        client, tls = result
        # One string per version and cipher, not one per connection.
        conn.log.tls = sys.intern(f"{tls.version} {tls.cipher}")
        conn.log.sni = tls.server_name
        if conn.state.config.mode == "http":
            return self._serve_http_now(
                conn, client, _downstream(conn, unwrapped, tls), b"", denial
            )
        return self._serve_tcp_now(conn, unwrapped, client, tls, b"")

    def _serve_tcp_now(
        self,
        conn: _Connection,
        unwrapped: Unwrapped,
        client: trio.abc.Stream | socket.socket,
        tls: SSLFacts | None,
        leftover: bytes,
    ) -> _Begun | None:
        downstream = _downstream(conn, unwrapped, tls)
        begun = serve_tcp_now(
            client,
            downstream,
            pool=conn.pool,
            listener=conn.state.config,
            initial_data=leftover,
            log=conn.log,
            exits=conn.exits,
            relays=self._relays,
            metering=self._metrics.metering,
            client_socket=None if client is conn.raw else conn.raw,
        )
        if begun is None:
            return None
        return functools.partial(
            self._serve_tcp, conn, client, downstream, leftover, begun
        )

    async def _serve_tcp(
        self,
        conn: _Connection,
        client: trio.abc.Stream | socket.socket,
        downstream: Downstream,
        leftover: bytes,
        begun: Connected | Opening,
    ) -> None:
        await serve_tcp(
            client,
            downstream,
            pool=conn.pool,
            listener=conn.state.config,
            initial_data=leftover,
            log=conn.log,
            exits=conn.exits,
            relays=self._relays,
            metering=self._metrics.metering,
            # The socket under the client's stream, TLS or not (a client
            # given as its socket is relayed as it is).
            client_socket=None if client is conn.raw else conn.raw,
            begun=begun,
        )

    async def _answer_denied(
        self,
        conn: _Connection,
        client: trio.abc.Stream,
        leftover: bytes,
        denial: Refused,
    ) -> None:
        """``denied = "403"``: answer the client, then refuse it."""
        assert isinstance(client, trio.abc.HalfCloseableStream)
        conn.log.bytes_from_client = len(leftover)
        await _answer_forbidden(client, conn.log)
        raise Refused(denial.termination, f"{denial.detail}; answered 403")

    def _keepalive_pool(self, backend: str) -> KeepAlivePool:
        """The idle upstream HTTP connections of *backend* (made on first use)."""
        keepalive = self._keepalive.get(backend)
        if keepalive is None:
            keepalive = self._keepalive[backend] = KeepAlivePool()
            if self._services is not None:
                self._services.start_soon(keepalive.run)
        return keepalive

    def _serve_http_now(
        self,
        conn: _Connection,
        client: trio.abc.Stream,
        downstream: Downstream,
        leftover: bytes,
        denial: Refused | None,
    ) -> _Begun | None:
        """HTTP mode, for `_serve_now`: the connection goes to the reactor
        (`_start_http`), except a client to answer 403 and one that may open
        with the h2c preface: their task goes on (`_handle_connection`)."""
        if denial is not None:
            return functools.partial(
                self._answer_denied, conn, client, leftover, denial
            )
        if downstream.tls is None and conn.state.config.h2_cleartext:
            return functools.partial(
                self._sniff_then_serve, conn, client, downstream, leftover
            )
        h2 = downstream.tls is not None and downstream.tls.alpn == "h2"
        self._start_http(conn, client, downstream, leftover, h2=h2)
        return None

    async def _sniff_then_serve(
        self,
        conn: _Connection,
        client: trio.abc.Stream,
        downstream: Downstream,
        leftover: bytes,
    ) -> None:
        """Read a plain client's first bytes until they are, or cannot be,
        the h2c preface, then `_start_http`. Drain waits for it (and cancels
        it at the deadline) among the HTTP connections."""
        sniffing = _Sniffing()
        self._http.start(sniffing)
        try:
            with sniffing.scope:
                is_h2, leftover = await sniff_preface(
                    client,
                    leftover,
                    header_timeout=conn.state.config.http.request_header_timeout,
                )
                # Among the HTTP connections before the sniff leaves them.
                self._start_http(conn, client, downstream, leftover, h2=is_h2)
        finally:
            self._http.ended(sniffing)
        if sniffing.scope.cancelled_caught:
            conn.log.termination = Termination.DRAINED

    def _start_http(
        self,
        conn: _Connection,
        client: trio.abc.Stream,
        downstream: Downstream,
        leftover: bytes,
        *,
        h2: bool,
    ) -> None:
        """Start serving HTTP/1.x (`tlsedge._pipeline.http.h1`) or HTTP/2
        (`tlsedge._pipeline.http.h2`: ALPN ``h2``, or the h2c preface) on the
        reactor, with no task: what must await runs in a task of the
        connections nursery. Its end takes over what the connection gives
        back (`_http_ended`). The metrics read its byte counts while it
        runs (`HttpConnectionResult.traffic`)."""
        assert self._connections is not None
        pool = conn.pool
        backend = pool.config
        build = h2_connection if h2 else http_connection
        log = conn.log
        result = HttpConnectionResult()

        def ended(result: HttpConnectionResult) -> None:
            self._http.ended(connection)
            with owned:
                _http_ended(log, downstream, result)

        connection = build(
            client,
            downstream,
            listener=conn.state.config,
            backend=pool,
            keepalive=self._keepalive_pool(pool.name),
            proxy_header=proxy_header_for(
                downstream, backend.send_proxy, backend.proxy_tlvs
            ),
            drain=self._drain_event,
            spawn=self._connections.start_soon,
            on_done=ended,
            result=result,
            on_request=self._record_http_request,
            initial_data=leftover,
        )
        owned = conn.exits.pop_all()
        self._metrics.metering(log, result)
        try:
            self._http.start(connection)
        except BaseException:
            conn.exits.callback(owned.close)  # nothing started: the owner cleans up
            raise

    def _record_http_request(self, log: RequestLog) -> None:
        """Metrics for one HTTP request (a request never answered has no status)."""
        if log.status is not None:
            self._metrics.record_http_request(
                log.listener,
                log.backend or "",
                log.status,
                log.total,
                server=log.server,
            )


async def serve(
    config: Config, *, task_status: trio.TaskStatus[Edge] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run an edge for *config* inside any trio program.

    ``edge = await nursery.start(serve, config)`` returns once every listener
    is bound; ``edge.drain()`` stops it gracefully.

    Raises:
        ConfigError: a listener cannot bind or a backend does not resolve.
    """
    await Edge(config).run(task_status=task_status)
