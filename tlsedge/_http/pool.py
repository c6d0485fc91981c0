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
from typing import Final

import trio

from tlsedge._balancer import Server
from tlsedge._tls_stream import TLSStream

__all__ = [
    "DEFAULT_MAX_IDLE_PER_SERVER",
    "DEFAULT_UPSTREAM_IDLE_TIMEOUT",
    "POOL_SWEEP_INTERVAL",
    "KeepAlivePool",
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


async def is_idle_and_open(stream: trio.abc.Stream) -> bool:
    """False when the peer closed, reset or (unexpectedly) sent something.

    An idle HTTP/1.1 connection must have nothing to read: readability means a
    FIN, an RST or stray bytes, and each makes it unusable. Over TLS, the
    socket may also hold records without application data (a TLS 1.3 server
    sends its session tickets after the handshake): what the socket holds is
    read without blocking and decrypted, and only application data, a
    close_notify, an EOF or a TLS error make the connection unusable. Never
    blocks; checkpoints only over TLS with something to read.
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
        try:
            # Readable: returns at once (data, b"" for a FIN, or the RST).
            transport_data = bytes(
                await stream.transport_stream.receive_some(_READ_SIZE)
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return False


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

    async def acquire(self, server: Server) -> trio.abc.Stream | None:
        """A usable idle connection to *server*, or None."""
        entries = self._idle.get(server)
        now = trio.current_time()
        while entries:
            released, stream = entries.pop()
            if not entries:
                del self._idle[server]
            if now - released < self.idle_timeout and await _usable(stream):
                return stream
            await trio.aclose_forcefully(stream)
            entries = self._idle.get(server)
        return None

    async def release(self, server: Server, stream: trio.abc.Stream) -> None:
        """Park *stream* (its last exchange ended cleanly) for reuse."""
        if self._closed or self.max_idle_per_server == 0:
            await trio.aclose_forcefully(stream)
            return
        entries = self._idle.setdefault(server, collections.deque())
        entries.append((trio.current_time(), stream))
        while len(entries) > self.max_idle_per_server:
            _, oldest = entries.popleft()
            await trio.aclose_forcefully(oldest)

    async def purge(self) -> None:
        """Close every idle connection that expired or that the server closed."""
        now = trio.current_time()
        for server in list(self._idle):
            # Taken out while checked (a TLS check checkpoints): concurrent
            # acquires and releases use a fresh deque meanwhile.
            entries = self._idle.pop(server, None) or collections.deque()
            keep: collections.deque[tuple[float, trio.abc.Stream]]
            keep = collections.deque()
            for released, stream in entries:
                if now - released < self.idle_timeout and await _usable(stream):
                    keep.append((released, stream))
                else:
                    await trio.aclose_forcefully(stream)
            keep.extend(self._idle.pop(server, ()))  # released meanwhile: newer
            if self._closed:
                for _, stream in keep:
                    await trio.aclose_forcefully(stream)
                continue
            while len(keep) > self.max_idle_per_server:
                _, oldest = keep.popleft()
                await trio.aclose_forcefully(oldest)
            if keep:
                self._idle[server] = keep

    async def run(self, *, interval: float = POOL_SWEEP_INTERVAL) -> None:
        """Sweep with `purge` every *interval* seconds until cancelled (optional)."""
        while True:
            await trio.sleep(interval)
            await self.purge()

    async def aclose(self) -> None:
        """Close every idle connection; later releases close at once."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for entries in idle.values():
            for _, stream in entries:
                await trio.aclose_forcefully(stream)


async def _usable(stream: trio.abc.Stream) -> bool:
    """`is_idle_and_open`, shielded where it may checkpoint (over TLS): it never
    blocks, and a connection taken out of the pool for the check must not be
    lost to a cancellation. A plain connection is checked without a checkpoint."""
    if not isinstance(stream, TLSStream):
        sock = _socket_of(stream)
        return sock is None or not _readable(sock)
    with trio.CancelScope(shield=True):
        usable = await is_idle_and_open(stream)
    return usable
