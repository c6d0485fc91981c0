"""Client source ranges: a listener's ``allow`` and ``deny`` networks.

The matcher alone (`tlsedge._core.admission`), then real clients from several
loopback addresses (127.0.0.0/8 is all ours), curl from an ``--interface``,
and HAProxy's ``send-proxy-v2`` carrying addresses of other networks.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from hypothesis import given, strategies as st

from proxyproto import InetAddress, ProxyHeader, encode_v1, encode_v2
from tests.peers import free_port, haproxy, require
from tests.tlsedge.control.test_admin import admin_address, http_get, total
from tests.tlsedge.helpers import (
    Backend,
    access_records,
    address_of,
    make_config,
    read_all,
    read_proxy,
    running_edge,
    wait_access_records,
    wait_until,
)
from tlsedge._control.cli import main
from tlsedge._core.admission import AccessRules, Network
from tlsedge._core.config import load_config


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


def nets(*texts: str) -> list[Network]:
    return [ipaddress.ip_network(text) for text in texts]


# -- the matcher ------------------------------------------------------------------


def test_empty_allow_admits_everyone() -> None:
    rules = AccessRules(allow=(), deny=nets("192.0.2.0/24"))
    for client in ("10.0.0.1", "2001:db8::1", "::ffff:10.0.0.1", None, "/run/x"):
        verdict = rules.check(client)
        assert verdict.admitted, client
        assert verdict.rule is None
        assert verdict.reason == "allow is empty"


def test_allow_admits_its_networks_and_names_the_rule() -> None:
    rules = AccessRules(allow=nets("10.0.0.0/8", "2001:db8::/32"), deny=())
    verdict = rules.check("10.20.30.40")
    assert verdict.admitted
    assert verdict.rule == ipaddress.ip_network("10.0.0.0/8")
    assert verdict.reason == "client 10.20.30.40 is in allow 10.0.0.0/8"
    assert rules.check("2001:db8:5::1").rule == ipaddress.ip_network("2001:db8::/32")
    refused = rules.check("192.0.2.1")
    assert not refused.admitted
    assert refused.rule is None
    assert refused.reason == "client 192.0.2.1 is in no allow network"
    assert not rules.check("2001:db9::1").admitted


def test_deny_wins_over_allow() -> None:
    rules = AccessRules(
        allow=nets("10.0.0.0/8", "10.1.2.3/32"), deny=nets("10.1.0.0/16")
    )
    verdict = rules.check("10.1.2.3")
    assert not verdict.admitted
    assert verdict.rule == ipaddress.ip_network("10.1.0.0/16")
    assert verdict.reason == "client 10.1.2.3 is in deny 10.1.0.0/16"
    assert rules.check("10.2.0.1").admitted


def test_ipv4_mapped_clients_match_ipv4_and_ipv6_networks() -> None:
    rules = AccessRules(allow=nets("10.0.0.0/8"), deny=())
    assert rules.check("::ffff:10.0.0.1").admitted
    assert not rules.check("::ffff:192.0.2.1").admitted
    # a network written in the mapped form also holds them
    mapped = AccessRules(allow=nets("::ffff:192.0.2.0/120"), deny=())
    assert mapped.check("::ffff:192.0.2.1").admitted
    denied = AccessRules(allow=(), deny=nets("192.0.2.0/24"))
    assert not denied.check("::ffff:192.0.2.9").admitted


def test_ipv4_clients_match_networks_in_the_mapped_form() -> None:
    mapped = AccessRules(allow=nets("::ffff:192.0.2.0/120"), deny=())
    verdict = mapped.check("192.0.2.1")
    assert verdict.admitted
    assert verdict.rule == ipaddress.ip_network("::ffff:192.0.2.0/120")
    assert verdict.reason == "client 192.0.2.1 is in allow ::ffff:192.0.2.0/120"
    assert not mapped.check("192.0.3.1").admitted
    denied = AccessRules(allow=(), deny=nets("::ffff:127.0.0.9"))
    refused = denied.check("127.0.0.9")
    assert not refused.admitted
    assert refused.reason == "client 127.0.0.9 is in deny ::ffff:127.0.0.9/128"
    assert denied.check("127.0.0.8").admitted


def test_an_ipv6_network_over_the_mapped_range_holds_every_ipv4_client() -> None:
    # ::/0 holds ::ffff:0:0/96, so every IPv4 client, in either form.
    everyone6 = AccessRules(allow=nets("::/0"), deny=())
    assert everyone6.check("192.0.2.1").admitted
    assert everyone6.check("::ffff:192.0.2.1").admitted
    only6 = AccessRules(allow=nets("2001:db8::/32"), deny=())
    assert not only6.check("192.0.2.1").admitted
    # Both written: the rule reported is the one of the client's own family.
    both = AccessRules(allow=nets("::/0", "0.0.0.0/0"), deny=())
    assert both.check("192.0.2.1").rule == ipaddress.ip_network("0.0.0.0/0")
    assert both.check("::ffff:192.0.2.1").rule == ipaddress.ip_network("0.0.0.0/0")
    assert both.check("2001:db8::1").rule == ipaddress.ip_network("::/0")


def test_mapped_clients_are_written_with_their_ipv4_address() -> None:
    rules = AccessRules(allow=nets("10.0.0.0/8"), deny=())
    assert rules.check("::ffff:192.0.2.66").reason == (
        "client ::ffff:192.0.2.66 is in no allow network"
    )


def test_nested_networks_report_the_outer_one() -> None:
    rules = AccessRules(allow=nets("10.1.0.0/16", "10.0.0.0/8", "10.1.2.0/24"), deny=())
    assert rules.check("10.1.2.3").rule == ipaddress.ip_network("10.0.0.0/8")


def test_clients_without_an_ip_address_are_in_no_network() -> None:
    rules = AccessRules(allow=nets("0.0.0.0/0", "::/0"), deny=())
    for client in (None, "/run/app.sock", ""):
        verdict = rules.check(client)
        assert not verdict.admitted
        assert verdict.reason == "client has no IP address and allow lists networks"
    assert rules.check("fe80::1%lo").admitted  # a scope id is allowed


addresses_v4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
addresses_v6 = st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address)
addresses_mapped = addresses_v4.map(lambda a: ipaddress.IPv6Address(f"::ffff:{a}"))
networks = st.one_of(
    st.tuples(addresses_v4, st.integers(0, 32)),
    st.tuples(addresses_v6, st.integers(0, 128)),
    # mapped networks, and IPv6 ones around the mapped range (::/0 ... /96)
    st.tuples(addresses_mapped, st.integers(0, 128)),
).map(lambda a: ipaddress.ip_network(f"{a[0]}/{a[1]}", strict=False))


def _in_any(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, of: list[Network]
) -> bool:
    """The client is in one of *of*, in either of its forms: ``a.b.c.d``
    and ``::ffff:a.b.c.d`` are one client."""
    candidates: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [address]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        candidates.append(address.ipv4_mapped)
    if isinstance(address, ipaddress.IPv4Address):
        candidates.append(ipaddress.IPv6Address(f"::ffff:{address}"))
    return any(a in n for a in candidates for n in of)


@given(
    allow=st.lists(networks, max_size=8),
    deny=st.lists(networks, max_size=8),
    clients=st.lists(
        st.one_of(addresses_v4, addresses_v6, addresses_mapped), max_size=8
    ),
)
def test_the_lookup_agrees_with_a_linear_scan(
    allow: list[Network], deny: list[Network], clients: list[Any]
) -> None:
    rules = AccessRules(allow=allow, deny=deny)
    # the networks themselves: edges of the ranges
    probes = clients + [n.network_address for n in allow + deny]
    probes += [n.broadcast_address for n in allow + deny]
    for address in probes:
        expected = (not allow or _in_any(address, allow)) and not _in_any(address, deny)
        verdict = rules.check(str(address))
        assert verdict.admitted == expected, address
        if verdict.rule is not None:
            assert _in_any(address, [verdict.rule])


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


# -- real clients -----------------------------------------------------------------


async def connect_from(source: str, address: tuple[str, int]) -> trio.SocketStream:
    """A TCP connection to *address* from the local address *source*."""
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    sock = trio.socket.socket(family)
    try:
        await sock.bind((source, 0))
        await sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def exchange_from(source: str, address: tuple[str, int], data: bytes) -> bytes:
    """From *source*: send *data*, half-close, read until EOF. A connection the
    edge closed (or reset: it read none of *data*) gives what came before."""
    received = b""
    async with await connect_from(source, address) as client:
        with trio.fail_after(10):
            try:
                await client.send_all(data)
                await client.send_eof()
                while chunk := await client.receive_some(65536):
                    received += chunk
            except trio.BrokenResourceError:
                pass
    return received


def echo_handler() -> Any:
    """Answer ``seen:`` and what the client sent, up to its EOF."""

    async def handler(stream: trio.SocketStream) -> None:
        data = await read_all(stream)
        await stream.send_all(b"seen:" + data)

    return handler


async def http_app(stream: trio.SocketStream) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        data += chunk
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\napp"
    )


def by_client(caplog: pytest.LogCaptureFixture) -> dict[str, dict[str, Any]]:
    """The access-log lines by the client's IP address."""
    return {r["client"].rpartition(":")[0]: r for r in access_records(caplog)}


