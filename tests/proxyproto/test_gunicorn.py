"""proxyproto.gunicorn: real gunicorn processes behind PROXY senders.

A gunicorn per worker class (sync, gthread, asgi) serves most tests; TLS and
the lenient worker (SKIP for untrusted peers, a 0.5 s header timeout, v2
only) get their own. Connections from 127.0.0.2 are untrusted (gunicorn's
default ``--proxy-allow-from`` is 127.0.0.1 and ::1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "gunicorn", reason="gunicorn is not installed (pip install 'tlsedge[gunicorn]')"
)

from proxyproto import Policy, SSLClient
from proxyproto.gunicorn import ThreadWorker
from tests.peers import free_port, haproxy
from tests.proxyproto.lb_checks import (
    BEFORE_HEADER,
    CLOSED_BEFORE_HEADER,
    HAPROXY_CHECKS,
    close_before_header,
    run_haproxy_checks,
    send_health_checks,
)
from tests.proxyproto.scheme_checks import (
    CLIENT,
    ssl_header,
    websocket_app,
    websocket_scheme,
)
from tests.proxyproto.server_checks import (
    TIMEOUT,
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

# -- the apps and the worker the processes run ------------------------------------


def describe(
    client: list[Any] | None, scheme: str, header: Any, peer: Any
) -> dict[str, Any]:
    ssl_info = header.ssl if header else None
    return {
        "client": client,
        "scheme": scheme,
        "peer": list(peer) if peer else None,
        "command": header.command.name if header else None,
        "version": header.version if header else None,
        "authority": header.authority if header else None,
        "unique_id": header.unique_id.hex() if header and header.unique_id else None,
        "cn": ssl_info.cn if ssl_info else None,
    }


def wsgi_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    seen = describe(
        [environ["REMOTE_ADDR"], int(environ["REMOTE_PORT"])],
        environ["wsgi.url_scheme"],
        environ.get("proxyproto.header"),
        environ.get("proxyproto.peer"),
    )
    body = json.dumps(seen).encode()
    start_response("200 OK", [("Content-Length", str(len(body)))])
    return [body]


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["type"] == "websocket":
        await websocket_app(scope, receive, send)
        return
    ext = scope.get("extensions", {}).get("proxyproto") or {}
    seen = describe(
        list(scope["client"]), scope["scheme"], ext.get("header"), ext.get("peer")
    )
    body = json.dumps(seen).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class LenientThreadWorker(ThreadWorker):
    """Other peers served directly; a short header timeout."""

    proxy_untrusted = Policy.SKIP
    proxy_header_timeout = 0.5


# -- the gunicorn processes ------------------------------------------------------

WORKERS = {
    "sync": ("proxyproto.gunicorn.SyncWorker", "wsgi_app"),
    "gthread": ("proxyproto.gunicorn.ThreadWorker", "wsgi_app"),
    "asgi": ("proxyproto.gunicorn.ASGIWorker", "asgi_app"),
    "lenient": ("tests.proxyproto.test_gunicorn.LenientThreadWorker", "wsgi_app"),
}


@dataclass(frozen=True)
class Gunicorn:
    worker: str
    port: int
    log: Path

    def offset(self) -> int:
        return self.log.stat().st_size

    def warnings_since(self, offset: int) -> list[str]:
        with self.log.open("rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
        return [line for line in lines if "[WARNING]" in line or "[ERROR]" in line]


@contextlib.contextmanager
def gunicorn(name: str, directory: Path, *options: str) -> Iterator[Gunicorn]:
    worker, app = WORKERS[name]
    port = free_port()
    log = directory / "gunicorn.log"
    args = [
        "-m",
        "gunicorn",
        "--worker-class",
        worker,
        "--workers",
        "1",
        "--bind",
        f"127.0.0.1:{port}",
        "--log-level",
        "info",
        "--graceful-timeout",
        "1",
        "--no-control-socket",
        *options,
        f"tests.proxyproto.test_gunicorn:{app}",
    ]
    with server_process(args, [port], log):
        wait_for_log(log, "Booting worker")
        yield Gunicorn(name, port, log)


@pytest.fixture(scope="module", params=["sync", "gthread", "asgi"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gunicorn]:
    with gunicorn(request.param, tmp_path_factory.mktemp(request.param)) as running:
        yield running


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module", params=["gthread", "asgi"])
def tls_server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tls_files: dict[str, Any],
) -> Iterator[Gunicorn]:
    tls = ["--certfile", str(tls_files["cert"]), "--keyfile", str(tls_files["key"])]
    directory = tmp_path_factory.mktemp(f"tls-{request.param}")
    with gunicorn(request.param, directory, *tls) as running:
        yield running


@pytest.fixture(scope="module")
def lenient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    directory = tmp_path_factory.mktemp("lenient")
    with gunicorn("lenient", directory, "--proxy-protocol", "v2") as running:
        yield running


def connect_from(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    try:
        sock.bind((host, 0))
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


# -- headers ----------------------------------------------------------------------


def test_v1_header_and_leftover_in_one_segment(server: Gunicorn) -> None:
    sock, source_port = connect(server.port)
    with sock:
        seen = Client(sock).request(first=V1_HEADER)
    assert seen["client"] == ["192.0.2.1", 1234]
    assert seen["scheme"] == "http"
    assert seen["peer"] == ["127.0.0.1", source_port]
    assert seen["version"] == 1


def test_v2_header_with_tlvs(server: Gunicorn) -> None:
    sock, source_port = connect(server.port)
    with sock:
        sock.sendall(v2_header())
        seen = Client(sock).request()
    assert seen["client"] == ["2001:db8::1", 5555]
    assert seen["authority"] == "example.com"
    assert seen["unique_id"] == "010203"
    assert seen["peer"] == ["127.0.0.1", source_port]


def test_header_byte_by_byte(server: Gunicorn) -> None:
    sock, _ = connect(server.port)
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in v2_header(("192.0.2.7", 7)):
            sock.sendall(bytes([byte]))
        seen = Client(sock).request()
    assert seen["client"] == ["192.0.2.7", 7]


def test_keep_alive_requests_share_the_header(server: Gunicorn) -> None:
    if server.worker == "sync":
        pytest.skip("the sync worker closes the connection after each request")
    sock, _ = connect(server.port)
    with sock:
        client = Client(sock)
        seen = [
            client.request(f"/{i}", first=V1_HEADER if i == 0 else b"")
            for i in range(3)
        ]
    assert {tuple(s["client"]) for s in seen} == {("192.0.2.1", 1234)}
    assert all(s["version"] == 1 for s in seen)


def test_local_header_uses_real_endpoints(server: Gunicorn) -> None:
    local = bytes.fromhex("0d0a0d0a000d0a515549540a") + b"\x20\x11\x00\x0c" + bytes(12)
    sock, source_port = connect(server.port)
    with sock:
        seen = Client(sock).request(first=local)
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["command"] == "LOCAL"


@pytest.mark.parametrize(
    ("client", "scheme"),
    [
        pytest.param(SSLClient.SSL, "https", id="tls"),
        pytest.param(SSLClient(0), "http", id="no-tls-flag"),
    ],
)
def test_scheme_from_ssl_tlv(server: Gunicorn, client: SSLClient, scheme: str) -> None:
    sock, _ = connect(server.port)
    with sock:
        seen = Client(sock).request(first=ssl_header(client))
    assert seen["scheme"] == scheme
    assert seen["client"] == list(CLIENT)


@pytest.mark.parametrize(
    ("client", "scheme"),
    [
        pytest.param(SSLClient.SSL, "wss", id="tls"),
        pytest.param(SSLClient(0), "ws", id="no-tls-flag"),
    ],
)
def test_websocket_scheme_from_ssl_tlv(
    server: Gunicorn, client: SSLClient, scheme: str
) -> None:
    if server.worker != "asgi":
        pytest.skip("WSGI has no WebSockets")
    sock, _ = connect(server.port)
    with sock:
        assert websocket_scheme(sock, first=ssl_header(client)) == scheme


def test_scheme_ignores_ssl_tlv_of_local_header(server: Gunicorn) -> None:
    sock, _ = connect(server.port)
    with sock:
        seen = Client(sock).request(first=ssl_header(SSLClient.SSL, local=True))
    assert seen["command"] == "LOCAL"
    assert seen["scheme"] == "http"


# -- refusals ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            b"GET / HTTP/1.1\r\nHost: test\r\n\r\n", "not a PROXY header", id="missing"
        ),
        pytest.param(b"PROXY TCP4 1.2.3.4 5.6.7.8 +80 443\r\n", "port", id="garbage"),
        pytest.param(b"\x16\x03\x01\x02\x00\x01", "not a PROXY header", id="tls"),
    ],
)
def test_bad_header_is_closed(server: Gunicorn, data: bytes, message: str) -> None:
    offset = server.offset()
    sock, source_port = connect(server.port)
    with sock:
        sock.sendall(data)
        assert_closed(sock)
    wait_for_log(server.log, f"closing connection from ('127.0.0.1', {source_port})")
    (line,) = server.warnings_since(offset)
    assert message in line


def test_untrusted_peer_is_refused(server: Gunicorn) -> None:
    offset = server.offset()
    with connect_from("127.0.0.2", server.port) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(V1_HEADER + b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        assert_closed(sock)
    wait_for_log(server.log, "(trust policy REJECT)")
    assert len(server.warnings_since(offset)) == 1


@pytest.mark.parametrize(("data", "level", "text"), CLOSED_BEFORE_HEADER)
def test_close_before_header_is_logged_once(
    server: Gunicorn, data: bytes, level: str, text: str
) -> None:
    # A TCP health check closes without a byte: one INFO line, no WARNING.
    # After part of a header the sender is broken: one WARNING.
    offset = server.offset()
    client_port = close_before_header(server.port, data)
    lines = wait_for_lines(server.log, offset, f", {client_port})")
    (line,) = [line for line in lines if f", {client_port})" in line]
    assert f"[{level}]" in line
    assert text in line
    if level == "INFO":
        assert not server.warnings_since(offset)


def test_health_checks_are_info_not_warnings(server: Gunicorn) -> None:
    offset = server.offset()
    send_health_checks(server.port)
    sock, _ = connect(server.port)
    with sock:
        seen = Client(sock).request(first=V1_HEADER)
    assert seen["client"] == ["192.0.2.1", 1234]
    wait_for_log(server.log, BEFORE_HEADER)
    assert not server.warnings_since(offset)


def test_untrusted_peer_skipped_is_served_directly(lenient: Gunicorn) -> None:
    with connect_from("127.0.0.2", lenient.port) as sock:
        seen = Client(sock).request()
        source_port = sock.getsockname()[1]
    assert seen["client"] == ["127.0.0.2", source_port]
    assert seen["command"] is None


def test_slow_header_times_out(lenient: Gunicorn) -> None:
    sock, source_port = connect(lenient.port)
    with sock:
        sock.sendall(v2_header()[:20])
        assert_closed(sock, within=5)
    text = wait_for_log(lenient.log, f"{source_port}): no complete PROXY header")
    assert "no complete PROXY header within 0.5 s" in text


def test_proxy_protocol_v2_narrows_the_versions(lenient: Gunicorn) -> None:
    sock, _ = connect(lenient.port)
    with sock:
        sock.sendall(V1_HEADER)
        assert_closed(sock)
    sock, _ = connect(lenient.port)
    with sock:
        seen = Client(sock).request(first=v2_header(("192.0.2.3", 3)))
    assert seen["version"] == 2


def test_a_second_header_is_not_read(lenient: Gunicorn) -> None:
    # gunicorn's own reader is off: a second v2 header after ours is a bad
    # request, not a second set of addresses.
    sock, _ = connect(lenient.port)
    with sock:
        sock.sendall(v2_header(("192.0.2.3", 3)) + v2_header(("203.0.113.9", 9)))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400")


# -- TLS after the header ------------------------------------------------------------


def test_tls_after_header(tls_server: Gunicorn, tls_files: dict[str, Any]) -> None:
    sock, source_port = connect(tls_server.port)
    with sock:
        tls = tls_connect(sock, v2_header(("192.0.2.9", 999)), tls_files["client"])
        seen = Client(tls).request()
    assert seen["client"] == ["192.0.2.9", 999]
    assert seen["scheme"] == "https"
    assert seen["peer"] == ["127.0.0.1", source_port]


def test_tls_without_header_is_refused(
    tls_server: Gunicorn, tls_files: dict[str, Any]
) -> None:
    offset = tls_server.offset()
    sock, _ = connect(tls_server.port)
    with sock, pytest.raises((ssl.SSLError, ConnectionError)):
        tls_files["client"].wrap_socket(sock, server_hostname="localhost")
    wait_for_log(tls_server.log, "not a PROXY header")
    assert len(tls_server.warnings_since(offset)) == 1


# -- behind real load balancers ------------------------------------------------------


@pytest.mark.peers
@pytest.mark.parametrize(
    ("option", "version"), [("send-proxy", 1), ("send-proxy-v2", 2)]
)
def test_haproxy_send_proxy(server: Gunicorn, option: str, version: int) -> None:
    front = free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
        f"backend be\n    server app 127.0.0.1:{server.port} {option}\n"
    )
    local_port = free_port()
    with haproxy(config, [front]):
        seen = curl_json(f"http://127.0.0.1:{front}/", "--local-port", str(local_port))
    assert seen["client"] == ["127.0.0.1", local_port]
    assert seen["version"] == version


@pytest.mark.peers
def test_haproxy_send_proxy_v2_ssl_cn(server: Gunicorn, tmp_path: Path) -> None:
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
        f"backend be\n    server app 127.0.0.1:{server.port} send-proxy-v2-ssl-cn\n"
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
@pytest.mark.parametrize("check", HAPROXY_CHECKS)
def test_haproxy_health_checks_are_not_warnings(server: Gunicorn, check: str) -> None:
    offset = server.offset()
    run_haproxy_checks(server.port, check)
    assert not server.warnings_since(offset)


@pytest.mark.peers
def test_haproxy_tls_passthrough(
    tls_server: Gunicorn, tls_files: dict[str, Any]
) -> None:
    front = free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
        f"backend be\n    server app 127.0.0.1:{tls_server.port} send-proxy-v2\n"
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
def test_tlsedge_in_front(
    server: Gunicorn, tls_files: dict[str, Any], tmp_path: Path
) -> None:
    local_port = free_port()
    with tlsedge_in_front(server.port, tls_files, tmp_path) as front:
        seen = curl_json(
            f"https://localhost:{front}/",
            "--cacert",
            str(tls_files["ca"]),
            "--local-port",
            str(local_port),
        )
    assert seen["client"] == ["127.0.0.1", local_port]
    assert seen["scheme"] == "https"
    assert seen["version"] == 2


def test_private_api() -> None:
    """Fails loudly if the gunicorn internals the workers use change."""
    spec = importlib.util.find_spec("gunicorn.workers.gasgi")
    assert spec is not None
    assert spec.origin is not None
    source = Path(spec.origin).read_text()
    assert "await self.loop.create_server(" in source
    assert "ssl=ssl_context," in source
    from gunicorn.workers import gthread, sync

    assert (
        "def handle(self, listener, client, addr):" in Path(sync.__file__).read_text()
    )
    assert "def handle(self, conn):" in Path(gthread.__file__).read_text()
