"""proxyproto.twisted: Daphne and twistd as real processes behind PROXY senders.

One Daphne process serves every endpoint the tests need (``daphne -e`` once
per endpoint string), so the module pays for one start. Its log (where the
adapter's refusals go, through Daphne's logging set-up) is read per test from
the offset the test started at.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import logging
import socket
import ssl
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "daphne", reason="daphne is not installed (pip install 'tlsedge[test]')"
)

from twisted.internet.endpoints import serverFromString
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor, StringTransport
from twisted.protocols.tls import TLSMemoryBIOFactory

from proxyproto import (
    SSLClient,
    TrustPolicy,
)
from proxyproto.twisted import (
    DaphneScopeMiddleware,
    ProxyProtocol,
    ProxyWrappingFactory,
    find_proxy_protocol,
)
from tests.peers import free_port, haproxy
from tests.proxyproto.lb_checks import (
    BEFORE_HEADER,
    CLOSED_BEFORE_HEADER,
    HAPROXY_CHECKS,
    LOCAL_V2,
    close_before_header,
    run_haproxy_checks,
    send_health_checks,
)
from tests.proxyproto.scheme_checks import (
    CLIENT,
    WEBSOCKET_REQUEST,
    ssl_header,
)
from tests.proxyproto.server_checks import (
    V1_HEADER,
    Client,
    assert_closed,
    connect,
    curl_json,
    make_tls_files,
    server_process,
    tls_connect,
    tlsedge_in_front,
    v2_header,
    wait_for_lines,
    wait_for_log,
)

# -- the apps the servers run ---------------------------------------------------


def describe(scope: dict[str, Any]) -> dict[str, Any]:
    """What an ASGI app learned about its connection, as JSON."""
    ext = scope.get("extensions", {}).get("proxyproto")
    header = ext["header"] if ext else None
    ssl_info = header.ssl if header else None
    return {
        "client": list(scope["client"]) if scope["client"] else None,
        "server": list(scope["server"]) if scope["server"] else None,
        "scheme": scope.get("scheme", "ws"),
        "has_extension": ext is not None,
        "peer": list(ext["peer"]) if ext and ext["peer"] else None,
        "command": header.command.name if header else None,
        "version": header.version if header else None,
        "authority": header.authority if header else None,
        "unique_id": header.unique_id.hex() if header and header.unique_id else None,
        "cn": ssl_info.cn if ssl_info else None,
    }


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """HTTP: answer ``describe(scope)``; WebSocket: send it as one text
    message, then close."""
    body = json.dumps(describe(scope))
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": body})
        await send({"type": "websocket.close"})
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body.encode()})


daphne_app = DaphneScopeMiddleware(echo_app)


def wsgi_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """twistd's WSGI resource: the client address it reports."""
    body = json.dumps(
        {
            "client": [environ["REMOTE_ADDR"], int(environ["REMOTE_PORT"])],
        }
    ).encode()
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


# -- the Daphne process -----------------------------------------------------------


@dataclass(frozen=True)
class Daphne:
    ports: dict[str, int]
    log: Path

    def offset(self) -> int:
        return self.log.stat().st_size

    def lines_since(self, offset: int) -> list[str]:
        with self.log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace").splitlines()


ENDPOINTS = {
    "main": "",
    "reject": ":trusted=192.0.2.0/24",
    "skip": ":trusted=192.0.2.0/24:untrusted=skip",
    "slow": ":headerTimeout=0.5",
    "v2": ":versions=2",
}


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def daphne(
    tmp_path_factory: pytest.TempPathFactory, tls_files: dict[str, Any]
) -> Iterator[Daphne]:
    ports = {name: free_port() for name in [*ENDPOINTS, "tls"]}
    args = ["-m", "daphne", "--verbosity", "1"]
    for name, options in ENDPOINTS.items():
        endpoint = f"proxyproto:tcp:{ports[name]}:interface=127.0.0.1{options}"
        args += ["-e", endpoint]
    args += [
        "-e",
        f"proxyproto:ssl:{ports['tls']}:interface=127.0.0.1"
        f":privateKey={tls_files['key']}:certKey={tls_files['cert']}",
        "tests.proxyproto.test_twisted:daphne_app",
    ]
    log = tmp_path_factory.mktemp("daphne") / "daphne.log"
    with server_process(args, list(ports.values()), log):
        yield Daphne(ports, log)


