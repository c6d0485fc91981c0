"""HTTP mode through a running Edge, with curl as the client."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import trio
import trustme

from tests.peers import require
from tests.tlsedge.helpers import make_config
from tlsedge._server import Edge


class EchoBackend:
    """Answers each request with the request head it received, as JSON."""

    def __init__(self) -> None:
        self.connections = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers: dict[str, list[str]] = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers.setdefault(name.strip().lower(), []).append(value.strip())
                body = json.dumps({"request": lines[0], "headers": headers}).encode()
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body
                )
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()


async def curl(*args: str) -> list[dict[str, object]]:
    result = await trio.run_process(
        [require("curl"), "-sS", "--max-time", "10", *args],
        capture_stdout=True,
        capture_stderr=True,
    )
    text = result.stdout.decode()
    # Several URLs in one curl call print their bodies back to back.
    decoder = json.JSONDecoder()
    bodies, index = [], 0
    while index < len(text):
        body, index = decoder.raw_decode(text, index)
        bodies.append(body)
    return bodies


async def _start(
    nursery: trio.Nursery, listener: dict[str, object]
) -> tuple[Edge, EchoBackend, int]:
    """Start a backend and an HTTP-mode edge; the edge's drain cancels both."""
    backend = EchoBackend()
    servers = await nursery.start(
        partial(trio.serve_tcp, backend.handle, 0, host="127.0.0.1")
    )
    port = servers[0].socket.getsockname()[1]
    config = make_config(
        [{"name": "web", "backend": "app", "mode": "http", **listener}],
        [{"name": "app", "servers": [f"127.0.0.1:{port}"]}],
    )

    async def run_edge(*, task_status: trio.TaskStatus[Edge]) -> None:
        await Edge(config).run(task_status=task_status)
        nursery.cancel_scope.cancel()  # the edge stopped: stop the backend

    edge: Edge = await nursery.start(run_edge)
    return edge, backend, edge.listen_addresses["web"][0][1]


async def test_spoofed_forwarding_headers_are_replaced() -> None:
    async with trio.open_nursery() as nursery:
        edge, _, port = await _start(nursery, {})
        (seen,) = await curl(
            "-H",
            "X-Forwarded-For: 6.6.6.6",
            "-H",
            "Forwarded: for=6.6.6.6",
            "-H",
            "X-Real-IP: 6.6.6.6",
            f"http://127.0.0.1:{port}/path?q=1",
        )
        edge.drain()
    headers = seen["headers"]
    assert isinstance(headers, dict)
    assert seen["request"] == "GET /path?q=1 HTTP/1.1"
    assert headers["x-forwarded-for"] == ["127.0.0.1"]
    assert headers["x-forwarded-proto"] == ["http"]
    assert headers["x-forwarded-port"] == [str(port)]
    assert "forwarded" not in headers
    assert "x-real-ip" not in headers


async def test_keepalive_reuses_one_upstream_connection() -> None:
    async with trio.open_nursery() as nursery:
        edge, backend, port = await _start(nursery, {})
        url = f"http://127.0.0.1:{port}/"
        first = await curl(url + "a", url + "b", url + "c")  # one client connection
        second = await curl(url + "d")  # another client connection, pooled upstream
        edge.drain()
    assert [b["request"] for b in first + second] == [
        f"GET /{p} HTTP/1.1" for p in "abcd"
    ]
    assert backend.connections == 1


async def test_tls_and_proxy_header_give_https_and_the_real_client(
    tmp_path: Path,
) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "site.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "site.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    tls = {
        "certificates": [
            {"cert": str(tmp_path / "site.pem"), "key": str(tmp_path / "site.key")}
        ]
    }
    async with trio.open_nursery() as nursery:
        edge, _, port = await _start(
            nursery,
            {"tls": tls, "proxy_protocol": {"trusted": ["127.0.0.1/32"]}},
        )
        (seen,) = await curl(
            "--cacert",
            str(tmp_path / "ca.pem"),
            "--haproxy-protocol",
            "--resolve",
            f"localhost:{port}:127.0.0.1",
            f"https://localhost:{port}/secure",
        )
        edge.drain()
    headers = seen["headers"]
    assert isinstance(headers, dict)
    assert headers["x-forwarded-proto"] == ["https"]
    assert headers["x-forwarded-for"] == ["127.0.0.1"]
    assert headers["host"] == [f"localhost:{port}"]
