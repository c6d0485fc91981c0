"""Stage: tcp mode: a backend server, our PROXY header, TLS to it, the relay.

The last stage of a ``mode = "tcp"`` connection. It connects a server of the
backend (balancing, retries, and for ``protocol = "tls"`` the handshake, all in
`BackendPool.connect`), registers the upstream's socket and the server's lease
with the connection's exit stack (so the owner's cleanup closes and gives back
everything, also when cancelled), sends the PROXY header (``send_proxy``) and
the client's first bytes, and hands both to the reactor (`tlsedge._reactor.relay`'s
`DetachedRelays`), which relays with its half-close rules. The connection's
task ends there; the reactor fills in the access-log record and closes what
the exit stack held when the relay ends. Meanwhile the metrics read the
relay's byte counts at each flush (*metering*, `_RelayEnd.traffic`).

The stage is written as two synchronous steps around the waits:
`_connect_now` starts the first connect attempt, `_relay_now` sends what
goes without waiting and starts the relay. Where neither has to wait (a plain
backend on loopback or a fast network) the edge runs them from its accept
loop (`serve_tcp_now`), with no task for the connection at all; where one
must wait, the connection's task takes over with `serve_tcp`.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable
from typing import TypeAlias

import trio

from tlsedge._backends.upstream import (
    BackendPool,
    Connected,
    ConnectFailedError,
    NoServerError,
    Opening,
)
from tlsedge._core.accesslog import ConnectionLog
from tlsedge._core.cleanup import Cleanup
from tlsedge._core.config import ListenerConfig
from tlsedge._core.downstream import Downstream
from tlsedge._core.metrics import Meter
from tlsedge._core.proxy_wrap import proxy_header_for
from tlsedge._core.termination import Refused, RelayStats, Termination
from tlsedge._pipeline.close import settle_health_check
from tlsedge._reactor.relay import DetachedRelays, set_abortive_close

__all__ = ["Metering", "serve_tcp", "serve_tcp_now"]

#: Counts a connection's bytes while it runs: `EdgeMetrics.metering`.
Metering: TypeAlias = Callable[[ConnectionLog, Meter], None]


def _connect_now(
    downstream: Downstream, pool: BackendPool, *, log: ConnectionLog, exits: Cleanup
) -> Connected | Opening:
    """Pick a server of *pool* and start connecting, without waiting.

    The attempt's socket and lease go to *exits*. Returns the connection if
    it is complete already (`BackendPool.connected_now`), else the attempt
    for `serve_tcp` to finish.

    Raises:
        Refused: ``no_server``.
    """
    backend = pool.config
    header = proxy_header_for(downstream, backend.send_proxy, backend.proxy_tlvs)
    try:
        opening = pool.open_first(downstream.client_ip, proxy_header=header or b"")
    except NoServerError as exc:
        raise Refused(Termination.NO_SERVER, str(exc)) from exc
    connected = pool.connected_now(opening)
    if connected is None:
        exits.callback(opening.close)
        return opening
    # What the connection holds from here (not the attempt: its header).
    exits.callback(connected.raw.close)
    exits.callback(connected.lease.release)
    log.server = connected.server.name
    return connected


def _relay_now(
    client: trio.abc.Stream | socket.socket,
    downstream: Downstream,
    connected: Connected,
    *,
    pool: BackendPool,
    listener: ListenerConfig,
    stats: RelayStats,
    log: ConnectionLog,
    exits: Cleanup,
    relays: DetachedRelays,
    metering: Metering,
    client_socket: socket.socket | None,
) -> bool:
    """Send ``connected.pending`` as far as it goes without waiting, then
    hand *client* and the upstream to the reactor (and the relay's counts
    to *metering*).

    Returns False if bytes are left to send (in ``connected.pending``;
    nothing else was done): the caller sends them, then calls again. True
    once done: the relay started (the reactor fills in *log* and closes
    *exits* at its end), or the send failed (logged in *log*).
    """
    if connected.pending and connected.tls is None:
        try:
            sent = connected.raw.send(connected.pending)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            _send_failed(client, downstream, exc, stats=stats, log=log)
            return True
        connected.pending = connected.pending[sent:]
    if connected.pending:
        return False
    # From here the reactor owns the connection: what the connection's exit
    # stack would close and release, it closes and releases at the end.
    owned = exits.pop_all()
    end = _RelayEnd(log, stats, owned, health_check=downstream.health_check)
    # Before the start: the relay may end (and the log be recorded) in it.
    metering(log, end)
    try:
        relays.start(
            client,
            connected.tuned() if connected.tls is None else connected.tls,
            stats=stats,
            idle_timeout=listener.idle_timeout,
            client_fin_timeout=listener.client_fin_timeout,
            server_fin_timeout=pool.config.server_fin_timeout,
            on_done=end,
            sockets=None if client_socket is None else (client_socket, connected.raw),
            closed_at_end=True,
        )
    except BaseException:
        exits.callback(owned.close)  # nothing started: the owner cleans up
        raise
    return True


def serve_tcp_now(
    client: trio.abc.Stream | socket.socket,
    downstream: Downstream,
    *,
    pool: BackendPool,
    listener: ListenerConfig,
    initial_data: bytes,
    log: ConnectionLog,
    exits: Cleanup,
    relays: DetachedRelays,
    metering: Metering,
    client_socket: socket.socket | None,
) -> Connected | Opening | None:
    """`serve_tcp` as far as it goes without waiting (the arguments are
    `serve_tcp`'s).

    Returns None once the stage is done (as `serve_tcp` returns), else where
    it stopped: pass that as `serve_tcp`'s *begun* to go on, with the same
    *initial_data* (a `Connected` has them queued already, in its
    ``pending``; an `Opening` not yet).

    Raises:
        Refused: ``no_server``.
    """
    begun = _connect_now(downstream, pool, log=log, exits=exits)
    if isinstance(begun, Opening):
        return begun
    begun.pending += initial_data
    if not _relay_now(
        client,
        downstream,
        begun,
        pool=pool,
        listener=listener,
        stats=RelayStats(bytes_from_client=len(initial_data)),
        log=log,
        exits=exits,
        relays=relays,
        metering=metering,
        client_socket=client_socket,
    ):
        return begun
    return None


async def serve_tcp(
    client: trio.abc.Stream | socket.socket,
    downstream: Downstream,
    *,
    pool: BackendPool,
    listener: ListenerConfig,
    initial_data: bytes,
    log: ConnectionLog,
    exits: Cleanup,
    relays: DetachedRelays,
    metering: Metering,
    begun: Connected | Opening,
    client_socket: socket.socket | None = None,
) -> None:
    """Go on from where `serve_tcp_now` stopped: finish the connect, send
    what waits to go, and hand *client* and the server to the reactor.

    Returns once the relay started (or the first bytes could not be sent):
    the reactor relays until both sides are done, then fills in *log* and
    closes *exits* (taken over from the caller).

    Args:
        client: The client's stream after the earlier stages, or its socket
            (for the reactor to drive as it is) if no stage needed a stream.
        downstream: The connection's facts (the PROXY header is built from them).
        pool: The listener's backend.
        listener: The listener's settings (timeouts).
        initial_data: Client bytes an earlier stage read past its own data.
        log: The connection's access-log record, filled in here.
        exits: The connection's exit stack: the upstream is closed and the
            server's lease released by it. Once the relay started, its
            callbacks are the relay's to run (the stack is left empty).
        relays: The edge's relays on the reactor.
        metering: Given the connection's log and the relay's counts as it
            starts (`EdgeMetrics.metering`), to count bytes as they flow.
        client_socket: The stdlib socket under *client* when *client* is
            the accepted socket's `trio.SocketStream` (the relay uses it).
        begun: Where `serve_tcp_now` stopped for this connection: the
            connect in progress, or the connection whose first bytes did not
            all go (a `Connected` has *initial_data* queued already).

    Raises:
        Refused: ``no_server`` or ``connect_failed`` (a failed TLS handshake
            with the server is a failed connect attempt).
    """
    queued = isinstance(begun, Connected)  # by serve_tcp_now
    if isinstance(begun, Connected):
        connected = begun
    else:
        try:
            connected = await pool.connect(downstream.client_ip, opening=begun)
        except ConnectFailedError as exc:
            raise Refused(Termination.CONNECT_FAILED, str(exc)) from exc
        exits.callback(connected.raw.close)
        exits.callback(connected.lease.release)
        log.server = connected.server.name
    # Client bytes that came with the PROXY header or the TLS handshake. A
    # plain backend gets our header and the first bytes in one segment, as
    # HAProxy sends them.
    stats = RelayStats(bytes_from_client=len(initial_data))
    if not queued:
        connected.pending += initial_data
    start = functools.partial(
        _relay_now,
        client,
        downstream,
        connected,
        pool=pool,
        listener=listener,
        stats=stats,
        log=log,
        exits=exits,
        relays=relays,
        metering=metering,
        client_socket=client_socket,
    )
    if start():
        return
    try:  # what could not go without waiting
        await connected.upstream.send_all(connected.pending)
    except (trio.BrokenResourceError, OSError) as exc:
        _send_failed(client, downstream, exc, stats=stats, log=log)
        return
    connected.pending = b""
    start()


def _send_failed(
    client: trio.abc.Stream | socket.socket,
    downstream: Downstream,
    exc: Exception,
    *,
    stats: RelayStats,
    log: ConnectionLog,
) -> None:
    """The first bytes could not go to the server: reset the client, log it."""
    log.termination, log.detail = Termination.SERVER_ERROR, str(exc)
    set_abortive_close(client)
    _record(log, stats, health_check=downstream.health_check)


class _RelayEnd:
    """What the reactor calls at the end of a relay: the access-log record
    filled in, then what the connection held closed and given back (both
    sockets: see ``closed_at_end``). Only what that needs stays with an idle
    connection (not its `Downstream`, TLS facts or closures)."""

    __slots__ = ("health_check", "log", "owned", "stats")

    def __init__(
        self,
        log: ConnectionLog,
        stats: RelayStats,
        owned: Cleanup,
        *,
        health_check: bool,
    ) -> None:
        self.log = log
        self.stats = stats
        self.owned = owned
        self.health_check = health_check

    def __call__(self) -> None:
        try:
            _record(self.log, self.stats, health_check=self.health_check)
        finally:
            self.owned.close()

    def traffic(self) -> tuple[int, int, str | None]:
        """The relay's byte counts so far and the server (a `Meter`)."""
        stats = self.stats
        return stats.bytes_from_client, stats.bytes_from_server, self.log.server


def _record(log: ConnectionLog, stats: RelayStats, *, health_check: bool) -> None:
    """What the relay did, into the connection's access-log record."""
    log.bytes_from_client = stats.bytes_from_client
    log.bytes_from_server = stats.bytes_from_server
    if stats.termination is not None:
        log.termination = stats.termination
    settle_health_check(log, health_check=health_check)
