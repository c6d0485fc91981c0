"""What HTTP mode reports: the connection's result, an access-log line per request."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from tlsedge._core.accesslog import (
    access_log_enabled,
    format_time,
    write_access_line,
)
from tlsedge._core.termination import Termination

if TYPE_CHECKING:  # the relay's module is I/O; this one is pure
    from tlsedge._core.termination import RelayStats

_json_string: Final = json.encoder.encode_basestring_ascii

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
        upgraded: While the connection relays after an ``Upgrade``: the
            relay's counts so far (added to the byte counts above when it
            ends), else None.
    """

    requests: int = 0
    bytes_from_client: int = 0
    bytes_to_client: int = 0
    termination: str = Termination.UNKNOWN
    detail: str | None = None
    server: str | None = None
    upgraded: RelayStats | None = None

    def traffic(self) -> tuple[int, int, str | None]:
        """Bytes from and to the client so far (the relay's included) and the
        server in use: what the metrics read while the connection runs."""
        from_client, to_client = self.bytes_from_client, self.bytes_to_client
        upgraded = self.upgraded
        if upgraded is not None:
            from_client += upgraded.bytes_from_client
            to_client += upgraded.bytes_from_server
        return from_client, to_client, self.server


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
        declaration order, as `JsonLine` writes them (one f-string: the types
        are the fields', and the durations finite, so no value's type is
        looked up; ``test_accesslog`` holds it to ``json.dumps``)."""
        s = _json_string
        client, method, target, version = (
            self.client,
            self.method,
            self.target,
            self.version,
        )
        host, agent, status = self.host, self.user_agent, self.status
        connect, first_byte = self.connect, self.first_byte
        backend, server, tls, sni = self.backend, self.server, self.tls, self.sni
        request_id, detail = self.request_id, self.detail
        return (
            f'{{"type":"http","connection":{s(self.connection)},'
            f'"listener":{s(self.listener)},'
            f'"client":{"null" if client is None else s(client)},'
            f'"start":{s(format_time(self.start))},'
            f'"method":{"null" if method is None else s(method)},'
            f'"target":{"null" if target is None else s(target)},'
            f'"version":{"null" if version is None else s(version)},'
            f'"host":{"null" if host is None else s(host)},'
            f'"user_agent":{"null" if agent is None else s(agent)},'
            f'"status":{"null" if status is None else int.__repr__(status)},'
            f'"bytes_in":{int.__repr__(self.bytes_in)},'
            f'"bytes_out":{int.__repr__(self.bytes_out)},'
            f'"connect":{"null" if connect is None else repr(round(connect, 6))},'
            f'"first_byte":'
            f"{'null' if first_byte is None else repr(round(first_byte, 6))},"
            f'"total":{round(self.total, 6)!r},'
            f'"backend":{"null" if backend is None else s(backend)},'
            f'"server":{"null" if server is None else s(server)},'
            f'"tls":{"null" if tls is None else s(tls)},'
            f'"sni":{"null" if sni is None else s(sni)},'
            f'"request_id":{"null" if request_id is None else s(request_id)},'
            f'"termination":{s(self.termination)},'
            f'"detail":{"null" if detail is None else s(detail)}}}'
        )
