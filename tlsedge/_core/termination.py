"""Why a connection or an HTTP request ended: the one vocabulary.

Every stage of a connection's path (PROXY unwrap, TLS, the tcp relay, HTTP
mode), the access log and the metrics use these members. They are strings
(`enum.StrEnum`), so a member is written to the JSON access log and used as a
metric label as its value, and compares equal to it.

A stage that refuses a connection raises `Refused` with the member that says
why; `tlsedge._pipeline.close` records it, and decides every connection's ending.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Refused", "RelayStats", "Termination"]


class Termination(enum.StrEnum):
    """The access log's ``termination`` values (docs/operations.md)."""

    UNKNOWN = "unknown"
    """Not decided yet (a connection still running)."""

    # -- refused before any byte was relayed ---------------------------------
    REJECTED = "rejected"
    """The PROXY trust policy refuses the peer."""
    DENIED = "denied"
    """The listener's ``allow``/``deny`` networks refuse the real client
    (closed before TLS, or answered 403 with ``denied = "403"``)."""
    HEADER_TIMEOUT = "header_timeout"
    """No complete PROXY header within ``proxy_protocol.timeout``."""
    HEADER_ERROR = "header_error"
    """A malformed or refused PROXY header."""
    TLS_ERROR = "tls_error"
    """The client's TLS handshake failed."""
    TLS_HANDSHAKE_TIMEOUT = "tls_handshake_timeout"
    """No TLS handshake within ``tls.handshake_timeout``."""
    NO_SERVER = "no_server"
    """No healthy server in the backend."""
    CONNECT_FAILED = "connect_failed"
    """Every connect attempt to the backend failed (with ``protocol = "tls"``,
    a failed TLS handshake is a failed attempt)."""
    HEALTH_CHECK = "health_check"
    """A load balancer's check: a PROXY header describing no client (LOCAL, v1
    UNKNOWN), then a close without a byte."""

    # -- how a relayed connection ended -----------------------------------------
    CLIENT_CLOSED = "client_closed"
    """The client's EOF came first, then the server finished (http mode: the
    client closed between requests)."""
    SERVER_CLOSED = "server_closed"
    """The server's EOF came first, then the client finished."""
    IDLE_TIMEOUT = "idle_timeout"
    """No byte from either side for ``idle_timeout`` seconds (udp mode: no
    datagram either way; the normal end of a flow)."""
    CLIENT_FIN_TIMEOUT = "client_fin_timeout"
    """The server finished; the client did not within ``client_fin_timeout``."""
    SERVER_FIN_TIMEOUT = "server_fin_timeout"
    """The client finished; the server did not within ``server_fin_timeout``."""
    CLIENT_ERROR = "client_error"
    """RST, read or write error on the client side (http mode: the client went
    away or stalled mid-exchange)."""
    SERVER_ERROR = "server_error"
    """RST, read or write error on the server side (http mode: the upstream broke
    before responding, 502; udp mode: the server's host reported its port
    unreachable)."""
    DRAINED = "drained"
    """Cut by the drain deadline (or the edge stopping); udp flows too."""
    INTERNAL_ERROR = "internal_error"
    """A bug; logged with a traceback."""

    # -- http mode -----------------------------------------------------------------
    OK = "ok"
    """A request answered in full (request lines only)."""
    KEEPALIVE_TIMEOUT = "keepalive_timeout"
    """Idle between requests for ``keepalive_timeout``."""
    REQUEST_HEADER_TIMEOUT = "request_header_timeout"
    """No complete request head within ``request_header_timeout``."""
    CLOSED = "closed"
    """A response with ``Connection: close`` was sent."""
    BAD_REQUEST = "bad_request"
    """An error response (4xx, 5xx) to the client's request."""
    RESPONSE_TIMEOUT = "response_timeout"
    """The upstream did not answer within ``response_timeout`` (504)."""
    SERVER_ABORTED = "server_aborted"
    """The upstream broke mid-response: the client is reset."""
    UPGRADED = "upgraded"
    """Upgraded (WebSocket) and relayed; written ``upgraded:<how the relay ended>``."""


class Refused(Exception):
    """A stage refuses the connection: *termination* says why, *detail* says more.

    Args:
        termination: The access log's cause.
        detail: What happened, for the access log's ``detail`` (one line).
        reason: A short code for metrics, where the stage has one (a PROXY
            header's `proxyproto.RemoteProtocolError.reason`).
    """

    def __init__(
        self, termination: Termination, detail: str, *, reason: str | None = None
    ) -> None:
        super().__init__(f"{termination}: {detail}")
        self.termination = termination
        self.detail = detail
        self.reason = reason


@dataclass(slots=True)
class RelayStats:
    """Counters for one relayed connection, updated in place while relaying.

    Passed in rather than returned so that a caller whose relay was cancelled still
    sees the partial counts.

    Attributes:
        bytes_from_client: Bytes received from the client (forwarded to the server
            unless an error cut the connection).
        bytes_from_server: Bytes received from the server.
        termination: Why the relay ended; ``None`` while it runs.
    """

    bytes_from_client: int = 0
    bytes_from_server: int = 0
    termination: Termination | None = None