def warnings_in(lines: list[str]) -> list[str]:
    return [line for line in lines if " WARNING " in line or " ERROR " in line]


def websocket_message(sock: socket.socket, first: bytes = b"") -> dict[str, Any]:
    """Open a WebSocket (after *first*) and read the app's one text message."""
    sock.sendall(first + WEBSOCKET_REQUEST)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed during the WebSocket handshake: {data!r}"
        data += chunk
    head, _, data = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    while len(data) < 4:
        data += sock.recv(65536)
    assert data[0] == 0x81  # FIN + text
    assert data[1] == 126  # unmasked, a 16-bit length follows
    (length,) = struct.unpack("!H", data[2:4])
    while len(data) < 4 + length:
        data += sock.recv(65536)
    result: dict[str, Any] = json.loads(data[4 : 4 + length])
    return result


# -- Daphne: headers, TLS, refusals ---------------------------------------------------


def test_v1_header_and_leftover_in_one_segment(daphne: Daphne) -> None:
    sock, source_port = connect(daphne.ports["main"])
    with sock:
        seen = Client(sock).request(first=V1_HEADER)
    assert seen["client"] == ["192.0.2.1", 1234]
    assert seen["server"] == ["198.51.100.2", 443]
    assert seen["scheme"] == "http"
    assert seen["peer"] == ["127.0.0.1", source_port]
    assert seen["version"] == 1


def test_v2_header_with_tlvs(daphne: Daphne) -> None:
    sock, source_port = connect(daphne.ports["main"])
    with sock:
        sock.sendall(v2_header())
        seen = Client(sock).request()
    assert seen["client"] == ["2001:db8::1", 5555]
    assert seen["server"] == ["2001:db8::2", 443]
    assert seen["authority"] == "example.com"
    assert seen["unique_id"] == "010203"
    assert seen["peer"] == ["127.0.0.1", source_port]


def test_header_byte_by_byte(daphne: Daphne) -> None:
    sock, _ = connect(daphne.ports["main"])
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in v2_header(("192.0.2.7", 7)):
            sock.sendall(bytes([byte]))
        seen = Client(sock).request()
    assert seen["client"] == ["192.0.2.7", 7]


def test_keep_alive_requests_share_the_header(daphne: Daphne) -> None:
    sock, _ = connect(daphne.ports["main"])
    with sock:
        client = Client(sock)
        seen = [
            client.request(f"/{i}", first=V1_HEADER if i == 0 else b"")
            for i in range(3)
        ]
    assert {tuple(s["client"]) for s in seen} == {("192.0.2.1", 1234)}
    assert all(s["has_extension"] for s in seen)


def test_tls_after_header(daphne: Daphne, tls_files: dict[str, Any]) -> None:
    # proxyproto:ssl: the header comes in clear, in the ClientHello's segment.
    sock, source_port = connect(daphne.ports["tls"])
    with sock:
        tls = tls_connect(sock, v2_header(("192.0.2.9", 999)), tls_files["client"])
        client = Client(tls)
        seen = [client.request(), client.request()]
    for s in seen:
        assert s["client"] == ["192.0.2.9", 999]
        assert s["scheme"] == "https"
        assert s["peer"] == ["127.0.0.1", source_port]
        assert s["authority"] == "example.com"


def test_tls_without_header_is_refused(
    daphne: Daphne, tls_files: dict[str, Any]
) -> None:
    # The ClientHello is not a header: closed before any TLS is spoken.
    sock, _ = connect(daphne.ports["tls"])
    with sock, pytest.raises((ssl.SSLError, ConnectionError)):
        tls_files["client"].wrap_socket(sock, server_hostname="localhost")


