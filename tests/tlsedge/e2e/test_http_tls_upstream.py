"""HTTP mode to TLS backends (``mode = "http"``, backend ``protocol = "tls"``).

The AWS ``backend-protocol: https`` / Kubernetes ``appProtocol: https`` case:
nginx (``listen ... ssl``), uvicorn with TLS and a trio HTTPS server behind the
edge, every certificate made by ``tlsedge cert``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
import pytest
import trio

from tests.peers import free_port, nginx, require, wait_for_port
from tests.tlsedge.helpers import Backend, address_of, make_config, running_edge
from tests.tlsedge.pipeline.http.test_h1 import Client, running_proxy
from tlsedge._backends.keepalive import KeepAlivePool
from tlsedge._control.cli import main
from tlsedge._core.balancer import Server
from tlsedge._tls.stream import TLSStream

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Certs:
    """``tlsedge cert`` output: a CA, a server certificate for localhost and
    127.0.0.1, a client certificate (CN ``edge``), and an unrelated CA."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _tlsedge_cert(directory: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "tlsedge", "cert", str(directory), *args],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    main = tmp_path_factory.mktemp("certs")
    _tlsedge_cert(
        main, "--name", "localhost", "--name", "127.0.0.1", "--client", "edge"
    )
    other = tmp_path_factory.mktemp("other-certs")
    _tlsedge_cert(other, "--name", "localhost")
    return Certs(
        ca=main / "ca.pem",
        cert=main / "server.pem",
        key=main / "server.key",
        client_cert=main / "client.pem",
        client_key=main / "client.key",
        other_ca=other / "ca.pem",
    )


def _client_context(certs: Certs) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def _tls_backend(certs: Certs, **tls: Any) -> dict[str, Any]:
    """A ``[[backends]]`` table's TLS keys: verified against the CA, SNI localhost."""
    return {
        "protocol": "tls",
        "tls": {"ca": str(certs.ca), "sni": "localhost", **tls},
    }


