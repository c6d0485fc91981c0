"""Stage: tcp mode: a backend server, our PROXY header, TLS to it, the relay.

The last stage of a ``mode = "tcp"`` connection. It connects a server of the
backend (balancing, retries, and for ``protocol = "tls"`` the handshake, all in
`BackendPool.connect`), registers the upstream's socket and the server's lease
with the connection's exit stack (so the owner's cleanup closes and gives back
everything, also when cancelled), sends the PROXY header (``send_proxy``) and
the client's first bytes, and hands both to the reactor (`tlsedge._relay`'s
`DetachedRelays`), which relays with its half-close rules. The connection's
task ends there; the reactor fills in the access-log record and closes what
the exit stack held when the relay ends.
"""

from __future__ import annotations

import socket

import trio

from tlsedge._accesslog import ConnectionLog
from tlsedge._cleanup import Cleanup
from tlsedge._config import ListenerConfig
from tlsedge._downstream import Downstream
from tlsedge._proxy_wrap import proxy_header_for
from tlsedge._relay import DetachedRelays, RelayStats, set_abortive_close
from tlsedge._termination import Refused, Termination
from tlsedge._upstream import BackendPool, ConnectFailedError, NoServerError

__all__ = ["serve_tcp"]

# How a relay ends when the client side finishes first; see ``health_check``.
_CLIENT_ENDED = frozenset({Termination.CLIENT_CLOSED, Termination.CLIENT_ERROR})


async def serve_tcp(
    client: trio.abc.Stream,
    downstream: Downstream,
    *,
    pool: BackendPool,
    listener: ListenerConfig,
    initial_data: bytes,
    log: ConnectionLog,
    exits: Cleanup,
    relays: DetachedRelays,
    client_socket: socket.socket | None = None,
) -> None:
    """Connect a server of *pool* and hand *client* and it to the reactor.

    Returns once the relay started (or the first bytes could not be sent):
    the reactor relays until both sides are done, then fills in *log* and
    closes *exits* (taken over from the caller).

    Args:
        client: The client's stream after the earlier stages.
        downstream: The connection's facts (the PROXY header is built from them).
        pool: The listener's backend.
        listener: The listener's settings (timeouts).
        initial_data: Client bytes an earlier stage read past its own data.
        log: The connection's access-log record, filled in here.
        exits: The connection's exit stack: the upstream is closed and the
            server's lease released by it. Once the relay started, its
            callbacks are the relay's to run (the stack is left empty).
        relays: The edge's relays on the reactor.
        client_socket: The stdlib socket under *client* when *client* is
            the accepted socket's `trio.SocketStream` (the relay uses it).

    Raises:
        Refused: ``no_server`` or ``connect_failed`` (a failed TLS handshake
            with the server is a failed connect attempt).
    """
    backend = pool.config
    header = proxy_header_for(downstream, backend.send_proxy, backend.proxy_tlvs)
    try:
        connected = await pool.connect(downstream.client_ip, proxy_header=header or b"")
    except NoServerError as exc:
        raise Refused(Termination.NO_SERVER, str(exc)) from exc
    except ConnectFailedError as exc:
        raise Refused(Termination.CONNECT_FAILED, str(exc)) from exc
    exits.callback(connected.stream.socket.close)
    exits.callback(connected.lease.release)
    log.server = str(connected.server)
    upstream = connected.upstream
    # Client bytes that came with the PROXY header or the TLS handshake.
    stats = RelayStats(bytes_from_client=len(initial_data))
    # A plain backend gets our header and the first bytes in one segment, as
    # HAProxy sends them.
    data = connected.pending + initial_data
    if data:
        try:
            await upstream.send_all(data)
        except (trio.BrokenResourceError, OSError) as exc:
            log.termination, log.detail = Termination.SERVER_ERROR, str(exc)
            set_abortive_close(client)
            _record(log, stats, downstream)
            return
    # From here the reactor owns the connection: what the connection's exit
    # stack would close and release, it closes and releases at the end.
    owned = exits.pop_all()

    def ended() -> None:
        _record(log, stats, downstream)
        owned.close()

    try:
        relays.start(
            client,
            upstream,
            stats=stats,
            idle_timeout=listener.idle_timeout,
            client_fin_timeout=listener.client_fin_timeout,
            server_fin_timeout=backend.server_fin_timeout,
            on_done=ended,
            sockets=None
            if client_socket is None or connected.tls is not None
            else (client_socket, connected.raw),
        )
    except BaseException:
        exits.callback(owned.close)  # nothing started: the owner cleans up
        raise


def _record(log: ConnectionLog, stats: RelayStats, downstream: Downstream) -> None:
    """What the relay did, into the connection's access-log record."""
    log.bytes_from_client = stats.bytes_from_client
    log.bytes_from_server = stats.bytes_from_server
    if stats.termination is not None:
        log.termination = stats.termination
    if (
        downstream.health_check
        and stats.bytes_from_client == 0
        and stats.termination in _CLIENT_ENDED
    ):
        # Checks close at once, often with an RST (HAProxy's do):
        # not a client error to count or alert on.
        log.termination = Termination.HEALTH_CHECK
