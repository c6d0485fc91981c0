"""proxyproto.hypercorn over real sockets (asyncio and trio workers)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

hypercorn = pytest.importorskip(
    "hypercorn",
    reason="hypercorn is not installed (pip install 'hypercorn>=0.17.3,<0.19')",
)

import trio  # noqa: E402
from hypercorn.config import Config  # noqa: E402

from proxyproto import (  # noqa: E402
    TLV,
    Policy,
    ProxyHeader,
    SSLClient,
    TLVType,
    TrustPolicy,
    encode_v2,
)
from proxyproto.hypercorn import serve  # noqa: E402
from tests.peers import free_port, haproxy, require  # noqa: E402
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
from tests.proxyproto.scheme_checks import (  # noqa: E402
    CLIENT,
    curl_through_haproxy_tls,
    ssl_header,
    websocket_app,
    websocket_scheme,
)

TIMEOUT = 10.0
LOGGER_NAME = "proxyproto.hypercorn"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Echo what the app learned about the connection as JSON."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["type"] == "websocket":
        await websocket_app(scope, receive, send)
        return
    if scope["type"] != "http":
        return
    ext = scope.get("extensions", {}).get("proxyproto")
    header = ext["header"] if ext else None
    body = json.dumps(
        {
            "client": list(scope["client"]) if scope["client"] else None,
            "server": list(scope["server"]) if scope["server"] else None,
            "scheme": scope["scheme"],
            "has_extension": ext is not None,
            "peer": list(ext["peer"]) if ext and ext["peer"] else None,
            "command": header.command.name if header else None,
            "version": header.version if header else None,
            "authority": header.authority if header else None,
            "unique_id": header.unique_id.hex()
            if header and header.unique_id
            else None,
            "state_keys": sorted(scope.get("state", {})),
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


cli_app = app


@pytest.fixture(params=["asyncio", "trio"])
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.contextmanager
def running(
    flavour: str,
    *,
    certfile: Path | None = None,
    keyfile: Path | None = None,
    before_start: Callable[[int], None] | None = None,
    **kwargs: Any,
) -> Iterator[int]:
    """Run proxyproto.hypercorn.serve in a thread under *flavour*; yield the port.

    *before_start(port)* runs once the port listens, before the server
    accepts (connections it makes wait in the accept queue).
    """
    # Listening before the server starts: no start-up race, no probe
    # connection (which would be logged as a missing header).
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    if before_start is not None:
        before_start(port)
    config = Config()
    config.bind = [f"fd://{listener.detach()}"]  # hypercorn owns it now
    config.graceful_timeout = 2
    config.accesslog = None
    if certfile is not None:
        config.certfile, config.keyfile = str(certfile), str(keyfile)
    stop: Callable[[], None]
    errors: list[BaseException] = []
    ready = threading.Event()

    if flavour == "asyncio":
        loop = asyncio.new_event_loop()
        event = asyncio.Event()

        async def main_asyncio() -> None:
            ready.set()
            await serve(app, config, shutdown_trigger=event.wait, **kwargs)

        def target() -> None:
            try:
                loop.run_until_complete(main_asyncio())
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            finally:
                loop.close()

        def stop() -> None:
            loop.call_soon_threadsafe(event.set)

    else:
        token: list[trio.lowlevel.TrioToken] = []
        trio_event = trio.Event()

        async def main_trio() -> None:
            token.append(trio.lowlevel.current_trio_token())
            ready.set()
            await serve(app, config, shutdown_trigger=trio_event.wait, **kwargs)

        def target() -> None:
            try:
                trio.run(main_trio)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        def stop() -> None:
            trio.from_thread.run_sync(trio_event.set, trio_token=token[0])

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert ready.wait(TIMEOUT)
    try:
        yield port
    finally:
        if thread.is_alive():
            stop()
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "hypercorn did not shut down"
    assert not errors, errors


def connect(port: int) -> tuple[socket.socket, int]:
    """A connection from 127.0.0.1 with a pinned source port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.settimeout(TIMEOUT)
    try:
        source_port = free_port()
        sock.bind(("127.0.0.1", source_port))
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock, source_port


