"""DNS discovery against a real (tiny, authoritative) DNS server on loopback."""

from __future__ import annotations

import logging
import socket
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import pytest
import trio

from tests.tlsedge.helpers import close_clients, connect, make_config, wait_until
from tlsedge._backends.discovery import DnsDiscovery, Found, scale_srv_weights
from tlsedge._backends.upstream import BackendPool
from tlsedge._control.edge import Edge
from tlsedge._core.config import (
    Config,
    ConfigError,
    DiscoveryConfig,
    config_from_mapping,
)

Mode = Literal["answer", "drop", "servfail"]


class FakeDns:
    """An authoritative UDP DNS server on 127.0.0.1 whose records tests change.

    ``records`` maps ``(absolute name, type)`` to record texts; a name with no
    entry at all gets NXDOMAIN, a known name without the type an empty answer.
    ``glue`` names are added to SRV answers' additional section. ``mode``:
    ``"drop"`` ignores queries (the client times out), ``"servfail"`` fails.
    """

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = {}
        self.glue: set[str] = set()
        self.mode: Mode = "answer"
        self.queries: list[tuple[str, str]] = []
        self.port = 0

    def set(self, name: str, rdtype: str, *texts: str) -> None:
        """Replace the *rdtype* records of *name* (none: the name stays known)."""
        self.records[(name, rdtype)] = list(texts)

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            await sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
            task_status.started()
            while True:
                data, peer = await sock.recvfrom(65535)
                query = dns.message.from_wire(data)
                question = query.question[0]
                name = question.name.to_text()
                rdtype = dns.rdatatype.to_text(question.rdtype)
                self.queries.append((name, rdtype))
                if self.mode == "drop":
                    continue
                response = dns.message.make_response(query)
                response.flags |= dns.flags.AA
                if self.mode == "servfail":
                    response.set_rcode(dns.rcode.SERVFAIL)
                else:
                    self._answer(response, question.name, rdtype)
                await sock.sendto(response.to_wire(), peer)

    def _answer(self, response: dns.message.Message, qname: Any, rdtype: str) -> None:
        name = qname.to_text()
        if not any(known == name for known, _ in self.records):
            response.set_rcode(dns.rcode.NXDOMAIN)
            return
        texts = self.records.get((name, rdtype))
        if not texts:
            return  # NOERROR, no data
        response.answer.append(
            dns.rrset.from_text_list(qname, 0, dns.rdataclass.IN, rdtype, texts)
        )
        if rdtype != "SRV":
            return
        for text in texts:
            target = text.split()[-1]
            if target not in self.glue:
                continue
            for glue_type in ("A", "AAAA"):
                if glue := self.records.get((target, glue_type)):
                    response.additional.append(
                        dns.rrset.from_text_list(
                            dns.name.from_text(target),
                            0,
                            dns.rdataclass.IN,
                            glue_type,
                            glue,
                        )
                    )


@pytest.fixture
async def fake_dns(nursery: trio.Nursery) -> FakeDns:
    server = FakeDns()
    await nursery.start(server.serve)
    return server


@pytest.fixture
async def closing_clients() -> AsyncIterator[None]:
    """Close the edge's clients at the end (requested by name: pytest-trio
    does not run async fixtures named in ``usefixtures``)."""
    yield
    await close_clients()


@pytest.fixture(autouse=True)
def _logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


def discovery(server: FakeDns, **keys: Any) -> DiscoveryConfig:
    table = {"name": "app.test", "port": 8080, "nameserver": server.nameserver} | keys
    table = {key: value for key, value in table.items() if value is not None}
    config = config_from_mapping(
        {
            "listeners": [{"name": "l", "bind": "127.0.0.1:0", "backend": "b"}],
            "backends": [{"name": "b", "discovery": table}],
        },
        base_dir=Path("/"),
    )
    result = config.backends[0].discovery
    assert result is not None
    return result


# --- lookups ----------------------------------------------------------------