def test_local_header_uses_real_endpoints(daphne: Daphne) -> None:
    # AWS NLB health check: LOCAL with dummy addresses in the length.
    local = bytes.fromhex("0d0a0d0a000d0a515549540a") + b"\x20\x11\x00\x0c" + bytes(12)
    sock, source_port = connect(daphne.ports["main"])
    with sock:
        seen = Client(sock).request(first=local)
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["server"] == ["127.0.0.1", daphne.ports["main"]]
    assert seen["command"] == "LOCAL"


def test_untrusted_peer_is_refused(daphne: Daphne) -> None:
    offset = daphne.offset()
    sock, source_port = connect(daphne.ports["reject"])
    with sock:
        with contextlib.suppress(OSError):
            sock.sendall(V1_HEADER + b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        assert_closed(sock)
    wait_for_log(
        daphne.log, f"{source_port}): not a trusted source (trust policy REJECT)"
    )
    assert len(warnings_in(daphne.lines_since(offset))) == 1


def test_untrusted_peer_skipped_is_served_directly(daphne: Daphne) -> None:
    sock, source_port = connect(daphne.ports["skip"])
    with sock:
        seen = Client(sock).request()
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["has_extension"]
    assert seen["command"] is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            b"GET / HTTP/1.1\r\nHost: test\r\n\r\n", "not a PROXY header", id="missing"
        ),
        pytest.param(
            b"PROXY TCP4 1.2.3.4 5.6.7.8 +80 443\r\nGET /", "port", id="garbage"
        ),
        pytest.param(b"\x16\x03\x01\x02\x00\x01", "not a PROXY header", id="tls"),
    ],
)
def test_bad_header_is_closed(daphne: Daphne, data: bytes, message: str) -> None:
    offset = daphne.offset()
    sock, source_port = connect(daphne.ports["main"])
    with sock:
        sock.sendall(data)
        assert_closed(sock)
    wait_for_log(daphne.log, f"closing connection from ('127.0.0.1', {source_port})")
    (line,) = warnings_in(daphne.lines_since(offset))
    assert message in line


def test_slow_header_times_out(daphne: Daphne) -> None:
    sock, source_port = connect(daphne.ports["slow"])
    with sock:
        sock.sendall(V1_HEADER[:10])
        assert_closed(sock, within=5)
    text = wait_for_log(daphne.log, f"{source_port}): no complete PROXY header")
    assert "no complete PROXY header within 0.5 s" in text


@pytest.mark.parametrize(("data", "level", "text"), CLOSED_BEFORE_HEADER)
def test_close_before_header_is_logged_once(
    daphne: Daphne, data: bytes, level: str, text: str
) -> None:
    # A TCP health check closes without a byte: one INFO line, no WARNING.
    # After part of a header the sender is broken: one WARNING.
    offset = daphne.offset()
    client_port = close_before_header(daphne.ports["main"], data)
    lines = wait_for_lines(daphne.log, offset, f", {client_port})")
    (line,) = [line for line in lines if f", {client_port})" in line]
    assert f" {level} " in line
    assert text in line
    if level == "INFO":
        assert not warnings_in(lines)


def test_only_v2_accepted(daphne: Daphne) -> None:
    sock, _ = connect(daphne.ports["v2"])
    with sock:
        sock.sendall(V1_HEADER)
        assert_closed(sock)
    sock, _ = connect(daphne.ports["v2"])
    with sock:
        seen = Client(sock).request(first=v2_header(("192.0.2.3", 3)))
    assert seen["version"] == 2


def test_health_checks_are_info_not_warnings(daphne: Daphne) -> None:
    # LOCAL then a reset, a bare reset, LOCAL then a FIN (HAProxy, AWS NLB).
    offset = daphne.offset()
    send_health_checks(daphne.ports["main"])
    sock, _ = connect(daphne.ports["main"])
    with sock:
        seen = Client(sock).request(first=V1_HEADER)
    assert seen["client"] == ["192.0.2.1", 1234]
    wait_for_log(daphne.log, BEFORE_HEADER)
    lines = daphne.lines_since(offset)
    assert not warnings_in(lines)
    gone = [line for line in lines if BEFORE_HEADER in line]
    assert gone
    assert all(" INFO " in line for line in gone)


