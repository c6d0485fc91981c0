"""proxyproto.uvicorn over real sockets: raw PROXY headers, TLS, HAProxy + curl."""

from __future__ import annotations

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

uvicorn = pytest.importorskip(
    "uvicorn", reason="uvicorn is not installed (pip install 'uvicorn>=0.54,<0.55')"
)

from proxyproto import (  # noqa: E402
    TLV,
    Policy,
    ProxyHeader,
    SSLClient,
    TLVType,
    TrustPolicy,
    encode_v1,
    encode_v2,
)
from proxyproto.uvicorn import ProxyConfig  # noqa: E402
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


# -- server and clients -------------------------------------------------------


@contextlib.contextmanager
def running(
    before_start: Callable[[int], None] | None = None, **kwargs: Any
) -> Iterator[int]:
    """Run a ProxyConfig uvicorn server in a thread; yield its port.

    With *before_start(port)*, the server gets a socket that already listens,
    and *before_start* runs before the server accepts.
    """
    kwargs.setdefault("lifespan", "off")
    config = ProxyConfig(
        app,
        host="127.0.0.1",
        port=0,
        log_config=None,
        timeout_graceful_shutdown=2,
        **kwargs,
    )
    server = uvicorn.Server(config)
    sockets = None
    if before_start is not None:
        listener = socket.create_server(("127.0.0.1", 0))
        sockets = [listener]
        before_start(listener.getsockname()[1])
    thread = threading.Thread(target=server.run, args=(sockets,), daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during startup"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "uvicorn did not shut down"
        for sock in sockets or ():
            sock.close()


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


def test_v1_header_and_leftover_in_one_segment() -> None:
    with running() as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request(first=V1_HEADER)
    assert seen["client"] == ["192.0.2.1", 1234]
    assert seen["server"] == ["198.51.100.2", 443]
    assert seen["scheme"] == "http"
    assert seen["peer"] == ["127.0.0.1", source_port]
    assert seen["version"] == 1
    assert seen["state_keys"] == []  # the private state key never shows


def test_v2_header_with_tlvs() -> None:
    with running() as port:
        sock, source_port = connect(port)
        with sock:
            sock.sendall(v2_header())
            seen = Client(sock).request()
    assert seen["client"] == ["2001:db8::1", 5555]
    assert seen["server"] == ["2001:db8::2", 443]
    assert seen["authority"] == "example.com"
    assert seen["unique_id"] == "010203"
    assert seen["peer"] == ["127.0.0.1", source_port]


def test_header_byte_by_byte() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            for byte in v2_header(("192.0.2.7", 7)):
                sock.sendall(bytes([byte]))
            seen = Client(sock).request()
    assert seen["client"] == ["192.0.2.7", 7]


def test_keep_alive_requests_share_the_header() -> None:
    # gunicorn#899: the header belongs to the connection, not the first request.
    with running() as port:
        sock, _ = connect(port)
        with sock:
            client = Client(sock)
            seen = [
                client.request(f"/{i}", first=V1_HEADER if i == 0 else b"")
                for i in range(4)
            ]
    assert {tuple(s["client"]) for s in seen} == {("192.0.2.1", 1234)}
    assert all(s["has_extension"] for s in seen)


def test_pipelined_requests_after_header() -> None:
    with running() as port:
        sock, _ = connect(port)
        with sock:
            request = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"
            sock.sendall(V1_HEADER + request * 3)
            client = Client(sock)
            seen = [client.response() for _ in range(3)]
    assert all(s["client"] == ["192.0.2.1", 1234] for s in seen)


def test_tls_after_header(tls_files: dict[str, Any]) -> None:
    with running(
        ssl_certfile=str(tls_files["cert"]), ssl_keyfile=str(tls_files["key"])
    ) as port:
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


def test_tls_with_stdlib_client(tls_files: dict[str, Any]) -> None:
    with running(
        ssl_certfile=str(tls_files["cert"]), ssl_keyfile=str(tls_files["key"])
    ) as port:
        sock, _ = connect(port)
        sock.sendall(V1_HEADER)
        with tls_files["client"].wrap_socket(sock, server_hostname="localhost") as tls:
            seen = Client(tls).request()
    assert seen["client"] == ["192.0.2.1", 1234]
    assert seen["scheme"] == "https"


def test_tls_bad_handshake_is_closed(tls_files: dict[str, Any]) -> None:
    with running(
        ssl_certfile=str(tls_files["cert"]), ssl_keyfile=str(tls_files["key"])
    ) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER + b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
            assert_closed(sock)


def test_local_header_uses_real_endpoints() -> None:
    # AWS NLB health check: LOCAL with dummy addresses in the length.
    local = bytes.fromhex("0d0a0d0a000d0a515549540a") + b"\x20\x11\x00\x0c" + bytes(12)
    with running() as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request(first=local)
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["server"] == ["127.0.0.1", port]
    assert seen["command"] == "LOCAL"


def test_untrusted_peer_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "proxyproto.uvicorn")
    with running(trusted=["192.0.2.0/24"]) as port:
        sock, _ = connect(port)
        with sock:
            with contextlib.suppress(OSError):
                sock.sendall(V1_HEADER + b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
            assert_closed(sock)
    assert "trust policy REJECT" in caplog.text


def test_untrusted_peer_skipped_is_served_directly() -> None:
    with running(trusted=["192.0.2.0/24"], untrusted=Policy.SKIP) as port:
        sock, source_port = connect(port)
        with sock:
            seen = Client(sock).request()
    assert seen["client"] == ["127.0.0.1", source_port]
    assert seen["has_extension"]
    assert seen["command"] is None


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n", id="missing"),
        pytest.param(b"PROXY TCP4 1.2.3.4 5.6.7.8 +80 443\r\nGET /", id="garbage"),
        pytest.param(b"\x16\x03\x01\x02\x00\x01", id="tls-without-header"),
    ],
)
def test_bad_header_is_closed(data: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "proxyproto.uvicorn")
    with running() as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(data)
            assert_closed(sock)
    assert "closing connection from ('127.0.0.1'" in caplog.text


