"""Backends at run time: resolved servers, balancing, health, connecting.

A ``BackendPool`` is built from one ``[[backends]]`` table. Server host names
are resolved once when the pool is built (and again on reload), never per
connection: ``connect()`` only picks a server and opens a socket to a numeric
address. Connect failures count against the server's health (passive
checking); retries follow HAProxy: the same server again after a short pause,
the last try on another server ("redispatch"). Connects to a ``protocol =
"tls"`` backend include the TLS handshake: a handshake that fails or does not
finish within ``connect_timeout`` is a failed attempt like a refused connect
(counted, retried).

A backend with a ``discovery`` table gets its servers from DNS instead
(`tlsedge._backends.discovery`): looked up when the pool is built or updated, then
refreshed by ``run_discovery()`` in the background. A refresh swaps the server
list with ``Balancer.set_servers``: servers that stay keep their state, removed
ones drain (no new connections; open ones carry on), and the active health
checks follow the list.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from tlsedge._backends.discovery import DnsDiscovery, Found
from tlsedge._backends.health import HealthState, ServerHealth, run_health_checks
from tlsedge._backends.preflight import backend_tls_context, resolve_servers
from tlsedge._core.balancer import Balancer, Server, ServerLease
from tlsedge._core.config import BackendConfig, HealthConfig
from tlsedge._tls.contexts import backend_server_hostname
from tlsedge._tls.stream import TLSStream

__all__ = [
    "BackendPool",
    "ConnectFailedError",
    "Connected",
    "LeaseObserver",
    "NoServerError",
    "Opening",
    "PoolUpdate",
]

LOGGER = logging.getLogger("tlsedge.upstream")

#: Pause before retrying a failed connect (HAProxy waits min(connect, 1 s));
#: short, so a client waits little when the last try goes elsewhere.
RETRY_DELAY = 0.1


class NoServerError(Exception):
    """No healthy server in the backend."""


class ConnectFailedError(Exception):
    """Every connect attempt failed; the message lists them."""


class _TLSSetupError(Exception):
    """The PROXY header or the TLS handshake to a server failed (the message
    says which and why)."""


@dataclass(slots=True)
class Connected:
    """A connected upstream socket and the lease on the server it goes to.

    The caller owns both: it closes ``stream`` and releases the lease.

    Attributes:
        raw: The connected non-blocking socket.
        lease: The server's lease.
        attempts: Connect attempts made.
        tls: With a TLS backend, the TLS stream over `stream`.
        pending: Bytes the caller sends before anything else, in its first
            write: the PROXY header to a plain server (to a TLS server it
            went before the handshake already).
    """

    raw: socket.socket
    lease: ServerLease
    attempts: int
    tls: TLSStream | None
    pending: bytes
    _stream: trio.SocketStream | None = None

    @property
    def server(self) -> Server:
        return self.lease.server

    @property
    def stream(self) -> trio.SocketStream:
        """The trio stream over `raw`, built when first asked for (a reactor
        relay of a plain backend drives `raw` itself: see `tuned`)."""
        if self._stream is None:
            self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(self.raw))
        return self._stream

    def tuned(self) -> socket.socket:
        """`raw`, with the options a `trio.SocketStream` would have set on it
        (``TCP_NODELAY``, ``TCP_NOTSENT_LOWAT``) if none was built."""
        if self._stream is None:
            set_stream_options(self.raw)
        return self.raw

    @property
    def upstream(self) -> trio.abc.Stream:
        """The stream to talk to the server over (TLS or the socket)."""
        return self.tls if self.tls is not None else self.stream


@dataclass(slots=True)
class Opening:
    """A first connect attempt, started without waiting (`BackendPool.open_first`).

    `BackendPool.connected_now` turns it into a `Connected` when nothing is
    left to wait for; otherwise ``BackendPool.connect(opening=...)`` finishes
    it (retrying as configured). Whoever holds it calls `close` when done
    (it is idempotent): that gives back the socket and the lease unless a
    `Connected` took them over.

    Attributes:
        server: The server of the attempt.
        lease: The lease on it, taken before the connect.
        sock: The non-blocking socket; None if it could not be created.
        error: 0 (connected already), ``EINPROGRESS`` (the handshake is
            under way), or the errno the attempt failed with.
        proxy_header: Our PROXY header for this connection (see `connect`).
    """

    server: Server
    lease: ServerLease
    sock: socket.socket | None
    error: int
    proxy_header: bytes

    def close(self) -> None:
        """Release the lease and close the socket (again: a no-op)."""
        self.lease.release()
        if self.sock is not None:
            self.sock.close()


def set_stream_options(sock: socket.socket) -> None:
    """Set what `trio.SocketStream` sets on a TCP socket: ``TCP_NODELAY``, and
    ``TCP_NOTSENT_LOWAT`` of 16 KiB where the platform has it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if _NOTSENT_LOWAT is not None:
        sock.setsockopt(socket.IPPROTO_TCP, _NOTSENT_LOWAT, _STREAM_LOWAT)


