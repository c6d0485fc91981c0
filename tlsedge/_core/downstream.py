"""What the edge knows about a client connection, once its stages have run.

One frozen record, built by the connection's owner after the PROXY unwrap and
TLS stages, and read by the mode (tcp relay or http), the PROXY header we send
upstream and the access log. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Downstream", "SSLFacts"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class SSLFacts:
    """What a completed server-side handshake negotiated (for PROXY v2's SSL TLV).

    Attributes:
        version: ``"TLSv1.3"``, ``"TLSv1.2"``...
        cipher: The OpenSSL cipher name (``"TLS_AES_256_GCM_SHA384"``,
            ``"ECDHE-RSA-AES128-GCM-SHA256"``).
        alpn: The negotiated ALPN protocol, or None.
        server_name: The SNI the client sent, or None.
        client_cert_der: The client's certificate (DER) if it sent one.
        client_cn: The subject CN of the client's certificate, if any.
        verified: True iff a client certificate was presented and verified.
        sig_alg: How our certificate is signed (``"RSA-SHA256"``).
        key_alg: Our certificate's key (``"EC256"``, ``"RSA2048"``).
        group: The key exchange group: always None (Python 3.11 cannot tell).
        sig_scheme: The handshake signature scheme: always None (same reason).
    """

    version: str
    cipher: str
    alpn: str | None
    server_name: str | None
    client_cert_der: bytes | None
    client_cn: str | None
    verified: bool
    sig_alg: str
    key_alg: str
    group: str | None = None
    sig_scheme: str | None = None