async def test_a_and_aaaa(fake_dns: FakeDns) -> None:
    fake_dns.set("app.test.", "A", "10.0.0.2", "10.0.0.1")
    fake_dns.set("app.test.", "AAAA", "fd00::1")
    found = await DnsDiscovery(discovery(fake_dns), "b").lookup()
    assert found == [
        (("10.0.0.1", 8080), 1),
        (("10.0.0.2", 8080), 1),
        (("fd00::1", 8080), 1),
    ]
    assert ("app.test.", "A") in fake_dns.queries
    assert ("app.test.", "AAAA") in fake_dns.queries


async def test_a_only_ipv6(fake_dns: FakeDns) -> None:
    fake_dns.set("app.test.", "AAAA", "::1")
    found = await DnsDiscovery(discovery(fake_dns, port=9), "b").lookup()
    assert found == [(("::1", 9), 1)]


async def test_srv_weights_ports_and_lowest_priority(fake_dns: FakeDns) -> None:
    fake_dns.set(
        "_app._tcp.app.test.",
        "SRV",
        "0 60 8001 a.app.test.",
        "0 20 8002 b.app.test.",
        "0 0 8004 d.app.test.",
        "1 100 8003 c.app.test.",  # a higher priority value: not used
    )
    fake_dns.set("a.app.test.", "A", "10.0.0.1")
    fake_dns.set("b.app.test.", "A", "10.0.0.2", "10.0.0.3")
    fake_dns.set("c.app.test.", "A", "10.0.0.9")
    fake_dns.set("d.app.test.", "AAAA", "fd00::4")
    fake_dns.glue = {"a.app.test."}  # a: from the additional section
    config = discovery(fake_dns, name="_app._tcp.app.test", type="SRV", port=None)
    found = await DnsDiscovery(config, "b").lookup()
    assert found == [
        (("10.0.0.1", 8001), 60),
        (("10.0.0.2", 8002), 20),
        (("10.0.0.3", 8002), 20),
        (("fd00::4", 8004), 1),  # SRV weight 0 -> 1
    ]
    # a came with the answer; b and d needed their own lookups, c none at all.
    assert ("a.app.test.", "A") not in fake_dns.queries
    assert ("b.app.test.", "A") in fake_dns.queries
    assert ("d.app.test.", "AAAA") in fake_dns.queries
    assert not any(name == "c.app.test." for name, _ in fake_dns.queries)


def test_srv_weight_scaling() -> None:
    assert scale_srv_weights([]) == []
    assert scale_srv_weights([0, 5, 256]) == [1, 5, 256]
    assert scale_srv_weights([1000, 250, 1]) == [256, 64, 1]
    assert scale_srv_weights([65535, 0]) == [256, 1]


async def test_srv_no_service_target_is_skipped(fake_dns: FakeDns) -> None:
    fake_dns.set("_x._tcp.app.test.", "SRV", "0 0 0 .")
    config = discovery(fake_dns, name="_x._tcp.app.test", type="SRV", port=None)
    assert await DnsDiscovery(config, "b").lookup() == []


async def test_refresh_policy(
    fake_dns: FakeDns, caplog: pytest.LogCaptureFixture
) -> None:
    watcher = DnsDiscovery(discovery(fake_dns, refresh=0.2), "b")
    assert watcher.interval == 0.2
    fake_dns.set("app.test.", "A", "10.0.0.1")
    first: list[Found] = [(("10.0.0.1", 8080), 1)]
    assert await watcher.refresh() == first
    assert await watcher.refresh() is None  # unchanged
    # Empty answer: the last good list stays, with a warning.
    fake_dns.set("app.test.", "A")
    assert await watcher.refresh() is None
    assert watcher.last == first
    assert "has no A/AAAA records; keeping the last 1 servers" in caplog.text
    # NXDOMAIN, SERVFAIL, timeout: the same.
    fake_dns.records.clear()
    assert await watcher.refresh() is None
    assert "no such name" in caplog.text
    fake_dns.set("app.test.", "A", "10.0.0.2")
    for mode in ("servfail", "drop"):
        fake_dns.mode = mode
        caplog.clear()
        with trio.fail_after(5):
            assert await watcher.refresh() is None
        assert "DNS lookup failed" in caplog.text
        assert watcher.last == first
    fake_dns.mode = "answer"
    assert await watcher.refresh() == [(("10.0.0.2", 8080), 1)]
    assert "+10.0.0.2:8080, -10.0.0.1:8080" in caplog.text


