"""One JSON access-log line per connection (logger ``tlsedge.access``).

Every connection ends with exactly one line saying who it was, where it went,
how many bytes went each way, how long it took and why it ended. JSON encoding
escapes anything a peer could smuggle into a field (addresses come from
validated headers, error texts quote peer bytes with ``repr``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

__all__ = ["ACCESS_LOGGER", "ConnectionLog"]

ACCESS_LOGGER = logging.getLogger("tlsedge.access")


def format_address(address: tuple[str, int] | None) -> str | None:
    """``"ip:port"``, with IPv6 in brackets; None stays None."""
    if address is None:
        return None
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
    termination: str = "unknown"
    detail: str | None = None
    start: float = 0.0
    duration: float = 0.0

    def emit(self) -> None:
        """Write the line (if the access logger is enabled)."""
        if not ACCESS_LOGGER.isEnabledFor(logging.INFO):
            return
        fields = asdict(self)
        fields["start"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.start))
        fields["duration"] = round(self.duration, 6)
        ACCESS_LOGGER.info("%s", json.dumps(fields, separators=(",", ":")))
