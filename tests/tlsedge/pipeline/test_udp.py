"""``mode = "udp"`` listeners, with real UDP peers.

The flow table alone (`tlsedge._core.udp_flows`), then an edge in front of Python
UDP echo servers: flows per client address, balancing, idle expiry, the flow
cap under a flood from thousands of source ports, allow/deny, drain, a DNS
resolver queried with dnspython, socat as a client, and PROXY v2 with DGRAM
transports both ways.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import dns.message
import dns.rdatatype
import dns.rrset
import pytest
import trio
import trio.lowlevel

from proxyproto import (
    InetAddress,
    Policy,
    ProxyHeader,
    Transport,
    encode_v1,
    encode_v2,
    parse,
)
from tests.peers import require
from tests.tlsedge.control.test_admin import admin_address, http_get, total
from tests.tlsedge.helpers import (
    access_records,
    address_of,
    make_config,
    running_edge,
    wait_access_records,
    wait_until,
)
from tlsedge._control.cli import main
from tlsedge._control.edge import Edge
from tlsedge._core.config import ConfigError
from tlsedge._core.udp_flows import (
    DropLog,
    FlowTable,
    send_drop_reason,
    unwrap_datagram,
)
from tlsedge._pipeline.udp import UdpListener, _Flow
from tlsedge._reactor.loop import current_reactor

REPLY_WITHIN = 5.0


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


# -- the flow table ------------------------------------------------------------


class _Entry:
    def __init__(self, name: str) -> None:
        self.name = name
        self.last_seen = 0.0


def test_flow_table_expires_least_recently_used_first() -> None:
    table: FlowTable[_Entry] = FlowTable()
    a, b, c = _Entry("a"), _Entry("b"), _Entry("c")
    table.add("a", a, 0.0)
    table.add("b", b, 1.0)
    table.add("c", c, 2.0)
    table.touch("a", a, 3.0)  # a is now the most recent
    assert table.next_expiry(10.0) == 11.0  # b's
    assert table.pop_expired(11.5, 10.0) == [b]
    assert table.pop_expired(12.5, 10.0) == [c]
    assert len(table) == 1
    assert table.pop_expired(13.0, 10.0) == [a]
    assert table.next_expiry(10.0) is None


def test_flow_table_discard_keeps_a_newer_flow_of_the_same_key() -> None:
    table: FlowTable[_Entry] = FlowTable()
    old, new = _Entry("old"), _Entry("new")
    table.add("k", old, 0.0)
    assert table.pop_expired(5.0, 1.0) == [old]
    table.add("k", new, 5.0)
    table.discard("k", old)
    assert table.get("k") is new
    table.discard("k", new)
    assert table.get("k") is None


def test_drop_log_reports_at_most_once_per_interval() -> None:
    drops = DropLog(interval=1.0)
    assert drops.add("flow_cap", 0.0) == {"flow_cap": 1}
    for index in range(1000):
        assert drops.add("flow_cap" if index % 2 else "denied", 0.5) is None
    assert drops.add("flow_cap", 1.0) == {"flow_cap": 501, "denied": 500}
    assert drops.add("flow_cap", 1.5) is None


def test_a_mapped_header_source_is_written_with_its_ipv4_address() -> None:
    header = ProxyHeader.from_addresses(
        ("::ffff:192.0.2.66", 5353),
        ("::ffff:192.0.2.1", 53),
        transport=Transport.DGRAM,
    )
    peer, local = ("127.0.0.1", 1000), ("127.0.0.1", 53)
    unwrapped = unwrap_datagram(encode_v2(header) + b"q", Policy.REQUIRE, peer, local)
    assert unwrapped.client == ("::ffff:192.0.2.66", 5353)
    assert unwrapped.destination == ("::ffff:192.0.2.1", 53)
    assert unwrapped.payload == b"q"


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (errno.EMSGSIZE, "too_large"),
        (errno.ENOBUFS, "server_busy"),
        (errno.ENOMEM, "server_busy"),
        (errno.ECONNREFUSED, None),  # the server's host: port unreachable
        (errno.EHOSTUNREACH, None),
        (errno.ENETUNREACH, None),
    ],
)
def test_send_errors_that_are_not_the_servers(error: int, reason: str | None) -> None:
    assert send_drop_reason(OSError(error, os.strerror(error))) == reason


# -- peers ------------------------------------------------------------------------


class EchoServer:
    """A UDP server on 127.0.0.1: answers each datagram with ``name|`` and
    the datagram (PROXY header stripped and remembered with ``proxy``)."""

    def __init__(
        self, name: str = "", *, proxy: bool = False, host: str = "127.0.0.1"
    ) -> None:
        self.name = name
        self.proxy = proxy
        self.host = host
        self.port = 0
        self.sources: list[tuple[str, int]] = []
        self.headers: list[ProxyHeader] = []

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def run(self, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            await sock.bind((self.host, 0))
            self.port = sock.getsockname()[1]
            task_status.started()
            while True:
                data, source = await sock.recvfrom(65535)
                self.sources.append(source)
                if self.proxy:
                    header, used = parse(data)
                    self.headers.append(header)
                    data = data[used:]
                prefix = f"{self.name}|".encode() if self.name else b""
                await sock.sendto(prefix + data, source)


class Client:
    """A UDP client socket bound to *host* (any loopback address)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.host = host

    async def __aenter__(self) -> Client:
        await self.sock.bind((self.host, 0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.sock.close()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()
        return (host, port)

    async def ask(self, edge: tuple[str, int], data: bytes) -> bytes:
        """Send *data*, return the reply; the reply must come from *edge*."""
        await self.sock.sendto(data, edge)
        with trio.fail_after(REPLY_WITHIN):
            reply, source = await self.sock.recvfrom(65535)
        assert source == edge
        return reply

    async def quiet(self, seconds: float = 0.2) -> bool:
        """True when nothing arrives within *seconds* (a dropped datagram)."""
        with trio.move_on_after(seconds):
            await self.sock.recvfrom(65535)
            return False
        return True


@asynccontextmanager
async def servers(
    *names: str, proxy: bool = False, hosts: tuple[str, ...] = ()
) -> AsyncIterator[list[EchoServer]]:
    async with trio.open_nursery() as nursery:
        started = []
        for index, name in enumerate(names):
            host = hosts[index] if hosts else "127.0.0.1"
            server = EchoServer(name, proxy=proxy, host=host)
            await nursery.start(server.run)
            started.append(server)
        yield started
        nursery.cancel_scope.cancel()


def udp_config(
    backends: list[EchoServer],
    listener: dict[str, Any] | None = None,
    backend: dict[str, Any] | None = None,
    edge: dict[str, Any] | None = None,
) -> Any:
    return make_config(
        [{"name": "dns", "mode": "udp", "backend": "b", **(listener or {})}],
        [{"name": "b", "servers": [s.address for s in backends], **(backend or {})}],
        edge,
    )


def samples(edge: Edge, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(labels.items())): value
        for sample, labels, value in edge._metrics.samples()
        if sample == name
    }


def dropped(edge: Edge, reason: str) -> float:
    return sum(
        value
        for labels, value in samples(
            edge, "tlsedge_udp_datagrams_dropped_total"
        ).items()
        if ("reason", reason) in labels
    )


def relayed(edge: Edge) -> float:
    return samples(edge, "tlsedge_udp_datagrams_total").get(
        (("direction", "from_client"), ("listener", "dns")), 0.0
    )


def flow_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r for r in access_records(caplog) if r["listener"] == "dns"]


