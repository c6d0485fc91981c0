"""proxyproto.tornado over real sockets: raw headers, TLS, HAProxy, tlsedge, curl."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "tornado", reason="tornado is not installed (pip install 'tlsedge[tornado]')"
)

from tornado import httpserver, tcpserver, web
from tornado.iostream import IOStream, SSLIOStream, StreamClosedError

from proxyproto import (
    TLV,
    Policy,
    ProxyHeader,
    SSLClient,
    TLVType,
    TrustPolicy,
    encode_v2,
)
from proxyproto.tornado import (
    ProxyHTTPServer,
    ProxyTCPServer,
    proxy_connection,
)
from tests.peers import free_port
from tests.proxyproto.backend_checks import (
    REQUEST,
    ROOT,
    TIMEOUT,
    V1_HEADER,
    Client,
    assert_closed,
    connect,
    curl,
    haproxy_in_front,
    haproxy_tls_bind,
    tls_connect,
    tlsedge_in_front,
    write_tls_files,
)
from tests.proxyproto.lb_checks import (
    BEFORE_HEADER,
    CLOSED_BEFORE_HEADER,
    HAPROXY_CHECKS,
    assert_logged_once,
    assert_no_warnings,
    close_before_header,
    queue_health_checks,
    run_haproxy_checks,
    send_health_checks,
)
from tests.proxyproto.scheme_checks import CLIENT, ssl_header

LOGGER_NAME = "proxyproto.tornado"


def _pair(address: object) -> list[Any] | None:
    return list(address[:2]) if isinstance(address, tuple) else None


class Describe(web.RequestHandler):
    """Answer what the handler learned about the connection, as JSON."""

    def get(self) -> None:
        connection = proxy_connection(self.request)
        header = connection.header if connection else None
        ssl_info = header.ssl if header else None
        self.write(
            {
                "remote_ip": self.request.remote_ip,
                "protocol": self.request.protocol,
                "url": self.request.full_url(),
                "has_connection": connection is not None,
                "policy": connection.policy.name if connection else None,
                "peer": _pair(connection.peer_address) if connection else None,
                "client": _pair(connection.client_address) if connection else None,
                "server": _pair(connection.server_address) if connection else None,
                "command": header.command.name if header else None,
                "version": header.version if header else None,
                "authority": header.authority if header else None,
                "unique_id": header.unique_id.hex()
                if header and header.unique_id
                else None,
                "ssl_cn": ssl_info.cn if ssl_info else None,
            }
        )


class Echo(ProxyTCPServer):
    """A line protocol: answers one line of JSON about the connection, then
    echoes the first line it received."""

    async def handle_stream(self, stream: IOStream, address: tuple[Any, ...]) -> None:
        connection = proxy_connection(stream)
        try:
            line = await stream.read_until(b"\n")
            about = {
                "address": _pair(address),
                "command": connection.header.command.name
                if connection and connection.header
                else None,
                "tls": isinstance(stream, SSLIOStream),
            }
            await stream.write(json.dumps(about).encode() + b"\n" + line)
        except StreamClosedError:
            pass
        stream.close()


@contextlib.contextmanager
def running(
    before_start: Callable[[int], None] | None = None,
    listener: socket.socket | None = None,
    server_class: Callable[..., tcpserver.TCPServer] | None = None,
    stoppers: list[Callable[[], None]] | None = None,
    **options: Any,
) -> Iterator[int]:
    """Serve from a thread's event loop; yield the port.

    A ``ProxyHTTPServer`` for the ``Describe`` app by default, or
    ``server_class(**options)``. It listens on *listener* if given, else on
    a new socket; *before_start(port)* runs before it accepts. *stoppers*
    gets a function calling the server's ``stop()`` in its loop.
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sock = listener or socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1] if sock.family != socket.AF_UNIX else 0
    if before_start is not None:
        before_start(port)
    holder: list[tcpserver.TCPServer] = []

    async def start() -> None:
        if server_class is None:
            app = web.Application([("/", Describe)])
            server: tcpserver.TCPServer = ProxyHTTPServer(app, **options)
        else:
            server = server_class(**options)
        sock.setblocking(False)
        server.add_sockets([sock])
        holder.append(server)

    async def stop() -> None:
        server = holder[0]
        server.stop()
        if isinstance(server, httpserver.HTTPServer):
            await server.close_all_connections()
        # As asyncio.run ends: the tasks still running are cancelled and
        # finish (stop() cancelled the header reads still going on).
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def stop_listening() -> None:
        holder[0].stop()

    if stoppers is not None:
        stoppers.append(
            lambda: asyncio.run_coroutine_threadsafe(stop_listening(), loop).result(
                TIMEOUT
            )
        )
    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(TIMEOUT)
        yield port
    finally:
        if holder:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(TIMEOUT)
        sock.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(TIMEOUT)
        loop.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return write_tls_files(tmp_path_factory.mktemp("tls"))