#: trio's value (`trio.SocketStream`).
_STREAM_LOWAT = 2**14
_NOTSENT_LOWAT: int | None = getattr(socket, "TCP_NOTSENT_LOWAT", None)


class LeaseObserver(Protocol):
    """Hears about a backend's server use (the edge's metrics implement it).

    ``server`` is the server's address as the access log writes it
    (``str(Server)``).
    """

    def server_leased(self, backend: str, server: str) -> None:
        """A lease on *server* was taken (a connection is opening or in use)."""

    def server_released(self, backend: str, server: str) -> None:
        """A lease on *server* was released."""

    def server_connection_opened(
        self, backend: str, server: str, attempts: int
    ) -> None:
        """A new upstream connection to *server* was made after *attempts* tries."""


#: connect() errors that mean this process or host ran out of something
#: (fds, ephemeral ports, buffers): they do not count against the server.
_LOCAL_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL}
)


#: ``socket()`` flag for a socket born non-blocking (Linux; 0 elsewhere).
_SOCK_NONBLOCK: int = getattr(socket, "SOCK_NONBLOCK", 0)


def _connected(sock: socket.socket) -> bool:
    """Whether a non-blocking ``connect()`` already completed (``getpeername``
    fails with ENOTCONN until it has, and after it failed)."""
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


def _describe(exc: OSError) -> str:
    if exc.errno is not None:
        return os.strerror(exc.errno).lower()
    return str(exc) or type(exc).__name__


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolUpdate:
    """A backend configuration made ready for a pool (`BackendPool.prepare_update`)."""

    config: BackendConfig
    tls_context: ssl.SSLContext | None
    discovery: DnsDiscovery | None
    resolved: list[Found]