def open_flows(address: tuple[str, int], count: int) -> list[socket.socket]:
    """*count* clients (a flow each), each having sent one datagram."""
    clients = []
    try:
        for index in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            clients.append(sock)
            sock.setblocking(False)
            sock.sendto(str(index).encode(), address)
    except BaseException:
        for sock in clients:
            sock.close()
        raise
    return clients


async def wait_replies(edge: Edge, clients: list[socket.socket]) -> None:
    """Wait until every client of `open_flows` has its answer, and check it."""
    await wait_until(
        lambda: (
            samples(edge, "tlsedge_udp_datagrams_total").get(
                (("direction", "from_server"), ("listener", "dns"))
            )
            == len(clients)
        )
    )
    assert [sock.recv(100) for sock in clients] == [
        str(index).encode() for index in range(len(clients))
    ]


def assert_released(edge: Edge, flows: list[Any]) -> None:
    """Every one of *flows* ended whole: its socket closed and off the
    reactor, its tokens and its server's lease given back, counted."""
    assert flows
    assert all(flow.upstream.fileno() == -1 for flow in flows)
    handlers = current_reactor()._handlers.values()
    assert not any(isinstance(handler, _Flow) for handler in handlers)
    assert edge._listeners["dns"].limiter.borrowed_tokens == 0
    assert edge._edge_limiter.borrowed_tokens == 0
    assert edge.active_connections == 0
    assert [h.server.active for h in edge._pools["b"].servers] == [0]
    assert samples(edge, "tlsedge_connections_active") == {(("listener", "dns"),): 0}


# -- relaying -----------------------------------------------------------------------


async def test_replies_come_from_the_listener_address() -> None:
    async with servers("a") as (echo,), running_edge(udp_config([echo])) as edge:
        address = address_of(edge, "dns")
        async with Client() as client:
            assert await client.ask(address, b"hello") == b"a|hello"
            assert await client.ask(address, b"") == b"a|"  # empty datagrams too
            big = bytes(range(256)) * 255 + b"x" * 127  # 65407 bytes
            assert await client.ask(address, big) == b"a|" + big
        # One flow: the server saw one source, the edge's upstream socket.
        assert len(set(echo.sources)) == 1


async def test_a_flow_counts_its_bytes_while_it_runs() -> None:
    def counts(edge: Edge) -> list[float]:
        server = (("backend", "b"), ("server", echo.address))
        return [
            samples(edge, "tlsedge_client_bytes_received_total")[listener],
            samples(edge, "tlsedge_client_bytes_sent_total")[listener],
            samples(edge, "tlsedge_server_bytes_sent_total")[server],
            samples(edge, "tlsedge_server_bytes_received_total")[server],
        ]

    listener = (("listener", "dns"),)
    async with servers("a") as (echo,), running_edge(udp_config([echo])) as edge:
        address = address_of(edge, "dns")
        async with Client() as client:
            assert await client.ask(address, b"one") == b"a|one"
            assert await client.ask(address, b"two" * 100) == b"a|" + b"two" * 100
            # The flow is open (idle_timeout 60 s): its bytes count already.
            assert samples(edge, "tlsedge_connections_active") == {listener: 1}
            assert counts(edge) == [303, 307, 303, 307]
    # Ended with the edge: counted once.
    assert samples(edge, "tlsedge_connections_active") == {listener: 0}
    assert counts(edge) == [303, 307, 303, 307]