@pytest.mark.parametrize(
    ("client", "http", "websocket"),
    [
        pytest.param(SSLClient.SSL, "https", "wss", id="tls"),
        pytest.param(
            SSLClient.SSL | SSLClient.CERT_CONN | SSLClient.CERT_SESS,
            "https",
            "wss",
            id="tls-client-cert",
        ),
        pytest.param(SSLClient(0), "http", "ws", id="no-tls-flag"),
    ],
)
def test_scheme_from_ssl_tlv(
    daphne: Daphne, client: SSLClient, http: str, websocket: str
) -> None:
    sock, _ = connect(daphne.ports["main"])
    with sock:
        client_ = Client(sock)
        seen = [client_.request(first=ssl_header(client)), client_.request()]
    sock, _ = connect(daphne.ports["main"])
    with sock:
        ws = websocket_message(sock, first=ssl_header(client))
    assert [s["scheme"] for s in seen] == [http, http]
    assert seen[0]["client"] == list(CLIENT)
    assert ws["scheme"] == websocket
    assert ws["client"] == list(CLIENT)


def test_scheme_ignores_ssl_tlv_of_local_header(daphne: Daphne) -> None:
    sock, _ = connect(daphne.ports["main"])
    with sock:
        seen = Client(sock).request(first=ssl_header(SSLClient.SSL, local=True))
    assert seen["command"] == "LOCAL"
    assert seen["scheme"] == "http"


def test_private_api() -> None:
    """Fails loudly if the Daphne internals DaphneScopeMiddleware uses change."""
    # Read, not imported: importing daphne.server installs a reactor.
    spec = importlib.util.find_spec("daphne.server")
    assert spec is not None
    assert spec.origin is not None
    source = Path(spec.origin).read_text()
    assert "def create_application(self, protocol, scope):" in source
    assert "send=partial(self.handle_reply, protocol)," in source


# -- Daphne behind real load balancers ------------------------------------------------


@pytest.mark.peers
@pytest.mark.parametrize(
    ("option", "version"), [("send-proxy", 1), ("send-proxy-v2", 2)]
)
def test_haproxy_send_proxy(daphne: Daphne, option: str, version: int) -> None:
    front = free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
        f"backend be\n    server app 127.0.0.1:{daphne.ports['main']} {option}\n"
    )
    local_port = free_port()
    with haproxy(config, [front]):
        seen = curl_json(f"http://127.0.0.1:{front}/", "--local-port", str(local_port))
    assert seen["client"] == ["127.0.0.1", local_port]
    assert seen["server"] == ["127.0.0.1", front]
    assert seen["version"] == version
    assert seen["scheme"] == "http"


@pytest.mark.peers
def test_haproxy_send_proxy_v2_ssl_cn(daphne: Daphne, tmp_path: Path) -> None:
    # HAProxy terminates TLS (client certificate asked for) and says so in
    # the SSL TLV: Daphne reports https and the app reads the client's CN.
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "server.pem")
    )
    client_cert = ca.issue_cert("alice@example.test", common_name="alice")
    client_cert.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    client_cert.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    front = free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front} ssl crt {tmp_path}/server.pem "
        f"verify optional ca-file {tmp_path}/ca.pem\n    default_backend be\n"
        f"backend be\n    server app 127.0.0.1:{daphne.ports['main']} "
        "send-proxy-v2-ssl-cn\n"
    )
    local_port = free_port()
    with haproxy(config, [front]):
        seen = curl_json(
            f"https://127.0.0.1:{front}/",
            "--cacert",
            str(tmp_path / "ca.pem"),
            "--cert",
            str(tmp_path / "client.pem"),
            "--key",
            str(tmp_path / "client.key"),
            "--local-port",
            str(local_port),
        )
    assert seen["client"] == ["127.0.0.1", local_port]
    assert seen["scheme"] == "https"
    assert seen["cn"] == "alice"