class BackendPool:
    """One backend's servers, balancer and health state.

    Build it with ``await BackendPool.create(config)``. ``update()`` takes a
    reloaded config and keeps the state of servers whose address is unchanged.
    """

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.name = config.name
        #: Client context for ``protocol = "tls"`` (re-encryption), else None.
        self.tls_context: ssl.SSLContext | None = None
        self._health: dict[tuple[str, int], ServerHealth] = {}
        self.balancer = Balancer(
            [], config.balance, affinity_timeout=config.affinity_timeout
        )
        self._discovery: DnsDiscovery | None = None
        # The running health checks, so that DNS refreshes can start and stop
        # the checks of servers that come and go.
        self._health_nursery: trio.Nursery | None = None
        self._health_scopes: dict[tuple[str, int], trio.CancelScope] = {}
        #: Told about every lease and new connection (the edge's metrics).
        self.observer: LeaseObserver | None = None
        # What every lease calls when released: one bound method for all.
        self._on_release: Callable[[ServerLease], None] = self._released

    @classmethod
    async def create(
        cls,
        config: BackendConfig,
        *,
        observer: LeaseObserver | None = None,
        path: str = "backend",
    ) -> BackendPool:
        """Resolve the servers of *config* and build the pool.

        *observer* hears about every lease and new connection (metrics);
        *path* is the backend's dotted path in the configuration, for errors.

        Raises:
            ConfigError: a file is unusable or a server name does not resolve.
        """
        pool = cls(config)
        pool.observer = observer
        await pool.update(config, path=path)
        return pool

    async def update(self, config: BackendConfig, *, path: str = "backend") -> None:
        """Apply a (re)loaded config; servers that stay keep their state.

        `prepare_update` then `apply_update`.

        Raises:
            ConfigError: as `prepare_update` (nothing is changed then).
        """
        self.apply_update(await self.prepare_update(config, path=path))

    async def prepare_update(
        self, config: BackendConfig, *, path: str = "backend"
    ) -> PoolUpdate:
        """Do what can fail in applying *config*, changing nothing: build the
        TLS context, resolve the servers (an edge's reload does this for every
        backend before it changes any).

        With ``discovery``, a failed or empty DNS answer does not fail the
        update: the servers of the last good answer stay (none for a new name;
        the background refresh then retries every second).

        Raises:
            ConfigError: a file is unusable or a server name does not resolve;
                the message starts with the dotted path under *path* (the
                backend's, ``backends[0]``).
        """
        tls_context = backend_tls_context(config, path)
        discovery = None
        if config.discovery is None:
            resolved = await resolve_servers(config, path)
        else:
            discovery = self._discovery
            if discovery is None or discovery.config != config.discovery:
                discovery = DnsDiscovery(config.discovery, config.name)
            found = await discovery.refresh()
            resolved = found if found is not None else list(discovery.last or [])
        return PoolUpdate(
            config=config,
            tls_context=tls_context,
            discovery=discovery,
            resolved=resolved,
        )

    def apply_update(self, update: PoolUpdate) -> None:
        """Make *update* (from `prepare_update`) the pool's configuration."""
        config = update.config
        self.config = config
        self.tls_context = update.tls_context
        self._discovery = update.discovery
        self.balancer = (
            self.balancer
            if self.balancer.policy == config.balance
            else Balancer([], config.balance, affinity_timeout=config.affinity_timeout)
        )
        self._set_servers(update.resolved)

    def _set_servers(self, resolved: list[Found]) -> None:
        """Make *resolved* the server list; servers that stay keep their state."""
        config = self.config
        health: dict[tuple[str, int], ServerHealth] = {}
        for address, weight in resolved:
            existing = self._health.get(address)
            if existing is None:
                state = HealthState(
                    healthy_threshold=config.health.healthy_threshold
                    if config.health
                    else 2,
                    unhealthy_threshold=config.health.unhealthy_threshold
                    if config.health
                    else 6,
                )
                existing = ServerHealth(
                    Server(address, weight), state, backend=config.name
                )
            existing.server.weight = weight
            health[address] = existing
        self._health = health
        self.balancer.set_servers([h.server for h in health.values()])
        self._sync_health_checks()

    async def run_discovery(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Refresh the servers from DNS until cancelled (``discovery`` only)."""
        discovery = self._discovery
        if discovery is None:
            task_status.started()
            return

        def apply(found: list[Found]) -> None:
            if self._discovery is discovery:  # not replaced by a reload since
                self._set_servers(found)

        await discovery.run(apply, task_status=task_status)

    def server_hostname(self, stream: trio.SocketStream) -> str:
        """The name to send as SNI and verify for a TLS connection to the
        server behind *stream*: ``[backends.tls] sni``, else its address."""
        assert self.config.tls is not None
        host = str(stream.socket.getpeername()[0])
        return backend_server_hostname(self.config.tls, host)

    @property
    def servers(self) -> list[ServerHealth]:
        """The servers with their health state."""
        return list(self._health.values())

    async def run_health_checks(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the active checks of ``[backends.health]`` until cancelled.

        Reports started once every server had its first check.
        """
        health = self.config.health
        if health is None:
            task_status.started()
            return
        self._health_scopes = {}
        async with trio.open_nursery() as nursery:
            self._health_nursery = nursery
            try:
                for address, server_health in list(self._health.items()):
                    if address not in self._health_scopes:
                        scope = self._health_scopes[address] = trio.CancelScope()
                        await nursery.start(
                            self._check_server, server_health, health, scope
                        )
                task_status.started()
                self._sync_health_checks()  # servers that came while starting
                await trio.sleep_forever()
            finally:
                if self._health_nursery is nursery:
                    self._health_nursery = None

    async def _check_server(
        self,
        server_health: ServerHealth,
        health: HealthConfig,
        scope: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        address = server_health.server.address
        # Checks speak what the edge's connections speak: the PROXY header
        # version, and TLS with this pool's context and server name.
        tls = self.config.tls if self.tls_context is not None else None
        try:
            with scope:
                await run_health_checks(
                    server_health.server,
                    server_health.state,
                    kind=health.kind,
                    path=health.path,
                    port=health.port,
                    interval=health.interval,
                    timeout=health.timeout,
                    host_header=health.host or "",
                    expect=health.expect,
                    send_proxy=self.config.send_proxy,
                    tls_context=self.tls_context,
                    server_hostname=""
                    if tls is None
                    else backend_server_hostname(tls, address[0]),
                    backend=self.name,
                    task_status=task_status,
                )
        finally:
            if self._health_scopes.get(address) is scope:
                del self._health_scopes[address]

    def _sync_health_checks(self) -> None:
        """Start the checks of new servers and stop those of removed ones."""
        nursery, health = self._health_nursery, self.config.health
        if nursery is None or health is None:
            return
        for address, scope in list(self._health_scopes.items()):
            if address not in self._health:
                scope.cancel()
                del self._health_scopes[address]
        for address, server_health in self._health.items():
            if address not in self._health_scopes:
                scope = self._health_scopes[address] = trio.CancelScope()
                nursery.start_soon(self._check_server, server_health, health, scope)

    def lease(self, server: Server) -> ServerLease:
        """Take a lease on *server*: it counts in ``server.active`` until released.

        Every use of a server goes through here (a connect in tcp mode, an
        exchange in http mode, whether its connection is new or pooled).
        """
        observer = self.observer
        if observer is None:
            return ServerLease(server)
        observer.server_leased(self.name, server.name)
        return ServerLease(server, self._on_release)

    def _released(self, lease: ServerLease) -> None:
        """*lease* was released: tell the observer."""
        if self.observer is not None:
            self.observer.server_released(self.name, lease.server.name)

    def open_first(
        self, client_ip: str | None, *, proxy_header: bytes = b""
    ) -> Opening:
        """Pick a server and start the first connect attempt, without waiting.

        Loopback and fast peers complete the handshake within ``connect()``:
        `connected_now` then has the connection with no wait at all.

        Raises:
            NoServerError: no healthy server.
        """
        server = self.balancer.pick(client_ip)
        if server is None:
            raise NoServerError(f"backend {self.name}: no healthy server")
        return self._begin(server, proxy_header)

    def connected_now(self, opening: Opening) -> Connected | None:
        """The connection of *opening* if it needs no more waiting: the connect
        completed at once and the backend is plain (TLS needs its handshake).
        None: finish it with ``connect(opening=...)``."""
        if opening.error or self.tls_context is not None:
            return None
        return self._succeeded(opening, 1, None, None)

    async def connect(
        self,
        client_ip: str | None,
        *,
        first: Server | None = None,
        proxy_header: bytes = b"",
        opening: Opening | None = None,
    ) -> Connected:
        """Pick a server and connect to it, retrying as configured.

        Each attempt is bounded by ``connect_timeout`` (a cancel scope). The
        attempt's lease is taken before the connect is awaited, so concurrent
        picks see it; a failed attempt releases it.

        Args:
            client_ip: The client's address, for "source-ip" affinity.
            first: The server for the first attempt, when the caller picked
                one already (http mode looks in its keep-alive pool first).
            proxy_header: Our PROXY header for this connection. To a TLS
                backend (``tls_context``), whose handshake (SNI and name from
                `server_hostname`, within another ``connect_timeout``) is part
                of each attempt, it is sent raw before the handshake; to a
                plain one it comes back as ``pending``.
            opening: The first attempt, started by `open_first` (its server
                and PROXY header replace *first* and *proxy_header*).

        Raises:
            NoServerError: no healthy server.
            ConnectFailedError: every attempt failed.
        """
        config = self.config
        attempts = 1 + config.retries
        tried: list[Server] = []
        failures: list[str] = []
        if opening is not None:
            server: Server | None = opening.server
            proxy_header = opening.proxy_header
        else:
            server = first if first is not None else self.balancer.pick(client_ip)
        for attempt in range(1, attempts + 1):
            if server is None:
                break
            tried.append(server)
            health = self._health.get(server.address)
            if opening is None:
                opening = self._begin(server, proxy_header)
            try:
                await self._finish_open(opening, config.connect_timeout)
                stream = encrypted = None
                if self.tls_context is not None:
                    stream = _stream(opening)
                    encrypted = await self._start_tls(stream, proxy_header)
            except (OSError, trio.TooSlowError, _TLSSetupError) as exc:
                opening.close()
                if isinstance(exc, trio.TooSlowError):
                    detail = f"timeout after {config.connect_timeout:g} s"
                elif isinstance(exc, _TLSSetupError):
                    detail = str(exc)
                else:
                    detail = _describe(exc)
                failures.append(f"{server}: {detail}")
                # Out of fds/ports/buffers here is not the server's fault:
                # marking it down would turn a local overload into no_server.
                local = isinstance(exc, OSError) and exc.errno in _LOCAL_ERRNOS
                if health is not None and not local:
                    health.connect_failed(detail)
            except BaseException:
                opening.close()
                raise
            else:
                return self._succeeded(opening, attempt, encrypted, stream)
            opening = None
            if attempt == attempts:
                break
            await trio.sleep(RETRY_DELAY)
            if attempt == attempts - 1:
                # The last try goes to another server if there is one.
                server = self.balancer.pick(
                    client_ip, exclude=tried
                ) or self.balancer.pick(client_ip)
            elif not server.healthy:
                server = self.balancer.pick(client_ip, exclude=tried)
        if not tried:
            raise NoServerError(f"backend {self.name}: no healthy server")
        raise ConnectFailedError(
            f"backend {self.name}: {len(failures)} connect attempts failed ("
            + "; ".join(failures)
            + ")"
        )

    def _succeeded(
        self,
        opening: Opening,
        attempt: int,
        encrypted: TLSStream | None,
        stream: trio.SocketStream | None,
    ) -> Connected:
        """Count a successful attempt (health, metrics); its connection
        (*stream*: the trio stream over its socket, if one was built)."""
        server = opening.server
        health = self._health.get(server.address)
        if health is not None:
            health.connect_succeeded()
        if self.observer is not None:
            self.observer.server_connection_opened(self.name, server.name, attempt)
        pending = opening.proxy_header if encrypted is None else b""
        assert opening.sock is not None  # the attempt succeeded
        return Connected(
            opening.sock, opening.lease, attempt, encrypted, pending, stream
        )

    async def _start_tls(self, stream: trio.SocketStream, prefix: bytes) -> TLSStream:
        """Send *prefix* raw, then the TLS handshake within ``connect_timeout``.

        *stream* is closed when this fails.

        Raises:
            _TLSSetupError: saying what failed (the TLS error, or the timeout).
        """
        assert self.tls_context is not None
        timeout = self.config.connect_timeout
        try:
            tls = TLSStream(
                stream,
                self.tls_context,
                server_side=False,
                server_hostname=self.server_hostname(stream),
            )
            with trio.fail_after(timeout):
                if prefix:
                    try:
                        await stream.send_all(prefix)
                    except (trio.BrokenResourceError, OSError) as exc:
                        raise _TLSSetupError(
                            f"sending the PROXY header failed: {exc}"
                        ) from exc
                try:
                    await tls.do_handshake()
                except trio.BrokenResourceError as exc:
                    raise _TLSSetupError(
                        f"TLS handshake failed: {exc.__cause__ or exc}"
                    ) from exc
        except trio.TooSlowError:
            await trio.aclose_forcefully(stream)
            raise _TLSSetupError(f"no TLS handshake within {timeout:g} s") from None
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return tls

    def _begin(self, server: Server, proxy_header: bytes) -> Opening:
        """Take a lease on *server* and start connecting to it (no wait)."""
        lease = self.lease(server)
        host, port = server.address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # A non-blocking connect on a stdlib socket: the address is numeric
        # already (trio's connect() would resolve it again and checkpoint).
        # Created non-blocking where the OS can (Linux): trio's wrapper sets
        # O_NONBLOCK again, one FIONBIO per connection is enough.
        sock: socket.socket | None = None
        try:
            sock = socket.socket(family, socket.SOCK_STREAM | _SOCK_NONBLOCK)
            if not _SOCK_NONBLOCK:
                sock.setblocking(False)
            error = sock.connect_ex((host, port))
            if error == errno.EINPROGRESS and _connected(sock):
                # Loopback (and any peer fast enough) completes the handshake
                # within connect(): no wait, no cancel scope, no round trip.
                error = 0
        except OSError as exc:
            error = exc.errno or errno.EIO
        except BaseException:
            if sock is not None:
                sock.close()
            lease.release()
            raise
        return Opening(server, lease, sock, error, proxy_header)

    @staticmethod
    async def _finish_open(opening: Opening, connect_timeout: float) -> None:
        """Wait for the connect of *opening* to complete (within
        *connect_timeout*).

        Raises:
            OSError: the connect failed.
            trio.TooSlowError: it did not complete in time.
        """
        sock, error = opening.sock, opening.error
        if sock is None:
            raise OSError(error, os.strerror(error))
        if error == errno.EINPROGRESS:
            with trio.fail_after(connect_timeout):
                await trio.lowlevel.wait_writable(sock)
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            raise OSError(error, os.strerror(error))


def _stream(opening: Opening) -> trio.SocketStream:
    """The trio stream over the connected socket of *opening*."""
    assert opening.sock is not None
    return trio.SocketStream(trio.socket.from_stdlib_socket(opening.sock))
