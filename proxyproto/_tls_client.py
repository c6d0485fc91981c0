"""TLS on a blocking socket that stays the caller's (private).

``proxyproto send`` and ``probe --diagnose`` start TLS after a PROXY header
on a plain socket. ``SSLContext.wrap_socket`` would take the socket over, and
when the peer reset the connection before the handshake (as a port refusing
the header does) its constructor raises while holding the file descriptor,
leaving an ``SSLSocket`` nobody can close. Here the TLS state lives in an
``SSLObject`` over memory BIOs and the socket is only read and written, so
the caller's ``with sock:`` closes it whatever happened.
"""

from __future__ import annotations

import socket
import ssl

__all__ = ["TLSClient"]

_CHUNK = 65536


class TLSClient:
    """A client-side TLS session over *sock* (which must be connected; its
    timeout applies to every read and write)."""

    def __init__(
        self, sock: socket.socket, context: ssl.SSLContext, server_hostname: str | None
    ) -> None:
        self._sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._incoming, self._outgoing, server_hostname=server_hostname
        )

    def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            self._sock.sendall(data)

    def _fill(self) -> None:
        data = self._sock.recv(_CHUNK)
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    def handshake(self) -> str:
        """Complete the handshake; the protocol version.

        Raises:
            ssl.SSLError: the handshake failed (``SSLEOFError``: the peer
                closed the connection during it).
            OSError: the socket failed or timed out.
        """
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
                continue
            self._flush()
            return self._tls.version() or "TLS"

    def sendall(self, data: bytes) -> None:
        self._tls.write(data)
        self._flush()

    def recv(self, max_bytes: int) -> bytes:
        """Up to *max_bytes* of application data; ``b""`` after the peer's
        close_notify.

        Raises:
            ssl.SSLEOFError: the peer closed the connection without one.
        """
        while True:
            try:
                return self._tls.read(max_bytes)
            except ssl.SSLWantReadError:
                self._fill()
            except ssl.SSLZeroReturnError:
                return b""