class Client:
    """Minimal HTTP/1.1 over a (possibly TLS) socket."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buffer = b""

    def request(self, path: str = "/", first: bytes = b"") -> dict[str, Any]:
        self.sock.sendall(first + f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
        return self.response()

    def response(self) -> dict[str, Any]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        result: dict[str, Any] = json.loads(body)
        return result

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buffer += data


def assert_closed(sock: socket.socket, within: float = TIMEOUT) -> None:
    """The server closes without sending anything."""
    sock.settimeout(within)
    try:
        data = sock.recv(65536)
    except ConnectionResetError:
        data = b""
    assert data == b""


def v2_header(
    source: tuple[str, int] = ("2001:db8::1", 5555),
    destination: tuple[str, int] | None = None,
) -> bytes:
    if destination is None:
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


V1_HEADER = b"PROXY TCP4 192.0.2.1 198.51.100.2 1234 443\r\n"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    tmp = tmp_path_factory.mktemp("tls")
    certfile, keyfile, cafile = tmp / "cert.pem", tmp / "key.pem", tmp / "ca.pem"
    cert.private_key_pem.write_to_path(str(keyfile))
    certfile.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    ca.cert_pem.write_to_path(str(cafile))
    client = ssl.create_default_context(cafile=str(cafile))
    return {"cert": certfile, "key": keyfile, "ca": cafile, "client": client}


def tls_connect(
    sock: socket.socket, header: bytes, context: ssl.SSLContext
) -> _BIOSocket:
    """Send *header* and the ClientHello in one segment, then finish the
    handshake: the server must hand the bytes after the header to TLS."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    sock.sendall(header + outgoing.read())
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            pending = outgoing.read()
            if pending:
                sock.sendall(pending)
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed during the handshake") from None
            incoming.write(data)
    pending = outgoing.read()
    if pending:
        sock.sendall(pending)
    return _BIOSocket(sock, obj, incoming, outgoing)


class _BIOSocket:
    """sendall/recv over an SSLObject (what Client needs)."""

    def __init__(
        self,
        sock: socket.socket,
        obj: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
    ) -> None:
        self.sock, self.obj, self.incoming, self.outgoing = (
            sock,
            obj,
            incoming,
            outgoing,
        )

    def sendall(self, data: bytes) -> None:
        self.obj.write(data)
        self.sock.sendall(self.outgoing.read())

    def recv(self, size: int) -> bytes:
        while True:
            try:
                return self.obj.read(size)
            except ssl.SSLWantReadError:
                data = self.sock.recv(65536)
                if not data:
                    return b""
                self.incoming.write(data)
            finally:
                pending = self.outgoing.read()
                if pending:
                    self.sock.sendall(pending)


# -- tests --------------------------------------------------------------------


def test_v1_header_and_leftover_in_one_segment(flavour: str) -> None:
    with running(flavour) as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request(first=V1_HEADER)
    assert seen["client"] == ["192.0.2.1", 1234]
    assert seen["server"] == ["198.51.100.2", 443]
    assert seen["scheme"] == "http"
    assert seen["peer"] == ["127.0.0.1", source_port]
    assert seen["version"] == 1


def test_v2_header_with_tlvs(flavour: str) -> None:
    with running(flavour) as port:
        sock, source_port = connect(port)
        with sock:
            sock.sendall(v2_header())
            seen = Client(sock).request()
    assert seen["client"] == ["2001:db8::1", 5555]
    assert seen["server"] == ["2001:db8::2", 443]
    assert seen["authority"] == "example.com"
    assert seen["unique_id"] == "010203"
    assert seen["peer"] == ["127.0.0.1", source_port]


def test_keep_alive_requests_share_the_header(flavour: str) -> None:
    with running(flavour) as port:
        sock, _ = connect(port)
        with sock:
            client = Client(sock)
            seen = [
                client.request(f"/{i}", first=V1_HEADER if i == 0 else b"")
                for i in range(4)
            ]
    assert {tuple(s["client"]) for s in seen} == {("192.0.2.1", 1234)}
    assert all(s["has_extension"] for s in seen)


def test_tls_after_header(flavour: str, tls_files: dict[str, Any]) -> None:
    with running(flavour, certfile=tls_files["cert"], keyfile=tls_files["key"]) as port:
        sock, source_port = connect(port)
        with sock:
            tls = tls_connect(sock, v2_header(("192.0.2.9", 999)), tls_files["client"])
            client = Client(tls)
            seen = [client.request(), client.request()]
    for s in seen:
        assert s["client"] == ["192.0.2.9", 999]
        assert s["scheme"] == "https"
        assert s["peer"] == ["127.0.0.1", source_port]
        assert s["authority"] == "example.com"


def test_local_header_uses_real_endpoints(flavour: str) -> None:
    local = bytes.fromhex("0d0a0d0a000d0a515549540a") + b"\x20\x11\x00\x0c" + bytes(12)
    with running(flavour) as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request(first=local)
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["server"] == ["127.0.0.1", port]
    assert seen["command"] == "LOCAL"