def v2_header(source: tuple[str, int] = ("2001:db8::1", 5555)) -> bytes:
    destination = ("2001:db8::2", 443) if ":" in source[0] else ("192.0.2.200", 443)
    return encode_v2(
        ProxyHeader.from_addresses(
            source,
            destination,
            tlvs=(
                TLV(TLVType.AUTHORITY, b"example.com"),
                TLV(TLVType.UNIQUE_ID, b"\x01\x02\x03"),
            ),
        ),
        crc32c=True,
    )


def echo_exchange(port: int, first: bytes, line: bytes = b"hello\n") -> Any:
    """Send *first* and *line* to the Echo server; its JSON and the echo."""
    sock, _ = connect(port)
    with sock:
        sock.sendall(first + line)
        data = b""
        while data.count(b"\n") < 2:
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    about, echoed, _ = data.split(b"\n")
    assert echoed + b"\n" == line
    return json.loads(about)


# -- the header and the request -----------------------------------------------


def test_v1_header_and_request_in_one_segment() -> None:
    with running() as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request(first=V1_HEADER)
    assert seen["remote_ip"] == "192.0.2.1"
    assert seen["client"] == ["192.0.2.1", 1234]
    assert seen["server"] == ["198.51.100.2", 443]
    assert seen["protocol"] == "http"
    assert seen["url"] == "http://test/"
    assert seen["peer"] == ["127.0.0.1", source_port]
    assert seen["policy"] == "REQUIRE"
    assert seen["version"] == 1


def test_v2_header_with_tlvs() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(v2_header())
            seen = Client(sock).request()
    assert seen["remote_ip"] == "2001:db8::1"
    assert seen["server"] == ["2001:db8::2", 443]
    assert seen["authority"] == "example.com"
    assert seen["unique_id"] == "010203"


def test_header_byte_by_byte() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            for byte in V1_HEADER:
                sock.sendall(bytes([byte]))
            seen = Client(sock).request()
    assert seen["remote_ip"] == "192.0.2.1"


def test_keep_alive_and_pipelined_requests_share_the_header() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER + REQUEST * 3)
            client = Client(sock)
            seen = [client.request() for _ in range(3)]
            seen += [client.request("/")]
    assert [s["remote_ip"] for s in seen] == ["192.0.2.1"] * 4


def test_local_header_uses_real_endpoints() -> None:
    local = bytes.fromhex("0d0a0d0a000d0a515549540a") + b"\x20\x11\x00\x0c" + bytes(12)
    with running() as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request(first=local)
    assert seen["remote_ip"] == "127.0.0.1"
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["command"] == "LOCAL"


def test_only_v2_accepted() -> None:
    with running(reader_options={"versions": {2}}) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER + REQUEST)
            assert_closed(sock)


