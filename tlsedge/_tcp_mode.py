"""Stage: tcp mode: a backend server, our PROXY header, TLS to it, the relay.

The last stage of a ``mode = "tcp"`` connection. It connects a server of the
backend (balancing, retries: `BackendPool.connect`), registers the upstream's
socket and the server's lease with the connection's exit stack (so the owner's
cleanup closes and gives back everything, also when cancelled), sends the
PROXY header (``send_proxy``) and the client's first bytes, re-encrypts if the
backend says ``protocol = "tls"``, and relays with the half-close rules of
`tlsedge._relay`. What happened goes into the connection's access-log record.
"""

from __future__ import annotations

import contextlib

import trio

from tlsedge._accesslog import ConnectionLog
from tlsedge._balancer import Server
from tlsedge._config import ListenerConfig
from tlsedge._downstream import Downstream
from tlsedge._proxy_wrap import proxy_header_for
from tlsedge._relay import RelayStats, relay, set_abortive_close
from tlsedge._termination import Refused, Termination
from tlsedge._tls_stream import TLSStream
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

    Raises:
        Refused: ``no_server``, ``connect_failed`` or ``server_tls_error``.
    """
    try:
        connected = await pool.connect(downstream.client_ip)
    except NoServerError as exc:
        raise Refused(Termination.NO_SERVER, str(exc)) from exc
    except ConnectFailedError as exc:
        raise Refused(Termination.CONNECT_FAILED, str(exc)) from exc
    exits.callback(connected.stream.socket.close)
    exits.callback(connected.lease.release)
    log.server = str(connected.server)
    backend = pool.config
    # Client bytes that came with the PROXY header or the TLS handshake.
    stats = RelayStats(bytes_from_client=len(initial_data))
    data = initial_data
    upstream: trio.abc.Stream = connected.stream
    try:
        header = proxy_header_for(downstream, backend.send_proxy, backend.proxy_tlvs)
        if header is not None and pool.tls_context is None:
            data = header + data  # one segment, as HAProxy sends it
        elif header is not None:
            await upstream.send_all(header)  # before the TLS handshake
        if pool.tls_context is not None:
            upstream = await _encrypt_upstream(pool, connected.stream, connected.server)
        if data:
            await upstream.send_all(data)
        await relay(
            client,
            upstream,
            stats=stats,
            idle_timeout=listener.idle_timeout,
            client_fin_timeout=listener.client_fin_timeout,
            server_fin_timeout=backend.server_fin_timeout,
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


async def _encrypt_upstream(
    pool: BackendPool, stream: trio.SocketStream, server: Server
) -> TLSStream:
    """TLS to the backend server (``protocol = "tls"``) within ``connect_timeout``.

    Raises:
        Refused: ``server_tls_error``.
    """
    assert pool.tls_context is not None
    tls = TLSStream(
        stream,
        pool.tls_context,
        server_side=False,
        server_hostname=pool.server_hostname(stream),
    )
    timeout = pool.config.connect_timeout
    failed = f"backend {pool.name}: TLS to {server} failed"
    with trio.move_on_after(timeout) as connect_timeout_scope:
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            raise Refused(
                Termination.SERVER_TLS_ERROR, f"{failed}: {exc.__cause__ or exc}"
            ) from exc
    if connect_timeout_scope.cancelled_caught:
        raise Refused(
            Termination.SERVER_TLS_ERROR,
            f"{failed}: no TLS handshake within {timeout:g} s",
        )
    return tls