@pytest.mark.peers
def test_haproxy_tls_passthrough(daphne: Daphne, tls_files: dict[str, Any]) -> None:
    # HAProxy relays TLS untouched with a v2 header; Daphne terminates TLS.
    front = free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
        f"backend be\n    server app 127.0.0.1:{daphne.ports['tls']} send-proxy-v2\n"
    )
    local_port = free_port()
    with haproxy(config, [front]):
        seen = curl_json(
            f"https://localhost:{front}/",
            "--cacert",
            str(tls_files["ca"]),
            "--local-port",
            str(local_port),
        )
    assert seen["client"] == ["127.0.0.1", local_port]
    assert seen["scheme"] == "https"


@pytest.mark.peers
@pytest.mark.parametrize("check", HAPROXY_CHECKS)
def test_haproxy_health_checks_are_not_warnings(daphne: Daphne, check: str) -> None:
    offset = daphne.offset()
    run_haproxy_checks(daphne.ports["main"], check)
    assert not warnings_in(daphne.lines_since(offset))


@pytest.mark.peers
def test_tlsedge_in_front(
    daphne: Daphne, tls_files: dict[str, Any], tmp_path: Path
) -> None:
    # A real tlsedge terminates TLS and sends send_proxy = "v2" with its SSL
    # TLV: Daphne sees the client and https.
    local_port = free_port()
    with tlsedge_in_front(daphne.ports["main"], tls_files, tmp_path) as front:
        seen = curl_json(
            f"https://localhost:{front}/",
            "--cacert",
            str(tls_files["ca"]),
            "--local-port",
            str(local_port),
        )
    assert seen["client"] == ["127.0.0.1", local_port]
    assert seen["server"] == ["127.0.0.1", front]
    assert seen["scheme"] == "https"
    assert seen["version"] == 2


# -- twistd ----------------------------------------------------------------------


def test_twistd_web_reads_the_header(tmp_path: Path) -> None:
    port = free_port()
    args = [
        "-c",
        "from twisted.scripts.twistd import run; run()",
        "--nodaemon",
        "--pidfile=",
        "web",
        "--listen",
        f"proxyproto:tcp:{port}:interface=127.0.0.1",
        "--wsgi",
        "tests.proxyproto.test_twisted.wsgi_app",
    ]
    with server_process(args, [port], tmp_path / "twistd.log"):
        sock, _ = connect(port)
        with sock:
            client = Client(sock)
            seen = [client.request(first=ssl_header(SSLClient.SSL)), client.request()]
    assert seen == [{"client": list(CLIENT)}] * 2


# -- the endpoint string, without a running reactor -----------------------------------


def listened(description: str) -> tuple[Any, ...]:
    """What ``serverFromString(description).listen`` asked the reactor for."""
    reactor = MemoryReactor()
    serverFromString(reactor, description).listen(Factory.forProtocol(Protocol))
    (port,) = reactor.tcpServers or reactor.unixServers
    return tuple(port)


def test_endpoint_string_wraps_the_socket() -> None:
    port, factory, backlog, interface = listened(
        "proxyproto:tcp:8000:interface=127.0.0.1:backlog=7:headerTimeout=2.5"
    )
    assert (port, backlog, interface) == (8000, 7, "127.0.0.1")
    assert isinstance(factory, ProxyWrappingFactory)
    assert factory.settings.header_timeout == 2.5
    assert factory.settings.trust.decide(("127.0.0.1", 1)).name == "REQUIRE"
    assert factory.settings.trust.decide(("10.0.0.1", 1)).name == "REJECT"


@pytest.mark.allow_leaks(reason="parsing ssl: installs Twisted's global reactor")
def test_endpoint_string_puts_tls_above_the_header(tls_files: dict[str, Any]) -> None:
    # Twisted's own "haproxy:ssl:" puts TLS below (twisted/twisted#9041).
    port, factory, _, _ = listened(
        f"proxyproto:ssl:8443:privateKey={tls_files['key']}:certKey={tls_files['cert']}"
        ":trusted=10.0.0.0/8,192.0.2.1:untrusted=skip:versions=2"
    )
    assert port == 8443
    assert isinstance(factory, ProxyWrappingFactory)
    assert isinstance(factory.wrappedFactory, TLSMemoryBIOFactory)
    trust = factory.settings.trust
    assert trust.decide(("192.0.2.1", 1)).name == "REQUIRE"
    assert trust.decide(("127.0.0.1", 1)).name == "SKIP"
    assert set(factory.settings.reader_options["versions"]) == {2}


