"""What HTTP mode reports: the connection's result, an access-log line per request."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from tlsedge._accesslog import (
    access_log_enabled,
    format_time,
    json_object,
    write_access_line,
)
from tlsedge._termination import Termination

__all__ = ["HttpConnectionResult", "RequestLog"]

LOGGER = logging.getLogger("tlsedge.http")

#: Error responses that say the backend failed: logged at WARNING. Every other
#: error response (4xx, and 501/505 for what the client asked) is the client's
#: doing, logged at INFO: a client must not be able to raise warnings at will.
_BACKEND_FAILURES: Final = frozenset(
    {
        Termination.NO_SERVER,
        Termination.CONNECT_FAILED,
        Termination.SERVER_ERROR,
        Termination.RESPONSE_TIMEOUT,
    }
)


@dataclass(slots=True)
class HttpConnectionResult:
    """What `serve_http` reports for the connection-level access-log line.

    Updated in place while the connection runs (pass one in to see the counts
    of a connection that was cancelled).

    Attributes:
        requests: Requests answered (with any status).
        bytes_from_client: Raw bytes read from the client.
        bytes_to_client: Raw bytes written to the client.
        termination: Why it ended (see `Termination`).
        detail: A human-readable detail for errors, or None.
        server: The last upstream server used (``ip:port``), or None.
    """

    requests: int = 0
    bytes_from_client: int = 0
    bytes_to_client: int = 0
    termination: str = Termination.UNKNOWN
    detail: str | None = None
    server: str | None = None


@dataclass(slots=True)
class RequestLog:
    """One per-request access-log line (logger ``tlsedge.access``, JSON).

    The fields a connection's line has too (``listener``, ``client``, ``start``,
    ``tls``, ``sni``, ``backend``, ``server``, ``termination``, ``detail``)
    have its names and formats; docs/operations.md describes every field.
    ``start`` is a Unix time, written in RFC 3339 with milliseconds (UTC).
    """

    connection: str
    listener: str
    client: str | None
    start: float = 0.0
    method: str | None = None
    target: str | None = None
    version: str | None = None
    host: str | None = None
    user_agent: str | None = None
    status: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    connect: float | None = None
    first_byte: float | None = None
    total: float = 0.0
    backend: str | None = None
    server: str | None = None
    tls: str | None = None
    sni: str | None = None
    request_id: str | None = None
    termination: str = Termination.OK
    detail: str | None = None

    def error_response(
        self, listener: str, status: int, reason: str, termination: str
    ) -> None:
        """Record that we answered *status* ourselves, and log why: at WARNING
        when the backend failed, at INFO when the client asked for it."""
        self.status = status
        self.termination = termination
        self.detail = reason
        LOGGER.log(
            logging.WARNING if termination in _BACKEND_FAILURES else logging.INFO,
            "listener %s: client %s: %s %s -> %d: %s",
            listener,
            self.client,
            self.method,
            self.target,
            status,
            reason,
        )

    def emit(self) -> None:
        """Write the line (if the access logger is enabled)."""
        if access_log_enabled():
            write_access_line(self.to_json())

    def to_json(self) -> str:
        """The access-log line: one JSON object, ``type`` then the fields in
        declaration order."""
        connect, first_byte = self.connect, self.first_byte
        return json_object(
            {
                "connection": self.connection,
                "listener": self.listener,
                "client": self.client,
                "start": format_time(self.start),
                "method": self.method,
                "target": self.target,
                "version": self.version,
                "host": self.host,
                "user_agent": self.user_agent,
                "status": self.status,
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "connect": round(connect, 6) if connect is not None else None,
                "first_byte": (
                    round(first_byte, 6) if first_byte is not None else None
                ),
                "total": round(self.total, 6),
                "backend": self.backend,
                "server": self.server,
                "tls": self.tls,
                "sni": self.sni,
                "request_id": self.request_id,
                "termination": self.termination,
                "detail": self.detail,
            },
            '{"type":"http",',
        )
