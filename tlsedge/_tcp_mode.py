"""Stage: tcp mode: a backend server, our PROXY header, TLS to it, the relay.

The last stage of a ``mode = "tcp"`` connection. It connects a server of the
backend (balancing, retries, and for ``protocol = "tls"`` the handshake, all in
`BackendPool.connect`), registers the upstream's socket and the server's lease
with the connection's exit stack (so the owner's cleanup closes and gives back
everything, also when cancelled), sends the PROXY header (``send_proxy``) and
the client's first bytes, and relays with the half-close rules of
`tlsedge._relay`. What happened goes into the connection's access-log record.
"""

from __future__ import annotations

import contextlib
import socket

import trio

from tlsedge._accesslog import ConnectionLog
from tlsedge._config import ListenerConfig
from tlsedge._downstream import Downstream
from tlsedge._proxy_wrap import proxy_header_for
from tlsedge._relay import RelayStats, relay, set_abortive_close
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
    exits: contextlib.AsyncExitStack,
    client_socket: socket.socket | None = None,
) -> None:
    """Relay *client* to a server of *pool* until both sides are done.

    Args:
        client: The client's stream after the earlier stages.
        downstream: The connection's facts (the PROXY header is built from them).
        pool: The listener's backend.
        listener: The listener's settings (timeouts).
        initial_data: Client bytes an earlier stage read past its own data.
        log: The connection's access-log record, filled in here.
        exits: The connection's exit stack: the upstream is closed and the
            server's lease released by it.
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
    try:
        if data:
            await upstream.send_all(data)
        await relay(
            client,
            upstream,
            stats=stats,
            idle_timeout=listener.idle_timeout,
            client_fin_timeout=listener.client_fin_timeout,
            server_fin_timeout=backend.server_fin_timeout,
            sockets=None
            if client_socket is None or connected.tls is not None
            else (client_socket, connected.raw),
        )
    except (trio.BrokenResourceError, OSError) as exc:
        # Sending the PROXY header or the first bytes failed.
        log.termination, log.detail = Termination.SERVER_ERROR, str(exc)
        set_abortive_close(client)
    finally:
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