async def test_largest_datagram_is_relayed() -> None:
    async with servers("") as (echo,), running_edge(udp_config([echo])) as edge:
        address = address_of(edge, "dns")
        async with Client() as client:
            largest = b"z" * 65507
            assert await client.ask(address, largest) == largest


async def test_each_client_address_is_a_flow_of_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with servers("") as (echo,):
        config = udp_config([echo], {"idle_timeout": 0.3})
        async with running_edge(config) as edge:
            address = address_of(edge, "dns")
            async with (
                Client("127.0.0.1") as one,
                Client("127.0.0.2") as two,
                Client("127.0.0.2") as three,
            ):
                for round_ in range(3):
                    for client in (one, two, three):
                        data = f"{client.address}:{round_}".encode()
                        assert await client.ask(address, data) == data
                assert len(set(echo.sources)) == 3  # an upstream socket each
                addresses = {one.address, two.address, three.address}
                records = await wait_access_records(caplog, 3)
            by_client = {r["client"]: r for r in records}
            assert set(by_client) == {f"{host}:{port}" for host, port in addresses}
            for record in records:
                assert record["termination"] == "idle_timeout"
                assert record["requests"] == 3  # datagrams from the client
                assert record["bytes_from_client"] == record["bytes_from_server"]
                assert record["server"] == echo.address
                assert record["destination"] == f"127.0.0.1:{address[1]}"


async def test_round_robin_spreads_flows_over_servers() -> None:
    async with servers("a", "b") as echoes, running_edge(udp_config(echoes)) as edge:
        address = address_of(edge, "dns")
        answers = []
        for _ in range(4):
            async with Client() as client:
                answers.append((await client.ask(address, b"?")).split(b"|")[0])
        assert sorted(answers) == [b"a", b"a", b"b", b"b"]


async def test_source_ip_affinity_pins_a_client_address() -> None:
    async with servers("a", "b") as echoes:
        config = udp_config(echoes, backend={"balance": "source-ip"})
        async with running_edge(config) as edge:
            address = address_of(edge, "dns")
            answers = set()
            for _ in range(4):  # new source ports, one address
                async with Client("127.0.0.3") as client:
                    answers.add((await client.ask(address, b"?")).split(b"|")[0])
            assert len(answers) == 1


async def test_idle_timeout_ends_a_flow_and_a_new_one_starts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = {"idle_timeout": 0.2}
    async with servers("") as (echo,), running_edge(udp_config([echo], config)) as edge:
        address = address_of(edge, "dns")
        async with Client() as client:
            assert await client.ask(address, b"1") == b"1"
            (record,) = await wait_access_records(caplog, 1)
            assert record["termination"] == "idle_timeout"
            assert record["requests"] == 1
            assert record["bytes_from_client"] == 1
            assert record["bytes_from_server"] == 1
            assert await client.ask(address, b"2") == b"2"
        assert len(set(echo.sources)) == 2  # a second flow, a new socket
        opened = samples(edge, "tlsedge_connections_total")
        assert opened == {(("listener", "dns"),): 2.0}
        datagrams = samples(edge, "tlsedge_udp_datagrams_total")
        assert datagrams[(("direction", "from_client"), ("listener", "dns"))] == 2
        assert datagrams[(("direction", "from_server"), ("listener", "dns"))] == 2


async def test_server_port_unreachable_ends_the_flow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    config = make_config(
        [{"name": "dns", "mode": "udp", "backend": "b"}],
        [{"name": "b", "servers": [f"127.0.0.1:{port}"]}],
    )
    async with running_edge(config) as edge, Client() as client:
        address = address_of(edge, "dns")
        await client.sock.sendto(b"anyone?", address)
        (record,) = await wait_access_records(caplog, 1)
        assert record["termination"] == "server_error"
        assert record["detail"] == "connection refused"


