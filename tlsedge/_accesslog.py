"""One JSON access-log line per connection (logger ``tlsedge.access``).

Every connection ends with exactly one line saying who it was, where it went,
how many bytes went each way, when it started, how long it took and why it
ended (HTTP mode adds a line per request: ``tlsedge._http.RequestLog``, with
the same names and formats for the fields both have; docs/operations.md
describes every field). JSON encoding
escapes anything a peer could smuggle into a field (addresses come from
validated headers, error texts quote peer bytes with ``repr``).

Cost: the line is built from the slots directly (``dataclasses.asdict`` deep-copies
every value, ~18 us a call) and encoded by one shared :class:`json.JSONEncoder`
(the C encoder), so building a line costs a few microseconds; writing it is the
handler's business. The output is byte-identical to
``json.dumps(asdict(log), separators=(",", ":"))`` with ``start`` and
``duration`` formatted as below (``start``: `format_time`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, fields

from tlsedge._termination import Termination

__all__ = ["ACCESS_LOGGER", "ConnectionLog", "format_address", "format_time"]

ACCESS_LOGGER = logging.getLogger("tlsedge.access")


def format_address(address: tuple[str, int] | None) -> str | None:
    """``"ip:port"``, with IPv6 in brackets; None stays None."""
    if address is None:
        return None
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def format_time(timestamp: float) -> str:
    """A Unix time in RFC 3339, UTC, milliseconds: ``2026-11-23T19:50:01.123Z``.

    Milliseconds are cut, not rounded, so a time never shows the next second.
    """
    millis = math.floor(timestamp * 1000)
    seconds, millis = divmod(millis, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


@dataclass(slots=True)
class ConnectionLog:
    """The fields of one access-log line, filled in as the connection goes."""

    id: str
    listener: str
    peer: str | None
    client: str | None = None
    destination: str | None = None
    backend: str | None = None
    server: str | None = None
    tls: str | None = None
    sni: str | None = None
    bytes_from_client: int = 0
    bytes_from_server: int = 0
    requests: int | None = None  # HTTP mode: requests on this connection
    termination: str = Termination.UNKNOWN
    detail: str | None = None
    start: float = 0.0
    duration: float = 0.0

    def to_json(self) -> str:
        """The access-log line: one JSON object, fields in declaration order."""
        line = {name: getattr(self, name) for name in _FIELD_NAMES}
        line["start"] = format_time(self.start)
        line["duration"] = round(self.duration, 6)
        return _ENCODE(line)

    def emit(self) -> None:
        """Write the line (if the access logger is enabled)."""
        if ACCESS_LOGGER.isEnabledFor(logging.INFO):
            ACCESS_LOGGER.info("%s", self.to_json())


_FIELD_NAMES = tuple(f.name for f in fields(ConnectionLog))
# json.dumps(obj, separators=...) builds a new JSONEncoder per call; reuse one.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
