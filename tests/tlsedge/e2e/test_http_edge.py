"""HTTP mode through a running Edge, with curl as the client."""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
import trustme

from proxyproto import InetAddress, ProxyHeader
from tests.peers import free_port, nginx, require
from tests.tlsedge.control.test_admin import admin_address, http_get, total
from tests.tlsedge.control.test_status_page import cells, row_of
from tests.tlsedge.helpers import (
    Backend,
    access_records,
    address_of,
    exchange_then_close_notify,
    in_flight,
    make_config,
    read_proxy,
    running_edge,
    wait_access_records,
    wait_until,
)
from tests.tlsedge.pipeline.http.test_h1 import Client, EchoBackend as H11Backend, _next
from tlsedge._control.edge import Edge
from tlsedge._core.config import Config
from tlsedge._pipeline.http.upstreams import (
    NewConnection,
    Upstream,
    UpstreamConnections,
)
from tlsedge._reactor.loop import current_reactor
from tlsedge._tls.stream import TLSStream


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


async def test_curl_through_the_edge_as_a_proxy_and_underscore_headers() -> None:
    # curl --proxy sends the absolute form; the backend gets origin-form and
    # the target's authority as Host (RFC 9112 3.2.2), never the client's Host.
    # Header names with "_" (WSGI's HTTP_X_FORWARDED_FOR) never get through.
    async with trio.open_nursery() as nursery:
        edge, _, port = await _start(nursery, {"forwarded": {"forwarded": True}})
        (seen,) = await curl(
            *("--proxy", f"http://127.0.0.1:{port}"),
            *("-H", "Host: good.test"),
            *("-H", "X_Forwarded_For: 6.6.6.6"),
            *("-H", "X_Real_IP: 6.6.6.6"),
            *("-H", "Foo_Bar: 1"),
            "http://evil.test:8080/x?y=1",
        )
        edge.drain()
    headers = seen["headers"]
    assert isinstance(headers, dict)
    assert seen["request"] == "GET /x?y=1 HTTP/1.1"
    assert headers["host"] == ["evil.test:8080"]
    (forwarded,) = headers["forwarded"]
    assert ';host="evil.test:8080";' in forwarded, forwarded
    assert headers["x-forwarded-for"] == ["127.0.0.1"]
    assert not [name for name in headers if "_" in name], headers


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


async def test_an_idle_pooled_upstream_connection_expires() -> None:
    # The keep-alive pool (made with the listener's site, before the edge's
    # services run) is swept from the start: nothing else closes an upstream
    # connection that no request takes again.
    async with trio.open_nursery() as nursery:
        edge, _, port = await _start(nursery, {})
        pool = edge._keepalive_pool("app")
        await curl(f"http://127.0.0.1:{port}/")
        await wait_until(lambda: pool.idle_count() == 1)
        await wait_until(lambda: pool.idle_count() == 0)
        edge.drain()


async def test_reload_sends_new_http_connections_to_the_new_backend() -> None:
    # A reload remakes the listener's site: a new connection goes to the
    # backend it names now; one opened before keeps the site it started with.
    async with trio.open_nursery() as nursery:
        first, second = EchoBackend(), EchoBackend()
        ports = []
        for backend in (first, second):
            servers = await nursery.start(
                partial(trio.serve_tcp, backend.handle, 0, host="127.0.0.1")
            )
            ports.append(servers[0].socket.getsockname()[1])

        def config(backend: str) -> Config:
            return make_config(
                [{"name": "web", "backend": backend, "mode": "http"}],
                [
                    {"name": "one", "servers": [f"127.0.0.1:{ports[0]}"]},
                    {"name": "two", "servers": [f"127.0.0.1:{ports[1]}"]},
                ],
            )

        async def run_edge(*, task_status: trio.TaskStatus[Edge]) -> None:
            await Edge(config("one")).run(task_status=task_status)
            nursery.cancel_scope.cancel()  # the edge stopped: stop the backends

        edge: Edge = await nursery.start(run_edge)
        address = edge.listen_addresses["web"][0]
        before = await Client.open(address)
        assert (await before.request()).status == 200
        await edge.reload(config("two"))
        after = await Client.open(address)
        assert (await after.request()).status == 200
        assert (await before.request()).status == 200
        assert (first.connections, second.connections) == (1, 1)
        await before.aclose()
        await after.aclose()
        edge.drain()


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


