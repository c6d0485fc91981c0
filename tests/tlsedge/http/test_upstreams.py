"""UpstreamConnections: the connections an HTTP/2 connection keeps for its streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import trio
import trio.testing

from tests.tlsedge.helpers import make_config
from tlsedge._http.pool import KeepAlivePool
from tlsedge._http.upstreams import UpstreamConnections
from tlsedge._upstream import BackendPool


@dataclass
class Accepting:
    """A TCP server that keeps every connection it accepts open (in order)."""

    accepted: list[trio.SocketStream] = field(default_factory=list)
    port: int = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.accepted.append(stream)
        try:
            await trio.sleep_forever()
        finally:
            await trio.aclose_forcefully(stream)

    async def count(self) -> int:
        """How many connections it accepted, once it has caught up."""
        await trio.testing.wait_all_tasks_blocked()
        return len(self.accepted)


@asynccontextmanager
async def upstreams(keep: int) -> AsyncIterator[tuple[UpstreamConnections, Accepting]]:
    server = Accepting()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1")
        )
        server.port = listeners[0].socket.getsockname()[1]
        config = make_config(
            [{"name": "web", "mode": "http", "backend": "app"}],
            [{"name": "app", "servers": [f"127.0.0.1:{server.port}"]}],
        )
        backend = await BackendPool.create(config.backends[0])
        connections = UpstreamConnections(
            backend, KeepAlivePool(idle_timeout=4.0), "127.0.0.1", None, keep=keep
        )
        yield connections, server
        connections.close()
        connections.keepalive.close()
        nursery.cancel_scope.cancel()


async def test_released_connections_are_kept_reused_and_parked() -> None:
    async with upstreams(keep=2) as (connections, server):
        first, second, third = [await connections.acquire(None) for _ in range(3)]
        assert await server.count() == 3
        for upstream in (first, second, third):
            connections.release(upstream, clean=True)
        # Two kept back for this connection, the third in the shared pool.
        assert connections.kept == 2
        assert connections.keepalive.idle_count() == 1
        again = await connections.acquire(None)
        assert again.stream is second.stream  # the most recent first
        assert again.reused
        # The backend closed the other kept one: closed, not reused; the
        # shared pool's is next.
        await server.accepted[0].aclose()
        pooled = await connections.acquire(None)
        assert pooled.stream is third.stream
        assert connections.kept == 0
        for upstream in (again, pooled):
            connections.release(upstream, clean=True)
        assert await server.count() == 3
        connections.park()
        assert connections.kept == 0
        assert connections.keepalive.idle_count() == 2


async def test_kept_connections_expire_with_the_pools_idle_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with upstreams(keep=2) as (connections, server):
        upstream = await connections.acquire(None)
        connections.release(upstream, clean=True)
        await trio.sleep(5)  # beyond the pool's idle_timeout of 4 s
        fresh = await connections.acquire(None)
        assert fresh.stream is not upstream.stream
        assert not fresh.reused
        assert await server.count() == 2


async def test_close_parks_the_kept_and_closes_those_in_use() -> None:
    async with upstreams(keep=2) as (connections, server):
        kept, busy = [await connections.acquire(None) for _ in range(2)]
        connections.release(kept, clean=True)
        connections.close()
        assert connections.kept == 0
        assert connections.keepalive.idle_count() == 1
        pooled = connections.keepalive.acquire(kept.server)
        assert pooled is kept.stream
        await pooled.aclose()
        assert isinstance(busy.stream, trio.SocketStream)
        assert busy.stream.socket.fileno() == -1  # closed
        assert await server.count() == 2
