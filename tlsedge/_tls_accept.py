"""Stage: the client's TLS handshake (``[listeners.tls]``).

Bytes that came after a PROXY header are fed to the handshake first (never
over-read, never dropped). A connection that described no client in its PROXY
header and closes without a byte of TLS is the load balancer's check, not a
failed handshake.
"""

from __future__ import annotations

import trio

from tlsedge._termination import Refused, Termination
from tlsedge._tls import ServerTLS, SSLFacts, ssl_facts
from tlsedge._tls_stream import TLSStream

__all__ = ["accept_tls"]


async def accept_tls(
    stream: trio.SocketStream,
    server_tls: ServerTLS,
    *,
    initial_data: bytes,
    handshake_timeout: float,
    health_check: bool,
) -> tuple[TLSStream, SSLFacts]:
    """Run the server side of the handshake on *stream* within *handshake_timeout*.

    Returns the TLS stream (its transport is *stream*, which the caller keeps
    owning) and what the handshake negotiated.

    Raises:
        Refused: ``tls_error``, ``tls_handshake_timeout``, or ``health_check``
            (a *health_check* connection that sent no byte of TLS).
    """
    tls_stream = TLSStream(
        stream, server_tls.context, server_side=True, initial_data=initial_data
    )
    with trio.move_on_after(handshake_timeout) as handshake_timeout_scope:
        try:
            await tls_stream.do_handshake()
        except trio.BrokenResourceError as exc:
            detail = str(exc.__cause__ or exc)
            if health_check and tls_stream.transport_bytes_received == 0:
                # The load balancer's check: connect, header, close.
                raise Refused(Termination.HEALTH_CHECK, detail) from exc
            raise Refused(Termination.TLS_ERROR, detail) from exc
    if handshake_timeout_scope.cancelled_caught:
        raise Refused(
            Termination.TLS_HANDSHAKE_TIMEOUT,
            f"no TLS handshake within {handshake_timeout:g} s",
        )
    return tls_stream, ssl_facts(tls_stream.ssl_object, server_tls)
