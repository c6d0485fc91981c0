"""What the edge knows about a client connection, once its stages have run.

One frozen record, built by the connection's owner after the PROXY unwrap and
TLS stages, and read by the mode (tcp relay or http), the PROXY header we send
upstream and the access log. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tlsedge._tls import SSLFacts

__all__ = ["Downstream"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Downstream:
    """The facts of one client connection.

    Attributes:
        id: The connection's id (access log, PROXY UNIQUE_ID, request lines).
        listener: The listener's name.
        peer: The TCP peer (a load balancer when the PROXY header is trusted).
        client: The real client: the PROXY header's source when trusted,
            otherwise the peer. None when unknown.
        destination: The address the client connected to (the header's
            destination when trusted, otherwise our socket's address).
        health_check: The PROXY header described no client (v2 LOCAL, v1
            UNKNOWN): the load balancer's own connection, usually a check.
        tls: What the client's TLS handshake negotiated; None without TLS.
    """

    id: str
    listener: str
    peer: tuple[str, int] | None
    client: tuple[str, int] | None
    destination: tuple[str, int] | None
    health_check: bool = False
    tls: SSLFacts | None = None

    @property
    def client_ip(self) -> str | None:
        """The real client's IP address (for affinity and forwarding headers)."""
        return self.client[0] if self.client is not None else None