# -- drain, logs, metrics, PROXY v2, upgrade over TLS, nginx ----------------------


def _tls_files(tmp_path: Path) -> tuple[dict[str, Any], trustme.CA]:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "site.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "site.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    tls = {
        "certificates": [
            {"cert": str(tmp_path / "site.pem"), "key": str(tmp_path / "site.key")}
        ]
    }
    return tls, ca


@asynccontextmanager
async def h11_edge(
    listener: dict[str, Any] | None = None,
    edge: dict[str, Any] | None = None,
    extra_listeners: tuple[dict[str, Any], ...] = (),
    extra_backends: tuple[dict[str, Any], ...] = (),
) -> AsyncIterator[tuple[Edge, H11Backend, tuple[str, int]]]:
    """An Edge (listener ``web``, mode http, backend ``app``) in front of
    test_h1's h11 backend (JSON echo, ``/slow/<s>``, ``/upgrade``)."""
    async with trio.open_nursery() as nursery:
        app = await H11Backend().start(nursery)
        config = make_config(
            [
                {"name": "web", "backend": "app", "mode": "http", **(listener or {})},
                *extra_listeners,
            ],
            [{"name": "app", "servers": [app.address]}, *extra_backends],
            {"drain_timeout": 10.0, **(edge or {})},
        )
        async with running_edge(config) as running:
            yield running, app, address_of(running, "web")
        nursery.cancel_scope.cancel()


def _split(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], ...]:
    """(per-request lines, connection lines) of the access log."""
    return (
        [r for r in records if r.get("type") == "http"],
        [r for r in records if "type" not in r],
    )