def test_slow_header_times_out(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "proxyproto.uvicorn")
    with running(header_timeout=0.3) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER[:10])
            start = time.monotonic()
            assert_closed(sock, within=5)
            assert time.monotonic() - start < 3
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
    assert_logged_once(caplog, client_port, "proxyproto.uvicorn", level, text)


def test_health_checks_are_not_warnings(caplog: pytest.LogCaptureFixture) -> None:
    # As in test_hypercorn: resets and LOCAL headers from load balancers.
    caplog.set_level(logging.INFO)
    with running(before_start=queue_health_checks) as port:
        send_health_checks(port)
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=V1_HEADER)
    assert seen["client"] == ["192.0.2.1", 1234]
    assert_no_warnings(caplog)
    gone = [r for r in caplog.records if BEFORE_HEADER in r.getMessage()]
    assert len(gone) >= 2
    assert {(r.name, r.levelname) for r in gone} == {("proxyproto.uvicorn", "INFO")}


def test_only_v2_accepted() -> None:
    with running(proxy_options={"versions": {2}}) as port:
        sock, _ = connect(port)
        with sock:
            sock.sendall(V1_HEADER)
            assert_closed(sock)


def test_header_from_encoder_roundtrip() -> None:
    header = ProxyHeader.from_addresses(
        ("203.0.113.5", 40000),
        ("203.0.113.6", 80),
        version=1,
    )
    with running() as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=encode_v1(header))
    assert seen["client"] == ["203.0.113.5", 40000]


