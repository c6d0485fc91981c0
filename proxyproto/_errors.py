"""The three exception classes of proxyproto.

Everything in __all__ is re-exported as part of the public API.

``RemoteProtocolError`` means the peer sent something that is not a valid PROXY
header: close the connection. ``LocalProtocolError`` means *we* asked for
something impossible (encode a header that cannot be represented, feed data into
a reader that already finished). Both carry a short machine-readable ``reason``
for metrics and logs, next to a message that says what was expected and what was
seen.
"""

from __future__ import annotations

__all__ = ["LocalProtocolError", "ProxyProtocolError", "RemoteProtocolError"]

# Messages quote at most this many bytes of peer input, so an error never echoes
# unbounded attacker-controlled data into a log.
MAX_QUOTED_BYTES = 32


class ProxyProtocolError(Exception):
    """Base class of proxyproto's errors; never raised directly.

    Attributes:
        reason: a short, stable, machine-readable cause such as ``"bad_signature"``
            or ``"crc32c_mismatch"``, suitable as a metrics label.
    """

    reason: str

    def __init__(self, msg: str, *, reason: str = "invalid") -> None:
        if type(self) is ProxyProtocolError:
            raise TypeError("tried to directly instantiate ProxyProtocolError")
        super().__init__(msg)
        self.reason = reason


class LocalProtocolError(ProxyProtocolError):
    """We tried to do something the protocol does not allow."""


class RemoteProtocolError(ProxyProtocolError):
    """The peer sent bytes that are not a valid PROXY header."""


def quote(data: bytes | bytearray | memoryview) -> str:
    """Render peer bytes for an error message, bounded and escaped."""
    raw = bytes(data[: MAX_QUOTED_BYTES + 1])
    if len(raw) > MAX_QUOTED_BYTES:
        return repr(raw[:MAX_QUOTED_BYTES])[:-1] + "...'"
    return repr(raw)
