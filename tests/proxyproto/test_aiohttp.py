"""proxyproto.aiohttp over real sockets: raw headers, TLS, HAProxy, tlsedge, curl."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
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

aiohttp = pytest.importorskip(
    "aiohttp", reason="aiohttp is not installed (pip install 'tlsedge[aiohttp]')"
)

from aiohttp import web  # noqa: E402

from proxyproto import (  # noqa: E402
    TLV,
    Policy,
    ProxyHeader,
    SSLClient,
    TLVType,
    TrustPolicy,
    encode_v2,
)
from proxyproto.aiohttp import (  # noqa: E402
    ProxySockSite,
    ProxyTCPSite,
    proxy_connection,
)
from tests.peers import free_port  # noqa: E402
from tests.proxyproto.backend_checks import (  # noqa: E402
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
from tests.proxyproto.lb_checks import (  # noqa: E402
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
from tests.proxyproto.scheme_checks import CLIENT, ssl_header  # noqa: E402

LOGGER_NAME = "proxyproto.aiohttp"
STATIC = bytes(range(256)) * 4096  # 1 MiB: more than one write buffer


async def describe(request: web.Request) -> web.Response:
    """Answer what the handler learned about the connection, as JSON."""
    connection = proxy_connection(request)
    header = connection.header if connection else None
    ssl_info = header.ssl if header else None
    return web.json_response(
        {
            "remote": request.remote,
            "scheme": request.scheme,
            "secure": request.secure,
            "url": str(request.url),
            "has_connection": connection is not None,
            "policy": connection.policy.name if connection else None,
            "peer": list(connection.peer_address[:2])
            if connection and isinstance(connection.peer_address, tuple)
            else None,
            "client": list(connection.client_address)
            if connection and isinstance(connection.client_address, tuple)
            else None,
            "server": list(connection.server_address[:2])
            if connection and isinstance(connection.server_address, tuple)
            else None,
            "command": header.command.name if header else None,
            "version": header.version if header else None,
            "authority": header.authority if header else None,
            "unique_id": header.unique_id.hex()
            if header and header.unique_id
            else None,
            "ssl_cn": ssl_info.cn if ssl_info else None,
            "extra_header": request.get_extra_info("proxyproto.header") is header,
        }
    )


def make_app(static: Path | None = None) -> web.Application:
    app = web.Application()
    app.router.add_get("/", describe)
    if static is not None:
        app.router.add_static("/static", static)
    return app


@contextlib.contextmanager
def running(
    before_start: Callable[[int], None] | None = None,
    static: Path | None = None,
    **site_options: Any,
) -> Iterator[int]:
    """Serve the app from a thread's event loop; yield the port.

    Without *before_start*: a ``ProxyTCPSite`` on port 0. With it: a
    ``ProxySockSite`` on a socket that already listens, and
    *before_start(port)* runs before the server accepts.
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(make_app(static), access_log=None)
    sock = None
    site: ProxyTCPSite | ProxySockSite
    if before_start is not None:
        sock = socket.create_server(("127.0.0.1", 0))
        before_start(sock.getsockname()[1])

    async def start() -> int:
        nonlocal site
        await runner.setup()
        if sock is None:
            site = ProxyTCPSite(runner, "127.0.0.1", 0, **site_options)
            await site.start()
            return site.port
        site = ProxySockSite(runner, sock, **site_options)
        await site.start()
        return int(sock.getsockname()[1])

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(TIMEOUT)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(TIMEOUT)
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


# -- the header and the request -----------------------------------------------


def test_v1_header_and_request_in_one_segment() -> None:
    with running() as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request(first=V1_HEADER)
    assert seen["remote"] == "192.0.2.1"
    assert seen["client"] == ["192.0.2.1", 1234]
    assert seen["server"] == ["198.51.100.2", 443]
    assert seen["scheme"] == "http"
    assert not seen["secure"]
    assert seen["url"] == "http://test/"
    assert seen["peer"] == ["127.0.0.1", source_port]
    assert seen["policy"] == "REQUIRE"
    assert seen["version"] == 1
    assert seen["extra_header"]


def test_v2_header_with_tlvs() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(v2_header())
            seen = Client(sock).request()
    assert seen["remote"] == "2001:db8::1"
    assert seen["server"] == ["2001:db8::2", 443]
    assert seen["authority"] == "example.com"
    assert seen["unique_id"] == "010203"


def test_header_byte_by_byte() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            for byte in v2_header(("192.0.2.7", 7)):
                sock.sendall(bytes([byte]))
            seen = Client(sock).request()
    assert seen["remote"] == "192.0.2.7"


