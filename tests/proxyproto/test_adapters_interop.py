"""The trio, asyncio and blocking-socket adapters behind real HAProxy and nginx.

Each backend runs in a background thread, answers a minimal HTTP response and
records what it learned from the header. curl is the client, with its local
port pinned to a range and reported back (``-w %{local_port}``), so the test
can assert the backend saw the exact client endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socketserver
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from proxyproto import Command, ProxyHeader, SSLClient, TrustPolicy
from proxyproto.asyncio import start_server
from proxyproto.sockets import ProxyProtocolMixin, ProxyRequestHandlerMixin
from proxyproto.trio import ProxyStream, open_proxy_listener
from tests.peers import free_port, haproxy, nginx, require

pytestmark = pytest.mark.peers

TRUST = TrustPolicy.from_cidrs(["127.0.0.1"])
Record = dict[str, Any]
Backend = Callable[[int], contextlib.AbstractContextManager[list[Record]]]


def describe(header: ProxyHeader | None, client: object, server: object) -> Record:
    record: Record = {
        "client": list(client) if isinstance(client, tuple) else client,
        "server": list(server) if isinstance(server, tuple) else server,
        "version": None if header is None else header.version,
        "command": None if header is None else header.command.name,
        "tlvs": []
        if header is None
        else [[t.type, t.value.hex()] for t in header.tlvs],
        "ssl": None,
    }
    ssl_info = None if header is None else header.ssl
    if ssl_info is not None:
        record["ssl"] = {
            "client": int(ssl_info.client),
            "verify": ssl_info.verify,
            "version": ssl_info.version,
            "cn": ssl_info.cn,
        }
    return record


def http_response(record: Record) -> bytes:
    body = json.dumps(record).encode()
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
    )


# -- the three backends ----------------------------------------------------------------


@contextlib.contextmanager
def trio_backend(port: int) -> Iterator[list[Record]]:
    records: list[Record] = []
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def handler(stream: ProxyStream) -> None:
        data = b""
        with contextlib.suppress(trio.BrokenResourceError):
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some()
                if not chunk:
                    break
                data += chunk
            record = describe(
                stream.header, stream.client_address, stream.server_address
            )
            records.append(record)
            if data:
                await stream.send_all(http_response(record))
        await stream.aclose()

    async def main() -> None:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            state["cancel"] = nursery.cancel_scope
            state["token"] = trio.lowlevel.current_trio_token()
            async with open_proxy_listener(listeners[0], trust=TRUST) as listener:
                await nursery.start(trio.serve_listeners, handler, [listener])
                ready.set()
                await trio.sleep_forever()

    thread = threading.Thread(target=trio.run, args=(main,))
    thread.start()
    assert ready.wait(10)
    try:
        yield records
    finally:
        trio.from_thread.run_sync(state["cancel"].cancel, trio_token=state["token"])
        thread.join(10)


@contextlib.contextmanager
def asyncio_backend(port: int) -> Iterator[list[Record]]:
    records: list[Record] = []
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def handle(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            data = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            data = exc.partial
        except ConnectionError:  # HAProxy ends its health checks with a reset
            data = b""
        record = describe(
            writer.get_extra_info("proxyproto.header"),
            writer.get_extra_info("peername"),
            writer.get_extra_info("sockname"),
        )
        records.append(record)
        if data:
            writer.write(http_response(record))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(
            start_server(handle, "127.0.0.1", port, trust=TRUST)
        )
        ready.set()
        loop.run_forever()
        server.close()
        loop.run_until_complete(server.wait_closed())
        loop.close()

    thread = threading.Thread(target=run)
    thread.start()
    assert ready.wait(10)
    try:
        yield records
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@contextlib.contextmanager
def blocking_backend(port: int) -> Iterator[list[Record]]:
    records: list[Record] = []

    class Handler(ProxyRequestHandlerMixin, socketserver.StreamRequestHandler):
        def handle(self) -> None:
            data = b""
            with contextlib.suppress(ConnectionError):
                while (line := self.rfile.readline()) not in (b"", b"\r\n"):
                    data += line
            info = self.proxy
            assert info is not None
            record = describe(info.header, self.client_address, info.server_address)
            records.append(record)
            if data:
                self.wfile.write(http_response(record))

    class Server(ProxyProtocolMixin, socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    server = Server(("127.0.0.1", port), Handler, trust=TRUST)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}
    )
    thread.start()
    try:
        yield records
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


BACKENDS: dict[str, Backend] = {
    "trio": trio_backend,
    "asyncio": asyncio_backend,
    "blocking": blocking_backend,
}


# -- helpers ---------------------------------------------------------------------------


def curl(url: str, *extra: str) -> tuple[Record, tuple[str, int], int]:
    """GET *url* from a pinned local port range; the JSON body and our endpoint."""
    binary = require("curl")
    low = free_port()
    low = min(low, 65000)
    result = subprocess.run(
        [
            binary,
            "-sS",
            "--max-time",
            "10",
            "--local-port",
            f"{low}-{low + 40}",
            "-w",
            "\n%{local_ip} %{local_port}",
            *extra,
            url,
        ],
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr.decode()
    body, _, endpoint = result.stdout.rpartition(b"\n")
    ip, port = endpoint.decode().split()
    assert low <= int(port) <= low + 40
    return json.loads(body), (ip, int(port)), low


def wait_for(predicate: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    return BACKENDS[request.param]


# -- HAProxy ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "version"), [("send-proxy", 1), ("send-proxy-v2", 2)]
)
def test_haproxy_send_proxy(backend: Backend, option: str, version: int) -> None:
    front, back = free_port(), free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
        f"backend be\n    server s1 127.0.0.1:{back} {option}\n"
    )
    with backend(back) as records, haproxy(config, [front]):
        body, client, _ = curl(f"http://127.0.0.1:{front}/")
    assert body["client"] == list(client)
    assert body["server"] == ["127.0.0.1", front]
    assert body["version"] == version
    assert body["command"] == "PROXY"
    assert body in records


def test_haproxy_send_proxy_v2_ssl_cn(backend: Backend, tmp_path: Path) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
        str(tmp_path / "server.pem")
    )
    client_cert = ca.issue_cert("alice@example.test", common_name="alice")
    client_cert.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    client_cert.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    front, back = free_port(), free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front} ssl crt {tmp_path}/server.pem "
        f"verify optional ca-file {tmp_path}/ca.pem\n    default_backend be\n"
        f"backend be\n    server s1 127.0.0.1:{back} send-proxy-v2-ssl-cn\n"
    )
    with backend(back) as records, haproxy(config, [front]):
        body, client, _ = curl(
            f"https://127.0.0.1:{front}/",
            "--cacert",
            str(tmp_path / "ca.pem"),
            "--cert",
            str(tmp_path / "client.pem"),
            "--key",
            str(tmp_path / "client.key"),
        )
    assert body["client"] == list(client)
    assert body["server"] == ["127.0.0.1", front]
    assert body["version"] == 2
    ssl_info = body["ssl"]
    assert ssl_info is not None, body
    flags = SSLClient(ssl_info["client"])
    assert SSLClient.SSL in flags
    assert SSLClient.CERT_CONN in flags
    assert ssl_info["verify"] == 0
    assert ssl_info["version"] == "TLSv1.3"
    assert ssl_info["cn"] == "alice"
    assert body in records


def test_haproxy_http_health_checks_send_local(backend: Backend) -> None:
    # With "option httpchk" HAProxy sends a v2 LOCAL header, then its request,
    # and waits for the answer: the backend must serve it with real endpoints.
    front, back = free_port(), free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
        "backend be\n    option httpchk GET /health\n"
        f"    server s1 127.0.0.1:{back} send-proxy-v2 check inter 100ms\n"
    )
    with backend(back) as records, haproxy(config, [front]):
        wait_for(lambda: sum(r["command"] == "LOCAL" for r in records) >= 2)
        body, client, _ = curl(f"http://127.0.0.1:{front}/")
    local = next(r for r in records if r["command"] == "LOCAL")
    assert local["version"] == 2
    assert local["client"][0] == "127.0.0.1"  # the socket's own endpoints
    assert local["server"] == ["127.0.0.1", back]
    assert body["client"] == list(client)
    assert body["command"] == "PROXY"


def test_haproxy_tcp_health_checks_are_not_errors(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    # A plain "check" connects, sends LOCAL and resets at once; depending on
    # timing the backend reads the LOCAL header or finds the peer gone. Either
    # way: no warning, and the backend keeps serving.
    caplog.set_level(logging.INFO)
    front, back = free_port(), free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
        f"backend be\n    server s1 127.0.0.1:{back} send-proxy-v2 check inter 100ms\n"
    )
    with backend(back) as records, haproxy(config, [front]):
        time.sleep(1)
        body, client, _ = curl(f"http://127.0.0.1:{front}/")
    assert body["client"] == list(client)
    assert all(r["command"] in ("LOCAL", "PROXY") for r in records)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("proxyproto.") and r.levelno >= logging.WARNING
    ]
    assert not warnings


# -- nginx -----------------------------------------------------------------------------


def test_nginx_stream_proxy_protocol(backend: Backend) -> None:
    front, back = free_port(), free_port()
    body_conf = (
        "stream {\n"
        f"  server {{ listen 127.0.0.1:{front}; proxy_pass 127.0.0.1:{back}; "
        "proxy_protocol on; }\n"
        "}\n"
    )
    with backend(back) as records, nginx(body_conf, [front]):
        body, client, _ = curl(f"http://127.0.0.1:{front}/")
    assert body["client"] == list(client)
    assert body["server"] == ["127.0.0.1", front]
    assert body["version"] == 1
    assert body["command"] == "PROXY"
    assert body in records


def test_local_record_shape() -> None:
    # describe() itself, so a failure above is not a bug in the test helper.
    record = describe(ProxyHeader.local(), ("127.0.0.1", 1), ("127.0.0.1", 2))
    assert record["command"] == Command.LOCAL.name
    assert record["client"] == ["127.0.0.1", 1]