def test_untrusted_peer_is_refused(
    flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER_NAME)
    with running(flavour, trusted=["192.0.2.0/24"]) as port:
        sock, _ = connect(port)
        with sock:
            with contextlib.suppress(OSError):
                sock.sendall(V1_HEADER + b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
            assert_closed(sock)
    assert "REJECT" in caplog.text


def test_untrusted_peer_skipped_is_served_directly(flavour: str) -> None:
    with running(flavour, trusted=["192.0.2.0/24"], untrusted=Policy.SKIP) as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request()
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["command"] is None


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n", id="missing"),
        pytest.param(b"PROXY TCP4 1.2.3.4 5.6.7.8 +80 443\r\nGET /", id="garbage"),
    ],
)
def test_bad_header_is_closed(
    flavour: str, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER_NAME)
    with running(flavour) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(data)
            assert_closed(sock)
    assert "closing connection from ('127.0.0.1'" in caplog.text


def test_slow_header_times_out(flavour: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER_NAME)
    with running(flavour, header_timeout=0.3) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER[:10])
            start = time.monotonic()
            assert_closed(sock, within=5)
            assert time.monotonic() - start < 3
    assert "0.3 s" in caplog.text


@pytest.mark.parametrize(("data", "level", "text"), CLOSED_BEFORE_HEADER)
def test_close_before_header_is_logged_once(
    flavour: str, data: bytes, level: str, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A TCP health check closes without a byte: one INFO line, no WARNING.
    # After part of a header the sender is broken: one WARNING.
    caplog.set_level(logging.INFO)
    with running(flavour) as port:
        client_port = close_before_header(port, data)
    assert_logged_once(caplog, client_port, LOGGER_NAME, level, text)


def test_health_checks_are_not_warnings(
    flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A LOCAL header then a reset, a bare reset (both before the server
    # accepts: the peer is gone when it asks for the address), and the same
    # plus LOCAL then a close once it runs: no header is bad here.
    caplog.set_level(logging.INFO)
    with running(flavour, before_start=queue_health_checks) as port:
        send_health_checks(port)
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=V1_HEADER)
    assert seen["client"] == ["192.0.2.1", 1234]
    assert_no_warnings(caplog)
    gone = [r for r in caplog.records if BEFORE_HEADER in r.getMessage()]
    assert len(gone) >= 2
    assert {(r.name, r.levelname) for r in gone} == {(LOGGER_NAME, "INFO")}


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
    flavour: str, client: SSLClient, http: str, websocket: str
) -> None:
    # The load balancer terminated TLS and says so in the SSL TLV: the app
    # builds its URLs with the scheme the client used.
    with running(flavour) as port:
        sock, _ = connect(port)
        with sock:
            client_ = Client(sock)
            seen = [client_.request(first=ssl_header(client)), client_.request()]
        sock, _ = connect(port)
        with sock:
            assert websocket_scheme(sock, first=ssl_header(client)) == websocket
    assert [s["scheme"] for s in seen] == [http, http]
    assert seen[0]["client"] == list(CLIENT)


def test_scheme_ignores_ssl_tlv_of_local_header(flavour: str) -> None:
    # LOCAL: a health check, no client; its TLVs say nothing about one.
    with running(flavour) as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=ssl_header(SSLClient.SSL, local=True))
    assert seen["command"] == "LOCAL"
    assert seen["scheme"] == "http"


def test_scheme_ignores_ssl_tlv_under_ignore_policy(flavour: str) -> None:
    # IGNORE: the header is read but does not describe the connection.
    trust = TrustPolicy.everyone(Policy.IGNORE)
    with running(flavour, trusted=trust) as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=ssl_header(SSLClient.SSL))
    assert seen["client"][0] == "127.0.0.1"
    assert seen["scheme"] == "http"


def test_private_api() -> None:
    """Fails loudly if the Hypercorn internals proxyproto.hypercorn uses change."""
    from proxyproto.hypercorn import _hypercorn_internals

    lifespan, tcp_server, worker_context = _hypercorn_internals("asyncio")
    assert len(inspect.signature(lifespan).parameters) == 4
    assert list(inspect.signature(tcp_server).parameters) == [
        "app",
        "loop",
        "config",
        "context",
        "state",
        "reader",
        "writer",
    ]
    assert "max_requests" in inspect.signature(worker_context).parameters
    lifespan, tcp_server, worker_context = _hypercorn_internals("trio")
    assert len(inspect.signature(lifespan).parameters) == 3
    assert list(inspect.signature(tcp_server).parameters) == [
        "app",
        "config",
        "context",
        "state",
        "stream",
    ]
    # The trio TCPServer finds addresses via stream.socket / transport_stream.socket.
    source = inspect.getsource(tcp_server.run)
    assert "self.stream.socket" in source
    assert "transport_stream.socket" in source
    asyncio_source = inspect.getsource(_hypercorn_internals("asyncio")[1].run)
    assert 'get_extra_info("socket")' in asyncio_source
    main = importlib.import_module("hypercorn.__main__")
    assert "return run(config)" in inspect.getsource(main.main)


