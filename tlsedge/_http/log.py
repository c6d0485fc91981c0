"""What HTTP mode reports: the connection's result, an access-log line per request.

Cost of a request's line: a connection builds one `RequestLines`, which
encodes the fields its requests share (id, listener, client, backend, TLS,
SNI) once; per request the drivers fill a `RequestLog` (the record
``on_request`` gets) and `RequestLines.line` writes one f-string of those
constant pieces and the request's own values: each string through the ``json``
module's C escaper, the second of ``start`` cached, its milliseconds a table
lookup, the durations with one float conversion each (`_seconds`).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from tlsedge._core.accesslog import (
    access_log_enabled,
    second_text,
    write_access_line,
)
from tlsedge._core.termination import Termination

if TYPE_CHECKING:  # the relay's module is I/O; this one is pure
    from tlsedge._core.termination import RelayStats

_json_string: Final = json.encoder.encode_basestring_ascii
_floor: Final = math.floor
#: The end of ``start`` for each millisecond (a lookup: a ``03d`` format costs
#: ~2,300 instructions a line, callgrind).
_MILLIS: Final = tuple(f'.{millis:03d}Z",' for millis in range(1000))

__all__ = ["HttpConnectionResult", "RequestLines", "RequestLog"]

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
        declaration order (what `RequestLines.line` writes)."""
        return RequestLines(
            connection=self.connection,
            listener=self.listener,
            client=self.client,
            backend=self.backend,
            tls=self.tls,
            sni=self.sni,
        ).line(self)


class RequestLines:
    """The access-log lines of one connection's requests.

    What all requests of a connection share (its id, listener, client,
    backend, TLS version and cipher, SNI) is encoded once, here, into the
    constant parts of the line; `line` adds what one request has of its own.
    The line is byte-identical to ``json.dumps`` of ``type`` and the
    `RequestLog`'s fields in order, ``start`` written by
    `tlsedge._core.accesslog.format_time` and the durations rounded to the
    microsecond (``test_accesslog`` holds it to that): every string is
    escaped by the C function the ``json`` module uses, but the ``start``
    text, which is digits the edge writes.
    """

    __slots__ = (
        "_after_server",
        "_after_start",
        "_after_total",
        "backend",
        "client",
        "connection",
        "listener",
        "sni",
        "tls",
    )

    def __init__(
        self,
        *,
        connection: str,
        listener: str,
        client: str | None,
        backend: str | None,
        tls: str | None,
        sni: str | None,
    ) -> None:
        self.connection = connection
        self.listener = listener
        self.client = client
        self.backend = backend
        self.tls = tls
        self.sni = sni
        self._after_start = (
            f'{{"type":"http","connection":{_json_string(connection)},'
            f'"listener":{_json_string(listener)},"client":{_optional(client)},'
            '"start":"'
        )
        self._after_total = f',"backend":{_optional(backend)},"server":'
        self._after_server = f',"tls":{_optional(tls)},"sni":{_optional(sni)},'

    def new(
        self,
        start: float,
        method: str | None = None,
        target: str | None = None,
        version: str | None = None,
        *,
        host: str | None = None,
        user_agent: str | None = None,
    ) -> RequestLog:
        """The record of a request of this connection (its shared fields set)."""
        return RequestLog(
            self.connection,
            self.listener,
            self.client,
            start,
            method,
            target,
            version,
            host,
            user_agent,
            backend=self.backend,
            tls=self.tls,
            sni=self.sni,
        )

    def emit(self, log: RequestLog) -> None:
        """Write *log*'s line (if the access logger is enabled)."""
        if access_log_enabled():
            write_access_line(self.line(log))

    def line(self, log: RequestLog) -> str:
        """*log*'s access-log line (*log* is a request of this connection)."""
        s = _json_string
        number = int.__repr__
        method, target, version = log.method, log.target, log.version
        host, agent, status = log.host, log.user_agent, log.status
        connect, first_byte = log.connect, log.first_byte
        server, request_id, detail = log.server, log.request_id, log.detail
        second, millis = divmod(_floor(log.start * 1000), 1000)
        return (
            f"{self._after_start}{second_text(second)}{_MILLIS[millis]}"
            f'"method":{"null" if method is None else s(method)},'
            f'"target":{"null" if target is None else s(target)},'
            f'"version":{"null" if version is None else s(version)},'
            f'"host":{"null" if host is None else s(host)},'
            f'"user_agent":{"null" if agent is None else s(agent)},'
            f'"status":{"null" if status is None else number(status)},'
            f'"bytes_in":{number(log.bytes_in)},'
            f'"bytes_out":{number(log.bytes_out)},'
            f'"connect":{"null" if connect is None else _seconds(connect)},'
            f'"first_byte":{"null" if first_byte is None else _seconds(first_byte)},'
            f'"total":{_seconds(log.total)}{self._after_total}'
            f"{'null' if server is None else s(server)}{self._after_server}"
            f'"request_id":{"null" if request_id is None else s(request_id)},'
            f'"termination":{s(log.termination)},'
            f'"detail":{"null" if detail is None else s(detail)}}}'
        )


def _seconds(duration: float) -> str:
    """``repr(round(duration, 6))`` at ~60% of its cost, for what durations are.

    Between 100 µs and 10⁹ s, that ``repr`` is the value to six decimals
    without its trailing zeros: ``round`` takes its digits from the same
    correctly rounded conversion (``_Py_dg_dtoa``, mode 3) as the ``.6f``
    format does, and ``repr`` writes the shortest text that reads back as the
    same float, which for 15 significant digits or fewer is that text itself.
    Outside (``1.2e-05``, ``1e+16``), the ``repr`` of the ``round``.
    """
    if 0.0001 <= duration < 1e9:
        text = f"{duration:.6f}".rstrip("0")
        return text + "0" if text[-1] == "." else text
    return repr(round(duration, 6))


def _optional(text: str | None) -> str:
    """*text* as a JSON string, or ``null``."""
    return "null" if text is None else _json_string(text)
