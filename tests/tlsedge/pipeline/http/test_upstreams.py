"""UpstreamConnections: the connections a client connection holds for its exchanges."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import trio
import trio.testing

from tests.tlsedge.helpers import make_config
from tlsedge._backends.keepalive import KeepAlivePool
from tlsedge._backends.upstream import BackendPool
from tlsedge._pipeline.http.upstreams import (
    NewConnection,
    Upstream,
    UpstreamConnections,
)


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
async def upstreams() -> AsyncIterator[tuple[UpstreamConnections, Accepting]]:
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
            backend, KeepAlivePool(idle_timeout=4.0), "127.0.0.1", None
        )
        yield connections, server
        connections.close()
        connections.keepalive.close()
        nursery.cancel_scope.cancel()


async def test_take_reuses_the_newest_held_connection_first() -> None:
    async with upstreams() as (connections, server):
        first, second, third = [await connections.acquire(None) for _ in range(3)]
        assert await server.count() == 3
        for upstream in (first, second):
            connections.hold(upstream)
        connections.release(third, clean=True)  # to the shared pool
        held = [first, second]  # oldest first
        again = connections.take(None, held=held)
        assert again is second
        assert again.reused
        # A retry wants a new connection, not a held or pooled one.
        assert isinstance(connections.take(None, fresh=True, held=held), NewConnection)
        held.remove(second)
        assert connections.take(None, held=held) is first
        pooled = connections.take(None)
        assert isinstance(pooled, Upstream)
        assert pooled.stream is third.stream
        assert await server.count() == 3


async def test_park_held_gives_it_to_the_shared_pool() -> None:
    async with upstreams() as (connections, server):
        upstream = await connections.acquire(None)
        connections.hold(upstream)
        connections.park_held(upstream)
        assert connections.keepalive.idle_count() == 1
        again = await connections.acquire(None)
        assert again.stream is upstream.stream
        assert again.reused
        assert await server.count() == 1


async def test_close_closes_those_in_use() -> None:
    async with upstreams() as (connections, server):
        idle, busy = [await connections.acquire(None) for _ in range(2)]
        connections.release(idle, clean=True)
        connections.close()
        assert connections.keepalive.idle_count() == 1
        pooled = connections.keepalive.acquire(idle.server)
        assert pooled is idle.stream
        await pooled.aclose()
        assert isinstance(busy.stream, trio.SocketStream)
        assert busy.stream.socket.fileno() == -1  # closed
        assert await server.count() == 2