async def test_drain_answers_in_flight_closes_idle_refuses_new(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    async with h11_edge() as (edge, app, address):
        idle = await Client.open(address)
        assert (await idle.request()).status == 200
        busy = await Client.open(address)
        first = await busy.request("GET", "/first")  # busy is a keep-alive client
        assert first.header(b"connection") is None
        responses: list[Any] = []

        async def slow() -> None:
            responses.append(await busy.request("GET", "/slow/0.5"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow)
            await wait_until(lambda: len(app.requests) == 3)  # /slow is upstream
            edge.drain()
            with trio.fail_after(1):  # idle keep-alive connection: closed at once
                assert await idle.stream.receive_some() == b""
            assert not responses  # ... while the slow one is still being answered
            with pytest.raises(OSError, match="onnect"):  # listener closed: refused
                await trio.open_tcp_stream(*address)
        (response,) = responses
        assert response.status == 200
        assert response.header(b"connection") == b"close"
        assert response.json()["target"] == "/slow/0.5"
        with trio.fail_after(2):
            assert await busy.stream.receive_some() == b""
        await idle.aclose()
        await busy.aclose()
        records = await wait_access_records(caplog, 5)
    requests, connections = _split(records)
    assert [r["target"] for r in requests] == ["/", "/first", "/slow/0.5"]
    assert all(r["status"] == 200 and r["termination"] == "ok" for r in requests)
    assert sorted((c["requests"], c["termination"]) for c in connections) == [
        (1, "drained"),
        (2, "drained"),
    ]


async def test_curl_keepalive_client_gets_connection_close_after_drain() -> None:
    async with h11_edge() as (edge, app, address):
        url = f"http://127.0.0.1:{address[1]}"
        outputs: list[str] = []

        async def run_curl() -> None:
            result = await trio.run_process(
                [
                    require("curl"),
                    *("-sS", "-v", "--max-time", "10"),
                    *(f"{url}/one", f"{url}/slow/0.5"),
                ],
                capture_stdout=True,
                capture_stderr=True,
            )
            outputs.append(result.stderr.decode())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_curl)
            await wait_until(lambda: len(app.requests) == 2)
            edge.drain()
    (err,) = outputs
    # One connection for both; the first response keeps it, the second closes it.
    assert err.count("Connected to") == 1, err
    assert "Connection: close" in err.rsplit("GET /slow/0.5", 1)[1], err
    assert "Connection: close" not in err.split("GET /slow/0.5", 1)[0], err
    assert err.count("< HTTP/1.1 200") == 2, err


async def test_status_page_shows_http_traffic_under_load() -> None:
    # At 6,000 requests/s over keep-alive connections the page showed
    # "0.37 connections/s", no request and 0 B.
    async with h11_edge(edge={"admin": "127.0.0.1:0"}) as (edge, app, address):
        admin = admin_address(edge)
        done = 0

        async def load(client: Client) -> None:
            nonlocal done
            while True:
                response = await client.request("GET", "/")
                assert response.status == 200
                done += 1

        clients = [await Client.open(address) for _ in range(4)]
        try:
            async with trio.open_nursery() as nursery:
                for client in clients:
                    nursery.start_soon(load, client)
                await wait_until(lambda: done >= 200)
                assert edge.active_connections == len(clients)
                html = (await http_get(admin, "/status")).text
                nursery.cancel_scope.cancel()
        finally:
            for client in clients:
                await client.aclose()
    section = html.split("<h2>HTTP requests</h2>", 1)[1].split("<h2", 1)[0]
    listener = cells(row_of(section, "web"))
    requests, rate, by_class = listener[2], listener[3], listener[4:]
    assert int(requests.replace(",", "")) >= 200
    assert float(rate) > 0
    assert by_class[1] == requests  # every one 2xx
    assert by_class[0] == by_class[2] == by_class[3] == by_class[4] == "0"
    server = cells(row_of(section, app.address))
    assert server[1:3] == ["app", requests]
    assert float(server[3]) > 0
    # The keep-alive connections' bytes, though none had ended.
    cards = {
        label: value
        for value, label in re.findall(r"<b>([^<]*)</b><span>([^<]*)</span>", html)
    }
    assert cards["HTTP requests"] == requests
    assert float(cards["requests/s (1 min)"]) > 0
    assert cards["from clients"] != "0 B"
    assert cards["to clients"] != "0 B"


async def test_access_log_lines_per_request_and_per_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    async with h11_edge() as (_, app, address):
        client = await Client.open(address)
        port = client.stream.socket.getsockname()[1]
        assert (await client.request("GET", "/a?x=1")).status == 200
        assert (await client.request("POST", "/b", body=b"hello")).status == 200
        await client.aclose()
        records = await wait_access_records(caplog, 3)
    requests, connections = _split(records)
    (connection,) = connections
    assert connection["requests"] == 2
    assert connection["termination"] == "client_closed"
    assert connection["backend"] == "app"
    assert connection["server"] == app.address
    assert [(r["method"], r["target"], r["status"]) for r in requests] == [
        ("GET", "/a?x=1", 200),
        ("POST", "/b", 200),
    ]
    for record in requests:
        assert record["connection"] == connection["id"]
        assert record["listener"] == "web"
        assert record["client"] == f"127.0.0.1:{port}"
        assert record["version"] == "1.1"
        assert record["backend"] == "app"
        assert record["server"] == app.address
        assert record["termination"] == "ok"
        assert record["bytes_in"] > 0
        assert record["bytes_out"] > 0
        assert record["total"] >= record["first_byte"] >= 0
    assert requests[1]["bytes_in"] > requests[0]["bytes_in"]  # the 5-byte body
    assert app.accepted == 1  # the second request reused the pooled connection


#: Every field of a request line, in order (docs/operations.md lists them).
REQUEST_FIELDS = [
    "type",
    "connection",
    "listener",
    "client",
    "start",
    "method",
    "target",
    "version",
    "host",
    "user_agent",
    "status",
    "bytes_in",
    "bytes_out",
    "connect",
    "first_byte",
    "total",
    "backend",
    "server",
    "tls",
    "sni",
    "request_id",
    "termination",
    "detail",
]
RFC3339_MS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def _unix_time(text: str) -> float:
    assert RFC3339_MS.fullmatch(text), text
    return datetime.datetime.fromisoformat(text).timestamp()


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
async def test_access_log_request_and_connection_fields_with_curl(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, use_tls: bool
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    tls, _ = _tls_files(tmp_path)
    before = time.time()
    async with h11_edge({"tls": tls} if use_tls else {}) as (_, app, address):
        port = address[1]
        scheme = "https" if use_tls else "http"
        (seen,) = await curl(
            *("--cacert", str(tmp_path / "ca.pem")),
            *("--resolve", f"localhost:{port}:127.0.0.1"),
            *("-A", "probe/1.0 (test)"),
            f"{scheme}://localhost:{port}/a?x=1",
        )
        records = await wait_access_records(caplog, 2)
    after = time.time()
    assert seen["target"] == "/a?x=1"
    requests, connections = _split(records)
    (request,), (connection,) = requests, connections
    assert list(request) == REQUEST_FIELDS
    # The times: RFC 3339, UTC, milliseconds, both lines.
    assert before - 0.001 <= _unix_time(connection["start"]) <= after
    assert _unix_time(connection["start"]) <= _unix_time(request["start"]) <= after
    assert request["connection"] == connection["id"]
    assert request["listener"] == connection["listener"] == "web"
    assert request["client"] == connection["client"]
    assert request["client"].startswith("127.0.0.1:")
    assert (request["method"], request["target"], request["version"]) == (
        "GET",
        "/a?x=1",
        "1.1",
    )
    assert request["host"] == f"localhost:{port}"
    assert request["user_agent"] == "probe/1.0 (test)"
    assert request["status"] == 200
    assert request["bytes_in"] > len("GET /a?x=1 HTTP/1.1\r\n\r\n")
    assert request["bytes_out"] > len(json.dumps(seen))
    assert 0 <= request["connect"] <= request["first_byte"] <= request["total"]
    assert request["backend"] == connection["backend"] == "app"
    assert request["server"] == connection["server"] == app.address
    assert request["request_id"] is None
    assert (request["termination"], request["detail"]) == ("ok", None)
    assert (request["tls"], request["sni"]) == (connection["tls"], connection["sni"])
    if use_tls:
        assert re.fullmatch(r"TLSv1\.[23] \S+", request["tls"]), request["tls"]
        assert request["sni"] == "localhost"
    else:
        assert (request["tls"], request["sni"]) == (None, None)


async def test_client_caused_error_responses_are_not_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="tlsedge")
    async with h11_edge() as (_, app, address):
        answers = []
        for head in (
            b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
            b"GET ftp://evil.test/ HTTP/1.1\r\nHost: good.test\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n",
        ):
            stream = await trio.open_tcp_stream(*address)
            await stream.send_all(head)
            answers.append((await _read_until_closed(stream)).split(b"\r\n")[0])
            await stream.aclose()
        records = await wait_access_records(caplog, 6)
    assert answers == [
        b"HTTP/1.1 501 Not Implemented",
        b"HTTP/1.1 400 Bad Request",
        b"HTTP/1.1 400 Bad Request",
    ]
    assert sorted(r["status"] for r in _split(records)[0]) == [400, 400, 501]
    assert app.accepted == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, [r.getMessage() for r in warnings]
    refusals = [r for r in caplog.records if r.name == "tlsedge.http"]
    assert [r.levelno for r in refusals] == [logging.INFO] * 3


async def _read_until_closed(stream: trio.SocketStream) -> bytes:
    data = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


async def test_metrics_count_requests_by_status_class(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    async with h11_edge(
        edge={"admin": "127.0.0.1:0"},
        extra_listeners=({"name": "dead", "backend": "gone", "mode": "http"},),
        extra_backends=({"name": "gone", "servers": [dead], "retries": 0},),
    ) as (edge, _, address):
        admin = admin_address(edge)
        client = await Client.open(address)
        assert (await client.request()).status == 200
        await client.aclose()
        smuggler = await trio.open_tcp_stream(*address)
        await smuggler.send_all(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        )
        answer = await _read_until_closed(smuggler)
        await smuggler.aclose()
        assert answer.startswith(b"HTTP/1.1 400 "), answer
        gone = await Client.open(address_of(edge, "dead"))
        assert (await gone.request()).status == 502
        await gone.aclose()
        await wait_until(lambda: len(_split(access_records(caplog))[0]) == 3)
        text = (await http_get(admin, "/metrics")).text
    name = "tlsedge_http_requests_total"
    assert total(text, name, listener="web", backend="app", code="2xx") == 1
    assert total(text, name, listener="web", backend="app", code="4xx") == 1
    assert total(text, name, listener="dead", backend="gone", code="5xx") == 1
    assert total(text, name) == 3
    assert total(text, "tlsedge_http_request_duration_seconds_count") == 3


async def test_send_proxy_v2_dedicated_upstream_per_client_connection() -> None:
    seen: list[tuple[ProxyHeader, list[str]]] = []

    async def proxy_then_http(stream: trio.SocketStream) -> None:
        header, rest = await read_proxy(stream)
        targets: list[str] = []
        seen.append((header, targets))
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(rest)
        while True:
            event = await _next(conn, stream)
            if isinstance(event, h11.ConnectionClosed):
                return
            if isinstance(event, h11.Request):
                targets.append(event.target.decode())
            if isinstance(event, h11.EndOfMessage):
                body = targets[-1].encode()
                await stream.send_all(
                    (
                        conn.send(
                            h11.Response(
                                status_code=200,
                                headers=[("Content-Length", str(len(body)))],
                            )
                        )
                        or b""
                    )
                    + (conn.send(h11.Data(data=body)) or b"")
                    + (conn.send(h11.EndOfMessage()) or b"")
                )
                conn.start_next_cycle()

    async with trio.open_nursery() as nursery:
        backend = await Backend(proxy_then_http).start(nursery)
        config = make_config(
            [{"name": "web", "backend": "app", "mode": "http"}],
            [{"name": "app", "servers": [backend.address], "send_proxy": "v2"}],
        )
        async with running_edge(config) as edge:
            address = address_of(edge, "web")
            first = await Client.open(address)
            second = await Client.open(address)
            ports = [c.stream.socket.getsockname()[1] for c in (first, second)]
            assert (await first.request("GET", "/a1")).body == b"/a1"
            assert (await second.request("GET", "/b1")).body == b"/b1"
            assert (await first.request("GET", "/a2")).body == b"/a2"
            await first.aclose()
            await second.aclose()
        nursery.cancel_scope.cancel()
    assert backend.accepted == 2
    by_port = {}
    for header, targets in seen:
        assert header.version == 2
        assert header.command.name == "PROXY"
        assert isinstance(header.source, InetAddress)
        assert isinstance(header.destination, InetAddress)
        assert str(header.source.host) == "127.0.0.1"
        assert header.destination.port == address[1]
        by_port[header.source.port] = targets
    assert by_port == {ports[0]: ["/a1", "/a2"], ports[1]: ["/b1"]}


async def test_upgrade_over_tls_relays_both_ways_and_half_closes(
    tmp_path: Path,
) -> None:
    tls, ca = _tls_files(tmp_path)
    context = ssl.create_default_context()
    ca.configure_trust(context)
    context.minimum_version = ssl.TLSVersion.TLSv1_3  # half-close: close_notify
    async with h11_edge({"tls": tls}) as (_, _, address):
        stream = TLSStream(
            await trio.open_tcp_stream(*address),
            context,
            server_side=False,
            server_hostname="localhost",
        )
        await stream.do_handshake()
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
            assert b"upgrade: echo" in head.lower()
            assert rest == b"server-hello|EARLY-FRAME|"
            await stream.send_all(b"frame2")
            while not rest.endswith(b"FRAME2"):
                chunk = await stream.receive_some(65536)
                assert chunk, rest
                rest += chunk
            await stream.send_eof()  # close_notify: the backend still answers
            while chunk := await stream.receive_some(65536):
                rest += chunk
        assert rest == b"server-hello|EARLY-FRAME|FRAME2|bye"
        await stream.aclose()


async def test_a_close_notify_in_the_request_s_read_ends_the_connection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request and the client's close_notify in one segment, TCP left
    open: the edge answers, then ends the connection as ``client_closed``
    (the EOF came with the request's read: no socket event says it again).
    """
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    tls, ca = _tls_files(tmp_path)
    context = ssl.create_default_context()
    ca.configure_trust(context)
    # Without the EOF, the connection would end at the keep-alive timeout.
    listener = {"tls": tls, "http": {"keepalive_timeout": 0.5}}
    async with h11_edge(listener) as (_, _, address):
        with trio.fail_after(10):
            received = await exchange_then_close_notify(
                address, context, b"GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n"
            )
        assert received.startswith(b"HTTP/1.1 200 "), received
        requests, connections = _split(await wait_access_records(caplog, 2))
        assert [r["termination"] for r in requests] == ["ok"]
        assert [r["termination"] for r in connections] == ["client_closed"]


async def test_nginx_backend_sees_x_forwarded_for() -> None:
    nginx_port = free_port()
    body = (
        "http { access_log off; keepalive_timeout 60s; server { listen 127.0.0.1:"
        f"{nginx_port}; location / {{ return 200 "
        '"xff=$http_x_forwarded_for proto=$http_x_forwarded_proto '
        'n=$connection_requests\\n"; } } }'
    )
    with nginx(body, [nginx_port]):
        config = make_config(
            [{"name": "web", "backend": "nginx", "mode": "http"}],
            [{"name": "nginx", "servers": [f"127.0.0.1:{nginx_port}"]}],
        )
        async with running_edge(config) as edge:
            url = f"http://127.0.0.1:{address_of(edge, 'web')[1]}/"
            result = await trio.run_process(
                [
                    require("curl"),
                    *("-sS", "--max-time", "10"),
                    *("-H", "X-Forwarded-For: 6.6.6.6", url, url),
                ],
                capture_stdout=True,
            )
    assert result.stdout.decode().splitlines() == [
        "xff=127.0.0.1 proto=http n=1",
        "xff=127.0.0.1 proto=http n=2",  # the pooled upstream connection
    ]


# -- connections with no task of their own -------------------------------------------


def _connection_tasks(edge: Edge) -> int:
    """The tasks in the edge's connections nursery (jobs that must await)."""
    assert edge._connections is not None
    return len(edge._connections.child_tasks)


async def test_idle_keepalive_http_connections_hold_no_task() -> None:
    async with h11_edge() as (edge, _, address):
        clients = [await Client.open(address) for _ in range(20)]
        for client in clients:
            assert (await client.request()).status == 200
        assert in_flight(edge, "http") == 20
        assert _connection_tasks(edge) == 0
        for client in clients:
            await client.aclose()
        await wait_until(lambda: not in_flight(edge, "http"))


async def test_drain_deadline_ends_silent_busy_and_connecting_connections(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the drain deadline a client that sent nothing, one whose request
    is upstream and one whose upstream connect still runs (in a task) all
    end as ``drained`` (the requests too: they were logged ``ok``), and no
    task is left."""
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    hang, hanging_now = trio.Event(), trio.Event()
    connect = UpstreamConnections.connect

    async def hanging(self: UpstreamConnections, new: NewConnection) -> Upstream:
        if hang.is_set():
            hanging_now.set()
            await trio.sleep_forever()
        return await connect(self, new)

    monkeypatch.setattr(UpstreamConnections, "connect", hanging)
    async with h11_edge(edge={"drain_timeout": 0.5}) as (edge, app, address):
        silent = await Client.open(address)
        busy = await Client.open(address)
        await busy.stream.send_all(b"GET /slow/30 HTTP/1.1\r\nHost: h\r\n\r\n")
        await wait_until(lambda: len(app.requests) == 1)
        hang.set()
        connecting = await Client.open(address)
        await connecting.stream.send_all(b"GET /never HTTP/1.1\r\nHost: h\r\n\r\n")
        with trio.fail_after(5):
            await hanging_now.wait()
        assert _connection_tasks(edge) == 1  # the connect
        assert in_flight(edge, "http") == 3
        edge.drain()
        with trio.fail_after(5):
            for client in (silent, busy, connecting):
                assert await _read_until_closed(client.stream) == b""
        await wait_until(
            lambda: not in_flight(edge, "http") and _connection_tasks(edge) == 0
        )
        for client in (silent, busy, connecting):
            await client.aclose()
        records = await wait_access_records(caplog, 5)
    requests, connections = _split(records)
    assert sorted((r["target"], r["termination"]) for r in requests) == [
        ("/never", "drained"),
        ("/slow/30", "drained"),
    ]
    assert {r["detail"] for r in requests} == {
        "the connection ended before the response did"
    }
    assert [c["termination"] for c in connections] == ["drained"] * 3
    assert sorted(c["requests"] for c in connections) == [0, 1, 1]


async def test_an_edge_cancelled_with_requests_in_flight_logs_them_drained(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cancelled from outside while requests wait upstream, the edge ends
    them as ``drained`` (they were logged ``ok``, with no status), with no
    error logged. (test_h2 has the twin whose backend's close makes a
    retry.)"""
    caplog.set_level(logging.INFO, logger="tlsedge")
    clients = []
    with trio.CancelScope() as scope:
        async with h11_edge() as (_, app, address):
            for _ in range(3):
                client = await Client.open(address)
                await client.stream.send_all(
                    b"GET /slow/30 HTTP/1.1\r\nHost: h\r\n\r\n"
                )
                clients.append(client)
            await wait_until(lambda: len(app.requests) == 3)
            scope.cancel()
            await trio.sleep_forever()
    for client in clients:
        await client.aclose()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    requests, connections = _split(access_records(caplog))
    assert [r["termination"] for r in requests] == ["drained"] * 3
    assert [c["termination"] for c in connections] == ["drained"] * 3


async def test_no_descriptor_left_after_many_http_connections() -> None:
    """Clients that complete requests, send garbage, or leave mid-head: once
    the edge stopped, every descriptor it opened is closed."""
    current_reactor()  # the run's own (its epoll), which outlives the edge
    fds = len(os.listdir("/proc/self/fd"))
    async with h11_edge() as (_, app, address):

        async def one(index: int) -> None:
            client = await Client.open(address)
            if index % 3 == 0:
                assert (await client.request()).status == 200
                assert (await client.request()).status == 200
            elif index % 3 == 1:
                await client.stream.send_all(b"NOT HTTP\r\n\r\n")
                assert b" 400 " in await _read_until_closed(client.stream)
            else:
                await client.stream.send_all(b"GET / HTTP/1.1\r\nHo")
            await client.aclose()

        for batch in range(5):
            async with trio.open_nursery() as nursery:
                for index in range(40):
                    nursery.start_soon(one, batch * 40 + index)
        assert app.requests
    assert len(os.listdir("/proc/self/fd")) == fds