@pytest.mark.parametrize(
    ("first", "remote"),
    [
        pytest.param(V1_HEADER, "192.0.2.1", id="header"),
        pytest.param(b"", "127.0.0.1", id="no-header"),
    ],
)
def test_use_policy_reads_a_header_if_present(first: bytes, remote: str) -> None:
    with running(trusted=TrustPolicy.everyone(Policy.USE)) as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=first)
    assert seen["remote_ip"] == remote


def test_unix_socket_load_balancer(tmp_path: Path) -> None:
    # HAProxy "server app unix@/path send-proxy-v2": the client's IP comes
    # from the header although the socket is AF_UNIX.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "app.sock"))
    listener.listen()
    with (
        running(listener=listener, trusted=TrustPolicy.everyone()),
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
    ):
        sock.settimeout(TIMEOUT)
        sock.connect(str(tmp_path / "app.sock"))
        seen = Client(sock).request(first=V1_HEADER)
    assert seen["remote_ip"] == "192.0.2.1"
    assert seen["url"] == "http://test/"


def test_tcp_server_gets_the_client_and_the_bytes_after_the_header() -> None:
    with running(server_class=Echo) as port:
        about = echo_exchange(port, V1_HEADER)
        local = echo_exchange(port, ssl_header(SSLClient.SSL, local=True))
    assert about == {"address": ["192.0.2.1", 1234], "command": "PROXY", "tls": False}
    assert local["address"][0] == "127.0.0.1"
    assert local["command"] == "LOCAL"


def test_tcp_server_with_tls_after_header(tls_files: dict[str, Any]) -> None:
    with running(server_class=Echo, ssl_options=tls_files["server_context"]) as port:
        sock, _ = connect(port)
        with sock:
            tls = tls_connect(sock, v2_header(("192.0.2.9", 999)), tls_files["client"])
            tls.sendall(b"hello\n")
            data = b""
            while data.count(b"\n") < 2:
                chunk = tls.recv(65536)
                assert chunk, data
                data += chunk
    about = json.loads(data.split(b"\n")[0])
    assert about == {"address": ["192.0.2.9", 999], "command": "PROXY", "tls": True}


# -- the scheme -----------------------------------------------------------------


def test_tls_after_header(tls_files: dict[str, Any]) -> None:
    with running(ssl_options=tls_files["server_context"]) as port:
        sock, source_port = connect(port)
        with sock:
            tls = tls_connect(sock, v2_header(("192.0.2.9", 999)), tls_files["client"])
            client = Client(tls)
            seen = [client.request(), client.request()]
    for s in seen:
        assert s["remote_ip"] == "192.0.2.9"
        assert s["protocol"] == "https"
        assert s["url"] == "https://test/"
        assert s["peer"] == ["127.0.0.1", source_port]


def test_tls_without_tls_is_closed(tls_files: dict[str, Any]) -> None:
    with running(ssl_options=tls_files["server_context"]) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER + REQUEST)
            assert_closed(sock)


@pytest.mark.parametrize(
    ("client", "protocol"),
    [
        pytest.param(SSLClient.SSL, "https", id="tls"),
        pytest.param(
            SSLClient.SSL | SSLClient.CERT_CONN | SSLClient.CERT_SESS,
            "https",
            id="tls-client-cert",
        ),
        pytest.param(SSLClient(0), "http", id="no-tls-flag"),
    ],
)
def test_protocol_from_ssl_tlv(client: SSLClient, protocol: str) -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            http = Client(sock)
            seen = [http.request(first=ssl_header(client)), http.request()]
    assert [s["protocol"] for s in seen] == [protocol, protocol]
    assert seen[0]["url"] == f"{protocol}://test/"
    assert seen[0]["remote_ip"] == CLIENT[0]


def test_protocol_ignores_ssl_tlv_of_local_header() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=ssl_header(SSLClient.SSL, local=True))
    assert seen["command"] == "LOCAL"
    assert seen["protocol"] == "http"