async def test_server_gone_mid_flow_ends_it_and_releases_everything(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        await server.bind(("127.0.0.1", 0))
        config = make_config(
            [{"name": "dns", "mode": "udp", "backend": "b"}],
            [{"name": "b", "servers": [f"127.0.0.1:{server.getsockname()[1]}"]}],
        )
        async with running_edge(config) as edge, Client() as client:
            address = address_of(edge, "dns")
            udp = edge._listeners["dns"].udp
            assert udp is not None
            await client.sock.sendto(b"one", address)
            with trio.fail_after(REPLY_WITHIN):
                _, upstream = await server.recvfrom(100)
            await server.sendto(b"first", upstream)
            with trio.fail_after(REPLY_WITHIN):
                assert await client.sock.recv(100) == b"first"
            flows = udp.flows.values()
            server.close()  # the next datagram gets an ICMP port unreachable
            await client.sock.sendto(b"two", address)
            (record,) = await wait_access_records(caplog, 1)
            assert record["termination"] == "server_error"
            assert record["detail"] == "connection refused"
            assert record["requests"] == 2
            assert record["bytes_from_client"] == 6
            assert record["bytes_from_server"] == 5
            assert_released(edge, flows)
            assert len(udp.flows) == 0
            closed = samples(edge, "tlsedge_connections_closed_total")
            assert closed == {(("listener", "dns"), ("termination", "server_error")): 1}


async def test_a_bug_relaying_replies_ends_that_flow_alone(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken_flows: list[_Flow] = []

    def broken(listener: UdpListener, flow: _Flow) -> None:
        broken_flows.append(flow)
        raise RuntimeError("broken relay")

    async with servers("") as (echo,), running_edge(udp_config([echo])) as edge:
        address = address_of(edge, "dns")
        async with Client() as client:
            with monkeypatch.context() as patch:
                patch.setattr(UdpListener, "_replies", broken)
                await client.sock.sendto(b"lost", address)
                (record,) = await wait_access_records(caplog, 1)
            assert record["termination"] == "internal_error"
            assert record["detail"] == "RuntimeError: broken relay"
            assert_released(edge, broken_flows)
            # The next datagram of that client makes a new flow.
            assert await client.ask(address, b"again") == b"again"


async def test_a_bug_on_one_datagram_costs_that_datagram_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    datagram = UdpListener._datagram

    def broken_once(listener: UdpListener, *args: Any) -> bool:
        patch.undo()
        raise RuntimeError("broken datagram")

    async with servers("") as (echo,), running_edge(udp_config([echo])) as edge:
        address = address_of(edge, "dns")
        async with Client() as client:
            with monkeypatch.context() as patch:
                patch.setattr(UdpListener, "_datagram", broken_once)
                await client.sock.sendto(b"lost", address)
                assert await client.quiet()
            assert UdpListener._datagram is datagram
            assert await client.ask(address, b"served") == b"served"
        assert len(echo.sources) == 1  # the second datagram only


async def test_unreachable_server_is_marked_down_by_traffic() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    async with servers("live") as (echo,):
        config = make_config(
            [{"name": "dns", "mode": "udp", "backend": "b"}],
            [{"name": "b", "servers": [dead, echo.address]}],
        )
        async with running_edge(config) as edge:
            address = address_of(edge, "dns")
            pool = edge._pools["b"]
            down = pool.servers[0].server
            with trio.fail_after(10):
                while down.healthy:  # each flow to it ends: port unreachable
                    async with Client() as client:
                        await client.sock.sendto(b"?", address)
                        with trio.move_on_after(0.2):
                            await client.sock.recvfrom(100)
            for _ in range(3):  # no trial before the passive cool-down
                async with Client() as client:
                    assert await client.ask(address, b"?") == b"live|?"
            assert pool.servers[1].server.healthy


async def test_flood_from_many_ports_stays_within_the_flow_cap() -> None:
    cap, clients, batch = 100, 3000, 100
    async with servers("") as (echo,):
        config = udp_config([echo], {"max_connections": cap, "idle_timeout": 30.0})
        async with running_edge(config) as edge:
            address = address_of(edge, "dns")
            udp = edge._listeners["dns"].udp
            assert udp is not None
            most = 0
            for sent in range(batch, clients + 1, batch):
                sockets = [
                    socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    for _ in range(batch)
                ]
                try:
                    for sock in sockets:
                        sock.sendto(b"flood", address)
                    # Each datagram is relayed on a flow or dropped at the cap
                    # (a port the kernel gave out twice joins its earlier
                    # flow). Waiting per batch keeps the flood within the
                    # listener's receive buffer, where the kernel would drop.
                    await wait_until(
                        lambda: relayed(edge) + dropped(edge, "flow_cap") == sent  # noqa: B023
                    )
                    most = max(most, len(udp.flows))
                finally:
                    for sock in sockets:
                        sock.close()
            assert most == cap
            assert dropped(edge, "flow_cap") >= clients - 2 * cap
            assert len(udp.flows) == cap
            assert edge._listeners["dns"].limiter.borrowed_tokens == cap
            assert edge.snapshot().listeners[0].connections == cap


async def test_denied_clients_make_no_flow(caplog: pytest.LogCaptureFixture) -> None:
    async with servers("") as (echo,):
        config = udp_config([echo], {"allow": ["127.0.0.2/32"]})
        async with running_edge(config) as edge:
            address = address_of(edge, "dns")
            async with Client("127.0.0.1") as refused, Client("127.0.0.2") as admitted:
                for _ in range(50):
                    await refused.sock.sendto(b"no", address)
                assert await admitted.ask(address, b"yes") == b"yes"
                assert await refused.quiet()
                await wait_until(lambda: dropped(edge, "denied") == 50)
            assert echo.sources
            assert len(set(echo.sources)) == 1
            udp = edge._listeners["dns"].udp
            assert udp is not None
            assert len(udp.flows) == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "tlsedge.udp"]
    assert 1 <= len(warnings) < 50  # throttled, never one per datagram
    assert "denied" in warnings[0]


async def test_no_healthy_server_drops_datagrams() -> None:
    with socket.socket() as closed:  # a TCP port nobody listens on
        closed.bind(("127.0.0.1", 0))
        health_port = closed.getsockname()[1]
    async with servers("") as (echo,):
        health = {"port": health_port, "interval": 0.2, "timeout": 0.2}
        config = udp_config([echo], backend={"health": health})
        async with running_edge(config) as edge, Client() as client:
            address = address_of(edge, "dns")
            (server,) = edge._pools["b"].servers
            await wait_until(lambda: not server.server.healthy)
            await client.sock.sendto(b"anyone?", address)
            assert await client.quiet()
            await wait_until(lambda: dropped(edge, "no_server") == 1)
            assert echo.sources == []


async def test_edge_max_connections_counts_flows() -> None:
    async with servers("") as (echo,):
        config = udp_config([echo], edge={"max_connections": 2})
        async with (
            running_edge(config) as edge,
            Client() as one,
            Client() as two,
            Client() as three,
        ):
            address = address_of(edge, "dns")
            assert await one.ask(address, b"1") == b"1"
            assert await two.ask(address, b"2") == b"2"
            await three.sock.sendto(b"3", address)
            assert await three.quiet()
            assert dropped(edge, "flow_cap") == 1
            assert edge.active_connections == 2
            assert await one.ask(address, b"again") == b"again"


async def test_drain_keeps_flows_and_takes_no_new_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with servers("") as (echo,):
        config = udp_config([echo], {"idle_timeout": 60.0}, edge={"drain_timeout": 0.5})
        async with trio.open_nursery() as nursery:
            edge: Edge = await nursery.start(Edge(config).run)
            address = address_of(edge, "dns")
            async with Client() as old, Client() as new:
                assert await old.ask(address, b"before") == b"before"
                edge.drain()
                assert await old.ask(address, b"during") == b"during"
                await new.sock.sendto(b"late", address)
                assert await new.quiet()
                assert dropped(edge, "draining") == 1
        # run() returned: the flow was cut at the drain deadline.
        (record,) = flow_records(caplog)
        assert record["termination"] == "drained"
        assert record["requests"] == 2


@pytest.mark.parametrize(
    ("end", "idle_timeout", "drain_timeout", "termination"),
    [
        ("drain", 60.0, 0.3, "drained"),  # cut at the drain deadline
        ("drain", 1.0, 60.0, "idle_timeout"),  # idle before it: run() returns
        ("stop", 60.0, 60.0, "drained"),
    ],
)
async def test_drain_ends_many_open_flows_and_closes_the_listener(
    caplog: pytest.LogCaptureFixture,
    end: str,
    idle_timeout: float,
    drain_timeout: float,
    termination: str,
) -> None:
    count = 50
    async with servers("") as (echo,):
        config = udp_config(
            [echo],
            {"idle_timeout": idle_timeout},
            edge={"drain_timeout": drain_timeout},
        )
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                edge: Edge = await nursery.start(Edge(config).run)
                listener = edge._listeners["dns"]
                assert listener.udp is not None
                clients = open_flows(address_of(edge, "dns"), count)
                try:
                    await wait_replies(edge, clients)
                    flows = listener.udp.flows.values()
                    if end == "drain":
                        edge.drain()
                    else:
                        edge.stop()
                finally:
                    for sock in clients:
                        sock.close()
        # run() returned: every flow ended, the listener's socket closed.
        records = flow_records(caplog)
        assert len(records) == count
        assert {r["termination"] for r in records} == {termination}
        assert all(r["requests"] == 1 for r in records)
        assert [sock.fileno() for sock in listener.sockets] == [-1]
        assert_released(edge, flows)


async def test_many_flows_expiring_at_once_all_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    count = 200
    long_idle = {"idle_timeout": 60.0}
    async with (
        servers("") as (echo,),
        running_edge(udp_config([echo], long_idle)) as edge,
    ):
        address = address_of(edge, "dns")
        udp = edge._listeners["dns"].udp
        assert udp is not None
        clients = open_flows(address, count)
        try:
            await wait_replies(edge, clients)
            flows = udp.flows.values()
            assert len(flows) == count
            # A shorter idle_timeout applies to every open flow: all of
            # them expire on the listener's next timer.
            await edge.reload(udp_config([echo], {"idle_timeout": 0.05}))
            records = await wait_access_records(caplog, count)
        finally:
            for sock in clients:
                sock.close()
        assert {r["termination"] for r in records} == {"idle_timeout"}
        assert len({r["client"] for r in records}) == count
        assert_released(edge, flows)
        closed = samples(edge, "tlsedge_connections_closed_total")
        assert closed == {(("listener", "dns"), ("termination", "idle_timeout")): count}
        # The listener goes on: a new client makes a new flow.
        async with Client() as client:
            assert await client.ask(address, b"after") == b"after"


async def test_reload_moves_a_listener_and_its_old_flows_finish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with servers("a", "b") as (a, b):
        first = udp_config([a], {"idle_timeout": 0.3})
        second = make_config(
            [{"name": "dns", "mode": "udp", "backend": "b", "bind": "127.0.0.2:0"}],
            [{"name": "b", "servers": [b.address]}],
        )
        async with running_edge(first) as edge, Client() as old, Client() as late:
            old_address = address_of(edge, "dns")
            moved = edge._listeners["dns"]
            assert await old.ask(old_address, b"1") == b"a|1"
            await edge.reload(second)
            new_address = address_of(edge, "dns")
            assert new_address[0] == "127.0.0.2"
            # The old flow goes on through the old socket; new clients there
            # are dropped; the new address serves the new backend.
            assert await old.ask(old_address, b"2") == b"a|2"
            await late.sock.sendto(b"x", old_address)
            assert await late.quiet()
            assert await late.ask(new_address, b"3") == b"b|3"
            # The old flow idles out, and the old socket closes after it.
            await wait_until(lambda: moved.sockets[0].fileno() == -1)
            (record,) = [r for r in flow_records(caplog) if r["server"] == a.address]
            assert record["termination"] == "idle_timeout"
            assert record["requests"] == 2


async def test_reload_turns_a_tcp_listener_into_a_udp_one() -> None:
    async with servers("u") as (echo,):
        tcp = make_config(
            [{"name": "dns", "backend": "t"}],
            [{"name": "t", "servers": ["127.0.0.1:9"]}],
        )
        async with running_edge(tcp) as edge, Client() as client:
            await edge.reload(udp_config([echo]))
            assert await client.ask(address_of(edge, "dns"), b"x") == b"u|x"


@pytest.mark.parametrize(
    ("bind", "family", "client", "sent_to"),
    [
        ("0.0.0.0:0", socket.AF_INET, "127.0.0.1", "127.0.0.2"),
        ("[::]:0", socket.AF_INET6, "::1", "::1"),
    ],
)
async def test_wildcard_listener_replies_from_the_address_sent_to(
    caplog: pytest.LogCaptureFixture,
    bind: str,
    family: socket.AddressFamily,
    client: str,
    sent_to: str,
) -> None:
    async with servers("", proxy=True) as (echo,):
        config = udp_config(
            [echo], {"bind": bind, "idle_timeout": 0.2}, {"send_proxy": "v2"}
        )
        async with running_edge(config) as edge:
            target = (sent_to, address_of(edge, "dns")[1])
            with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
                await sock.bind((client, 0))
                await sock.sendto(b"where", target)
                with trio.fail_after(REPLY_WITHIN):
                    reply, source = await sock.recvfrom(100)
            assert reply == b"where"
            assert source[:2] == target  # not the address routing would pick
            (record,) = await wait_access_records(caplog, 1)
        shown = f"[{sent_to}]" if ":" in sent_to else sent_to
        assert record["destination"] == f"{shown}:{target[1]}"
        (header,) = echo.headers
        assert header.destination == InetAddress.parse(*target)


async def test_ipv6_clients(caplog: pytest.LogCaptureFixture) -> None:
    async with servers("", proxy=True) as (echo,):
        config = udp_config(
            [echo], {"bind": "[::1]:0", "idle_timeout": 0.2}, {"send_proxy": "v2"}
        )
        async with running_edge(config) as edge:
            address = address_of(edge, "dns")
            with trio.socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
                await sock.bind(("::1", 0))
                port = sock.getsockname()[1]
                await sock.sendto(b"six", address)
                with trio.fail_after(REPLY_WITHIN):
                    reply, source = await sock.recvfrom(100)
            assert reply == b"six"
            assert source[:2] == address
            (record,) = await wait_access_records(caplog, 1)
        assert record["client"] == f"[::1]:{port}"
        (header,) = echo.headers
        assert header.source == InetAddress.parse("::1", port)


async def test_drain_with_no_flows_returns_at_once() -> None:
    async with servers("") as (echo,):
        config = udp_config([echo], edge={"drain_timeout": 60.0})
        with trio.fail_after(REPLY_WITHIN):
            async with trio.open_nursery() as nursery:
                edge: Edge = await nursery.start(Edge(config).run)
                edge.drain()


async def test_socat_client() -> None:
    socat = require("socat")
    async with servers("s") as (echo,), running_edge(udp_config([echo])) as edge:
        host, port = address_of(edge, "dns")
        result = await trio.run_process(
            [socat, "-t", "2", "-", f"UDP:{host}:{port}"],
            stdin=b"hello over socat\n",
            capture_stdout=True,
        )
        assert result.stdout == b"s|hello over socat\n"


async def _resolver(*, task_status: trio.TaskStatus[int]) -> None:
    """A tiny DNS server: every A query gets 192.0.2.53."""
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        await sock.bind(("127.0.0.1", 0))
        task_status.started(sock.getsockname()[1])
        while True:
            wire, source = await sock.recvfrom(65535)
            query = dns.message.from_wire(wire)
            response = dns.message.make_response(query)
            question = query.question[0]
            response.answer.append(
                dns.rrset.from_text(question.name, 60, "IN", "A", "192.0.2.53")
            )
            await sock.sendto(response.to_wire(), source)


async def test_dns_through_the_edge() -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_resolver)
        config = make_config(
            [{"name": "dns", "mode": "udp", "backend": "resolvers"}],
            [{"name": "resolvers", "servers": [f"127.0.0.1:{port}"]}],
        )
        async with running_edge(config) as edge, Client() as client:
            address = address_of(edge, "dns")
            for name in ("example.com.", "tlsedge.test."):
                query = dns.message.make_query(name, dns.rdatatype.A)
                answer = dns.message.from_wire(
                    await client.ask(address, query.to_wire())
                )
                assert answer.id == query.id
                assert [str(r) for r in answer.answer[0]] == ["192.0.2.53"]
                assert answer.answer[0].name.to_text() == name
        nursery.cancel_scope.cancel()