async def test_no_good_answer_yet_retries_sooner(fake_dns: FakeDns) -> None:
    watcher = DnsDiscovery(discovery(fake_dns, refresh=30), "b")
    fake_dns.mode = "servfail"
    assert await watcher.refresh() is None
    assert watcher.last is None
    assert watcher.interval == 1.0
    fake_dns.mode = "answer"
    fake_dns.set("app.test.", "A", "10.0.0.1")
    assert await watcher.refresh() is not None
    assert watcher.interval == 30


# --- through an Edge ----------------------------------------------------------


class TaggedEcho:
    """A TCP server on *host* that sends its tag, then echoes."""

    def __init__(self, tag: bytes, host: str, port: int = 0) -> None:
        self.tag = tag
        self.host = host
        self.port = port
        self.active = 0

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.active += 1
        try:
            await stream.send_all(self.tag)
            async for chunk in stream:
                await stream.send_all(chunk)
        except trio.BrokenResourceError:
            pass
        finally:
            self.active -= 1


async def echo_pair(nursery: trio.Nursery) -> tuple[TaggedEcho, TaggedEcho]:
    """Two echo servers on one port: 127.0.0.1 ("one") and 127.0.0.2 ("two")."""
    one = TaggedEcho(b"one", "127.0.0.1")
    await nursery.start(one.serve)
    two = TaggedEcho(b"two", "127.0.0.2", one.port)
    await nursery.start(two.serve)
    return one, two


def edge_config(fake_dns: FakeDns, port: int, **backend: Any) -> Config:
    table = {
        "name": "app.test",
        "port": port,
        "refresh": 0.1,
        "nameserver": fake_dns.nameserver,
    }
    return make_config(
        [{"name": "l", "backend": "app"}],
        [{"name": "app", "discovery": table, **backend}],
    )


async def ask(address: tuple[str, int]) -> tuple[trio.SocketStream, bytes]:
    client = await connect(address)
    with trio.fail_after(5):
        tag = await client.receive_some(3)
    return client, tag


async def roundtrip(client: trio.SocketStream, data: bytes) -> None:
    with trio.fail_after(5):
        await client.send_all(data)
        received = b""
        while len(received) < len(data):
            received += await client.receive_some()
    assert received == data


def addresses(pool: BackendPool) -> list[tuple[str, int]]:
    return [server.address for server in pool.balancer.servers]


async def test_refresh_adds_and_removes_without_touching_connections(
    nursery: trio.Nursery,
    closing_clients: None,
    fake_dns: FakeDns,
    caplog: pytest.LogCaptureFixture,
) -> None:
    one, _ = await echo_pair(nursery)
    fake_dns.set("app.test.", "A", "127.0.0.1")
    edge: Edge = await nursery.start(Edge(edge_config(fake_dns, one.port)).run)
    address = edge.listen_addresses["l"][0]
    pool = edge._pools["app"]
    assert addresses(pool) == [("127.0.0.1", one.port)]

    old, tag = await ask(address)
    assert tag == b"one"
    await roundtrip(old, b"before")

    # Swap the servers in DNS: one is removed (drains), two is added.
    fake_dns.set("app.test.", "A", "127.0.0.2")
    await wait_until(lambda: addresses(pool) == [("127.0.0.2", one.port)])
    await roundtrip(old, b"the open connection carries on")
    assert one.active == 1
    new, tag = await ask(address)
    assert tag == b"two"

    # Both: new connections go to both (round robin).
    fake_dns.set("app.test.", "A", "127.0.0.2", "127.0.0.1")
    await wait_until(lambda: len(addresses(pool)) == 2)
    tags = {(await ask(address))[1] for _ in range(4)}
    assert tags == {b"one", b"two"}
    await roundtrip(old, b"still")
    await roundtrip(new, b"fine")
    assert "DNS app.test now gives 2 servers (+127.0.0.1:" in caplog.text
    edge.stop()