def test_protocol_ignores_ssl_tlv_under_ignore_policy() -> None:
    with running(trusted=TrustPolicy.everyone(Policy.IGNORE)) as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=ssl_header(SSLClient.SSL))
    assert seen["remote_ip"] == "127.0.0.1"
    assert seen["policy"] == "IGNORE"
    assert seen["protocol"] == "http"


# -- refusals -------------------------------------------------------------------


def test_untrusted_peer_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with running(trusted=["192.0.2.0/24"]) as port:
        sock, _ = connect(port)
        with sock:
            with contextlib.suppress(OSError):
                sock.sendall(V1_HEADER + REQUEST)
            assert_closed(sock)
    refusals = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert [r.levelname for r in refusals] == ["WARNING"]
    assert "trust policy REJECT" in refusals[0].getMessage()


def test_untrusted_peer_skipped_is_served_directly() -> None:
    with running(trusted=["192.0.2.0/24"], untrusted=Policy.SKIP) as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request()
    assert seen["remote_ip"] == "127.0.0.1"
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["policy"] == "SKIP"
    assert seen["command"] is None


@pytest.mark.parametrize(
    ("data", "logged"),
    [
        pytest.param(REQUEST, "not a PROXY header", id="missing"),
        pytest.param(
            b"PROXY TCP4 1.2.3.4 5.6.7.8 +80 443\r\nGET /", "port", id="garbage"
        ),
        pytest.param(b"\x16\x03\x01\x02\x00\x01", "not a PROXY header", id="tls"),
    ],
)
def test_bad_header_is_closed(
    data: bytes, logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with running() as port:
        sock, source_port = connect(port)
        with sock:
            sock.sendall(data)
            assert_closed(sock)
    refusals = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert [r.levelname for r in refusals] == ["WARNING"]
    message = refusals[0].getMessage()
    assert f"closing connection from ('127.0.0.1', {source_port})" in message
    assert logged in message


def test_slow_header_times_out(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER_NAME)
    with running(header_timeout=0.3) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER[:10])
            assert_closed(sock, within=5)
    assert "no complete PROXY header within 0.3 s" in caplog.text


@pytest.mark.parametrize(("data", "level", "text"), CLOSED_BEFORE_HEADER)
def test_close_before_header_is_logged_once(
    data: bytes, level: str, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A TCP health check closes without a byte: one INFO line, no WARNING.
    # After part of a header the sender is broken: one WARNING.
    caplog.set_level(logging.INFO)
    with running() as port:
        client_port = close_before_header(port, data)
    assert_logged_once(caplog, client_port, LOGGER_NAME, level, text)


def test_stop_closes_connections_still_sending_their_header() -> None:
    stoppers: list[Callable[[], None]] = []
    with running(header_timeout=60, stoppers=stoppers) as port:
        waiting, _ = connect(port)
        with waiting:
            waiting.sendall(V1_HEADER[:10])
            # Accepted in order: once this one is served, so was the first.
            served, _ = connect(port)
            with served:
                Client(served).request(first=V1_HEADER)
            stoppers[0]()
            assert_closed(waiting, within=5)


def test_health_checks_are_not_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with running(before_start=queue_health_checks) as port:
        send_health_checks(port)
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=V1_HEADER)
    assert seen["remote_ip"] == "192.0.2.1"
    assert_no_warnings(caplog)
    gone = [r for r in caplog.records if "before its header" in r.getMessage()]
    assert len(gone) >= 2
    assert {(r.name, r.levelname) for r in gone} == {(LOGGER_NAME, "INFO")}
    assert BEFORE_HEADER in gone[0].getMessage()


