"""Idle upstream connections kept for reuse, per backend server (trio).

A connection goes back to the pool only after an exchange that left it clean
(`tlsedge._http.exchange.UpstreamExchange.reusable`). Before one is reused it is
checked without blocking: an idle HTTP/1.1 connection has nothing to read, so
anything readable (a FIN, an RST, stray bytes; over TLS, application data or a
close_notify, but not session tickets) retires it.
"""

from __future__ import annotations

import collections
import select
import socket
from typing import Final

import trio

from tlsedge._core.balancer import Server
from tlsedge._tls.stream import TLSStream

__all__ = [
    "DEFAULT_MAX_IDLE_PER_SERVER",
    "DEFAULT_UPSTREAM_IDLE_TIMEOUT",
    "POOL_SWEEP_INTERVAL",
    "KeepAlivePool",
    "close_now",
    "is_idle_and_open",
]

#: Largest read of what an idle TLS connection holds.
_READ_SIZE: Final = 65536
#: Idle upstream connections kept per backend server (nginx's ``keepalive 32``).
DEFAULT_MAX_IDLE_PER_SERVER: Final = 32
#: How long an idle upstream connection is kept. Below the keep-alive timeouts
#: of common app servers (uvicorn and hypercorn 5 s, gunicorn 2 s is the odd one
#: out: its closes are caught by the EOF check and the stale-connection retry).
DEFAULT_UPSTREAM_IDLE_TIMEOUT: Final = 4.0
#: How often `KeepAlivePool.run` sweeps expired and closed idle connections.
POOL_SWEEP_INTERVAL: Final = 1.0


def _socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    current: object = stream
    for _ in range(8):  # SSLStream over PrefixedStream over SocketStream is 3
        if isinstance(current, trio.SocketStream):
            return current.socket
        current = getattr(current, "transport_stream", None)
        if current is None:
            return None
    return None


def _readable(sock: trio.socket.SocketType) -> bool:
    """Whether a read would not block (data, FIN, RST; or the socket is closed).

    ``poll`` (not ``select``) so that descriptors above 1023 work.
    """
    fd = sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def is_idle_and_open(stream: trio.abc.Stream) -> bool:
    """False when the peer closed, reset or (unexpectedly) sent something.

    An idle HTTP/1.1 connection must have nothing to read: readability means a
    FIN, an RST or stray bytes, and each makes it unusable. Over TLS, the
    socket may also hold records without application data (a TLS 1.3 server
    sends its session tickets after the handshake): what the socket holds is
    read without blocking and decrypted, and only application data, a
    close_notify, an EOF or a TLS error make the connection unusable. Never
    blocks.
    """
    sock = _socket_of(stream)
    if sock is None:
        return True
    if not isinstance(stream, TLSStream):
        return not _readable(sock)
    transport_data: bytes | None = None
    while True:
        try:
            data, closed = stream.receive_available(transport_data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        if data or closed:
            return False  # application data, close_notify or EOF
        if not _readable(sock):
            return True
        raw = socket.socket(sock.family, sock.type, sock.proto, fileno=sock.fileno())
        try:
            # Readable: returns at once (data, b"" for a FIN, or the RST).
            transport_data = raw.recv(_READ_SIZE)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            raw.detach()


def close_now(stream: trio.abc.Stream) -> None:
    """Close *stream*'s socket at once (no close_notify, no checkpoint): for a
    connection that is dropped, never for one whose peer awaits an answer."""
    sock = _socket_of(stream)
    if sock is not None:
        sock.close()


class KeepAlivePool:
    """Idle upstream connections per backend server, shared by client connections.

    ``acquire(server)`` returns the most recently released idle connection to
    that server that is still usable (not expired after ``idle_timeout``, no
    EOF/RST/stray bytes pending; over TLS, no close_notify or application data
    either), or None. ``release(server, stream)`` parks a
    connection whose last exchange ended cleanly; beyond ``max_idle_per_server``
    the oldest one is closed. Expired connections are closed lazily on
    ``acquire``/``release``, and every ``POOL_SWEEP_INTERVAL`` by `run` when the
    owner runs it. Connections that carried a PROXY header never come here.

    Args:
        max_idle_per_server: Most idle connections kept per server (0: none).
        idle_timeout: Seconds an idle connection is kept.
    """

    def __init__(
        self,
        max_idle_per_server: int = DEFAULT_MAX_IDLE_PER_SERVER,
        idle_timeout: float = DEFAULT_UPSTREAM_IDLE_TIMEOUT,
    ) -> None:
        if max_idle_per_server < 0 or not idle_timeout >= 0:
            msg = "max_idle_per_server and idle_timeout must be >= 0"
            raise ValueError(msg)
        self.max_idle_per_server = max_idle_per_server
        self.idle_timeout = idle_timeout
        self._idle: dict[Server, collections.deque[tuple[float, trio.abc.Stream]]] = {}
        self._closed = False

    def idle_count(self, server: Server | None = None) -> int:
        """Idle connections kept (for *server*, or in total)."""
        if server is not None:
            return len(self._idle.get(server, ()))
        return sum(len(entries) for entries in self._idle.values())

    def acquire(self, server: Server) -> trio.abc.Stream | None:
        """A usable idle connection to *server*, or None (never blocks)."""
        entries = self._idle.get(server)
        now = trio.current_time()
        while entries:
            released, stream = entries.pop()
            if not entries:
                del self._idle[server]
            if now - released < self.idle_timeout and is_idle_and_open(stream):
                return stream
            close_now(stream)
            entries = self._idle.get(server)
        return None

    def release(self, server: Server, stream: trio.abc.Stream) -> None:
        """Park *stream* (its last exchange ended cleanly) for reuse."""
        if self._closed or self.max_idle_per_server == 0:
            close_now(stream)
            return
        entries = self._idle.setdefault(server, collections.deque())
        entries.append((trio.current_time(), stream))
        while len(entries) > self.max_idle_per_server:
            _, oldest = entries.popleft()
            close_now(oldest)

    def purge(self) -> None:
        """Close every idle connection that expired or that the server closed."""
        now = trio.current_time()
        for server in list(self._idle):
            entries = self._idle.pop(server)
            keep: collections.deque[tuple[float, trio.abc.Stream]]
            keep = collections.deque()
            for released, stream in entries:
                if now - released < self.idle_timeout and is_idle_and_open(stream):
                    keep.append((released, stream))
                else:
                    close_now(stream)
            if keep:
                self._idle[server] = keep

    async def run(self, *, interval: float = POOL_SWEEP_INTERVAL) -> None:
        """Sweep with `purge` every *interval* seconds until cancelled (optional)."""
        while True:
            await trio.sleep(interval)
            self.purge()

    def close(self) -> None:
        """Close every idle connection; later releases close at once."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for entries in idle.values():
            for _, stream in entries:
                close_now(stream)
