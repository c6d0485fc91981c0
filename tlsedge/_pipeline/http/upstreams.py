"""The upstream connections of one client connection in HTTP mode (trio).

Each exchange takes a connection (`UpstreamConnections.acquire`) and gives it
back (`UpstreamConnections.release`): from and to the backend's shared
`KeepAlivePool`, or, with ``send_proxy``, from and to the connections
*dedicated* to this client connection (opened with the PROXY header first,
kept across its requests, never pooled: a PROXY header describes one client).
An HTTP/1.1 connection runs one exchange at a time, so it keeps at most one
dedicated connection; an HTTP/2 connection may keep one per concurrent stream.

A driver may also *hold* the clean connections its exchanges leave
(`UpstreamConnections.hold`, its sockets still watched) for its next
exchanges, and `take` reuses them first; it gives them to the shared pool
(`park_held`) once the client connection has had no exchange for
`PARK_AFTER`. An HTTP/1.1 connection holds at most one, an HTTP/2 connection
one per concurrent stream: ``h2load -m10`` on 50 connections keeps 500
exchanges going, and handing each connection back to the shared pool
(``max_idle_per_server`` of them per server, the rest closed) between one
stream and the next opened a new upstream connection for a third of the
requests.
"""

from __future__ import annotations

import ssl
from collections.abc import Reversible
from dataclasses import dataclass, field
from typing import Final

import trio

from tlsedge._backends.keepalive import KeepAlivePool, close_now
from tlsedge._backends.upstream import BackendPool, NoServerError
from tlsedge._core.balancer import Server, ServerLease
from tlsedge._tls.stream import TLSStream

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
    #: The server it is connected to, every lease's (a field: each request
    #: asks, a property would be a call).
    server: Server = field(init=False)
    #: The TLS client context it was made with (None: plain TCP), for
    #: `UpstreamConnections.take` to compare with the backend's current one.
    tls_context: ssl.SSLContext | None = field(init=False)

    def __post_init__(self) -> None:
        self.server = self.lease.server
        stream = self.stream
        self.tls_context = (
            stream.ssl_object.context if isinstance(stream, TLSStream) else None
        )


class UpstreamConnections:
    """The upstream connections one client connection uses.

    Args:
        backend: Where requests go.
        keepalive: Idle upstream connections of *backend*, shared.
        client_ip: The real client (the balancer's source-ip affinity).
        proxy_header: With ``send_proxy``: the PROXY header for this client;
            connections are then dedicated to this client connection.
    """

    __slots__ = (
        "_dedicated",
        "_in_use",
        "backend",
        "client_ip",
        "keepalive",
        "proxy_header",
    )

    def __init__(
        self,
        backend: BackendPool,
        keepalive: KeepAlivePool,
        client_ip: str | None,
        proxy_header: bytes | None,
    ) -> None:
        self.backend = backend
        self.keepalive = keepalive
        self.client_ip = client_ip
        self.proxy_header = proxy_header
        self._dedicated: list[Upstream] = []  # idle, with send_proxy
        self._in_use: set[Upstream] = set()

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
        held: Reversible[Upstream] = (),
    ) -> Upstream | NewConnection:
        """`acquire` without waiting: a dedicated or pooled connection, or
        what `connect` must open when there is none to reuse.

        Args:
            exclude: A server not to pick (a failed first attempt's).
            fresh: Not a reused connection (a retry after one failed).
            held: Idle connections the caller holds (`hold`), oldest first:
                the newest one to the server the balancer picks is taken
                first; the caller watches them, so they are not checked here.

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
        if not fresh:
            context = self.backend.tls_context
            for candidate in reversed(held):
                if candidate.server is server and candidate.tls_context is context:
                    candidate.lease = self.backend.lease(server)
                    candidate.reused = True
                    self._in_use.add(candidate)
                    return candidate
            stream = self.keepalive.acquire(server)
            if stream is not None:
                if self._current(stream):
                    upstream = Upstream(stream, self.backend.lease(server), reused=True)
                    self._in_use.add(upstream)
                    return upstream
                close_now(stream)
        return NewConnection(server)

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

    def close(self) -> None:
        """Close every connection still in use or dedicated (the client is gone)."""
        for upstream in self._in_use:
            upstream.lease.release()
            close_now(upstream.stream)
        for upstream in self._dedicated:
            close_now(upstream.stream)
        self._in_use.clear()
        self._dedicated.clear()