# -- PROXY v2 with DGRAM transports ---------------------------------------------


def dgram_header(source: tuple[str, int], destination: tuple[str, int]) -> bytes:
    return encode_v2(
        ProxyHeader.from_addresses(source, destination, transport=Transport.DGRAM)
    )


async def test_send_proxy_v2_wraps_every_datagram() -> None:
    async with servers("", proxy=True) as (echo,):
        config = udp_config([echo], backend={"send_proxy": "v2"})
        async with running_edge(config) as edge, Client() as client:
            address = address_of(edge, "dns")
            assert await client.ask(address, b"one") == b"one"
            assert await client.ask(address, b"") == b""
            assert len(echo.headers) == 2
            for header in echo.headers:
                assert header.transport is Transport.DGRAM
                assert header.source == InetAddress.parse(*client.address)
                assert header.destination == InetAddress.parse(*address)
            assert echo.headers[0] == echo.headers[1]  # one header per flow


async def test_datagrams_too_large_for_the_proxy_header_never_take_the_server_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 65507 bytes (the largest IPv4 UDP payload) plus the PROXY v2 header:
    # EMSGSIZE. The client's fault: each is dropped, the server stays UP
    # (six failures in a row would have marked it DOWN for every client).
    async with servers("", proxy=True) as (echo,):
        config = udp_config(
            [echo], backend={"send_proxy": "v2"}, edge={"admin": "127.0.0.1:0"}
        )
        async with running_edge(config) as edge:
            address = address_of(edge, "dns")
            async with Client("127.0.0.2") as flooder:
                for _ in range(8):
                    await flooder.sock.sendto(b"z" * 65507, address)
                await wait_until(lambda: dropped(edge, "too_large") == 8)
                assert await flooder.quiet()
                assert await flooder.ask(address, b"small") == b"small"
            async with Client("127.0.0.3") as other:
                assert await other.ask(address, b"still there?") == b"still there?"
            (server,) = edge._pools["b"].servers
            assert server.server.healthy
            metrics = (await http_get(admin_address(edge), "/metrics")).text
        assert total(metrics, "tlsedge_server_up", backend="b") == 1
        assert total(metrics, "tlsedge_udp_datagrams_dropped_total") == 8
        assert (
            total(metrics, "tlsedge_udp_datagrams_dropped_total", reason="too_large")
            == 8
        )
    assert len(echo.headers) == 2  # the two small datagrams alone
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "tlsedge.udp" and r.levelno == logging.WARNING
    ]
    assert warnings
    assert re.fullmatch(
        r"listener dns: dropped datagrams \(too_large: 1\); the last from "
        rf"127\.0\.0\.2:\d+: datagram of 65507 bytes \((\d+) with the PROXY "
        rf"header\) to {re.escape(echo.address)}: message too long",
        warnings[0],
    ), warnings[0]
    # The flooder's flow lived on (it carried the small datagram); no flow
    # ended as the server's error.
    assert not [r for r in flow_records(caplog) if r["termination"] == "server_error"]


