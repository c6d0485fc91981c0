"""Drain and reload of a running Edge, over real loopback sockets."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from proxyproto import ProxyHeader, encode
from tests.peers import free_port
from tests.tlsedge.control.test_admin import http_get
from tests.tlsedge.helpers import (
    Backend,
    address_of,
    close_clients,
    connect,
    exchange,
    make_config,
    read_all,
    tag_handler,
    wait_access_records,
    wait_until,
)
from tlsedge._control.edge import Edge
from tlsedge._core.config import Config, ConfigError


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


class RunningEdge:
    """An Edge run in a nursery, with an event set when ``run()`` returned."""

    def __init__(self, config: Config) -> None:
        self.edge = Edge(config)
        self.returned = trio.Event()

    async def start(self, nursery: trio.Nursery) -> Edge:
        await nursery.start(self._run)
        return self.edge

    async def _run(self, *, task_status: trio.TaskStatus[Edge]) -> None:
        await self.edge.run(task_status=task_status)
        self.returned.set()


async def assert_refused(address: tuple[str, int]) -> None:
    with (
        trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock,
        pytest.raises(ConnectionRefusedError),
    ):
        await sock.connect(address)


def echo_handler(name: str) -> Any:
    """Send *name*, then echo everything back until EOF."""

    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(name.encode())
        while data := await stream.receive_some(65536):
            await stream.send_all(data)

    return handler


def config_for(
    backends: dict[str, Backend],
    listeners: dict[str, str],
    *,
    edge: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Config:
    """Listeners ``{name: backend}`` on 127.0.0.1:0 and one backend per Backend."""
    return make_config(
        [
            {"name": name, "backend": b, **(extra or {})}
            for name, b in listeners.items()
        ],
        [{"name": name, "servers": [b.address]} for name, b in backends.items()],
        edge=edge,
    )


# -- drain ------------------------------------------------------------------


async def test_drain_refuses_new_connections_and_lets_transfers_finish(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    release = trio.Event()
    response = b"r" * (1 << 20)

    async def slow(stream: trio.SocketStream) -> None:
        await stream.send_all(b"started")
        await release.wait()
        await stream.send_all(response)

    backend = await Backend(slow).start(nursery)
    running = RunningEdge(config_for({"b": backend}, {"in": "b"}))
    edge = await running.start(nursery)
    address = address_of(edge, "in")
    client = await connect(address)
    assert await client.receive_some(7) == b"started"
    edge.drain()
    assert not edge.ready
    await assert_refused(address)
    release.set()  # the transfer goes on after drain() ...
    with trio.fail_after(10):
        assert await read_all(client, limit=1 << 30) == response
    await client.aclose()
    with trio.fail_after(10):
        await running.returned.wait()  # ... and run() returns once it ended
    (record,) = await wait_access_records(caplog)
    assert record["termination"] == "server_closed"
    assert record["bytes_from_server"] == 7 + len(response)


async def test_drain_timeout_closes_what_is_left(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    running = RunningEdge(
        config_for({"b": backend}, {"in": "b"}, edge={"drain_timeout": 0.5})
    )
    edge = await running.start(nursery)
    clients = [await connect(address_of(edge, "in")) for _ in range(2)]
    for client in clients:
        assert await client.receive_some(2) == b"hi"
    start = trio.current_time()
    edge.drain()
    with trio.fail_after(10):
        for client in clients:
            assert await read_all(client) == b""  # closed by the edge
            await client.aclose()
        await running.returned.wait()
    assert trio.current_time() - start >= 0.5
    records = await wait_access_records(caplog, 2)
    assert [r["termination"] for r in records] == ["drained", "drained"]
    await wait_until(lambda: backend.active == 0)  # upstreams closed too
    assert "draining: listeners closed, 2 connections" in caplog.text


async def test_stop_closes_everything_at_once(nursery: trio.Nursery) -> None:
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    running = RunningEdge(config_for({"b": backend}, {"in": "b"}))
    edge = await running.start(nursery)  # drain_timeout 30 s: not waited for
    client = await connect(address_of(edge, "in"))
    assert await client.receive_some(2) == b"hi"
    edge.stop()
    with trio.fail_after(5):
        await running.returned.wait()
        assert await read_all(client) == b""
    await client.aclose()


# -- reload -------------------------------------------------------------------


async def test_reload_moves_new_connections_and_keeps_open_ones(
    nursery: trio.Nursery,
) -> None:
    old = await Backend(echo_handler("old")).start(nursery)
    new = await Backend(echo_handler("new")).start(nursery)
    backends = {"old": old, "new": new}
    running = RunningEdge(config_for(backends, {"in": "old"}))
    edge = await running.start(nursery)
    address = address_of(edge, "in")
    kept = await connect(address)
    assert await kept.receive_some(3) == b"old"
    await edge.reload(config_for(backends, {"in": "new"}))
    assert address_of(edge, "in") == address  # same bind: same socket
    assert (await exchange(address)).startswith(b"new")
    await kept.send_all(b"still here")  # the open connection still reaches old
    with trio.fail_after(5):
        assert await kept.receive_some(100) == b"still here"
    await kept.aclose()
    assert old.accepted == 1
    edge.drain()


async def test_reload_with_unresolvable_backend_is_refused(
    nursery: trio.Nursery,
) -> None:
    backend = await Backend(tag_handler("ok")).start(nursery)
    running = RunningEdge(config_for({"b": backend}, {"in": "b"}))
    edge = await running.start(nursery)
    before = edge.config
    bad = make_config(
        [{"name": "in", "backend": "b"}],
        [{"name": "b", "servers": ["no-such-host.invalid:80"]}],
    )
    with pytest.raises(ConfigError, match="backends"):
        await edge.reload(bad)
    assert edge.config is before
    assert await exchange(address_of(edge, "in")) == b"ok"
    edge.drain()


async def test_reload_adds_and_removes_listeners(nursery: trio.Nursery) -> None:
    backend = await Backend(tag_handler("ok")).start(nursery)
    backends = {"b": backend}
    running = RunningEdge(config_for(backends, {"in": "b"}))
    edge = await running.start(nursery)
    first = address_of(edge, "in")
    await edge.reload(config_for(backends, {"in": "b", "extra": "b"}))
    assert set(edge.listen_addresses) == {"in", "extra"}
    assert await exchange(address_of(edge, "extra")) == b"ok"
    assert await exchange(first) == b"ok"
    await edge.reload(config_for(backends, {"extra": "b"}))
    assert set(edge.listen_addresses) == {"extra"}
    await assert_refused(first)
    assert await exchange(address_of(edge, "extra")) == b"ok"
    edge.drain()
    with trio.fail_after(5):
        await running.returned.wait()


async def test_reload_while_a_header_is_pending_keeps_the_old_backend(
    nursery: trio.Nursery,
) -> None:
    """A connection accepted before a reload that removed its backend."""
    old = await Backend(tag_handler("old")).start(nursery)
    new = await Backend(tag_handler("new")).start(nursery)
    trust = {"proxy_protocol": {"trusted": ["127.0.0.1/32"]}}
    running = RunningEdge(config_for({"old": old}, {"in": "old"}, extra=trust))
    edge = await running.start(nursery)
    client = await connect(address_of(edge, "in"))
    await wait_until(lambda: edge.active_connections == 1)  # reading the header
    await edge.reload(config_for({"new": new}, {"in": "new"}, extra=trust))
    header = ProxyHeader.from_addresses(("192.0.2.1", 1234), ("192.0.2.2", 80))
    await client.send_all(encode(header))
    await client.send_eof()
    with trio.fail_after(5):
        assert await read_all(client) == b"old"
    await client.aclose()
    header_after = encode(header)
    assert await exchange(address_of(edge, "in"), header_after) == b"new"
    assert not running.returned.is_set()  # the edge is still up
    edge.drain()


async def test_reload_while_draining_is_refused(nursery: trio.Nursery) -> None:
    backend = await Backend(tag_handler("ok")).start(nursery)
    config = config_for({"b": backend}, {"in": "b"})
    running = RunningEdge(config)
    edge = await running.start(nursery)
    edge.drain()
    with pytest.raises(ConfigError, match="draining"):
        await edge.reload(config)
    with trio.fail_after(5):
        await running.returned.wait()


async def test_reload_before_start_or_after_stop_is_refused_as_such(
    nursery: trio.Nursery,
) -> None:
    # (A SIGHUP during start-up was refused "while draining or stopped".)
    backend = await Backend(tag_handler("ok")).start(nursery)
    config = config_for({"b": backend}, {"in": "b"})
    running = RunningEdge(config)
    with pytest.raises(ConfigError, match="while starting or once stopped"):
        await running.edge.reload(config)
    edge = await running.start(nursery)
    edge.stop()
    with trio.fail_after(5):
        await running.returned.wait()
    with pytest.raises(ConfigError, match="while starting or once stopped"):
        await edge.reload(config)


async def test_a_reload_refused_at_bind_leaves_the_backends_as_they_were(
    nursery: trio.Nursery,
) -> None:
    # Everything that can fail is done before anything changes: the backend's
    # new server was resolved before the bind failed, and is not in use.
    old = await Backend(tag_handler("old")).start(nursery)
    new = await Backend(tag_handler("new")).start(nursery)
    running = RunningEdge(config_for({"b": old}, {"in": "b"}))
    edge = await running.start(nursery)
    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        bad = make_config(
            [
                {"name": "in", "backend": "b"},
                {"name": "more", "backend": "b", "bind": f"127.0.0.1:{port}"},
            ],
            [{"name": "b", "servers": [new.address]}],
        )
        with pytest.raises(ConfigError, match=r"listeners\[1\]\.bind: cannot bind"):
            await edge.reload(bad)
    assert await exchange(address_of(edge, "in")) == b"old"
    assert set(edge.listen_addresses) == {"in"}
    edge.drain()


async def test_an_aborted_reload_closes_what_it_opened(nursery: trio.Nursery) -> None:
    backend = await Backend(tag_handler("ok")).start(nursery)
    backends = {"b": backend}
    admin = {"admin": f"127.0.0.1:{free_port()}"}
    running = RunningEdge(config_for(backends, {"in": "b"}))
    edge = await running.start(nursery)
    before = edge.config
    prepared = await edge.prepare_reload(
        config_for(backends, {"in": "b", "extra": "b"}, edge=admin)
    )
    assert prepared.admin is not None
    opened = [
        *prepared.opened["extra"].addresses,
        *prepared.admin.addresses,
    ]
    prepared.abort()
    for address in opened:
        await assert_refused(address)
    assert edge.config is before
    assert edge.admin is None
    assert set(edge.listen_addresses) == {"in"}
    edge.drain()


async def test_a_prepared_reload_is_not_committed_on_a_draining_edge(
    nursery: trio.Nursery,
) -> None:
    backend = await Backend(tag_handler("ok")).start(nursery)
    backends = {"b": backend}
    running = RunningEdge(config_for(backends, {"in": "b"}))
    edge = await running.start(nursery)
    before = edge.config
    prepared = await edge.prepare_reload(config_for(backends, {"extra": "b"}))
    (extra,) = prepared.opened["extra"].addresses
    edge.drain()
    prepared.commit()
    assert edge.config is before
    await assert_refused(extra)
    with trio.fail_after(5):
        await running.returned.wait()


async def test_reload_moves_the_admin_endpoint(nursery: trio.Nursery) -> None:
    backend = await Backend(tag_handler("ok")).start(nursery)
    backends = {"b": backend}
    first, moved = free_port(), free_port()
    running = RunningEdge(
        config_for(backends, {"in": "b"}, edge={"admin": f"127.0.0.1:{first}"})
    )
    edge = await running.start(nursery)
    assert (await http_get(("127.0.0.1", first), "/healthz")).status == 200
    await edge.reload(
        config_for(backends, {"in": "b"}, edge={"admin": f"127.0.0.1:{moved}"})
    )
    assert (await http_get(("127.0.0.1", moved), "/healthz")).status == 200
    await wait_refused(("127.0.0.1", first))
    await edge.reload(config_for(backends, {"in": "b"}))  # no admin endpoint
    assert edge.admin is None
    await wait_refused(("127.0.0.1", moved))
    edge.drain()


async def wait_refused(address: tuple[str, int]) -> None:
    """Until *address* refuses connections (the admin server closes its
    sockets as its task ends, a moment after the reload)."""
    with trio.fail_after(5):
        while True:
            try:
                await assert_refused(address)
            except pytest.fail.Exception:
                await trio.sleep(0.01)
                continue
            return