def test_private_api() -> None:
    """Fails loudly if the Tornado internals proxyproto.tornado replaces or
    uses change (checked against Tornado 6.6.1)."""
    accept = inspect.getsource(tcpserver.TCPServer.add_sockets)
    assert "self._handle_connection" in accept
    handle = inspect.getsource(tcpserver.TCPServer._handle_connection)
    for step in ("ssl_wrap_socket(", "SSLIOStream(", "IOStream(", "handle_stream("):
        assert step in handle
    serve = inspect.getsource(httpserver.HTTPServer.handle_stream)
    for step in (
        "_HTTPRequestContext(",
        "HTTP1ServerConnection(stream, self.conn_params, context)",
        "self._connections.add(conn)",
        "conn.start_serving(self)",
    ):
        assert step in serve
    context = inspect.signature(httpserver._HTTPRequestContext)
    assert list(context.parameters) == [
        "stream",
        "address",
        "protocol",
        "trusted_downstream",
    ]
    assert "_orig_remote_ip" in inspect.getsource(httpserver._HTTPRequestContext)


# -- the example ----------------------------------------------------------------


def test_example_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-u", "examples/tornado_backend.py", str(port), "127.0.0.1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert f"listening on 127.0.0.1:{port}" in line.decode(), line
        sock, _ = connect(port)
        with sock:
            answer = Client(sock).get(first=V1_HEADER)
        assert b"client:   192.0.2.1" in answer
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT) == 0
        assert b"stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


# -- real peers -------------------------------------------------------------------


@pytest.mark.peers
@pytest.mark.parametrize("option", ["send-proxy", "send-proxy-v2"])
def test_haproxy_send_proxy_and_curl(option: str) -> None:
    with running() as port, haproxy_in_front(port, option) as front:
        seen, client = curl(f"http://127.0.0.1:{front}/")
    assert seen["remote_ip"] == client[0]
    assert seen["client"] == list(client)
    assert seen["server"] == ["127.0.0.1", front]
    assert seen["version"] == (1 if option == "send-proxy" else 2)
    assert seen["protocol"] == "http"


@pytest.mark.peers
def test_haproxy_tls_passthrough_and_curl(tls_files: dict[str, Any]) -> None:
    with (
        running(ssl_options=tls_files["server_context"]) as port,
        haproxy_in_front(port, "send-proxy-v2") as front,
    ):
        seen, client = curl(
            f"https://localhost:{front}/", "--cacert", str(tls_files["ca"])
        )
    assert seen["client"] == list(client)
    assert seen["protocol"] == "https"
    assert seen["url"] == f"https://localhost:{front}/"


@pytest.mark.peers
def test_haproxy_terminates_tls_send_proxy_v2_ssl_cn(
    tls_files: dict[str, Any], tmp_path: Path
) -> None:
    bind = haproxy_tls_bind(tls_files, tmp_path)
    with (
        running() as port,
        haproxy_in_front(port, "send-proxy-v2-ssl-cn", bind) as front,
    ):
        seen, client = curl(
            f"https://localhost:{front}/",
            "--cacert",
            str(tls_files["ca"]),
            "--cert",
            str(tls_files["client_cert"]),
            "--key",
            str(tls_files["client_key"]),
        )
    assert seen["client"] == list(client)
    assert seen["protocol"] == "https"
    assert seen["ssl_cn"] == "alice"


@pytest.mark.peers
@pytest.mark.parametrize("check", HAPROXY_CHECKS)
def test_haproxy_health_checks_are_not_warnings(
    check: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with running() as port:
        run_haproxy_checks(port, check)
    assert_no_warnings(caplog)


@pytest.mark.peers
def test_behind_tlsedge_send_proxy_v2(
    tls_files: dict[str, Any], tmp_path: Path
) -> None:
    with running() as port, tlsedge_in_front(port, tls_files, tmp_path) as front:
        seen, client = curl(
            f"https://localhost:{front}/", "--cacert", str(tls_files["ca"])
        )
    assert seen["client"] == list(client)
    assert seen["server"] == ["127.0.0.1", front]
    assert seen["protocol"] == "https"
    assert seen["url"] == f"https://localhost:{front}/"
    assert seen["authority"] == "localhost"