def test_keep_alive_and_pipelined_requests_share_the_header() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER + REQUEST * 3)
            client = Client(sock)
            seen = [client.request() for _ in range(3)]
            seen += [client.request("/again")]
    assert [s["remote"] for s in seen] == ["192.0.2.1"] * 4


def test_static_file_after_the_header(tmp_path: Path) -> None:
    # web.FileResponse sends with loop.sendfile() on the connection's
    # transport: the body must arrive whole.
    (tmp_path / "file.bin").write_bytes(STATIC)
    with running(static=tmp_path) as port:
        sock, _ = connect(port)
        with sock:
            client = Client(sock)
            assert client.get("/static/file.bin", first=V1_HEADER) == STATIC
            assert client.request()["remote"] == "192.0.2.1"


def test_local_header_uses_real_endpoints() -> None:
    # AWS NLB health check: LOCAL with dummy addresses in the length.
    local = bytes.fromhex("0d0a0d0a000d0a515549540a") + b"\x20\x11\x00\x0c" + bytes(12)
    with running() as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request(first=local)
    assert seen["remote"] == "127.0.0.1"
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["command"] == "LOCAL"


def test_only_v2_accepted() -> None:
    with running(reader_options={"versions": {2}}) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER + REQUEST)
            assert_closed(sock)


def test_unix_socket_site(tmp_path: Path) -> None:
    # HAProxy "server app unix@/path send-proxy-v2": a UNIX peer has no
    # address, so the policy is the default (everyone must send a header).
    path = str(tmp_path / "app.sock")

    async def main() -> tuple[bytes, bytes]:
        runner = web.AppRunner(make_app(), access_log=None)
        await runner.setup()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        site = ProxySockSite(runner, listener, trusted=TrustPolicy.everyone())
        await site.start()
        try:
            answers = []
            for first in (V1_HEADER, b""):
                reader, writer = await asyncio.open_unix_connection(path)
                writer.write(first + b"GET / HTTP/1.0\r\n\r\n")
                answers.append(await asyncio.wait_for(reader.read(), TIMEOUT))
                writer.close()
                await writer.wait_closed()
            return answers[0], answers[1]
        finally:
            await runner.cleanup()

    with_header, without = asyncio.run(main())
    assert b'"remote": "192.0.2.1"' in with_header
    assert without == b""


# -- the scheme -----------------------------------------------------------------


def test_tls_after_header(tls_files: dict[str, Any]) -> None:
    with running(ssl_context=tls_files["server_context"]) as port:
        sock, source_port = connect(port)
        with sock:
            tls = tls_connect(sock, v2_header(("192.0.2.9", 999)), tls_files["client"])
            client = Client(tls)
            seen = [client.request(), client.request()]
    for s in seen:
        assert s["remote"] == "192.0.2.9"
        assert s["scheme"] == "https"
        assert s["secure"]
        assert s["peer"] == ["127.0.0.1", source_port]
        assert s["authority"] == "example.com"


def test_static_file_over_tls_after_header(
    tls_files: dict[str, Any], tmp_path: Path
) -> None:
    (tmp_path / "file.bin").write_bytes(STATIC)
    with running(static=tmp_path, ssl_context=tls_files["server_context"]) as port:
        sock, _ = connect(port)
        with sock:
            tls = tls_connect(sock, V1_HEADER, tls_files["client"])
            assert Client(tls).get("/static/file.bin") == STATIC


def test_tls_without_tls_is_closed(tls_files: dict[str, Any]) -> None:
    with running(ssl_context=tls_files["server_context"]) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER + REQUEST)
            assert_closed(sock)


@pytest.mark.parametrize(
    ("client", "scheme"),
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
def test_scheme_from_ssl_tlv(client: SSLClient, scheme: str) -> None:
    # The load balancer terminated TLS and says so in the SSL TLV: the
    # URLs the app builds use the scheme the client used.
    with running() as port:
        sock, _ = connect(port)
        with sock:
            http = Client(sock)
            seen = [http.request(first=ssl_header(client)), http.request()]
    assert [s["scheme"] for s in seen] == [scheme, scheme]
    assert [s["secure"] for s in seen] == [scheme == "https"] * 2
    assert seen[0]["url"] == f"{scheme}://test/"
    assert seen[0]["remote"] == CLIENT[0]


def test_scheme_ignores_ssl_tlv_of_local_header() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=ssl_header(SSLClient.SSL, local=True))
    assert seen["command"] == "LOCAL"
    assert seen["scheme"] == "http"