async def test_trusted_peer_datagrams_are_unwrapped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with servers("", proxy=True) as (echo,):
        config = udp_config(
            [echo],
            {"proxy_protocol": {"trusted": ["127.0.0.1/32"]}, "idle_timeout": 0.3},
            {"send_proxy": "v2"},
        )
        async with running_edge(config) as edge, Client() as balancer:
            address = address_of(edge, "dns")
            peer = balancer.address
            one, two = ("203.0.113.5", 4000), ("203.0.113.6", 4000)
            sent_to = ("192.0.2.1", 53)
            for client in (one, two, one):
                data = f"from {client}".encode()
                reply = await balancer.ask(
                    address, dgram_header(client, sent_to) + data
                )
                assert reply == data  # raw, back to the balancer's address
            # The header's source made the flows, and travels on to the server.
            assert [h.source for h in echo.headers] == [
                InetAddress.parse(*one),
                InetAddress.parse(*two),
                InetAddress.parse(*one),
            ]
            assert {h.destination for h in echo.headers} == {
                InetAddress.parse(*sent_to)
            }
            assert len(set(echo.sources)) == 2
            records = await wait_access_records(caplog, 2)
        assert sorted(r["client"] for r in records) == [
            "203.0.113.5:4000",
            "203.0.113.6:4000",
        ]
        assert {r["peer"] for r in records} == {"{}:{}".format(*peer)}
        assert {r["destination"] for r in records} == {"192.0.2.1:53"}


