"""proxyproto.sockets: read_header on blocking sockets and the socketserver mix-in."""

from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trustme

from proxyproto import (
    TLV,
    Command,
    InetAddress,
    Policy,
    ProxyHeader,
    RemoteProtocolError,
    SSLClient,
    SSLInfo,
    TrustPolicy,
    encode_v1,
    encode_v2,
)
from proxyproto.sockets import (
    ProxyConnection,
    ProxyProtocolMixin,
    ProxyRequestHandlerMixin,
    read_header,
)
from tests.proxyproto.lb_checks import (
    CLOSED_BEFORE_HEADER,
    assert_logged_once,
    close_before_header,
)

V1 = ProxyHeader.from_addresses(("192.0.2.7", 51234), ("198.51.100.1", 443), version=1)
V1_TCP6 = ProxyHeader.from_addresses(
    ("2001:db8::7", 51234), ("2001:db8::1", 443), version=1
)
V2 = ProxyHeader.from_addresses(
    ("192.0.2.7", 51234),
    ("198.51.100.1", 443),
    tlvs=(
        TLV.alpn(b"h2"),
        TLV.authority("example.com"),
        TLV.ssl(SSLInfo(client=SSLClient.SSL, verify=0, version="TLSv1.3")),
    ),
)
HEADERS = {
    "v1": encode_v1(V1),
    "v1-tcp6": encode_v1(V1_TCP6),
    "v1-unknown": encode_v1(ProxyHeader.unknown()),
    "v2": encode_v2(V2),
    "v2-crc": encode_v2(V2, crc32c=True),
    "v2-local": encode_v2(ProxyHeader.local()),
}
PAYLOAD = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


@contextmanager
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def drain(sock: socket.socket, size: int = 65536) -> bytes:
    sock.settimeout(2)
    return sock.recv(size)


@pytest.mark.parametrize("name", sorted(HEADERS))
def test_reads_exactly_the_header(name: str) -> None:
    raw = HEADERS[name]
    with pair() as (client, server):
        client.sendall(raw + PAYLOAD)  # one sendall: header and data together
        header = read_header(server)
        assert header is not None
        assert header.version == (1 if name.startswith("v1") else 2)
        assert drain(server) == PAYLOAD


def test_header_arriving_byte_by_byte() -> None:
    raw = HEADERS["v2"] + PAYLOAD
    with pair() as (client, server):

        def dribble() -> None:
            for i in range(len(raw)):
                client.send(raw[i : i + 1])
                time.sleep(0.001)

        thread = threading.Thread(target=dribble)
        thread.start()
        header = read_header(server)
        thread.join()
        assert header == V2
        got = b""
        while len(got) < len(PAYLOAD):
            got += drain(server)
        assert got == PAYLOAD


def test_v1_split_before_crlf() -> None:
    raw = HEADERS["v1"]
    with pair() as (client, server):
        client.sendall(raw[:-1])
        timer = threading.Timer(0.05, client.sendall, [raw[-1:] + PAYLOAD])
        timer.start()
        assert read_header(server) == V1
        timer.join()
        assert drain(server) == PAYLOAD


def test_timeout_is_a_total_deadline_and_restores_timeout() -> None:
    raw = HEADERS["v1"]
    with pair() as (client, server):
        server.settimeout(7.0)
        stop = threading.Event()

        def dribble() -> None:  # one byte every 20 ms: each read is "on time"
            for i in range(len(raw) - 1):
                if stop.wait(0.02):
                    return
                client.send(raw[i : i + 1])

        thread = threading.Thread(target=dribble)
        thread.start()
        with pytest.raises(RemoteProtocolError) as info:
            read_header(server, header_timeout=0.3)
        stop.set()
        thread.join()
        # Each byte came on time: only a total deadline times this out (the
        # header would have been complete after about a second).
        assert info.value.reason == "timeout"
        assert server.gettimeout() == 7.0


def test_silent_client_times_out() -> None:
    with pair() as (_client, server):
        server.setblocking(False)
        with pytest.raises(RemoteProtocolError) as info:
            read_header(server, header_timeout=0.1)
        assert info.value.reason == "timeout"
        assert server.gettimeout() == 0.0


@pytest.mark.parametrize(
    ("sent", "reason"),
    [
        (b"", "empty"),
        (b"PROXY TCP4 1.2.3.4", "eof"),
        (HEADERS["v2"][:20], "eof"),
    ],
)
def test_eof_before_complete_header(sent: bytes, reason: str) -> None:
    with pair() as (client, server):
        client.sendall(sent)
        client.shutdown(socket.SHUT_WR)
        with pytest.raises(RemoteProtocolError) as info:
            read_header(server)
        assert info.value.reason == reason