async def _curl(*args: str) -> list[str]:
    result = await trio.run_process(
        [require("curl"), "-sS", "--max-time", "10", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode().splitlines()


def test_tlsedge_check_accepts_http_mode_to_a_tls_backend(
    certs: Certs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(
        '[[listeners]]\nname = "web"\nbind = "127.0.0.1:0"\nmode = "http"\n'
        'backend = "app"\n[listeners.tls]\n'
        f'certificates = [{{ cert = "{certs.cert}", key = "{certs.key}" }}]\n'
        '[[backends]]\nname = "app"\nservers = ["127.0.0.1:8443"]\n'
        'protocol = "tls"\nsend_proxy = "v2"\n[backends.tls]\n'
        f'ca = "{certs.ca}"\nsni = "localhost"\nalpn = ["http/1.1"]\n'
        f'cert = "{certs.client_cert}"\nkey = "{certs.client_key}"\n'
    )
    assert main(["check", str(path)]) == 0
    assert "OK (1 listeners, 1 backends)" in capsys.readouterr().out


# -- a trio HTTPS backend --------------------------------------------------------


async def _next_event(
    conn: h11.Connection, stream: trio.abc.ReceiveStream
) -> h11.Event:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(65536)))
            continue
        assert isinstance(event, h11.Event)
        return event


class HttpsBackend:
    """An HTTPS server (h11 over `TLSStream`, TLS 1.3).

    Every request gets JSON: its target, its header fields (lower-case names)
    and the number of the TLS connection it came on. ``/upgrade`` switches to
    an upper-casing echo that ends with ``|bye`` and a close_notify after the
    client's. With ``close_after_response``, every response is followed by a
    close_notify and a FIN. ``after_handshake`` (``"close"`` or ``"data"``)
    makes it send a close_notify or stray bytes right after the handshake.
    """

    def __init__(
        self,
        certs: Certs,
        *,
        close_after_response: bool = False,
        after_handshake: str | None = None,
    ) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(certs.cert, certs.key)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_3
        self.close_after_response = close_after_response
        self.after_handshake = after_handshake
        self.handshakes = 0
        self.failed_handshakes = 0
        self.sent_close_notify = 0
        self.sent_after_handshake = 0
        self.server: Backend | None = None

    async def start(self, nursery: trio.Nursery) -> HttpsBackend:
        self.server = await Backend(self.handle).start(nursery)
        return self

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    async def handle(self, stream: trio.SocketStream) -> None:
        tls = TLSStream(stream, self.context, server_side=True)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError:
            self.failed_handshakes += 1  # the edge refused our certificate
            return
        self.handshakes += 1
        number = self.handshakes
        if self.after_handshake == "close":
            await tls.send_eof()
            self.sent_after_handshake += 1
            return
        if self.after_handshake == "data":
            await tls.send_all(b"stray")
            self.sent_after_handshake += 1
        conn = h11.Connection(h11.SERVER)
        while True:
            event = await _next_event(conn, tls)
            if isinstance(event, h11.ConnectionClosed):
                return
            assert isinstance(event, h11.Request), event
            assert await _next_event(conn, tls) == h11.EndOfMessage()
            if event.target == b"/upgrade":
                await self._upgrade(conn, tls)
                return
            body = json.dumps(
                {
                    "target": event.target.decode(),
                    "headers": {n.decode(): v.decode() for n, v in event.headers},
                    "connection": number,
                }
            ).encode()
            head = conn.send(
                h11.Response(
                    status_code=200,
                    headers=[
                        ("Content-Type", "application/json"),
                        ("Content-Length", str(len(body))),
                    ],
                )
            )
            await tls.send_all(
                (head or b"")
                + (conn.send(h11.Data(data=body)) or b"")
                + (conn.send(h11.EndOfMessage()) or b"")
            )
            if self.close_after_response:
                await tls.send_eof()
                self.sent_close_notify += 1
                return
            conn.start_next_cycle()

    @staticmethod
    async def _upgrade(conn: h11.Connection, tls: TLSStream) -> None:
        head = conn.send(
            h11.InformationalResponse(
                status_code=101,
                headers=[("Upgrade", "echo"), ("Connection", "Upgrade")],
            )
        )
        await tls.send_all((head or b"") + b"server-hello|")
        early, _ = conn.trailing_data
        if early:
            await tls.send_all(bytes(early).upper())
        while data := await tls.receive_some(65536):
            await tls.send_all(bytes(data).upper())
        # The edge passed the client's half-close on as a close_notify; TLS
        # 1.3 lets this direction carry on.
        await tls.send_all(b"|bye")
        await tls.send_eof()


# -- nginx with TLS behind the edge ----------------------------------------------


def _nginx_https(certs: Certs, port: int, server: str) -> str:
    """An nginx ``http`` block: one TLS server on *port*; *server* adds to it."""
    return (
        "http { access_log off; default_type text/plain; "
        f"ssl_certificate {certs.cert}; ssl_certificate_key {certs.key}; "
        "ssl_protocols TLSv1.2 TLSv1.3; "  # nginx 1.22 leaves TLS 1.3 out
        f"server {{ listen 127.0.0.1:{port} ssl{server} }} }}"
    )


async def test_nginx_tls_backend_gets_the_requests_on_one_pooled_connection(
    certs: Certs,
) -> None:
    port = free_port()
    body = _nginx_https(
        certs,
        port,
        "; location / { return 200 "
        '"conn=$connection n=$connection_requests xff=$http_x_forwarded_for '
        'sni=$ssl_server_name tls=$ssl_protocol\\n"; }',
    )
    with nginx(body, [port]):
        config = make_config(
            [{"name": "web", "backend": "nginx", "mode": "http"}],
            [
                {
                    "name": "nginx",
                    "servers": [f"127.0.0.1:{port}"],
                    **_tls_backend(certs),
                }
            ],
        )
        async with running_edge(config) as edge:
            url = f"http://127.0.0.1:{address_of(edge, 'web')[1]}/"
            lines = await _curl("-H", "X-Forwarded-For: 6.6.6.6", url, url, url)
            # A second client connection gets the pooled upstream connection too.
            lines += await _curl(url)
    connection = lines[0].split()[0]
    assert lines == [
        f"{connection} n={n} xff=127.0.0.1 sni=localhost tls=TLSv1.3"
        for n in (1, 2, 3, 4)
    ]


async def test_client_certificate_to_nginx_ssl_verify_client(certs: Certs) -> None:
    port = free_port()
    body = _nginx_https(
        certs,
        port,
        f"; ssl_verify_client on; ssl_client_certificate {certs.ca}; "
        'location / { return 200 "verify=$ssl_client_verify dn=$ssl_client_s_dn\\n"; }',
    )
    with nginx(body, [port]):
        config = make_config(
            [{"name": "web", "backend": "nginx", "mode": "http"}],
            [
                {
                    "name": "nginx",
                    "servers": [f"127.0.0.1:{port}"],
                    **_tls_backend(
                        certs, cert=str(certs.client_cert), key=str(certs.client_key)
                    ),
                }
            ],
        )
        async with running_edge(config) as edge:
            url = f"http://127.0.0.1:{address_of(edge, 'web')[1]}/"
            lines = await _curl(url)
    assert lines == ["verify=SUCCESS dn=CN=edge"]


async def test_send_proxy_v2_goes_before_the_tls_handshake_to_nginx(
    certs: Certs,
) -> None:
    port = free_port()
    body = _nginx_https(
        certs,
        port,
        " proxy_protocol; location / { return 200 "
        '"conn=$connection proxy=$proxy_protocol_addr '
        'xff=$http_x_forwarded_for tls=$ssl_protocol\\n"; }',
    )
    with nginx(body, [port]):
        config = make_config(
            [{"name": "web", "backend": "nginx", "mode": "http"}],
            [
                {
                    "name": "nginx",
                    "servers": [f"127.0.0.1:{port}"],
                    "send_proxy": "v2",
                    **_tls_backend(certs),
                }
            ],
        )
        async with running_edge(config) as edge:
            url = f"http://127.0.0.1:{address_of(edge, 'web')[1]}/"
            first = await _curl(url, url)
            second = await _curl(url, url)
    tail = " proxy=127.0.0.1 xff=127.0.0.1 tls=TLSv1.3"
    assert [line.partition(" ")[2] for line in first + second] == [tail[1:]] * 4
    # One dedicated upstream connection per client connection, never shared.
    assert first[0] == first[1]
    assert second[0] == second[1]
    assert first[0] != second[0]


# -- uvicorn with TLS behind the edge ----------------------------------------------

_ASGI_APP = """
import json


async def app(scope, receive, send):
    assert scope["type"] == "http"
    body = json.dumps({
        "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
        "scheme": scope["scheme"],
        "client_port": scope["client"][1],
    }).encode() + b"\\n"
    await send({
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"application/json")],
    })
    await send({"type": "http.response.body", "body": body})
"""


@contextlib.contextmanager
def _uvicorn(certs: Certs, app_dir: Path, port: int) -> Iterator[None]:
    pytest.importorskip("uvicorn")
    (app_dir / "seen_headers.py").write_text(_ASGI_APP)
    process = subprocess.Popen(
        [
            sys.executable,
            *("-m", "uvicorn", "seen_headers:app", "--app-dir", str(app_dir)),
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)),
            *("--lifespan", "off", "--no-proxy-headers", "--log-level", "warning"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(port, process=process)
        yield
    finally:
        process.terminate()
        process.wait(10)


async def test_uvicorn_with_tls_behind_an_https_edge(
    certs: Certs, tmp_path: Path
) -> None:
    port = free_port()
    with _uvicorn(certs, tmp_path, port):
        config = make_config(
            [
                {
                    "name": "web",
                    "backend": "uvicorn",
                    "mode": "http",
                    "tls": {
                        "certificates": [
                            {"cert": str(certs.cert), "key": str(certs.key)}
                        ]
                    },
                }
            ],
            [
                {
                    "name": "uvicorn",
                    "servers": [f"127.0.0.1:{port}"],
                    **_tls_backend(certs),
                }
            ],
        )
        async with running_edge(config) as edge:
            edge_port = address_of(edge, "web")[1]
            url = f"https://localhost:{edge_port}/"
            lines = await _curl(
                *("--cacert", str(certs.ca)),
                *("--resolve", f"localhost:{edge_port}:127.0.0.1"),
                *("-H", "X-Forwarded-For: 6.6.6.6", url, url),
            )
    seen = [json.loads(line) for line in lines]
    for answer in seen:
        assert answer["scheme"] == "https"  # uvicorn's own TLS
        headers = answer["headers"]
        assert headers["x-forwarded-for"] == "127.0.0.1"
        assert headers["x-forwarded-proto"] == "https"
        assert headers["host"] == f"localhost:{edge_port}"
    # Both requests came on one upstream connection (the same edge port).
    assert seen[0]["client_port"] == seen[1]["client_port"]


# -- failures ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tls", "error"),
    [
        pytest.param(
            {"ca": "other"},
            "certificate verify failed: unable to get local issuer certificate",
            id="wrong-ca",
        ),
        pytest.param(
            {"sni": "wrong.test"},
            "certificate verify failed: Hostname mismatch",
            id="wrong-sni",
        ),
    ],
)
async def test_a_certificate_that_does_not_verify_is_a_failed_connect(
    certs: Certs,
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    tls: dict[str, str],
    error: str,
) -> None:
    caplog.set_level(logging.INFO)
    backend = await HttpsBackend(certs).start(nursery)
    if tls.get("ca") == "other":
        tls = {**tls, "ca": str(certs.other_ca)}
    async with running_proxy(
        [backend.address], backend={"retries": 1, **_tls_backend(certs, **tls)}
    ) as proxy:
        client = await Client.open(proxy.address)
        response = await client.request("GET", "/x")
        await client.aclose()
    assert response.status == 502
    detail = (
        f"127.0.0.1:{backend.port}: TLS handshake failed: "
        f"[SSL: CERTIFICATE_VERIFY_FAILED] {error}"
    )
    assert detail in response.body.decode()
    assert response.body.decode().startswith(
        "502 Bad Gateway: backend app: 2 connect attempts failed ("
    )
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "tlsedge.http" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1
    assert "GET /x -> 502" in warnings[0]
    assert detail in warnings[0]
    # Both attempts counted against the server, like refused connects.
    (health,) = proxy.pool.servers
    assert health.state.failures == 2
    assert health.state.last_detail.startswith("TLS handshake failed: ")
    assert backend.handshakes == 0
    with trio.fail_after(10):
        while backend.failed_handshakes < 2:  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_a_tls_handshake_that_does_not_come_is_a_connect_timeout(
    certs: Certs, nursery: trio.Nursery
) -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()  # accepts, never answers the ClientHello

    backend = await Backend(silent).start(nursery)
    async with running_proxy(
        [backend.address], backend={"connect_timeout": 0.2, **_tls_backend(certs)}
    ) as proxy:
        client = await Client.open(proxy.address)
        response = await client.request("GET", "/")
        await client.aclose()
        backend.stop()
    assert response.status == 502
    assert response.body.decode() == (
        "502 Bad Gateway: backend app: 1 connect attempts failed "
        f"(127.0.0.1:{backend.port}: no TLS handshake within 0.2 s)\n"
    )
    (health,) = proxy.pool.servers
    assert health.state.failures == 1


async def test_kept_connections_are_not_reused_after_the_tls_settings_changed(
    certs: Certs, nursery: trio.Nursery
) -> None:
    backend = await HttpsBackend(certs).start(nursery)
    async with running_proxy([backend.address], backend=_tls_backend(certs)) as proxy:
        client = await Client.open(proxy.address)
        first = await client.request("GET", "/one")
        second = await client.request("GET", "/two")  # from the pool
        await proxy.pool.update(proxy.config.backends[0])  # a reload: new context
        third = await client.request("GET", "/three")
        await client.aclose()
    assert [r.json()["connection"] for r in (first, second, third)] == [1, 1, 2]


async def test_a_tls_backend_that_closes_is_not_reused(
    certs: Certs, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    backend = await HttpsBackend(certs, close_after_response=True).start(nursery)
    async with running_proxy([backend.address], backend=_tls_backend(certs)) as proxy:
        client = await Client.open(proxy.address)
        first = await client.request("GET", "/one")
        with trio.fail_after(10):
            while backend.sent_close_notify < 1:  # noqa: ASYNC110
                await trio.sleep(0.01)
        second = await client.request("GET", "/two")
        await client.aclose()
    assert (first.status, second.status) == (200, 200)
    assert [first.json()["connection"], second.json()["connection"]] == [1, 2]
    # The closed connection was seen as closed in the pool, not found out by
    # a failed request and a retry.
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


async def test_a_response_ended_by_a_close_notify_in_its_read_ends_at_once(
    certs: Certs, nursery: trio.Nursery
) -> None:
    """A TLS backend whose response ends at its EOF, sent with the
    close_notify in one write and TCP left open: the client gets it whole at
    once. (The EOF came in the same read as the body, and no socket event
    said it again: the response waited for a timeout.)"""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.cert, certs.key)

    async def answer(stream: trio.SocketStream) -> None:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        engine = context.wrap_bio(incoming, outgoing, server_side=True)
        request = b""
        while b"\r\n\r\n" not in request:
            try:
                engine.do_handshake()
                request += engine.read(65536)
            except ssl.SSLWantReadError:
                await stream.send_all(outgoing.read())
                incoming.write(await stream.receive_some(65536))
        engine.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        with contextlib.suppress(ssl.SSLWantReadError):
            engine.unwrap()  # the close_notify, behind the body
        await stream.send_all(outgoing.read())
        await stream.receive_some(65536)  # TCP open until the edge closes

    backend = await Backend(answer).start(nursery)
    async with running_proxy([backend.address], backend=_tls_backend(certs)) as proxy:
        client = await Client.open(proxy.address)
        with trio.fail_after(10):
            response = await client.request("GET", "/")
        await client.aclose()
    assert (response.status, response.body) == (200, b"all of it")


async def test_upgrade_relays_over_the_tls_upstream_with_half_close(
    certs: Certs, nursery: trio.Nursery
) -> None:
    backend = await HttpsBackend(certs).start(nursery)
    async with running_proxy([backend.address], backend=_tls_backend(certs)) as proxy:
        stream = await trio.open_tcp_stream(*proxy.address)
        await stream.send_all(
            b"GET /upgrade HTTP/1.1\r\nHost: localhost\r\n"
            b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\nearly-frame|"
        )
        received = b""
        with trio.fail_after(10):
            while b"EARLY-FRAME|" not in received:
                chunk = await stream.receive_some(65536)
                assert chunk, received
                received += chunk
            head, _, rest = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101 "), head
            assert rest == b"server-hello|EARLY-FRAME|"
            await stream.send_all(b"frame2")
            while not rest.endswith(b"FRAME2"):
                chunk = await stream.receive_some(65536)
                assert chunk, rest
                rest += chunk
            await stream.send_eof()  # -> close_notify upstream; it still answers
            while chunk := await stream.receive_some(65536):
                rest += chunk
        await stream.aclose()
    assert rest == b"server-hello|EARLY-FRAME|FRAME2|bye"
    assert backend.handshakes == 1


# -- the keep-alive pool's check of idle TLS connections ------------------------------


async def _get(stream: trio.abc.Stream, target: str) -> dict[str, Any]:
    """One GET over *stream*; the JSON body."""
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(method="GET", target=target, headers=[("Host", "localhost")])
    await stream.send_all(
        (conn.send(request) or b"") + (conn.send(h11.EndOfMessage()) or b"")
    )
    body = b""
    with trio.fail_after(10):
        while True:
            event = await _next_event(conn, stream)
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                result: dict[str, Any] = json.loads(body)
                return result


async def _idle_tls_connection(certs: Certs, port: int) -> TLSStream:
    """A finished client handshake, whose socket has something to read."""
    stream = TLSStream(
        await trio.open_tcp_stream("127.0.0.1", port),
        _client_context(certs),
        server_side=False,
        server_hostname="localhost",
    )
    await stream.do_handshake()
    transport = stream.transport_stream
    assert isinstance(transport, trio.SocketStream)
    with trio.fail_after(10):
        await trio.lowlevel.wait_readable(transport.socket)
    return stream


async def _acquire_after_release(
    stream: TLSStream, port: int
) -> trio.abc.Stream | None:
    pool = KeepAlivePool()
    server = Server(("127.0.0.1", port))
    try:
        pool.release(server, stream)
        return pool.acquire(server)
    finally:
        pool.close()


async def test_session_tickets_leave_an_idle_tls_connection_reusable_nginx(
    certs: Certs,
) -> None:
    # A TLS 1.3 server sends its session tickets after the handshake: the
    # socket is readable without any application data.
    port = free_port()
    body = _nginx_https(
        certs, port, '; location / { return 200 "n=$connection_requests\\n"; }'
    )
    with nginx(body, [port]):
        stream = await _idle_tls_connection(certs, port)
        try:
            assert await _acquire_after_release(stream, port) is stream
            await stream.send_all(
                b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
            )
            response = b""
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    response += chunk
        finally:
            await trio.aclose_forcefully(stream)
    assert response.startswith(b"HTTP/1.1 200 ")
    assert response.endswith(b"\r\n\r\nn=1\n")


@pytest.mark.parametrize(
    ("after_handshake", "reusable"),
    [
        pytest.param(None, True, id="tickets"),
        pytest.param("close", False, id="close_notify"),
        pytest.param("data", False, id="stray-data"),
    ],
)
async def test_the_pool_reads_idle_tls_connections_through_tls(
    certs: Certs, nursery: trio.Nursery, after_handshake: str | None, reusable: bool
) -> None:
    backend = await HttpsBackend(certs, after_handshake=after_handshake).start(nursery)
    stream = await _idle_tls_connection(certs, backend.port)
    try:
        if after_handshake is not None:
            with trio.fail_after(10):
                while backend.sent_after_handshake < 1:  # noqa: ASYNC110
                    await trio.sleep(0.01)
        got = await _acquire_after_release(stream, backend.port)
        assert (got is stream) is reusable
        if reusable:
            assert (await _get(stream, "/after"))["target"] == "/after"
    finally:
        await trio.aclose_forcefully(stream)