@pytest.mark.parametrize(
    ("datagram", "reason"),
    [
        (b"no header at all", "header_error"),
        (b"\r\n\r\n\x00\r\nQUIT\n\x21\x12\x00\x0c", "header_error"),  # cut
        (
            encode_v2(ProxyHeader.from_addresses(("203.0.113.5", 1), ("192.0.2.1", 53)))
            + b"stream",
            "header_error",
        ),
        (
            encode_v1(
                ProxyHeader.from_addresses(
                    ("203.0.113.5", 1), ("192.0.2.1", 53), version=1
                )
            ),
            "header_error",
        ),
        (encode_v2(ProxyHeader.local()) + b"check", "health_check"),
    ],
    ids=["none", "truncated", "stream", "v1", "local"],
)
async def test_bad_headers_from_trusted_peers_are_dropped(
    datagram: bytes, reason: str
) -> None:
    async with servers("") as (echo,):
        config = udp_config([echo], {"proxy_protocol": {"trusted": ["127.0.0.1/32"]}})
        async with running_edge(config) as edge, Client() as balancer:
            address = address_of(edge, "dns")
            await balancer.sock.sendto(datagram, address)
            await wait_until(lambda: dropped(edge, reason) == 1)
            assert await balancer.quiet()
            good = dgram_header(("203.0.113.5", 1), ("192.0.2.1", 53)) + b"ok"
            assert await balancer.ask(address, good) == b"ok"
        assert len(echo.sources) == 1


@pytest.mark.parametrize("untrusted", ["reject", "direct"])
async def test_untrusted_peers_follow_the_policy(untrusted: str) -> None:
    async with servers("") as (echo,):
        pp = {"trusted": ["127.0.0.1/32"], "untrusted": untrusted}
        config = udp_config([echo], {"proxy_protocol": pp})
        async with running_edge(config) as edge, Client("127.0.0.2") as stranger:
            address = address_of(edge, "dns")
            wrapped = dgram_header(("203.0.113.5", 1), ("192.0.2.1", 53)) + b"hi"
            for datagram in (b"hi", wrapped):
                if untrusted == "direct":  # served raw, header or not
                    assert await stranger.ask(address, datagram) == datagram
                else:
                    await stranger.sock.sendto(datagram, address)
                    assert await stranger.quiet()
            if untrusted == "reject":
                assert dropped(edge, "rejected") == 2
                assert echo.sources == []
            else:
                assert len(set(echo.sources)) == 1  # one flow: the peer's address