@pytest.mark.parametrize(
    "garbage",
    [PAYLOAD, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", b"PROXY TCP4 x\r\n"],
)
def test_garbage_is_refused(garbage: bytes) -> None:
    with pair() as (client, server):
        client.sendall(garbage)
        with pytest.raises(RemoteProtocolError):
            read_header(server, header_timeout=1)


def test_policies() -> None:
    with pair() as (client, server):
        client.sendall(HEADERS["v2"])
        with pytest.raises(RemoteProtocolError) as info:
            read_header(server, policy=Policy.REJECT)
        assert info.value.reason == "rejected"
        assert read_header(server, policy=Policy.SKIP) is None
        assert drain(server) == HEADERS["v2"]  # SKIP read nothing
    with pair() as (client, server):
        client.sendall(HEADERS["v2"] + PAYLOAD)
        assert read_header(server, policy=Policy.IGNORE) == V2
        assert drain(server) == PAYLOAD
    with pair() as (client, server):
        client.sendall(HEADERS["v1"] + PAYLOAD)
        assert read_header(server, policy=Policy.USE) == V1
        assert drain(server) == PAYLOAD


def test_use_without_header_consumes_nothing() -> None:
    with pair() as (client, server):
        client.sendall(PAYLOAD)
        assert read_header(server, policy=Policy.USE) is None
        assert drain(server) == PAYLOAD


@pytest.mark.parametrize(
    ("first", "rest", "has_header"),
    [
        (b"PRO", b"XY TCP4 192.0.2.7 198.51.100.1 51234 443\r\n", True),
        (b"PRO", b"BE /\r\n", False),
        (HEADERS["v2"][:5], HEADERS["v2"][5:], True),
    ],
)
def test_use_with_ambiguous_start(first: bytes, rest: bytes, has_header: bool) -> None:
    with pair() as (client, server):
        client.sendall(first)
        timer = threading.Timer(0.05, client.sendall, [rest + PAYLOAD])
        timer.start()
        header = read_header(server, policy=Policy.USE)
        timer.join()
        got = b""
        expected = PAYLOAD if has_header else first + rest + PAYLOAD
        while len(got) < len(expected):
            got += drain(server)
        assert (header is not None) is has_header
        assert got == expected


def test_reader_options_are_applied() -> None:
    with pair() as (client, server):
        client.sendall(HEADERS["v2"])
        with pytest.raises(RemoteProtocolError):
            read_header(server, versions=[1])
    with pair() as (client, server):
        client.sendall(HEADERS["v2"])
        with pytest.raises(RemoteProtocolError):
            read_header(server, max_v2_length=8)


# -- TLS right after the header ---------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def test_tls_client_hello_after_header(ca: trustme.CA) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    result: dict[str, object] = {}
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                result["header"] = read_header(conn)
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    data = tls.recv(100)
                    tls.sendall(b"echo:" + data)

        thread = threading.Thread(target=serve)
        thread.start()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(HEADERS["v2"])  # the ClientHello follows immediately
            with client_ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(b"hello")
                answer = tls.recv(100)
        thread.join(5)
    assert result["header"] == V2
    assert answer == b"echo:hello"


# -- socketserver -------------------------------------------------------------------


class Handler(ProxyRequestHandlerMixin, socketserver.StreamRequestHandler):
    def handle(self) -> None:
        info = self.proxy
        assert isinstance(info, ProxyConnection)
        header = self.proxy_header
        line = self.rfile.readline()
        self.wfile.write(
            repr(
                (
                    self.client_address,
                    info.server_address,
                    info.peer_address[:2]
                    if isinstance(info.peer_address, tuple)
                    else None,
                    None if header is None else header.command.name,
                    line,
                )
            ).encode()
            + b"\n"
        )


class Server(ProxyProtocolMixin, socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class DualStackServer(Server):
    """On ``::``, taking IPv4 clients too: it sees them as ``::ffff:a.b.c.d``."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


@contextmanager
def running_server(
    trust: TrustPolicy, header_timeout: float = 5.0, *, dual_stack: bool = False
) -> Iterator[tuple[str, int]]:
    server = (DualStackServer if dual_stack else Server)(
        ("::" if dual_stack else "127.0.0.1", 0),
        Handler,
        trust=trust,
        header_timeout=header_timeout,
    )
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}
    )
    thread.start()
    try:
        host, port = server.server_address[:2]
        assert isinstance(host, str)
        yield host, port
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def ask(address: tuple[str, int], data: bytes, timeout: float = 5) -> bytes:
    return ask_from(address, data, timeout)[0]


def ask_from(
    address: tuple[str, int], data: bytes, timeout: float = 5
) -> tuple[bytes, tuple[str, int]]:
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(4096):
            chunks.append(chunk)
        return b"".join(chunks), sock.getsockname()


TRUST_LOOPBACK = TrustPolicy.from_cidrs(["127.0.0.1"])


@pytest.mark.parametrize("name", ["v1", "v2"])
def test_server_reports_real_client(name: str) -> None:
    with running_server(TRUST_LOOPBACK) as address:
        answer, me = ask_from(address, HEADERS[name] + b"line\n")
    assert (
        answer
        == repr(
            (("192.0.2.7", 51234), ("198.51.100.1", 443), me, "PROXY", b"line\n")
        ).encode()
        + b"\n"
    )


def has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("dual_stack", [False, True], ids=["ipv4", "dual-stack"])
@pytest.mark.parametrize("trusted", ["127.0.0.1", "::ffff:127.0.0.1"])
def test_an_ipv4_peer_matches_trusted_networks_in_either_form(
    dual_stack: bool, trusted: str
) -> None:
    # A dual-stack server sees the IPv4 client as ::ffff:127.0.0.1: one peer.
    if dual_stack and not has_ipv6():
        pytest.skip("no IPv6: a dual-stack socket cannot be bound")
    with running_server(TrustPolicy.from_cidrs([trusted]), dual_stack=dual_stack) as (
        _,
        port,
    ):
        answer = ask(("127.0.0.1", port), HEADERS["v2"] + b"line\n")
    assert answer.startswith(b"(('192.0.2.7', 51234), ('198.51.100.1', 443), ")


def test_server_local_uses_socket_endpoints() -> None:
    with (
        running_server(TRUST_LOOPBACK) as address,
        socket.create_connection(address) as sock,
    ):
        sock.sendall(HEADERS["v2-local"] + b"x\n")
        answer = sock.makefile("rb").read()
        me = sock.getsockname()
        assert answer == repr((me, address, me, "LOCAL", b"x\n")).encode() + b"\n"


def test_server_closes_bad_headers_and_untrusted_peers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="proxyproto.sockets")
    with running_server(TRUST_LOOPBACK) as address:
        assert ask(address, PAYLOAD) == b""
    with running_server(TrustPolicy.from_cidrs(["10.0.0.0/8"])) as address:
        assert ask(address, HEADERS["v2"] + PAYLOAD) == b""
    messages = [
        r.getMessage() for r in caplog.records if r.name == "proxyproto.sockets"
    ]
    assert any("not a PROXY header" in m for m in messages), messages
    assert any("REJECT" in m for m in messages), messages


@pytest.mark.parametrize(("data", "level", "text"), CLOSED_BEFORE_HEADER)
def test_server_logs_a_close_before_header_once(
    caplog: pytest.LogCaptureFixture, data: bytes, level: str, text: str
) -> None:
    # A TCP health check closes without a byte: one INFO line, no WARNING.
    # After part of a header the sender is broken: one WARNING.
    caplog.set_level(logging.INFO)
    with running_server(TRUST_LOOPBACK) as (_, port):
        client_port = close_before_header(port, data)
    assert_logged_once(caplog, client_port, "proxyproto.sockets", level, text)


def test_silent_client_does_not_block_others(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="proxyproto.sockets")
    with running_server(TRUST_LOOPBACK, header_timeout=2.0) as address:
        silent = socket.create_connection(address)
        with silent:
            answer = ask(address, HEADERS["v1"] + b"hi\n")
            assert b"192.0.2.7" in answer
            # Served while the silent client still holds its connection.
            silent.setblocking(False)
            with pytest.raises(BlockingIOError):
                silent.recv(10)
            silent.settimeout(10)
            assert silent.recv(10) == b""  # closed after the header timeout
    assert any("within 2.0 s" in r.getMessage() for r in caplog.records)


def test_mixin_requires_trust() -> None:
    with pytest.raises(TypeError, match="trust"):
        Server(("127.0.0.1", 0), Handler, bind_and_activate=False)


def test_proxy_connection_addresses() -> None:
    peer = ("127.0.0.1", 5000)
    local = ("127.0.0.1", 80)
    info = ProxyConnection(V2, Policy.REQUIRE, peer, local)
    assert info.client_address == ("192.0.2.7", 51234)
    assert info.server_address == ("198.51.100.1", 443)
    ignored = ProxyConnection(V2, Policy.IGNORE, peer, local)
    assert ignored.client_address == peer
    assert ignored.server_address == local
    local_cmd = ProxyConnection(ProxyHeader.local(), Policy.REQUIRE, peer, local)
    assert local_cmd.header is not None
    assert local_cmd.header.command is Command.LOCAL
    assert local_cmd.client_address == peer
    assert ProxyConnection(None, Policy.SKIP, peer, local).client_address == peer
    assert isinstance(V2.source, InetAddress)
