"""The server name of a TLS ClientHello, read before OpenSSL reads it (sans-IO).

Why: Python's ``ssl`` hands the ClientHello's server_name (SNI) to the
``sni_callback`` decoded as ASCII. OpenSSL accepts any bytes there but NUL, so a
client that sends ``b"\\xff\\xfe"`` makes the decoding fail inside ``_ssl``,
before our callback runs: CPython prints "Exception ignored in ..." and a
traceback to stderr (not through `logging`) and fails the handshake with an
``internal_error`` alert. `ServerNameCheck` sees the same bytes first and
says when a ClientHello names its server in bytes that are not ASCII, so that
the handshake stage refuses it cleanly (an ``unrecognized_name`` alert, as
OpenSSL answers a name it cannot use, and a ``tls_error`` with that reason).

Theory of operation
-------------------
The check reads the client's bytes as TLS records (RFC 8446 5.1): a 5-byte
header (content type, version, length), then the body. The bodies of
handshake records (type 22) are one stream of handshake messages (a message
may span records, a record may hold several), each a 4-byte header (type,
24-bit length) and its body. ClientHello bodies (type 1) are gathered whole
and their extensions walked, as OpenSSL walks them; every other message is
skipped by its length, and every other record by its own.

Which ClientHellos: the first, and the second one a TLS 1.3 client sends
after a HelloRetryRequest (behind a ChangeCipherSpec record and maybe
refused 0-RTT data records: both skipped). Only plaintext handshake records
can hold one: a TLS 1.3 client encrypts everything after its last
ClientHello in application-data records, and a TLS 1.2 client encrypts what
follows its ClientKeyExchange (type 16), where the check stops. It also stops
(``done``) at bytes OpenSSL itself refuses before any callback (not a TLS
record, a record or ClientHello longer than OpenSSL takes); renegotiation is
off (``OP_NO_RENEGOTIATION``), so no ClientHello comes encrypted.

A ClientHello that is not well formed is left to OpenSSL: it refuses it
with ``decode_error`` before calling back. Pure: no I/O.
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = ["UNRECOGNIZED_NAME_ALERT", "ServerNameCheck", "non_ascii_server_name"]

_RECORD_HEADER: Final = 5
_HANDSHAKE_HEADER: Final = 4
_CHANGE_CIPHER_SPEC: Final = 20
_ALERT: Final = 21
_HANDSHAKE: Final = 22
_APPLICATION_DATA: Final = 23
_RECORD_TYPES: Final = frozenset(
    {_CHANGE_CIPHER_SPEC, _ALERT, _HANDSHAKE, _APPLICATION_DATA}
)
_CLIENT_HELLO: Final = 1
_CLIENT_KEY_EXCHANGE: Final = 16
_SERVER_NAME: Final = 0  # the extension (RFC 6066 3)
_HOST_NAME: Final = 0  # its only name type
#: The longest record OpenSSL reads: 2^14 bytes of plaintext plus the 2048
#: bytes of expansion TLS 1.2 allows (SSL3_RT_MAX_ENCRYPTED_LENGTH).
_MAX_RECORD: Final = 2**14 + 2048
#: The longest ClientHello OpenSSL reads (CLIENT_HELLO_MAX_LENGTH).
_MAX_CLIENT_HELLO: Final = 131396
#: The legacy version and random before the session id.
_HELLO_FIXED: Final = 2 + 32

#: A fatal ``unrecognized_name`` alert (RFC 8446 6.2, description 112) in a
#: plaintext record: what OpenSSL sends for a server name it cannot use.
UNRECOGNIZED_NAME_ALERT: Final = b"\x15\x03\x03\x00\x02\x02\x70"


_U16: Final = struct.Struct("!H")
_EXTENSION: Final = struct.Struct("!HH")  # type, length


def _u16(data: bytes | bytearray, at: int) -> int:
    value: int = _U16.unpack_from(data, at)[0]
    return value


def non_ascii_server_name(body: bytes) -> bytes | None:
    """The server name of the ClientHello *body* (its handshake message
    without the 4-byte header) when it holds a byte that is not ASCII; None
    when it is ASCII, absent, or the ClientHello is not well formed (as
    OpenSSL parses it: one ``host_name`` entry filling the extension)."""
    end = len(body)
    at = _HELLO_FIXED
    if at >= end:
        return None
    at += 1 + body[at]  # session id
    if at + 2 > end:
        return None
    at += 2 + _u16(body, at)  # cipher suites
    if at >= end:
        return None
    at += 1 + body[at]  # compression methods
    if at + 2 > end or at + 2 + _u16(body, at) != end:
        return None  # no extensions, or not exactly filling the message
    at += 2
    unpack = _EXTENSION.unpack_from
    while at + 4 <= end:
        kind, size = unpack(body, at)
        at += 4
        if kind == _SERVER_NAME:
            entry = body[at : at + size]
            if (
                len(entry) != size
                or size < 5
                or _u16(entry, 0) != size - 2
                or entry[2] != _HOST_NAME
                or _u16(entry, 3) != size - 5
            ):
                return None
            name = entry[5:]
            return None if name.isascii() else name
        at += size
    return None


class ServerNameCheck:
    """Watches what a TLS client sends until its handshake is done, for a
    ClientHello whose server name is not ASCII (see the module's theory)."""

    __slots__ = (
        "_gather",
        "_handshake",
        "_message_left",
        "_record",
        "_record_left",
        "_record_type",
        "done",
    )

    def __init__(self) -> None:
        self._record = bytearray()  # a record header, while incomplete
        self._record_left = 0  # bytes of the current record's body still to come
        self._record_type = 0
        self._handshake = bytearray()  # a message header, while incomplete
        self._message_left = 0  # bytes of the current message's body to come
        self._gather: bytearray | None = None  # a ClientHello's body so far
        #: Set once no ClientHello can follow (or OpenSSL refuses the bytes).
        self.done = False

    def feed(self, data: bytes | memoryview) -> str | None:
        """Check the next bytes from the client.

        Returns:
            Why to refuse the handshake (one line, the name's bytes quoted),
            or None to let it go on.
        """
        view = memoryview(data)
        at = 0
        while at < len(view) and not self.done:
            if not self._record_left:
                take = _RECORD_HEADER - len(self._record)
                self._record += view[at : at + take]
                at += take
                if len(self._record) < _RECORD_HEADER:
                    break
                kind, length = self._record[0], _u16(self._record, 3)
                self._record.clear()
                if kind not in _RECORD_TYPES or length > _MAX_RECORD:
                    self.done = True  # OpenSSL refuses these bytes itself
                    break
                self._record_left = length
                self._record_type = kind
                continue
            take = min(self._record_left, len(view) - at)
            body = view[at : at + take]
            at += take
            self._record_left -= take
            if self._record_type == _HANDSHAKE:
                name = self._messages(body)
                if name is not None:
                    self.done = True
                    return f"the ClientHello's server name is not ASCII: {name!r}"
        return None

    def _messages(self, data: memoryview) -> bytes | None:
        """Handshake message bytes: a non-ASCII server name, if a ClientHello
        completed here has one."""
        at = 0
        while at < len(data) and not self.done:
            if not self._message_left and self._gather is None:
                take = _HANDSHAKE_HEADER - len(self._handshake)
                self._handshake += data[at : at + take]
                at += take
                if len(self._handshake) < _HANDSHAKE_HEADER:
                    break
                kind = self._handshake[0]
                length = int.from_bytes(self._handshake[1:4])
                self._handshake.clear()
                if kind == _CLIENT_KEY_EXCHANGE or (
                    kind == _CLIENT_HELLO and length > _MAX_CLIENT_HELLO
                ):
                    self.done = True  # encrypted from here / refused by OpenSSL
                    break
                self._message_left = length
                if kind == _CLIENT_HELLO:
                    self._gather = bytearray()
            take = min(self._message_left, len(data) - at)
            if self._gather is not None:
                self._gather += data[at : at + take]
            at += take
            self._message_left -= take
            if not self._message_left and self._gather is not None:
                hello, self._gather = bytes(self._gather), None
                name = non_ascii_server_name(hello)
                if name is not None:
                    return name
        return None
