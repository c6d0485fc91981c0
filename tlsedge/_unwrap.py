"""Stage: the PROXY header of a trusted load balancer (``proxy_protocol``).

The bridge from `proxyproto` (the codec and its trio adapter) to the edge: the
trust policy decides from the peer address, before any byte is read, whether a
header must come; the header must arrive within ``timeout``; what it says
replaces the socket's endpoints. Bytes that came after the header are handed
to the next stage as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from proxyproto import Command, Family, RemoteProtocolError, TrustPolicy
from proxyproto.trio import read_proxy_header
from tlsedge._config import ProxyProtocolConfig
from tlsedge._termination import Refused, Termination

__all__ = ["Unwrapped", "unwrap_proxy_header"]

#: `RemoteProtocolError.reason` values with a termination of their own.
_TERMINATIONS = {
    "rejected": Termination.REJECTED,
    "timeout": Termination.HEADER_TIMEOUT,
}


@dataclass(frozen=True, slots=True)
class Unwrapped:
    """What the PROXY stage found.

    Attributes:
        client: The real client (the header's source, else the peer).
        destination: Where the client connected (the header's, else ours).
        health_check: The header described no client (LOCAL, v1 UNKNOWN, v2
            UNSPEC): the load balancer's own connection.
        leftover: Bytes received after the header, for the next stage.
    """

    client: tuple[str, int] | None
    destination: tuple[str, int] | None
    health_check: bool
    leftover: bytes


async def unwrap_proxy_header(
    stream: trio.SocketStream,
    *,
    trust: TrustPolicy,
    settings: ProxyProtocolConfig,
    peer: tuple[str, int] | None,
    local: tuple[str, int] | None,
) -> Unwrapped:
    """Read the header the trust policy asks for on *stream*.

    Raises:
        Refused: ``rejected`` (the policy refuses the peer), ``header_timeout``,
            ``header_error`` (with the codec's reason for metrics), or
            ``client_error`` (the peer broke the connection first).
    """
    try:
        proxy_stream = await read_proxy_header(
            stream,
            policy=trust.decide(peer, local),
            header_timeout=settings.timeout,
            versions=settings.versions,
        )
    except RemoteProtocolError as exc:
        termination = _TERMINATIONS.get(exc.reason, Termination.HEADER_ERROR)
        raise Refused(termination, str(exc), reason=exc.reason) from exc
    except trio.BrokenResourceError as exc:
        raise Refused(Termination.CLIENT_ERROR, str(exc)) from exc
    received = proxy_stream.header
    _, leftover = proxy_stream.detach()
    return Unwrapped(
        client=proxy_stream.client_address or peer,
        destination=proxy_stream.server_address or local,
        health_check=received is not None
        and (received.command is Command.LOCAL or received.family is Family.UNSPEC),
        leftover=leftover,
    )