# -- real peers ---------------------------------------------------------------


@pytest.mark.peers
def test_haproxy_send_proxy_v2_and_curl(flavour: str) -> None:
    curl = require("curl")
    with running(flavour) as port:
        front = free_port()
        config = (
            f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
            f"backend be\n    server app 127.0.0.1:{port} send-proxy-v2\n"
        )
        with haproxy(config, [front]):
            local_port = free_port()
            out = subprocess.run(
                [
                    curl,
                    "-sS",
                    "--max-time",
                    "10",
                    "--local-port",
                    str(local_port),
                    f"http://127.0.0.1:{front}/",
                ],
                capture_output=True,
                check=True,
                timeout=30,
            )
    seen = json.loads(out.stdout)
    assert seen["client"] == ["127.0.0.1", local_port]
    assert seen["version"] == 2


@pytest.mark.peers
def test_haproxy_tls_passthrough_and_curl(
    flavour: str, tls_files: dict[str, Any]
) -> None:
    curl = require("curl")
    with running(flavour, certfile=tls_files["cert"], keyfile=tls_files["key"]) as port:
        front = free_port()
        config = (
            f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
            f"backend be\n    server app 127.0.0.1:{port} send-proxy-v2\n"
        )
        with haproxy(config, [front]):
            local_port = free_port()
            out = subprocess.run(
                [
                    curl,
                    "-sS",
                    "--max-time",
                    "10",
                    "--cacert",
                    str(tls_files["ca"]),
                    "--local-port",
                    str(local_port),
                    f"https://localhost:{front}/",
                ],
                capture_output=True,
                check=True,
                timeout=30,
            )
    seen = json.loads(out.stdout)
    assert seen["client"] == ["127.0.0.1", local_port]
    assert seen["scheme"] == "https"


@pytest.mark.peers
@pytest.mark.parametrize("check", HAPROXY_CHECKS)
def test_haproxy_health_checks_are_not_warnings(
    flavour: str, check: str, caplog: pytest.LogCaptureFixture
) -> None:
    # HAProxy sends a LOCAL header on the checks of a send-proxy-v2 server;
    # its plain check then resets the connection at once.
    caplog.set_level(logging.INFO)
    with running(flavour) as port:
        run_haproxy_checks(port, check)
    assert_no_warnings(caplog)


@pytest.mark.peers
def test_haproxy_terminates_tls_send_proxy_v2_ssl(
    flavour: str, tls_files: dict[str, Any], tmp_path: Path
) -> None:
    # HAProxy terminates TLS and sends plain HTTP with a v2 header whose SSL
    # TLV says the client used TLS: the app sees https.
    with running(flavour) as port:
        seen, front = curl_through_haproxy_tls(port, tls_files, tmp_path)
    assert seen["scheme"] == "https"
    assert seen["server"] == ["127.0.0.1", front]


# -- command line -------------------------------------------------------------


def test_cli_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "proxyproto.hypercorn", "--help"],
        capture_output=True,
        check=True,
        timeout=60,
        text=True,
    )
    assert "--proxy-trusted" in out.stdout
    assert "--certfile" in out.stdout


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_cli_serves(worker: str) -> None:
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxyproto.hypercorn",
            "tests.proxyproto.test_hypercorn:cli_app",
            "--bind",
            f"127.0.0.1:{port}",
            "--worker-class",
            worker,
            "--proxy-trusted",
            "127.0.0.0/8",
            "--proxy-timeout",
            "3",
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        deadline = time.monotonic() + 30
        connection: socket.socket | None = None
        while connection is None:
            assert process.poll() is None, (
                process.stdout.read() if process.stdout else ""
            )
            assert time.monotonic() < deadline, "the CLI server did not start"
            try:
                connection, _ = connect(port)
            except OSError:
                time.sleep(0.1)
        with connection as sock:
            seen = Client(sock).request(first=V1_HEADER)
        assert seen["client"] == ["192.0.2.1", 1234]
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