async def test_failed_lookup_keeps_the_servers(
    nursery: trio.Nursery,
    closing_clients: None,
    fake_dns: FakeDns,
    caplog: pytest.LogCaptureFixture,
) -> None:
    one, _ = await echo_pair(nursery)
    fake_dns.set("app.test.", "A", "127.0.0.1")
    edge: Edge = await nursery.start(Edge(edge_config(fake_dns, one.port)).run)
    address = edge.listen_addresses["l"][0]
    pool = edge._pools["app"]
    client, tag = await ask(address)
    assert tag == b"one"

    fake_dns.mode = "drop"  # the DNS server stops answering
    asked = len(fake_dns.queries)
    await wait_until(lambda: len(fake_dns.queries) >= asked + 4)
    await wait_until(lambda: "DNS lookup failed" in caplog.text)
    assert addresses(pool) == [("127.0.0.1", one.port)]
    assert (await ask(address))[1] == b"one"
    await roundtrip(client, b"unaffected")

    fake_dns.mode = "answer"
    fake_dns.set("app.test.", "A", "127.0.0.2")
    await wait_until(lambda: addresses(pool) == [("127.0.0.2", one.port)])
    edge.stop()


async def test_start_without_an_answer_then_servers_appear(
    nursery: trio.Nursery,
    closing_clients: None,
    fake_dns: FakeDns,
    caplog: pytest.LogCaptureFixture,
) -> None:
    one, _ = await echo_pair(nursery)
    fake_dns.mode = "servfail"
    edge: Edge = await nursery.start(Edge(edge_config(fake_dns, one.port)).run)
    pool = edge._pools["app"]
    assert addresses(pool) == []
    assert "DNS lookup failed" in caplog.text
    assert "no servers yet" in caplog.text
    fake_dns.mode = "answer"
    fake_dns.set("app.test.", "A", "127.0.0.1")
    await wait_until(lambda: addresses(pool) == [("127.0.0.1", one.port)])
    _, tag = await ask(edge.listen_addresses["l"][0])
    assert tag == b"one"
    edge.stop()


async def test_srv_through_the_edge(
    nursery: trio.Nursery, closing_clients: None, fake_dns: FakeDns
) -> None:
    one = TaggedEcho(b"one", "127.0.0.1")
    await nursery.start(one.serve)
    two = TaggedEcho(b"two", "127.0.0.1")
    await nursery.start(two.serve)
    fake_dns.set("_app._tcp.app.test.", "SRV", f"0 3 {one.port} h.app.test.")
    fake_dns.set("h.app.test.", "A", "127.0.0.1")
    config = make_config(
        [{"name": "l", "backend": "app"}],
        [
            {
                "name": "app",
                "discovery": {
                    "name": "_app._tcp.app.test",
                    "type": "SRV",
                    "refresh": 0.1,
                    "nameserver": fake_dns.nameserver,
                },
            }
        ],
    )
    edge: Edge = await nursery.start(Edge(config).run)
    pool = edge._pools["app"]
    assert [(s.address, s.weight) for s in pool.balancer.servers] == [
        (("127.0.0.1", one.port), 3)
    ]
    fake_dns.set(
        "_app._tcp.app.test.",
        "SRV",
        f"0 3 {one.port} h.app.test.",
        f"0 1 {two.port} h.app.test.",
    )
    await wait_until(lambda: len(pool.balancer.servers) == 2)
    tags = [(await ask(edge.listen_addresses["l"][0]))[1] for _ in range(8)]
    assert tags.count(b"one") == 6
    assert tags.count(b"two") == 2
    edge.stop()