# -- health checks ----------------------------------------------------------------


async def test_health_checks_use_the_health_port() -> None:
    received: list[bytes] = []

    async def health_endpoint(stream: trio.SocketStream) -> None:
        with trio.move_on_after(1.0):
            received.append(await stream.receive_some(100))
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        # Only 127.0.0.1 answers on the health port: the server on 127.0.0.2
        # goes down, and every flow goes to the other.
        (listener,) = await nursery.start(
            partial(trio.serve_tcp, health_endpoint, 0, host="127.0.0.1")
        )
        health_port = listener.socket.getsockname()[1]
        async with servers("up", "down", hosts=("127.0.0.1", "127.0.0.2")) as echoes:
            config = udp_config(
                echoes,
                backend={
                    "send_proxy": "v2",
                    "health": {
                        "kind": "tcp",
                        "port": health_port,
                        "interval": 0.2,
                        "timeout": 0.2,
                        "unhealthy_threshold": 1,
                    },
                },
            )
            async with running_edge(config) as edge:
                address = address_of(edge, "dns")
                pool = edge._pools["b"]
                await wait_until(
                    lambda: [s.server.healthy for s in pool.servers] == [True, False]
                )
                for _ in range(4):
                    async with Client() as client:
                        reply = await client.ask(address, b"?")
                    assert reply.startswith(b"up|")
        nursery.cancel_scope.cancel()
    # The check went to the health port and sent no PROXY header there.
    assert received
    assert set(received) == {b""}


# -- configuration -------------------------------------------------------------------


def _config(listener: dict[str, Any], backend: dict[str, Any] | None = None) -> None:
    make_config(
        [{"name": "u", "mode": "udp", "backend": "b", **listener}],
        [{"name": "b", "servers": ["127.0.0.1:53"], **(backend or {})}],
    )


@pytest.mark.parametrize(
    ("listener", "backend", "message"),
    [
        (
            {"tls": {"certificates": []}},
            {},
            'listeners[0].tls: a mode = "udp" listener cannot terminate TLS',
        ),
        ({"http": {}}, {}, 'listeners[0].http: only applies with mode = "http" (a udp'),
        ({"forwarded": {}}, {}, "listeners[0].forwarded: only applies"),
        (
            {"denied": "403"},
            {},
            'listeners[0].denied: "403" needs mode = "http" (a udp',
        ),
        (
            {"proxy_protocol": {"trusted": ["10.0.0.0/8"], "versions": [1]}},
            {},
            "listeners[0].proxy_protocol.versions: a udp listener reads only PROXY v2",
        ),
        ({}, {"send_proxy": "v1"}, 'backends[0].send_proxy: "v1" cannot describe a'),
        ({}, {"protocol": "tls"}, "backends[0].protocol: 'tls' cannot carry datagrams"),
        (
            {},
            {"health": {"kind": "tcp"}},
            'backends[0].health: missing port (it serves the mode = "udp" listener '
            "listeners[0]): the servers' ports are UDP",
        ),
        ({}, {"health": {"kind": "http"}}, "backends[0].health: missing port"),
    ],
)
def test_config_errors(
    listener: dict[str, Any], backend: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(listener, backend)
    assert str(caught.value).startswith(message), str(caught.value)


def test_backend_cannot_serve_udp_and_tcp_listeners() -> None:
    with pytest.raises(
        ConfigError, match=r"listeners\[1\].backend: backend 'b' serves"
    ):
        make_config(
            [
                {"name": "u", "mode": "udp", "backend": "b"},
                {"name": "t", "mode": "tcp", "backend": "b"},
            ],
            [{"name": "b", "servers": ["127.0.0.1:53"]}],
        )


def test_udp_and_tcp_listeners_share_a_port() -> None:
    config = make_config(
        [
            {"name": "u", "mode": "udp", "backend": "u", "bind": "127.0.0.1:5353"},
            {"name": "t", "backend": "t", "bind": "127.0.0.1:5353"},
        ],
        [
            {"name": "u", "servers": ["127.0.0.1:53"]},
            {"name": "t", "servers": ["127.0.0.1:53"]},
        ],
    )
    assert [lst.mode for lst in config.listeners] == ["udp", "tcp"]
    with pytest.raises(ConfigError, match=r"listeners\[1\].bind: .* collides"):
        make_config(
            [
                {"name": "u", "mode": "udp", "backend": "u", "bind": "127.0.0.1:5353"},
                {"name": "v", "mode": "udp", "backend": "u", "bind": "0.0.0.0:5353"},
            ],
            [{"name": "u", "servers": ["127.0.0.1:53"]}],
        )


def test_health_port_is_accepted_for_udp_backends() -> None:
    _config({}, {"health": {"kind": "tcp", "port": 8053}})
    _config({}, {"send_proxy": "v2"})


def test_check_command_validates_udp(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        '[[listeners]]\nname = "dns"\nbind = "127.0.0.1:5353"\nmode = "udp"\n'
        'backend = "r"\n\n[[backends]]\nname = "r"\nservers = ["127.0.0.1:53"]\n'
    )
    assert main(["check", str(good)]) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text(good.read_text() + 'send_proxy = "v1"\n')
    assert main(["check", str(bad)]) == 2
