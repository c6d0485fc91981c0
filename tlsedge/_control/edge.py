"""The edge's lifecycle: listeners, accept loops, reload, drain, snapshots.

Theory of operation
-------------------
``Edge.run()`` owns two nurseries. The *services* nursery runs the accept loops
and the backends' health checks; the *connections* nursery runs the tasks of
client connections that must wait for something, the jobs of HTTP
connections that must await (an upstream connect, an ``Upgrade`` relay), and
the task of each ``mode = "udp"`` listener, which lasts as long as its flows
(they run on the reactor: `tlsedge._pipeline.udp`). What happens to one accepted
connection is `tlsedge._pipeline.stages`'s business: the accept loop hands each
client to `Pipeline.accepted`, which runs its stages (no task where none is
needed) and ends it through `tlsedge._pipeline.close`.

Splitting the nurseries is what makes drain work: ``drain()`` closes the
listening sockets (new connections are refused by the kernel, not left
hanging), the accept loops end, and the connections nursery gets a deadline
of ``drain_timeout``. Connections that finish before it end normally; those
still open are cancelled at the deadline and logged as ``drained``. A drain
can come while ``run()`` is still starting (the signal handlers are up
first): the listeners bound since are then closed instead of served. PROXY
header reads, TLS handshakes and HTTP connections on the reactor (the
pipeline's `InFlight`) are waited for within the same deadline (one may
still need a task of that nursery), then ended as ``drained``. A tcp-mode
connection's relay runs on the reactor (`tlsedge._reactor.relay.DetachedRelays`):
``run()`` waits for those relays with the same deadline, then ends the rest
the same way, and returns once the last connection has gone.

Each accept loop waits for a client, takes a slot from the listener's and the
edge's ``max_connections`` limiters, then accepts: at the limit it simply stops
accepting, and the kernel's backlog holds new clients (HAProxy's behaviour)
instead of resetting them. (Taking the slots before a client is there would let
idle accept loops hold slots that connections on other listeners need.)

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
import ipaddress
import logging
import math
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import trio

from proxyproto import Policy, TrustPolicy
from tlsedge._backends.keepalive import KeepAlivePool
from tlsedge._backends.preflight import load_listener_tls
from tlsedge._backends.upstream import BackendPool, PoolUpdate, set_stream_options
from tlsedge._control.admin import AdminServer, bind_admin
from tlsedge._control.logs import run_access_log_flusher
from tlsedge._core.accesslog import format_address
from tlsedge._core.admission import AccessRules
from tlsedge._core.config import Config, ConfigError, ListenerConfig
from tlsedge._core.metrics import EdgeMetrics
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
from tlsedge._pipeline.stages import (
    INHERITED_TCP_OPTIONS,
    ListenerState,
    Pipeline,
    socket_address,
)
from tlsedge._pipeline.udp import UdpListener
from tlsedge._reactor.drain import Drain
from tlsedge._reactor.listen import open_datagram_sockets, open_listening_sockets
from tlsedge._reactor.loop import current_reactor
from tlsedge._reactor.relay import DetachedRelays
from tlsedge._tls.contexts import watch_certificates
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


@dataclass(slots=True)
class _Listener:
    """A configured listener at run time: its sockets and current settings."""

    state: ListenerState
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


def _fixed_local_address(sock: trio.socket.SocketType) -> tuple[str, int] | None:
    """The local address of every client *sock* accepts, if it has only one.

    A socket bound to one address accepts only for it: the accepted socket's
    ``getsockname()`` would say the same, a syscall per connection. A wildcard
    bind (``0.0.0.0``, ``::``) accepts for every address of the host: ``None``,
    so each connection asks its own socket.
    """
    bound = socket_address(sock.getsockname())
    if bound is None or ipaddress.ip_address(bound[0]).is_unspecified:
        return None
    return bound


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
        self.states: dict[str, ListenerState] = {}
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
            lconf.name: edge._listener_state(lconf, f"listeners[{index}]", self.pools)
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
        self._udp_flows = 0
        self._started = time.time()
        self._reuse_port = config.edge.workers > 1 if reuse_port is None else reuse_port
        self._listeners: dict[str, _Listener] = {}
        self._pools: dict[str, BackendPool] = {}
        self._keepalive: dict[str, KeepAlivePool] = {}
        self._edge_limiter = trio.CapacityLimiter(config.edge.max_connections)
        self._drain_event = Drain()
        self._metrics = EdgeMetrics(self.snapshot)
        # tcp-mode connections whose relay the reactor runs (their tasks
        # ended).
        self._relays = DetachedRelays()
        # When the connections (tasks, and relays on the reactor) are cut at
        # the latest (set by drain/stop).
        self._drain_deadline = math.inf
        # Each accepted connection's stages.
        self._pipeline = Pipeline(
            metrics=self._metrics,
            relays=self._relays,
            edge_limiter=self._edge_limiter,
            drain=self._drain_event,
            keepalive=self._keepalive_pool,
        )
        self._background_scope = trio.CancelScope()
        self._services: trio.Nursery | None = None
        self._connections: trio.Nursery | None = None
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
    def active_connections(self) -> int:
        """Client connections open now (udp flows included)."""
        return self._pipeline.active + self._udp_flows

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
        self._drain_deadline = trio.current_time() + self.config.edge.drain_timeout
        self._stop_serving()
        self._drain_event.set()

    def _stop_serving(self) -> None:
        """Close the listeners; the connections get until the drain deadline
        (`drain`, or `run` when a drain came while it was starting)."""
        for listener in self._listeners.values():
            self._close_listener(listener)
        if self._connections is not None:
            self._connections.cancel_scope.deadline = self._drain_deadline

    def stop(self) -> None:
        """Close everything at once (a second SIGTERM, or SIGINT)."""
        self.drain()
        if self._connections is not None:
            self._connections.cancel_scope.cancel()
        self._drain_deadline = -math.inf
        self._pipeline.in_flight.drain_all()
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
        if self._services is None:
            raise ConfigError("edge: cannot reload while starting or once stopped")
        if self.draining:
            raise ConfigError("edge: cannot reload while draining")
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
            self._listener_state(lconf, f"listeners[{index}]", self._pools)
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
                # The sweeps of the keep-alive pools the listeners' sites
                # made (before there were services to run them).
                for keepalive in self._keepalive.values():
                    services.start_soon(keepalive.run)
                self._restart_background_tasks()
                if self.admin is not None:
                    await services.start(self._run_admin, self.admin, self._admin_scope)
                async with trio.open_nursery() as connections:
                    self._connections = self._pipeline.nursery = connections
                    if self.draining:
                        # Drained (a SIGTERM) while starting: the listeners
                        # bound since are closed, not served.
                        self._stop_serving()
                    else:
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
                    # Header reads, handshakes and HTTP connections on the
                    # reactor may still go on in a task of this nursery:
                    # within its deadline, like the tasks. Ended here, in
                    # its body, also when cancelled from outside: a job
                    # they start (an upstream connect) finds it open.
                    try:
                        await self._drain_event.wait()
                        await self._pipeline.in_flight.wait_empty()
                    finally:
                        self._pipeline.in_flight.drain_all()
                # Relays on the reactor get the rest of the drain timeout.
                with trio.move_on_at(self._drain_deadline):
                    await self._relays.wait_empty()
                self._relays.drain_all()
                services.cancel_scope.cancel()
        finally:
            # Cancelled from outside: close them now.
            self._pipeline.in_flight.drain_all()
            self._relays.drain_all()
            self._services = None
            for listener in self._listeners.values():
                for sock in listener.sockets:
                    sock.close()
            for keepalive in self._keepalive.values():
                keepalive.close()
            self._metrics.flush()  # the counts since the last flush, for workers
        LOGGER.info("all connections closed; stopped")

    # -- listeners --------------------------------------------------------

    def _listener_state(
        self, config: ListenerConfig, path: str, pools: Mapping[str, BackendPool]
    ) -> ListenerState:
        """Build what a listener needs per connection (loads its certificates;
        an HTTP listener's site, with the backend of *pools* it names).

        Args:
            config: The listener.
            path: Its dotted path in the configuration, ``listeners[0]``.
            pools: The backends by name.

        Raises:
            ConfigError: a certificate or key cannot be used.
        """
        tls = None
        if config.tls is not None:
            tls = load_listener_tls(config.tls, f"{path}.tls")
        access = None
        if config.allow or config.deny:
            access = AccessRules(config.allow, config.deny)
        site = None
        if config.mode == "http":
            site = self._pipeline.http_site(config, pools[config.backend])
        return ListenerState(
            config=config,
            trust=_trust_policy(config),
            tls=tls,
            access=access,
            site=site,
        )

    @staticmethod
    def _make_listener(
        state: ListenerState, sockets: list[trio.socket.SocketType]
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
        self._udp_flows += delta

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
        # A stdlib object on the same descriptor (no dup; detached, never
        # closed): its accept() does not checkpoint, so one wake-up accepts
        # every queued client (up to _ACCEPT_BATCH), not one per round trip.
        if sock.fileno() == -1:
            return  # closed (drain, reload) before this loop started
        local = _fixed_local_address(sock)
        raw = socket.socket(sock.family, sock.type, sock.proto, fileno=sock.fileno())
        if INHERITED_TCP_OPTIONS:
            # What trio's SocketStream sets on each connection, set once
            # (connections relayed from their socket build no stream).
            set_stream_options(raw)
        try:
            with listener.cancel_scope:
                await self._accept_batches(listener, sock, raw, local)
        finally:
            raw.detach()

    async def _accept_batches(
        self,
        listener: _Listener,
        sock: trio.socket.SocketType,
        raw: socket.socket,
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
                self._pipeline.accepted(
                    listener.state,
                    self._pools[listener.config.backend],
                    listener.limiter,
                    token,
                    conn,
                    peer_address,
                    local,
                )

    def _keepalive_pool(self, backend: str) -> KeepAlivePool:
        """The idle upstream HTTP connections of *backend* (made for the first
        HTTP listener's site that sends its requests there)."""
        keepalive = self._keepalive.get(backend)
        if keepalive is None:
            keepalive = self._keepalive[backend] = KeepAlivePool()
            if self._services is not None:
                self._services.start_soon(keepalive.run)
        return keepalive


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