def test_scheme_ignores_ssl_tlv_under_ignore_policy() -> None:
    with running(trusted=TrustPolicy.everyone(Policy.IGNORE)) as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=ssl_header(SSLClient.SSL))
    assert seen["remote"] == "127.0.0.1"
    assert seen["policy"] == "IGNORE"
    assert seen["scheme"] == "http"


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
    assert seen["remote"] == "127.0.0.1"
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


def test_health_checks_are_not_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with running(before_start=queue_health_checks) as port:
        send_health_checks(port)
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=V1_HEADER)
    assert seen["remote"] == "192.0.2.1"
    assert_no_warnings(caplog)
    gone = [r for r in caplog.records if BEFORE_HEADER in r.getMessage()]
    assert len(gone) >= 2
    assert {(r.name, r.levelname) for r in gone} == {(LOGGER_NAME, "INFO")}


def test_plain_site_on_the_same_runner_is_untouched() -> None:
    # The request factory the proxy site wraps is the runner's: requests on
    # an ordinary TCPSite keep aiohttp's own scheme and address.
    async def main() -> bytes:
        runner = web.AppRunner(make_app(), access_log=None)
        await runner.setup()
        await ProxyTCPSite(runner, "127.0.0.1", 0).start()
        plain = web.TCPSite(runner, "127.0.0.1", 0)
        await plain.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", plain.port)
            writer.write(b"GET / HTTP/1.0\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), TIMEOUT)
            writer.close()
            await writer.wait_closed()
            return answer
        finally:
            await runner.cleanup()

    answer = asyncio.run(main())
    assert b'"remote": "127.0.0.1"' in answer
    assert b'"has_connection": false' in answer


def test_private_api() -> None:
    """Fails loudly if the aiohttp internals proxyproto.aiohttp relies on change:
    each request handler reads the server's request_factory when it is made,
    and the site base class closes ``_server`` on stop."""
    handler_init = inspect.getsource(aiohttp.web_protocol.RequestHandler.__init__)
    assert "manager.request_factory" in handler_init
    assert "self._server.close()" in inspect.getsource(web.BaseSite.stop)
    assert "ssl_context" in inspect.getsource(aiohttp.web_protocol.RequestHandler)


# -- run_app and the example ----------------------------------------------------


def test_example_run_app_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "examples/aiohttp_backend.py",
            str(port),
            "127.0.0.1/32",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert f"http://127.0.0.1:{port}" in line.decode(), line
        sock, _ = connect(port)
        with sock:
            answer = Client(sock).get(first=V1_HEADER)
        assert b"client:  192.0.2.1" in answer
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT) == 0
        assert b"cleaned up" in process.stdout.read()
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
    assert seen["remote"] == client[0]
    assert seen["client"] == list(client)
    assert seen["server"] == ["127.0.0.1", front]
    assert seen["version"] == (1 if option == "send-proxy" else 2)
    assert seen["scheme"] == "http"


@pytest.mark.peers
def test_haproxy_tls_passthrough_and_curl(tls_files: dict[str, Any]) -> None:
    # HAProxy relays the TLS bytes with a v2 header; aiohttp terminates TLS.
    with (
        running(ssl_context=tls_files["server_context"]) as port,
        haproxy_in_front(port, "send-proxy-v2") as front,
    ):
        seen, client = curl(
            f"https://localhost:{front}/", "--cacert", str(tls_files["ca"])
        )
    assert seen["client"] == list(client)
    assert seen["scheme"] == "https"
    assert seen["url"] == f"https://localhost:{front}/"


@pytest.mark.peers
def test_haproxy_terminates_tls_send_proxy_v2_ssl_cn(
    tls_files: dict[str, Any], tmp_path: Path
) -> None:
    # HAProxy terminates TLS (with a client certificate) and sends plain HTTP
    # behind a v2 header whose SSL TLV says so: https, and the CN.
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
    assert seen["scheme"] == "https"
    assert seen["secure"]
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
    # tlsedge terminates TLS and relays with send_proxy = "v2": the client's
    # address, https from the SSL TLV, and the SNI in the authority TLV.
    with running() as port, tlsedge_in_front(port, tls_files, tmp_path) as front:
        seen, client = curl(
            f"https://localhost:{front}/", "--cacert", str(tls_files["ca"])
        )
    assert seen["client"] == list(client)
    assert seen["server"] == ["127.0.0.1", front]
    assert seen["scheme"] == "https"
    assert seen["url"] == f"https://localhost:{front}/"
    assert seen["authority"] == "localhost"
