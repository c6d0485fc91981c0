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
from typing import Final

import trio

from tlsedge._balancer import Server, ServerLease
from tlsedge._http.pool import KeepAlivePool, close_now, is_idle_and_open
from tlsedge._tls_stream import TLSStream
from tlsedge._upstream import BackendPool, NoServerError

__all__ = ["PARK_AFTER", "NewConnection", "Upstream", "UpstreamConnections"]

#: Seconds a client connection without an exchange keeps the upstream
#: connections it holds back for its next ones; then they go to the shared pool.
PARK_AFTER: Final = 1.0


@dataclass(frozen=True, slots=True)
class NewConnection:
    """What `UpstreamConnections.take` asks for when it has no connection to
    reuse: a new one to *server*, or to the balancer's pick when None."""

    server: Server | None


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
        taken = self.take(exclude, fresh=fresh)
        if isinstance(taken, NewConnection):
            return await self.connect(taken)
        await trio.lowlevel.checkpoint()
        return taken

    def take(
        self,
        exclude: Server | None,
        *,
        fresh: bool = False,
        held: Upstream | None = None,
    ) -> Upstream | NewConnection:
        """`acquire` without waiting: a dedicated or pooled connection, or
        what `connect` must open when there is none to reuse.

        Args:
            exclude: A server not to pick (a failed first attempt's).
            fresh: Not a reused connection (a retry after one failed).
            held: An idle connection the caller holds (`hold`), taken first
                when the balancer picks its server; the caller watches it,
                so it is not checked here.

        Raises:
            NoServerError: no healthy server.
        """
        if self.proxy_header is not None:
            while self._dedicated:
                upstream = self._dedicated.pop()
                if self._current(upstream.stream):
                    upstream.lease = self.backend.lease(upstream.server)
                    upstream.reused = True
                    self._in_use.add(upstream)
                    return upstream
                close_now(upstream.stream)
            return NewConnection(None)
        server = self.backend.balancer.pick(
            self.client_ip, exclude=(exclude,) if exclude is not None else ()
        )
        if server is None:
            if exclude is None:
                raise NoServerError(f"backend {self.backend.name}: no healthy server")
            return NewConnection(None)
        if (
            not fresh
            and held is not None
            and held.server is server
            and self._current(held.stream)
        ):
            held.lease = self.backend.lease(server)
            held.reused = True
            self._in_use.add(held)
            return held
        if not fresh:
            stream = self._take_kept(server)
            if stream is None:
                stream = self.keepalive.acquire(server)
            if stream is not None:
                if self._current(stream):
                    upstream = Upstream(stream, self.backend.lease(server), reused=True)
                    self._in_use.add(upstream)
                    return upstream
                close_now(stream)
        return NewConnection(server)

    def _take_kept(self, server: Server) -> trio.abc.Stream | None:
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
            if age < self.keepalive.idle_timeout and is_idle_and_open(stream):
                return stream
            close_now(stream)
        return None

    def _current(self, stream: trio.abc.Stream) -> bool:
        """Whether a kept connection was made with the backend's current TLS
        settings (none, or its client context): a reload that changed them
        must not leave requests on connections made with the old ones."""
        context = self.backend.tls_context
        if isinstance(stream, TLSStream):
            return stream.ssl_object.context is context
        return context is None

    async def connect(self, new: NewConnection) -> Upstream:
        """Open the connection `take` asked for.

        `BackendPool.connect` retries as configured; to a TLS backend each
        attempt includes the handshake, and the PROXY header goes raw before
        it; without TLS the header goes with the first request head.

        Raises:
            ConnectFailedError: every attempt failed.
        """
        connected = await self.backend.connect(
            self.client_ip, first=new.server, proxy_header=self.proxy_header or b""
        )
        upstream = Upstream(
            connected.upstream,
            connected.lease,
            reused=False,
            prefix=connected.pending,
        )
        self._in_use.add(upstream)
        return upstream

    def release(
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
            self.keepalive.release(upstream.server, upstream.stream)
        else:
            close_now(upstream.stream)

    def hold(self, upstream: Upstream) -> None:
        """The caller keeps *upstream* idle for its next exchange (it
        watches the socket and closes it if the server closes or sends
        anything): its lease goes back, and `take` gets it as *held*."""
        self._in_use.discard(upstream)
        upstream.lease.release()

    def park_held(self, upstream: Upstream) -> None:
        """Give a connection the caller held (`hold`) to the shared pool."""
        self.keepalive.release(upstream.server, upstream.stream)

    @property
    def kept(self) -> int:
        """How many idle connections are kept back (see `park`)."""
        return len(self._kept)

    def park(self) -> None:
        """Give the connections kept back to the shared pool."""
        kept, self._kept = self._kept, []
        for _, server, stream in kept:
            self.keepalive.release(server, stream)

    def close(self) -> None:
        """Close every connection still in use or dedicated, and give those
        kept back to the shared pool (the client is gone)."""
        self.park()
        for upstream in self._in_use:
            upstream.lease.release()
            close_now(upstream.stream)
        for upstream in self._dedicated:
            close_now(upstream.stream)
        self._in_use.clear()
        self._dedicated.clear()