async def test_health_checks_follow_the_server_list(
    nursery: trio.Nursery, closing_clients: None, fake_dns: FakeDns
) -> None:
    one, _ = await echo_pair(nursery)
    fake_dns.set("app.test.", "A", "127.0.0.1")
    config = edge_config(fake_dns, one.port, health={"interval": 0.1, "timeout": 0.1})
    edge: Edge = await nursery.start(Edge(config).run)
    pool = edge._pools["app"]
    await wait_until(lambda: set(pool._health_scopes) == {("127.0.0.1", one.port)})
    fake_dns.set("app.test.", "A", "127.0.0.2")
    await wait_until(lambda: set(pool._health_scopes) == {("127.0.0.2", one.port)})
    edge.stop()


async def test_reload_to_another_name(
    nursery: trio.Nursery, closing_clients: None, fake_dns: FakeDns
) -> None:
    one, _ = await echo_pair(nursery)
    fake_dns.set("app.test.", "A", "127.0.0.1")
    fake_dns.set("other.test.", "A", "127.0.0.2")
    config = edge_config(fake_dns, one.port)
    edge: Edge = await nursery.start(Edge(config).run)
    pool = edge._pools["app"]
    table = {
        "name": "other.test",
        "port": one.port,
        "refresh": 0.1,
        "nameserver": fake_dns.nameserver,
    }
    await edge.reload(
        make_config(
            [{"name": "l", "backend": "app"}], [{"name": "app", "discovery": table}]
        )
    )
    assert addresses(pool) == [("127.0.0.2", one.port)]
    # The refresh task of the old name is gone: the list stays.
    await trio.sleep(0.3)
    assert addresses(pool) == [("127.0.0.2", one.port)]
    edge.stop()


# --- configuration --------------------------------------------------------------


BACKEND = '[[listeners]]\nname = "l"\nbind = "127.0.0.1:0"\nbackend = "b"\n'


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        (
            'servers = ["127.0.0.1:1"]\ndiscovery = { name = "a.test", port = 1 }',
            "backends[0].discovery: servers and discovery exclude each other",
        ),
        ("", "backends[0]: missing required key 'servers' (or a discovery table"),
        (
            'discovery = { name = "a.test" }',
            "backends[0].discovery: missing required key 'port' (with type = \"A\")",
        ),
        (
            'discovery = { name = "a.test", type = "SRV", port = 80 }',
            'backends[0].discovery.port: not used with type = "SRV"',
        ),
        (
            'discovery = { name = "a.test", type = "MX" }',
            "backends[0].discovery.type: unknown type 'MX'; choose one of 'A', 'SRV'",
        ),
        (
            'discovery = { name = "a b", port = 1 }',
            "backends[0].discovery.name: expected a DNS host name",
        ),
        (
            'discovery = { name = "a.test", port = 1, nameserver = "dns.test:53" }',
            "backends[0].discovery.nameserver: expected an IP address",
        ),
        (
            'discovery = { name = "a.test", port = 1, refresh = 0 }',
            "backends[0].discovery.refresh: must be greater than 0 s",
        ),
        (
            'discovery = { name = "a.test", port = 0 }',
            "backends[0].discovery.port: must be between 1 and 65535, got 0",
        ),
        (
            'discovery = { name = "a.test", port = 1, ttl = 5 }',
            "backends[0].discovery: unknown key 'ttl'",
        ),
    ],
)
def test_config_errors(backend: str, message: str) -> None:
    text = BACKEND + '[[backends]]\nname = "b"\n' + backend + "\n"
    with pytest.raises(ConfigError) as info:
        config_from_mapping(tomllib.loads(text), base_dir=Path("/"))
    assert str(info.value).startswith(message)


def test_config_defaults_and_nameserver_forms() -> None:
    text = (
        BACKEND
        + '[[backends]]\nname = "b"\n'
        + 'discovery = { name = "_x._tcp.a.test.", type = "SRV", nameserver = "::1" }'
    )
    config = config_from_mapping(tomllib.loads(text), base_dir=Path("/"))
    backend = config.backends[0]
    assert backend.servers == ()
    assert backend.discovery is not None
    assert backend.discovery.refresh == 10.0
    assert backend.discovery.port is None
    assert str(backend.discovery.nameserver) == "[::1]:53"