def test_endpoint_string_unix(tmp_path: Path) -> None:
    path, factory, *_ = listened(f"proxyproto:unix:{tmp_path}/app.sock:trusted=*")
    assert path == f"{tmp_path}/app.sock"
    assert factory.settings.trust.decide(None).name == "REQUIRE"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (":trusted=lb.internal", "trusted: expected IP addresses or networks"),
        (":untrusted=maybe", "untrusted: expected reject or skip, got 'maybe'"),
        (":headerTimeout=0", "headerTimeout: expected seconds > 0, got '0'"),
        (":versions=3", "versions: expected 1, 2 or 1,2, got '3'"),
    ],
)
def test_endpoint_string_bad_options(options: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        serverFromString(MemoryReactor(), f"proxyproto:tcp:8000{options}")


def test_endpoint_string_needs_an_endpoint() -> None:
    with pytest.raises(ValueError, match="needs an endpoint"):
        serverFromString(MemoryReactor(), "proxyproto:trusted=*")


# -- ProxyProtocol on a StringTransport --------------------------------------------


class Recorder(Protocol):
    def __init__(self) -> None:
        self.data = b""

    def dataReceived(self, data: bytes) -> None:
        self.data += data


def wrapped_connection(
    trust: TrustPolicy,
) -> tuple[ProxyProtocol, StringTransport, Recorder]:
    recorder = Recorder()
    factory = ProxyWrappingFactory(
        Factory.forProtocol(lambda: recorder), trust=trust, reactor=Clock()
    )
    protocol = factory.buildProtocol(None)
    transport = StringTransport(
        peerAddress=_ipv4("127.0.0.1", 40000), hostAddress=_ipv4("127.0.0.1", 80)
    )
    protocol.makeConnection(transport)
    return protocol, transport, recorder


def _ipv4(host: str, port: int) -> Any:
    from twisted.internet.address import IPv4Address

    return IPv4Address("TCP", host, port)


def test_application_transport_reports_the_header() -> None:
    protocol, transport, recorder = wrapped_connection(TrustPolicy.everyone())
    protocol.dataReceived(ssl_header(SSLClient.SSL) + b"hello")
    assert recorder.data == b"hello"
    assert recorder.transport is protocol
    peer = recorder.transport.getPeer()
    assert (peer.host, peer.port) == CLIENT
    assert find_proxy_protocol(recorder.transport) is protocol
    assert protocol.client_tls
    assert protocol.peer_address == transport.getPeer()
    assert protocol.header is not None
    assert protocol.header.ssl is not None


def test_application_transport_without_tls_at_the_lb() -> None:
    protocol, _, recorder = wrapped_connection(TrustPolicy.everyone())
    protocol.dataReceived(V1_HEADER)
    assert not protocol.client_tls
    assert recorder.data == b""


def test_bytes_after_a_refusal_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "proxyproto.twisted")
    protocol, transport, recorder = wrapped_connection(TrustPolicy.everyone())
    protocol.dataReceived(b"GET / HTTP/1.1\r\n")
    protocol.dataReceived(LOCAL_V2)
    assert transport.disconnecting
    assert recorder.transport is None
    assert caplog.text.count("closing connection") == 1


def test_daphne_middleware_leaves_other_servers_alone() -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope)

    async def receive() -> None:
        raise AssertionError("not called")

    async def send(message: Any) -> None:
        raise AssertionError("not called")

    # A partial, but not Daphne's: no protocol with a PROXY layer behind it.
    scope = {"type": "http", "scheme": "http"}
    asyncio.run(DaphneScopeMiddleware(app)(scope, receive, functools.partial(send)))
    assert seen == [scope]
