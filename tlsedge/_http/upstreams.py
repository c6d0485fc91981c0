"""The upstream connections of one client connection in HTTP mode (trio).

Each exchange takes a connection (`UpstreamConnections.acquire`) and gives it
back (`UpstreamConnections.release`): from and to the backend's shared
`KeepAlivePool`, or, with ``send_proxy``, from and to the connections
*dedicated* to this client connection (opened with the PROXY header first,
kept across its requests, never pooled: a PROXY header describes one client).
An HTTP/1.1 connection runs one exchange at a time, so it keeps at most one
dedicated connection; an HTTP/2 connection may keep one per concurrent stream.

An HTTP/2 connection also keeps the pooled connections its streams gave back
(*keep*: at most that many, its concurrent streams) for its next streams:
``h2load -m10`` on 50 connections keeps 500 exchanges going, and handing
each connection back to the shared pool (``max_idle_per_server`` of them per
server, the rest closed) between one stream and the next opened a new
upstream connection for a third of the requests. `park` gives them to the
shared pool (the driver calls it once the client connection has had no
stream for a second), `close` when it ends; before reuse each is checked as
the pool checks its own (not expired, nothing to read).
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from tlsedge._balancer import Server, ServerLease
from tlsedge._http.pool import KeepAlivePool, is_idle_and_open
from tlsedge._tls_stream import TLSStream
from tlsedge._upstream import BackendPool, NoServerError

__all__ = ["Upstream", "UpstreamConnections"]


@dataclass(slots=True, eq=False)
class Upstream:
    """One upstream connection, in use by an exchange."""

    stream: trio.abc.Stream
    #: Held while an exchange uses the connection; a dedicated connection
    #: waiting for its client's next request holds a released one.
    lease: ServerLease
    reused: bool
    prefix: bytes = b""  # the PROXY header, sent with the first request head

    @property
    def server(self) -> Server:
        return self.lease.server


class UpstreamConnections:
    """The upstream connections one client connection uses.

    Args:
        backend: Where requests go.
        keepalive: Idle upstream connections of *backend*, shared.
        client_ip: The real client (the balancer's source-ip affinity).
        proxy_header: With ``send_proxy``: the PROXY header for this client;
            connections are then dedicated to this client connection.
        keep: Most pooled connections kept back for this client
            connection's next exchanges (until `park`); 0: none.
    """

    __slots__ = (
        "_dedicated",
        "_in_use",
        "_kept",
        "backend",
        "client_ip",
        "keep",
        "keepalive",
        "proxy_header",
    )

    def __init__(
        self,
        backend: BackendPool,
        keepalive: KeepAlivePool,
        client_ip: str | None,
        proxy_header: bytes | None,
        *,
        keep: int = 0,
    ) -> None:
        self.backend = backend
        self.keepalive = keepalive
        self.client_ip = client_ip
        self.proxy_header = proxy_header
        self.keep = keep
        self._dedicated: list[Upstream] = []  # idle, with send_proxy
        self._in_use: set[Upstream] = set()
        #: Idle pooled connections kept back: (released at, server, stream).
        self._kept: list[tuple[float, Server, trio.abc.Stream]] = []

    async def acquire(self, exclude: Server | None, *, fresh: bool = False) -> Upstream:
        """A connection for the next exchange: dedicated, pooled or new.

        The returned connection holds a lease on its server, given back by
        `release` (or `close`).

        Raises:
            NoServerError: no healthy server.
            ConnectFailedError: every attempt failed.
        """
        upstream = await self._acquire(exclude, fresh=fresh)
        self._in_use.add(upstream)
        return upstream

    async def _acquire(self, exclude: Server | None, *, fresh: bool) -> Upstream:
        if self.proxy_header is not None:
            while self._dedicated:
                upstream = self._dedicated.pop()
                if self._current(upstream.stream):
                    upstream.lease = self.backend.lease(upstream.server)
                    upstream.reused = True
                    return upstream
                await trio.aclose_forcefully(upstream.stream)
            return await self._connect(None, proxy_header=self.proxy_header)
        server = self.backend.balancer.pick(
            self.client_ip, exclude=(exclude,) if exclude is not None else ()
        )
        if server is None:
            if exclude is None:
                raise NoServerError(f"backend {self.backend.name}: no healthy server")
            return await self._connect(None)
        stream = None
        if not fresh:
            stream = await self._take_kept(server)
            if stream is None:
                stream = await self.keepalive.acquire(server)
        if stream is not None:
            if self._current(stream):
                return Upstream(stream, self.backend.lease(server), reused=True)
            await trio.aclose_forcefully(stream)
        return await self._connect(server)

    async def _take_kept(self, server: Server) -> trio.abc.Stream | None:
        """The most recently kept connection to *server* that is still
        usable, or None; expired or unusable ones on the way are closed."""
        kept = self._kept
        index = len(kept)
        while index:
            index -= 1
            released, kept_server, stream = kept[index]
            if kept_server is not server:
                continue
            del kept[index]
            age = trio.current_time() - released
            if age < self.keepalive.idle_timeout and await _usable(stream):
                return stream
            await trio.aclose_forcefully(stream)
        return None

    def _current(self, stream: trio.abc.Stream) -> bool:
        """Whether a kept connection was made with the backend's current TLS
        settings (none, or its client context): a reload that changed them
        must not leave requests on connections made with the old ones."""
        context = self.backend.tls_context
        if isinstance(stream, TLSStream):
            return stream.ssl_object.context is context
        return context is None

    async def _connect(
        self, server: Server | None, *, proxy_header: bytes | None = None
    ) -> Upstream:
        """Open a new upstream connection (to *server* first, if given).

        `BackendPool.connect` retries as configured; to a TLS backend each
        attempt includes the handshake, and the PROXY header goes raw before
        it; without TLS the header goes with the first request head.
        """
        connected = await self.backend.connect(
            self.client_ip, first=server, proxy_header=proxy_header or b""
        )
        return Upstream(
            connected.upstream,
            connected.lease,
            reused=False,
            prefix=connected.pending,
        )

    async def release(
        self, upstream: Upstream, *, clean: bool, handed_over: bool = False
    ) -> None:
        """Give a connection back after its exchange: kept (dedicated), pooled
        when *clean*, else closed; with *handed_over* (an upgrade relays it)
        only its lease is given back."""
        self._in_use.discard(upstream)
        upstream.lease.release()
        if handed_over:
            return
        if clean and self.proxy_header is not None:
            self._dedicated.append(upstream)
        elif clean and len(self._kept) < self.keep:
            self._kept.append((trio.current_time(), upstream.server, upstream.stream))
        elif clean:
            await self.keepalive.release(upstream.server, upstream.stream)
        else:
            await trio.aclose_forcefully(upstream.stream)

    @property
    def kept(self) -> int:
        """How many idle connections are kept back (see `park`)."""
        return len(self._kept)

    async def park(self) -> None:
        """Give the connections kept back to the shared pool. Shielded: it
        never blocks, and a connection taken out must not be lost to a
        cancellation."""
        kept, self._kept = self._kept, []
        if not kept:
            return
        with trio.CancelScope(shield=True):
            for _, server, stream in kept:
                await self.keepalive.release(server, stream)

    async def close(self) -> None:
        """Close every connection still in use or dedicated, and give those
        kept back to the shared pool (the client is gone)."""
        await self.park()
        for upstream in self._in_use:
            upstream.lease.release()
            await trio.aclose_forcefully(upstream.stream)
        for upstream in self._dedicated:
            await trio.aclose_forcefully(upstream.stream)
        self._in_use.clear()
        self._dedicated.clear()


async def _usable(stream: trio.abc.Stream) -> bool:
    """`is_idle_and_open`, shielded where it may checkpoint (over TLS): it
    never blocks, and a connection taken out for the check must not be lost
    to a cancellation."""
    if not isinstance(stream, TLSStream):
        return await is_idle_and_open(stream)
    with trio.CancelScope(shield=True):
        usable = await is_idle_and_open(stream)
    return usable