async def test_tcp_clients_from_several_addresses(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(echo_handler()).start(nursery)
    config = make_config(
        [
            {
                "name": "in",
                "backend": "b",
                "allow": ["127.0.0.2/31", "127.0.0.8/29"],
                "deny": ["127.0.0.3", "127.0.0.12/30"],
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        answers = {
            source: await exchange_from(source, address, b"hi")
            for source in (
                "127.0.0.2",
                "127.0.0.3",
                "127.0.0.4",
                "127.0.0.9",
                "127.0.0.13",
            )
        }
        records = await wait_access_records(caplog, 5)
    assert answers == {
        "127.0.0.2": b"seen:hi",
        "127.0.0.3": b"",
        "127.0.0.4": b"",
        "127.0.0.9": b"seen:hi",
        "127.0.0.13": b"",
    }
    assert backend.accepted == 2  # the denied never reached it
    clients = {r["client"].rpartition(":")[0]: r for r in records}
    assert clients["127.0.0.3"]["termination"] == "denied"
    assert clients["127.0.0.3"]["detail"] == "client 127.0.0.3 is in deny 127.0.0.3/32"
    assert clients["127.0.0.4"]["detail"] == "client 127.0.0.4 is in no allow network"
    assert clients["127.0.0.13"]["detail"] == (
        "client 127.0.0.13 is in deny 127.0.0.12/30"
    )
    assert clients["127.0.0.13"]["server"] is None
    assert clients["127.0.0.9"]["termination"] in {"client_closed", "server_closed"}
    # One process-log line per refusal, at INFO: clients cannot raise warnings.
    lines = [
        r
        for r in caplog.records
        if r.name == "tlsedge.server" and "denied" in r.getMessage()
    ]
    assert len(lines) == 3
    assert {r.levelno for r in lines} == {logging.INFO}
    assert "listener in: closing 127.0.0.4:" in lines[1].getMessage()


def client_hello() -> bytes:
    """The first flight of a real TLS client."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(
        incoming, outgoing, server_hostname="edge.test"
    )
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def tls_files(tmp_path: Path) -> tuple[dict[str, Any], trustme.CA]:
    ca = trustme.CA()
    leaf = ca.issue_cert("edge.test")
    leaf.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "edge.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "edge.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    tls = {
        "certificates": [
            {"cert": str(tmp_path / "edge.pem"), "key": str(tmp_path / "edge.key")}
        ]
    }
    return tls, ca


async def test_a_denied_tls_client_gets_no_server_hello(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(echo_handler()).start(nursery)
    tls, _ = tls_files(tmp_path)
    config = make_config(
        [{"name": "in", "backend": "b", "allow": ["127.0.0.2"], "tls": tls}],
        [{"name": "b", "servers": [backend.address]}],
    )
    hello = client_hello()
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        # Closed (or reset, the ClientHello unread): not a byte of TLS back.
        assert await exchange_from("127.0.0.5", address, hello) == b""
        first = await exchange_from("127.0.0.2", address, hello)
        assert first[:1] == b"\x16"  # a handshake record: the ServerHello
        (record,) = [
            r for r in await wait_access_records(caplog) if r["termination"] == "denied"
        ]
    assert record["tls"] is None
    assert backend.accepted == 0


async def curl_status(*args: str) -> tuple[int, str]:
    """curl's exit code and the status line it printed (``-w``)."""
    result = await trio.run_process(
        [
            *(require("curl"), "-sS", "--max-time", "10", "-o", "/dev/null"),
            *("-w", "%{http_code}", *args),
        ],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return result.returncode, result.stdout.decode()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
@pytest.mark.parametrize("denied", ["close", "403"])
async def test_http_mode_closes_or_answers_403(
    nursery: trio.Nursery,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    tls: bool,
    denied: str,
) -> None:
    require("curl")
    backend = await Backend(http_app).start(nursery)
    listener: dict[str, Any] = {
        "name": "web",
        "backend": "b",
        "mode": "http",
        "allow": ["127.0.0.0/30"],
        "denied": denied,
    }
    options: list[str] = []
    scheme = "http"
    if tls:
        listener["tls"], _ = tls_files(tmp_path)
        scheme = "https"
    config = make_config([listener], [{"name": "b", "servers": [backend.address]}])
    async with running_edge(config) as edge:
        _, port = address_of(edge, "web")
        if tls:
            options = ["--cacert", str(tmp_path / "ca.pem")]
            options += ["--resolve", f"edge.test:{port}:127.0.0.1"]
        url = f"{scheme}://edge.test:{port}/" if tls else f"http://127.0.0.1:{port}/"
        allowed = await curl_status("--interface", "127.0.0.2", *options, url)
        refused = await curl_status("--interface", "127.0.0.5", *options, url)
        records = await wait_access_records(caplog, 2)
    assert allowed == (0, "200")
    if denied == "403":
        assert refused == (0, "403")
    else:
        # no answer: an empty reply (52), or over TLS a handshake cut short (35)
        assert refused[0] in {35, 52, 56}
        assert refused[1] == "000"
    assert backend.accepted == 1
    record = by_client(caplog)["127.0.0.5"]
    assert record["termination"] == "denied"
    assert record["server"] is None
    if denied == "403":
        assert record["detail"].endswith("; answered 403")
        assert record["bytes_from_server"] > 0
    assert (record["tls"] is not None) == (tls and denied == "403")
    assert len(records) >= 2


async def test_x_forwarded_for_never_decides(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(http_app).start(nursery)
    config = make_config(
        [
            {
                "name": "web",
                "backend": "b",
                "mode": "http",
                "allow": ["10.0.0.0/8"],
                "denied": "403",
                "forwarded": {"trusted_proxies": ["127.0.0.0/8"]},
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        answer = await exchange_from(
            "127.0.0.2",
            address_of(edge, "web"),
            b"GET / HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 10.1.2.3\r\n"
            b"Forwarded: for=10.1.2.3\r\n\r\n",
        )
        await wait_access_records(caplog)
    assert answer.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert b"Connection: close\r\n" in answer
    assert backend.accepted == 0


async def test_the_trusted_proxy_header_decides_and_an_untrusted_one_cannot(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(echo_handler()).start(nursery)
    config = make_config(
        [
            {
                "name": "in",
                "backend": "b",
                "allow": ["10.0.0.0/8"],
                "proxy_protocol": {"trusted": ["127.0.0.2"], "untrusted": "direct"},
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
    )
    destination = ("192.0.2.1", 443)
    claim = encode_v1(
        ProxyHeader.from_addresses(("10.1.2.3", 4000), destination, version=1)
    )
    outside = encode_v2(ProxyHeader.from_addresses(("192.0.2.50", 4001), destination))
    mapped = encode_v2(ProxyHeader.from_addresses(("10.9.9.9", 4002), ("::1", 443)))
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        trusted = await exchange_from("127.0.0.2", address, claim + b"a")
        trusted_outside = await exchange_from("127.0.0.2", address, outside + b"b")
        trusted_mapped = await exchange_from("127.0.0.2", address, mapped + b"c")
        # An untrusted peer's header is plain data: the peer itself is judged.
        untrusted = await exchange_from("127.0.0.3", address, claim + b"d")
        await wait_access_records(caplog, 4)
    assert trusted == b"seen:a"
    assert trusted_outside == b""
    assert trusted_mapped == b"seen:c"
    assert untrusted == b""
    assert backend.accepted == 2
    clients = by_client(caplog)
    assert clients["192.0.2.50"]["termination"] == "denied"
    assert clients["192.0.2.50"]["peer"].startswith("127.0.0.2:")
    assert clients["127.0.0.3"]["detail"] == "client 127.0.0.3 is in no allow network"


async def test_403_behind_a_proxy_header_judges_the_client_it_names(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(http_app).start(nursery)
    config = make_config(
        [
            {
                "name": "web",
                "backend": "b",
                "mode": "http",
                "allow": ["10.0.0.0/8"],
                "denied": "403",
                "proxy_protocol": {"trusted": ["127.0.0.2"]},
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
    )
    destination = ("192.0.2.1", 80)
    request = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    inside = encode_v2(ProxyHeader.from_addresses(("10.1.2.3", 4000), destination))
    outside = encode_v2(ProxyHeader.from_addresses(("192.0.2.50", 4001), destination))
    async with running_edge(config) as edge:
        address = address_of(edge, "web")
        allowed = await exchange_from("127.0.0.2", address, inside + request)
        refused = await exchange_from("127.0.0.2", address, outside + request)
        await wait_access_records(caplog, 2)
    assert allowed.startswith(b"HTTP/1.1 200 ")
    assert refused.startswith(b"HTTP/1.1 403 Forbidden\r\n")
    assert backend.accepted == 1
    record = by_client(caplog)["192.0.2.50"]
    assert record["termination"] == "denied"
    assert record["detail"].endswith("; answered 403")
    # The request read with the header counts as the client's bytes.
    assert record["bytes_from_client"] == len(request)


async def test_a_deny_network_in_the_mapped_form_refuses_the_ipv4_client(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(echo_handler()).start(nursery)
    config = make_config(
        [{"name": "in", "backend": "b", "deny": ["::ffff:127.0.0.9"]}],
        [{"name": "b", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        denied = await exchange_from("127.0.0.9", address, b"x")
        served = await exchange_from("127.0.0.8", address, b"y")
        await wait_access_records(caplog, 2)
    assert denied == b""
    assert served == b"seen:y"
    assert backend.accepted == 1
    record = by_client(caplog)["127.0.0.9"]
    assert record["termination"] == "denied"
    assert record["detail"] == "client 127.0.0.9 is in deny ::ffff:127.0.0.9/128"


@pytest.mark.parametrize(
    ("deny", "source"),
    [
        ("::ffff:198.51.100.0/120", "198.51.100.7"),  # a TCP4 header
        ("198.51.100.0/24", "::ffff:198.51.100.7"),  # a TCP6 header
        ("::ffff:198.51.100.0/120", "::ffff:198.51.100.7"),
    ],
)
async def test_proxy_header_sources_match_deny_networks_in_either_form(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, deny: str, source: str
) -> None:
    backend = await Backend(echo_handler()).start(nursery)
    config = make_config(
        [
            {
                "name": "in",
                "backend": "b",
                "deny": [deny],
                "proxy_protocol": {"trusted": ["127.0.0.2"]},
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
    )
    destination = ("::ffff:192.0.2.1" if ":" in source else "192.0.2.1", 443)
    other = "::ffff:203.0.113.5" if ":" in source else "203.0.113.5"
    denied = encode_v2(ProxyHeader.from_addresses((source, 4000), destination))
    served = encode_v2(ProxyHeader.from_addresses((other, 4001), destination))
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        answers = [
            await exchange_from("127.0.0.2", address, denied + b"a"),
            await exchange_from("127.0.0.2", address, served + b"b"),
        ]
        records = await wait_access_records(caplog, 2)
    assert answers == [b"", b"seen:b"]
    assert backend.accepted == 1
    (record,) = [r for r in records if r["termination"] == "denied"]
    client = f"[{source}]:4000" if ":" in source else f"{source}:4000"
    assert record["client"] == client
    assert record["detail"] == f"client {source} is in deny {deny}"


async def test_a_trusted_network_in_the_mapped_form_holds_the_ipv4_peer(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(echo_handler()).start(nursery)
    config = make_config(
        [
            {
                "name": "in",
                "backend": "b",
                "allow": ["10.0.0.0/8"],
                "proxy_protocol": {"trusted": ["::ffff:127.0.0.2"]},
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
    )
    header = encode_v2(
        ProxyHeader.from_addresses(("10.1.2.3", 4000), ("10.0.0.1", 443))
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        trusted = await exchange_from("127.0.0.2", address, header + b"a")
        untrusted = await exchange_from("127.0.0.3", address, header + b"b")
        await wait_access_records(caplog, 2)
    assert trusted == b"seen:a"
    assert untrusted == b""
    peers = {r["peer"].rpartition(":")[0]: r for r in access_records(caplog)}
    assert peers["127.0.0.2"]["client"] == "10.1.2.3:4000"
    assert peers["127.0.0.3"]["termination"] == "rejected"


HAPROXY_DUAL_STACK = """\
frontend dual
    bind :::{dual} v4v6
    default_backend edge
backend edge
    server tlsedge 127.0.0.1:{edge} send-proxy-v2
"""


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 (dual-stack HAProxy)")
async def test_ipv4_clients_of_a_dual_stack_proxy_match_ipv4_networks(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    # HAProxy on a dual-stack socket sees an IPv4 client as ::ffff:a.b.c.d and
    # names it so in a TCP6 header: the same client as a.b.c.d.
    backend = await Backend(echo_handler()).start(nursery)
    config = make_config(
        [
            {
                "name": "in",
                "backend": "b",
                "allow": ["127.0.0.0/8"],
                "deny": ["::ffff:127.0.0.6", "127.0.0.7"],
                "proxy_protocol": {"trusted": ["127.0.0.1"]},
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        _, edge_port = address_of(edge, "in")
        dual = free_port()
        with haproxy(HAPROXY_DUAL_STACK.format(dual=dual, edge=edge_port), [dual]):
            answers = {
                source: await exchange_from(source, ("127.0.0.1", dual), b"v4")
                for source in ("127.0.0.5", "127.0.0.6", "127.0.0.7")
            }
            await wait_until(
                lambda: (
                    {"[::ffff:127.0.0.6]", "[::ffff:127.0.0.7]"}
                    <= {r["client"].rpartition(":")[0] for r in access_records(caplog)}
                )
            )
    assert answers == {"127.0.0.5": b"seen:v4", "127.0.0.6": b"", "127.0.0.7": b""}
    records = {r["client"].rpartition(":")[0]: r for r in access_records(caplog)}
    admitted = records["[::ffff:127.0.0.5]"]
    assert admitted["termination"] in {"client_closed", "server_closed"}
    assert admitted["peer"].startswith("127.0.0.1:")
    assert records["[::ffff:127.0.0.6]"]["detail"] == (
        "client ::ffff:127.0.0.6 is in deny ::ffff:127.0.0.6/128"
    )
    assert records["[::ffff:127.0.0.7]"]["detail"] == (
        "client ::ffff:127.0.0.7 is in deny 127.0.0.7/32"
    )


HAPROXY_FRONTENDS = """\
frontend office
    bind 127.0.0.1:{office}
    tcp-request connection set-src ipv4(203.0.113.7)
    default_backend edge
frontend elsewhere
    bind 127.0.0.1:{elsewhere}
    tcp-request connection set-src ipv4(198.51.100.9)
    default_backend edge
frontend office6
    bind 127.0.0.1:{office6}
    tcp-request connection set-src ipv6(2001:db8:1::7)
    default_backend edge
backend edge
    default-server check check-send-proxy inter 100ms rise 1 fall 1
    server tlsedge 127.0.0.1:{edge} send-proxy-v2
"""


async def test_through_haproxy_send_proxy_v2(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    reached: list[str] = []  # the clients the backend heard of

    async def handler(stream: trio.SocketStream) -> None:
        header, rest = await read_proxy(stream)
        assert isinstance(header.source, InetAddress)
        reached.append(str(header.source.host))
        await stream.send_all(b"seen:" + rest + await read_all(stream))

    backend = await Backend(handler).start(nursery)
    config = make_config(
        [
            {
                "name": "behind-haproxy",
                "backend": "b",
                # HAProxy's own address (127.0.0.1) is in neither list: the
                # PROXY header's source decides, its checks (LOCAL) pass.
                "allow": ["203.0.113.0/24", "2001:db8:1::/48"],
                "proxy_protocol": {"trusted": ["127.0.0.1"]},
            }
        ],
        [{"name": "b", "servers": [backend.address], "send_proxy": "v2"}],
    )

    def records(termination: str) -> list[dict[str, Any]]:
        return [r for r in access_records(caplog) if r["termination"] == termination]

    async with running_edge(config) as edge:
        _, edge_port = address_of(edge, "behind-haproxy")
        ports = {name: free_port() for name in ("office", "elsewhere", "office6")}
        frontends = HAPROXY_FRONTENDS.format(edge=edge_port, **ports)
        # (haproxy() waits for each port with a connection of its own.)
        with haproxy(frontends, list(ports.values())):
            await wait_until(lambda: len(records("health_check")) >= 1)
            answers = {
                name: await exchange_from("127.0.0.1", ("127.0.0.1", port), b"x")
                for name, port in ports.items()
            }
            await wait_until(
                lambda: (
                    len(records("denied")) >= 2
                    and sum(r["bytes_from_client"] == 1 for r in access_records(caplog))
                    >= 2
                )
            )
    assert answers == {"office": b"seen:x", "elsewhere": b"", "office6": b"seen:x"}
    assert "198.51.100.9" not in reached
    assert {"203.0.113.7", "2001:db8:1::7"} <= set(reached)
    assert {r["client"].rpartition(":")[0] for r in records("denied")} == {
        "198.51.100.9"
    }
    assert all(r["peer"].startswith("127.0.0.1:") for r in records("denied"))
    # HAProxy's checks: LOCAL headers from the trusted peer, admitted.
    checks = [r for r in access_records(caplog) if r["client"].startswith("127.")]
    assert checks
    assert {r["termination"] for r in checks} == {"health_check"}


async def test_metrics_count_denied(nursery: trio.Nursery) -> None:
    backend = await Backend(echo_handler()).start(nursery)
    config = make_config(
        [{"name": "in", "backend": "b", "deny": ["127.0.0.6"]}],
        [{"name": "b", "servers": [backend.address]}],
        {"admin": "127.0.0.1:0"},
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        assert await exchange_from("127.0.0.6", address, b"x") == b""
        assert await exchange_from("127.0.0.6", address, b"x") == b""
        assert await exchange_from("127.0.0.7", address, b"x") == b"seen:x"
        admin = admin_address(edge)

        async def denied() -> float:
            text = (await http_get(admin, "/metrics")).text
            return total(text, "tlsedge_connections_closed_total", termination="denied")

        with trio.fail_after(10):
            while await denied() < 2:  # noqa: ASYNC110 (polling another server)
                await trio.sleep(0.02)
        text = (await http_get(admin, "/metrics")).text
    assert total(text, "tlsedge_connections_closed_total", termination="denied") == 2
    assert total(text, "tlsedge_connections_refused_total", reason="denied") == 2
    assert backend.accepted == 1


async def test_reload_applies_new_lists_to_new_connections(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    async def echo_lines(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(65536):
            await stream.send_all(data)

    backend = await Backend(echo_lines).start(nursery)

    def config(allow: str) -> Any:
        return make_config(
            [{"name": "in", "backend": "b", "allow": [allow]}],
            [{"name": "b", "servers": [backend.address]}],
        )

    async with running_edge(config("127.0.0.2")) as edge:
        address = address_of(edge, "in")
        held = await connect_from("127.0.0.2", address)
        async with held:
            await held.send_all(b"before")
            with trio.fail_after(10):
                assert await held.receive_some(100) == b"before"
            assert await exchange_from("127.0.0.3", address, b"x") == b""

            await edge.reload(config("127.0.0.3"))
            assert address_of(edge, "in") == address  # same socket kept
            assert await exchange_from("127.0.0.3", address, b"x") == b"x"
            assert await exchange_from("127.0.0.2", address, b"x") == b""
            # The connection that started under the old lists carries on.
            await held.send_all(b"after")
            with trio.fail_after(10):
                assert await held.receive_some(100) == b"after"
        await wait_access_records(caplog, 4)
    denied = [r for r in access_records(caplog) if r["termination"] == "denied"]
    assert [r["client"].rpartition(":")[0] for r in denied] == [
        "127.0.0.3",
        "127.0.0.2",
    ]


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1)")
@pytest.mark.parametrize(
    ("allow", "deny", "admitted"),
    [
        (["::1"], [], True),
        (["::/0"], ["::1/128"], False),
        (["127.0.0.0/8"], [], False),
    ],
)
async def test_ipv6_clients(
    nursery: trio.Nursery,
    allow: list[str],
    deny: list[str],
    admitted: bool,
) -> None:
    backend = await Backend(echo_handler()).start(nursery)
    config = make_config(
        [
            {
                "name": "in",
                "bind": "[::1]:0",
                "backend": "b",
                "allow": allow,
                "deny": deny,
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        answer = await exchange_from("::1", address_of(edge, "in"), b"v6")
    assert answer == (b"seen:v6" if admitted else b"")
    assert backend.accepted == int(admitted)


# -- configuration ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            'allow = ["10.0.0.0/33"]',
            "listeners[0].allow[0]: expected an IP address or a CIDR like "
            "'10.0.0.0/8', got '10.0.0.0/33'",
        ),
        (
            'deny = ["192.0.2.0/24", "10.1.2.3/8"]',
            "listeners[0].deny[1]: '10.1.2.3/8' has host bits set; did you mean "
            "'10.0.0.0/8'?",
        ),
        (
            'allow = "10.0.0.0/8"',
            "listeners[0].allow: expected an array, got a string ('10.0.0.0/8')",
        ),
        (
            'denied = "403"',
            'listeners[0].denied: "403" needs mode = "http" (a tcp listener does '
            'not speak HTTP); use "close" or set mode = "http"',
        ),
        (
            'mode = "sctp"',
            "listeners[0].mode: SCTP is not supported: tlsedge relays TCP streams",
        ),
    ],
)
def test_check_config_only_reports_bad_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(
        '[[listeners]]\nname = "l"\nbind = "127.0.0.1:0"\nbackend = "b"\n'
        f"{line}\n"
        '[[backends]]\nname = "b"\nservers = ["127.0.0.1:8080"]\n'
    )
    assert main(["check", "--config-only", str(path)]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^listeners\[0\]"):
        load_config(path)
