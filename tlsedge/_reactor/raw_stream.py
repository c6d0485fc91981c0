"""A socket-backed stream driven from a reactor handler: no trio wait per call.

A `RawStream` wraps a `trio.SocketStream`, or an established `TLSStream` over
one (or over a stdlib socket: a handshake run on the reactor), for code that
the reactor (`tlsedge._reactor.loop`) calls when the socket is ready: non-blocking
``recv``/``send`` on a stdlib socket sharing the stream's descriptor, the TLS
engine driven through `TLSStream.receive_available` and
`TLSStream.send_nowait`. What the socket does not take at once waits in
`RawStream.out` until the owner sees the socket writable and calls `flush`.
The trio stream stays the owner of the descriptor: `detach` gives the stdlib
socket object up without closing anything, and the stream's owner closes it.
"""

from __future__ import annotations

import socket
from typing import Final

import trio

from tlsedge._reactor.relay import _scratch, _stdlib_socket
from tlsedge._tls.stream import TLSStream

__all__ = ["READ_SIZE", "RawStream"]

#: Largest read at once.
READ_SIZE: Final = 65536


class RawStream:
    """One socket-backed stream, driven without waiting (see the module docstring).

    Its methods raise `OSError` (a reset, a broken pipe) or
    `trio.BrokenResourceError` (a TLS error) when the connection fails.
    """

    __slots__ = (
        "built",
        "eof",
        "fd",
        "hung_up",
        "interest",
        "out",
        "shut_pending",
        "sock",
        "tls",
    )

    def __init__(
        self, sock: socket.socket, tls: TLSStream | None, *, built: bool = True
    ) -> None:
        self.sock = sock
        #: *sock* was made for us (`detach` gives it up), not the trio socket's own.
        self.built = built
        self.fd = sock.fileno()
        self.tls = tls
        #: Bytes (records, over TLS) the socket has not taken yet.
        self.out = bytearray()
        #: The peer's EOF (a FIN, or a close_notify) was received.
        self.eof = False
        #: `send_eof` waits for `out` to drain before the FIN goes.
        self.shut_pending = False
        #: What the owner's reactor registration watches; None: unregistered.
        self.interest: int | None = None
        #: The socket reported a hang-up (for the owner's registration).
        self.hung_up = False

    @classmethod
    def of(cls, stream: trio.abc.Stream) -> RawStream | None:
        """*stream* as a `RawStream`, or None when it is not socket-backed."""
        tls: TLSStream | None = None
        transport = stream
        if isinstance(stream, TLSStream):
            if not stream.established:
                return None
            if stream.transport_socket is not None:
                return cls(stream.transport_socket, stream, built=False)
            tls, transport = stream, stream.transport_stream
        if not isinstance(transport, trio.SocketStream):
            return None
        sock, built = _stdlib_socket(transport)
        return cls(sock, tls, built=built)

    def receive(self, *, read_socket: bool = True) -> bytes | None:
        """What arrived: plaintext, ``b""`` at the peer's EOF, or None when
        nothing can be returned without waiting. Without *read_socket*, only
        what the TLS engine already holds.

        Over TLS, plaintext may come with `eof` set already: the close_notify
        was in the same read, and no socket event will say it again (the
        caller takes the EOF from `eof`; a next call returns ``b""``)."""
        if self.eof:
            return b""
        tls = self.tls
        # Into the thread's scratch buffer: ``recv(READ_SIZE)`` would
        # allocate the whole size per read, then shrink it.
        scratch, view = _scratch(READ_SIZE)
        if tls is None:
            try:
                received = self.sock.recv_into(scratch)
            except BlockingIOError:
                return None
            if not received:
                self.eof = True
                return b""
            return bytes(view[:received])
        transport_data: memoryview | None = None
        if read_socket:
            try:
                received = self.sock.recv_into(scratch)
            except BlockingIOError:
                received = -1
            if received >= 0:
                transport_data = view[:received]
        data, eof = tls.receive_available(transport_data)
        records = tls.take_transport_data()
        if records:
            self.send_raw(records)
        if data:
            if eof:
                self.eof = True  # the next call returns b""
            return data
        if eof:
            self.eof = True
            return b""
        return None

    def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send *data* (encrypted over TLS); what the socket does not take
        now waits in `out`."""
        if self.tls is not None:
            data = self.tls.send_nowait(data)
        elif not self.out:  # (`send_raw` written out: a call less per write)
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                self.out += data[sent:]
            return
        self.send_raw(data)

    def send_raw(self, data: bytes | bytearray | memoryview) -> None:
        if self.out:
            self.out += data
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self.out += data[sent:]

    def flush(self) -> bool:
        """Send what waits in `out` (the socket is writable); then a pending
        `send_eof`. True if the socket took anything."""
        try:
            sent = self.sock.send(self.out)
        except BlockingIOError:
            return False
        del self.out[:sent]
        if not self.out and self.shut_pending:
            self.shut_pending = False
            self.sock.shutdown(socket.SHUT_WR)
        return sent > 0

    def send_eof(self) -> None:
        """Close our sending side once `out` drained: a close_notify over
        TLS (the socket stays open both ways), else a FIN."""
        if self.tls is not None:
            self.send_raw(self.tls.send_eof_nowait())
        elif self.out:
            self.shut_pending = True
        else:
            self.sock.shutdown(socket.SHUT_WR)

    def detach(self) -> None:
        """Give up the stdlib socket object; the descriptor stays open."""
        if self.built:
            self.sock.detach()
