"""What HTTP mode reports: the connection's result, an access-log line per request.

Cost of a request's line: a connection builds one `RequestLines`, which
encodes the fields its requests share (id, listener, client, backend, TLS,
SNI) once; per request the drivers fill a `RequestLog` (the record
``on_request`` gets) and `RequestLines.line` writes one f-string of those
constant pieces and the request's own values: each string through the ``json``
module's C escaper (the method, version, host, user agent and server only when
they differ from the connection's last request's), the second of ``start``
cached, its milliseconds a table lookup, the durations with one float
conversion each (`_seconds`), the numbers through ``str``. A request's
`RequestLog` is made by `RequestLines.new` with stores, not a class call.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from tlsedge._core.accesslog import (
    access_log_enabled,
    access_log_writer,
    second_text,
    write_access_line,
)
from tlsedge._core.termination import Termination

if TYPE_CHECKING:  # the relay's module is I/O; this one is pure
    from tlsedge._core.termination import RelayStats

_json_string: Final = json.encoder.encode_basestring_ascii
_new_request_log: Final = object.__new__
_OK: Final = Termination.OK
_OK_TEXT: Final = _json_string(_OK)
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
        "_agent",
        "_agent_json",
        "_host",
        "_host_json",
        "_method",
        "_method_json",
        "_second",
        "_second_text",
        "_server",
        "_server_json",
        "_version",
        "_version_json",
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
        # The last request's values that the next one most likely repeats,
        # and their JSON (the text of its second): one comparison instead of
        # an escape (a division and a cache look-up).
        self._method: str | None = None
        self._version: str | None = None
        self._host: str | None = None
        self._agent: str | None = None
        self._server: str | None = None
        self._method_json = self._version_json = self._host_json = "null"
        self._agent_json = self._server_json = "null"
        #: The first millisecond of the last ``start``'s second (none yet).
        self._second = -1000
        self._second_text = ""

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
        """The record of a request of this connection (its shared fields set).

        Equal to ``RequestLog(...)`` with these values and the defaults
        (``test_accesslog``), made without calling the class: a class call
        with keywords costs ~5,000 instructions more than the stores.
        """
        log = _new_request_log(RequestLog)
        log.connection = self.connection
        log.listener = self.listener
        log.client = self.client
        log.start = start
        log.method = method
        log.target = target
        log.version = version
        log.host = host
        log.user_agent = user_agent
        log.status = None
        log.bytes_in = 0
        log.bytes_out = 0
        log.connect = None
        log.first_byte = None
        log.total = 0.0
        log.backend = self.backend
        log.server = None
        log.tls = self.tls
        log.sni = self.sni
        log.request_id = None
        log.termination = _OK
        log.detail = None
        return log

    def emit(self, log: RequestLog) -> None:
        """Write *log*'s line (if the access logger is enabled); the writer
        makes it later, so *log* must not change any more."""
        writer = access_log_writer()
        if writer is not None:  # what the tlsedge command installs
            writer.write_later(self.line, log)
        elif access_log_enabled():
            write_access_line(self.line(log))

    def line(self, log: RequestLog) -> str:
        """*log*'s access-log line (*log* is a request of this connection)."""
        s = _json_string
        method, target, version = log.method, log.target, log.version
        host, agent, server = log.host, log.user_agent, log.server
        if method != self._method:
            self._method, self._method_json = method, _optional(method)
        if version != self._version:
            self._version, self._version_json = version, _optional(version)
        if host != self._host:
            self._host, self._host_json = host, _optional(host)
        if agent != self._agent:
            self._agent, self._agent_json = agent, _optional(agent)
        if server != self._server:
            self._server, self._server_json = server, _optional(server)
        status, connect, first_byte = log.status, log.connect, log.first_byte
        request_id, termination, detail = log.request_id, log.termination, log.detail
        millis = _floor(log.start * 1000) - self._second
        if not 0 <= millis < 1000:
            second, millis = divmod(millis + self._second, 1000)
            self._second, self._second_text = second * 1000, second_text(second)
        return (
            f"{self._after_start}{self._second_text}{_MILLIS[millis]}"
            f'"method":{self._method_json},'
            f'"target":{"null" if target is None else s(target)},'
            f'"version":{self._version_json},'
            f'"host":{self._host_json},'
            f'"user_agent":{self._agent_json},'
            f'"status":{"null" if status is None else status},'
            f'"bytes_in":{log.bytes_in},'
            f'"bytes_out":{log.bytes_out},'
            f'"connect":{"null" if connect is None else _seconds(connect)},'
            f'"first_byte":{"null" if first_byte is None else _seconds(first_byte)},'
            f'"total":{_seconds(log.total)}{self._after_total}'
            f"{self._server_json}{self._after_server}"
            f'"request_id":{"null" if request_id is None else s(request_id)},'
            f'"termination":'
            f"{_OK_TEXT if termination is _OK else s(termination)},"
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