def test_tls_with_uvloop_is_refused() -> None:
    with pytest.raises(ValueError, match="asyncio loop"):
        ProxyConfig(app, ssl_certfile="x.pem", loop="uvloop")


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
def test_scheme_from_ssl_tlv(client: SSLClient, http: str, websocket: str) -> None:
    # The load balancer terminated TLS and says so in the SSL TLV: the app
    # builds its URLs with the scheme the client used.
    with running() as port:
        sock, _ = connect(port)
        with sock:
            client_ = Client(sock)
            seen = [client_.request(first=ssl_header(client)), client_.request()]
        sock, _ = connect(port)
        with sock:
            assert websocket_scheme(sock, first=ssl_header(client)) == websocket
    assert [s["scheme"] for s in seen] == [http, http]
    assert seen[0]["client"] == list(CLIENT)


def test_scheme_ignores_ssl_tlv_of_local_header() -> None:
    # LOCAL: a health check, no client; its TLVs say nothing about one.
    with running() as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=ssl_header(SSLClient.SSL, local=True))
    assert seen["command"] == "LOCAL"
    assert seen["scheme"] == "http"


def test_scheme_ignores_ssl_tlv_under_ignore_policy() -> None:
    # IGNORE: the header is read but does not describe the connection.
    trust = TrustPolicy.everyone(Policy.IGNORE)
    with running(trusted=trust) as port:
        sock, _ = connect(port)
        with sock:
            seen = Client(sock).request(first=ssl_header(SSLClient.SSL))
    assert seen["client"][0] == "127.0.0.1"
    assert seen["scheme"] == "http"


def test_private_api() -> None:
    """Fails loudly if the Uvicorn internals proxyproto.uvicorn uses change."""
    source = inspect.getsource(uvicorn.server.Server.startup)
    assert "config.http_protocol_class(" in source
    for name in ("config=", "server_state=", "app_state=", "_loop="):
        assert name in source
    assert "ssl=config.ssl" in source
    config = ProxyConfig(app, lifespan="off", log_config=None)
    config.load()
    from proxyproto.uvicorn import _ProtocolFactory

    factory: Any = config.http_protocol_class
    assert isinstance(factory, _ProtocolFactory)
    parameters = inspect.signature(factory.protocol_class).parameters
    assert {"config", "server_state", "app_state", "_loop"} <= set(parameters)
    assert config.ssl is None
    uvicorn_main = importlib.import_module("uvicorn.main")
    assert "run(" in inspect.getsource(uvicorn_main.main.callback)
    assert callable(uvicorn_main.run)


# -- real peers ---------------------------------------------------------------


@pytest.mark.peers
def test_haproxy_send_proxy_v2_and_curl() -> None:
    curl = require("curl")
    with running() as port:
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
    assert seen["server"] == ["127.0.0.1", front]
    assert seen["version"] == 2


@pytest.mark.peers
def test_haproxy_tls_passthrough_and_curl(tls_files: dict[str, Any]) -> None:
    # HAProxy relays TCP (TLS untouched) with a v2 header; Uvicorn terminates TLS.
    curl = require("curl")
    with running(
        ssl_certfile=str(tls_files["cert"]), ssl_keyfile=str(tls_files["key"])
    ) as port:
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
    check: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with running() as port:
        run_haproxy_checks(port, check)
    assert_no_warnings(caplog)


@pytest.mark.peers
def test_haproxy_terminates_tls_send_proxy_v2_ssl(
    tls_files: dict[str, Any], tmp_path: Path
) -> None:
    # HAProxy terminates TLS and sends plain HTTP with a v2 header whose SSL
    # TLV says the client used TLS: the app sees https.
    with running() as port:
        seen, front = curl_through_haproxy_tls(port, tls_files, tmp_path)
    assert seen["scheme"] == "https"
    assert seen["server"] == ["127.0.0.1", front]


# -- command line -------------------------------------------------------------


def test_cli_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "proxyproto.uvicorn", "--help"],
        capture_output=True,
        check=True,
        timeout=60,
        text=True,
    )
    assert "--proxy-trusted" in out.stdout
    assert "--ssl-certfile" in out.stdout  # uvicorn's own options pass through


def test_cli_serves(tmp_path: Path) -> None:
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxyproto.uvicorn",
            "tests.proxyproto.test_uvicorn:cli_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--lifespan",
            "off",
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
