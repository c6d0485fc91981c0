"""HTTP/2 to clients through a running Edge: curl, httpx, h2load, raw h2 attackers."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import ssl
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.utilities
import h11
import httpx
import pytest
import trio
import trustme
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
)
from hypothesis import assume, example, given, settings, strategies as st

from tests.peers import free_port, nginx, require
from tests.tlsedge.control.test_admin import admin_address, http_get, total
from tests.tlsedge.helpers import (
    access_records,
    address_of,
    exchange_then_close_notify,
    in_flight,
    make_config,
    running_edge,
    wait_access_records,
    wait_until,
)
from tests.tlsedge.http.test_gate import H2Case, h2_cases
from tlsedge._control.cli import main
from tlsedge._control.edge import Edge
from tlsedge._http.head import ResponseRejectedError, parse_response_head
from tlsedge._http.rules import strip_hop_by_hop
from tlsedge._pipeline.http.h2 import _h2_fields, _response_fields
from tlsedge._pipeline.http.upstreams import (
    NewConnection,
    Upstream,
    UpstreamConnections,
)

# -- the backend: h11, answering by path, keeping the raw bytes it received ---------


@dataclass
class CaptureBackend:
    """An HTTP/1.1 server that records the raw bytes of each connection.

    ``/echo``: JSON of the request (head, body size and SHA-256, trailers).
    ``/big/<n>``: *n* bytes, chunked in 16 KiB pieces. ``/trailers``: a chunked
    body with a trailer. ``/slow/<s>``: answers after *s* seconds. ``/head``:
    204. ``/framed-wrongly``: a 103 and a 204 with a ``Content-Length``, then
    closes. ``/hold``: never answers, waits for the edge to close.
    """

    raw: list[bytearray] = field(default_factory=list)  # per connection
    received: bytearray = field(default_factory=bytearray)  # all, in order
    port: int = 0
    big_sent: int = 0  # the ``/big`` body bytes the kernel took
    holding: int = 0  # ``/hold`` requests received
    eofs: int = 0  # ... whose connection the edge then closed
    closed: int = 0  # connections ended

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, nursery: trio.Nursery) -> CaptureBackend:
        listeners = await nursery.start(
            partial(trio.serve_tcp, self.handle, 0, host="127.0.0.1")
        )
        self.port = listeners[0].socket.getsockname()[1]
        return self

    async def handle(self, stream: trio.SocketStream) -> None:
        raw = bytearray()
        self.raw.append(raw)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    raw += data
                    self.received += data
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.ConnectionClosed | h11.PAUSED):
                    return
                assert isinstance(event, h11.Request), event
                await self._answer(stream, conn, event, raw)
                if conn.our_state is not h11.DONE:  # closing, or /hold
                    return
                conn.start_next_cycle()
        except (
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            h11.RemoteProtocolError,
        ):
            return
        finally:
            self.closed += 1
            await trio.aclose_forcefully(stream)

    async def _answer(
        self,
        stream: trio.SocketStream,
        conn: h11.Connection,
        request: h11.Request,
        raw: bytearray,
    ) -> None:
        digest = hashlib.sha256()
        size = 0
        trailers: list[list[str]] = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                raw += data
                self.received += data
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Data):
                digest.update(event.data)
                size += len(event.data)
                continue
            assert isinstance(event, h11.EndOfMessage), event
            trailers = [[n.decode(), v.decode("latin-1")] for n, v in event.headers]
            break
        path = request.target.decode()

        async def send(*events: Any) -> None:
            for item in events:
                await stream.send_all(conn.send(item) or b"")

        if path.startswith("/big/"):
            total = int(path.rsplit("/", 1)[1])
            await send(h11.Response(status_code=200, headers=[("X-Big", "1")]))
            piece = b"x" * 16384
            sent = 0
            while sent < total:
                chunk = piece[: total - sent]
                await send(h11.Data(data=chunk))
                sent += len(chunk)
                self.big_sent += len(chunk)
            await send(h11.EndOfMessage())
            return
        if path == "/trailers":
            await send(
                h11.Response(
                    status_code=200,
                    headers=[("Transfer-Encoding", "chunked"), ("Trailer", "X-Sum")],
                ),
                h11.Data(data=b"part one,"),
                h11.Data(data=b"part two"),
                h11.EndOfMessage(headers=[("X-Sum", "42")]),
            )
            return
        if path == "/hold":
            self.holding += 1
            if not await stream.receive_some(65536):
                self.eofs += 1
            return
        if path.startswith("/slow/"):
            await trio.sleep(float(path.rsplit("/", 1)[1]))
        if path == "/head":
            await send(h11.Response(status_code=204, headers=[]), h11.EndOfMessage())
            return
        if path == "/framed-wrongly":  # (h11 would not send these; closes)
            await stream.send_all(
                b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\nContent-Length: 3\r\n\r\n"
                b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX: 1\r\n\r\n"
            )
            return
        body = json.dumps(
            {
                "method": request.method.decode(),
                "target": path,
                "headers": [
                    [n.decode(), v.decode("latin-1")] for n, v in request.headers
                ],
                "size": size,
                "sha256": digest.hexdigest(),
                "trailers": trailers,
            }
        ).encode()
        await send(
            h11.Response(
                status_code=200,
                headers=[
                    ("Content-Type", "application/json"),
                    ("Content-Length", str(len(body))),
                    ("Connection", "keep-alive"),
                    ("Keep-Alive", "timeout=5"),
                ],
            ),
            h11.Data(data=body),
            h11.EndOfMessage(),
        )


# -- the edge ------------------------------------------------------------------------


@dataclass
class Setup:
    edge: Edge
    backend: CaptureBackend
    tls_port: int
    plain_port: int
    ca: trustme.CA
    ca_file: Path


@asynccontextmanager
async def h2_edge(
    tmp_path: Path,
    http2: dict[str, Any] | None = None,
    http: dict[str, Any] | None = None,
    listener: dict[str, Any] | None = None,
    edge: dict[str, Any] | None = None,
) -> AsyncIterator[Setup]:
    """An edge with a TLS listener offering h2 and http/1.1 (``tls``) and a
    plain one serving h2c with prior knowledge (``plain``)."""
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "site.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "site.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    async with trio.open_nursery() as nursery:
        backend = await CaptureBackend().start(nursery)
        common = {
            "backend": "app",
            "mode": "http",
            "http": http or {},
            **(listener or {}),
        }
        config = make_config(
            [
                {
                    "name": "tls",
                    **common,
                    "http2": dict(http2 or {}),
                    "tls": {
                        "certificates": [
                            {
                                "cert": str(tmp_path / "site.pem"),
                                "key": str(tmp_path / "site.key"),
                            }
                        ],
                        "alpn": ["h2", "http/1.1"],
                    },
                },
                {
                    "name": "plain",
                    **common,
                    "http2": {"cleartext": "prior-knowledge", **(http2 or {})},
                },
            ],
            [{"name": "app", "servers": [backend.address]}],
            {"drain_timeout": 5.0, **(edge or {})},
        )
        running: Edge = await nursery.start(Edge(config).run)
        yield Setup(
            running,
            backend,
            running.listen_addresses["tls"][0][1],
            running.listen_addresses["plain"][0][1],
            ca,
            tmp_path / "ca.pem",
        )
        running.drain()
        nursery.cancel_scope.cancel()


async def curl(*args: str) -> tuple[str, str]:
    """Run curl; its stdout and stderr."""
    result = await trio.run_process(
        [require("curl"), "-sS", "--max-time", "20", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode(), result.stderr.decode()


async def test_curl_over_tls_alpn_h2_and_http11_on_the_same_port(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    async with h2_edge(tmp_path) as setup:
        url = f"https://localhost:{setup.tls_port}/echo?q=1"
        resolve = ("--resolve", f"localhost:{setup.tls_port}:127.0.0.1")
        out, _ = await curl(
            "--http2",
            "--cacert",
            str(setup.ca_file),
            *resolve,
            "-w",
            "\n%{http_version}",
            url,
        )
        body, version = out.rsplit("\n", 1)
        assert version == "2"
        seen = json.loads(body)
        assert seen["target"] == "/echo?q=1"
        headers = {n.lower(): v for n, v in seen["headers"]}
        assert headers["host"] == f"localhost:{setup.tls_port}"
        assert headers["x-forwarded-proto"] == "https"
        assert headers["x-forwarded-for"] == "127.0.0.1"
        out, _ = await curl(
            "--http1.1",
            "--cacert",
            str(setup.ca_file),
            *resolve,
            "-w",
            "\n%{http_version}",
            url,
        )
        assert out.rsplit("\n", 1)[1] == "1.1"
    records = [r for r in access_records(caplog) if r.get("type") == "http"]
    assert {r["version"] for r in records} == {"2.0", "1.1"}
    (h2_record,) = [r for r in records if r["version"] == "2.0"]
    assert h2_record["status"] == 200
    assert h2_record["method"] == "GET"
    assert h2_record["target"] == "/echo?q=1"
    assert h2_record["termination"] == "ok"


async def test_curl_h2c_prior_knowledge_and_http11_on_the_same_port(
    tmp_path: Path,
) -> None:
    async with h2_edge(tmp_path) as setup:
        url = f"http://127.0.0.1:{setup.plain_port}/echo"
        # One URL per call: curl 7.88 fails a second request on a
        # prior-knowledge connection (to nginx's h2c too).
        out, _ = await curl("--http2-prior-knowledge", "-w", "\n%{http_version}", url)
        assert out.endswith("\n2")
        assert json.loads(out.rsplit("\n", 1)[0])["target"] == "/echo"
        out, _ = await curl("--http1.1", "-w", "\n%{http_version}", url)
        assert out.endswith("\n1.1")
        headers = dict(json.loads(out.rsplit("\n", 1)[0])["headers"])
        assert headers["x-forwarded-proto"] == "http"


# -- a raw HTTP/2 client (the `h2` package over a real socket) -----------------------


class RawH2:
    """An h2 client connection on a plain (h2c) or TLS socket, for tests and
    attacks: ``conn`` is the h2 state machine; `send` flushes it; `events`
    reads until a predicate holds."""

    def __init__(self, stream: trio.abc.Stream, *, validate: bool = True) -> None:
        self.stream = stream
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=validate,
            normalize_outbound_headers=validate,
        )
        self.conn = h2.connection.H2Connection(config=config)
        self.seen: list[h2.events.Event] = []
        self.closed = False

    @classmethod
    async def open(
        cls, port: int, *, validate: bool = True, settings: dict[int, int] | None = None
    ) -> RawH2:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port), validate=validate)
        client.conn.initiate_connection()
        if settings:
            client.conn.update_settings(settings)
        await client.send()
        return client

    async def send(self, raw: bytes = b"") -> None:
        await self.stream.send_all(self.conn.data_to_send() + raw)

    async def read(self) -> list[h2.events.Event]:
        """One read's events ([] and ``closed`` at EOF)."""
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            data = b""
        if not data:
            self.closed = True
            return []
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.closed = True
            return []
        self.seen += events
        await self.send()  # ACKs
        return events

    async def until(self, done: Any) -> None:
        """Read until ``done(self)`` is true (or EOF), for at most 10 s."""
        with trio.fail_after(10):
            while not done(self) and not self.closed:
                await self.read()

    def request(
        self,
        path: str,
        *,
        method: str = "GET",
        headers: Sequence[tuple[str, str]] = (),
        end_stream: bool = True,
        authority: str = "localhost",
    ) -> int:
        sid = self.conn.get_next_available_stream_id()
        fields = [
            (":method", method),
            (":scheme", "http"),
            (":authority", authority),
            (":path", path),
            *headers,
        ]
        self.conn.send_headers(
            sid, [(n.encode(), v.encode()) for n, v in fields], end_stream=end_stream
        )
        return sid

    def of(self, kind: type, stream_id: int | None = None) -> list[Any]:
        return [
            e
            for e in self.seen
            if isinstance(e, kind)
            and (stream_id is None or getattr(e, "stream_id", None) == stream_id)
        ]

    def ended(self, stream_id: int) -> bool:
        return bool(self.of(h2.events.StreamEnded, stream_id)) or bool(
            self.of(h2.events.StreamReset, stream_id)
        )

    def body(self, stream_id: int) -> bytes:
        return b"".join(e.data for e in self.of(h2.events.DataReceived, stream_id))

    def status(self, stream_id: int) -> int:
        (response,) = self.of(h2.events.ResponseReceived, stream_id)
        return int(dict(response.headers)[b":status"])

    def goaway(self) -> h2.events.ConnectionTerminated | None:
        found = self.of(h2.events.ConnectionTerminated)
        return found[0] if found else None

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


def _answered(client: RawH2, *sids: int) -> bool:
    return all(client.ended(sid) for sid in sids)


def _the_reset_logged(
    caplog: pytest.LogCaptureFixture, reason: str, *, served: int
) -> dict[str, Any]:
    """The access line of the one stream reset as malformed for *reason*
    (the other *served* streams' say ``ok``)."""
    lines = [r for r in access_records(caplog) if r.get("type") == "http"]
    assert sorted(r["termination"] for r in lines) == ["bad_request"] + ["ok"] * served
    (line,) = [r for r in lines if r["termination"] == "bad_request"]
    assert line["detail"] == f"malformed request, stream reset: {reason}"
    return line


async def test_httpx_http2_over_tls_concurrent_requests_and_upload(
    tmp_path: Path,
) -> None:
    async with h2_edge(tmp_path) as setup:
        context = ssl.create_default_context(cafile=str(setup.ca_file))
        async with httpx.AsyncClient(http2=True, verify=context) as client:
            base = f"https://localhost:{setup.tls_port}"
            responses: list[httpx.Response] = []

            async def get(index: int) -> None:
                responses.append(await client.get(f"{base}/echo?i={index}"))

            async with trio.open_nursery() as nursery:
                for index in range(20):
                    nursery.start_soon(get, index)
            assert {r.http_version for r in responses} == {"HTTP/2"}
            assert sorted(r.json()["target"] for r in responses) == sorted(
                f"/echo?i={i}" for i in range(20)
            )
            payload = bytes(range(256)) * 4096  # 1 MiB
            posted = await client.post(f"{base}/echo", content=payload)
            assert posted.json()["size"] == len(payload)
            assert posted.json()["sha256"] == hashlib.sha256(payload).hexdigest()
            big = await client.get(f"{base}/big/3000000")
            assert big.status_code == 200
            assert big.content == b"x" * 3000000
    # One client connection, the upstream connections pooled and reused.
    assert len(setup.backend.raw) <= 21


async def test_h2load_a_few_hundred_requests_and_their_metrics(tmp_path: Path) -> None:
    async with h2_edge(tmp_path, edge={"admin": "127.0.0.1:0"}) as setup:
        for url in (
            f"https://127.0.0.1:{setup.tls_port}/echo",
            f"http://127.0.0.1:{setup.plain_port}/echo",
        ):
            result = await trio.run_process(
                [require("h2load"), "-n", "300", "-c", "4", "-m", "10", url],
                capture_stdout=True,
                capture_stderr=True,
            )
            out = result.stdout.decode()
            assert "300 succeeded, 0 failed, 0 errored, 0 timeout" in out, out
            assert "status codes: 300 2xx" in out, out
        text = (await http_get(admin_address(setup.edge), "/metrics")).text
    name = "tlsedge_http_requests_total"
    for listener in ("tls", "plain"):
        assert total(text, name, listener=listener, backend="app", code="2xx") == 300


async def _tls_client(setup: Setup, alpn: str) -> trio.SSLStream[trio.SocketStream]:
    context = ssl.create_default_context(cafile=str(setup.ca_file))
    context.set_alpn_protocols([alpn])
    raw = await trio.open_tcp_stream("127.0.0.1", setup.tls_port)
    stream = trio.SSLStream(raw, context, server_hostname="localhost")
    await stream.do_handshake()
    assert stream.selected_alpn_protocol() == alpn
    return stream


async def test_a_close_notify_in_the_preface_s_read_ends_the_connection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The preface and the client's close_notify in one segment, TCP left
    open: the connection ends as ``client_closed`` (the EOF came with the
    preface's read: no socket event says it again)."""
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    # Without the EOF, the connection would end at the header timeout.
    async with h2_edge(tmp_path, http={"request_header_timeout": 0.5}) as setup:
        context = ssl.create_default_context(cafile=str(setup.ca_file))
        context.set_alpn_protocols(["h2"])
        client = h2.connection.H2Connection()
        client.initiate_connection()
        with trio.fail_after(10):
            await exchange_then_close_notify(
                ("127.0.0.1", setup.tls_port), context, client.data_to_send()
            )
        (connection,) = await wait_access_records(caplog, 1)
    assert connection["termination"] == "client_closed"


# The same requests, field for field, as HTTP/1.1 text and as HTTP/2 fields.
_DIFFERENTIAL: list[
    tuple[str, str, list[tuple[str, str]], bytes, list[tuple[str, str]]]
] = [
    ("GET", "/echo?a=1&b=%20", [("accept", "*/*"), ("x-custom", "v1")], b"", []),
    (
        "POST",
        "/echo",
        [("content-type", "text/plain"), ("content-length", "11")],
        b"hello world",
        [],
    ),
    # No length in HTTP/2: chunked upstream, with the trailer.
    ("PUT", "/echo", [("content-type", "text/plain")], b"streamed", [("x-check", "7")]),
]


async def test_streams_reuse_the_upstream_connections_earlier_streams_released(
    tmp_path: Path,
) -> None:
    # 40 concurrent streams hold 40 upstream connections; the shared pool keeps
    # 32 idle ones per server. The client connection keeps its own for its
    # next streams (no reconnect per round), gives them to the pool after
    # PARK_AFTER without a stream, and when it ends.
    # The counts are upper bounds: streams that happen not to overlap (a busy
    # machine) share connections and open fewer.
    async with h2_edge(tmp_path) as setup:
        pool = setup.edge._keepalive_pool("app")
        client = await RawH2.open(setup.plain_port)
        try:
            for _ in range(3):
                sids = [client.request("/slow/0.05") for _ in range(40)]
                await client.send()
                await client.until(lambda c, sids=sids: _answered(c, *sids))
                assert {client.status(sid) for sid in sids} == {200}
            opened = len(setup.backend.raw)
            assert opened <= 40  # not 56: no reconnect per round
            assert pool.idle_count() == 0
            parked = min(32, opened)
            await wait_until(lambda: pool.idle_count() == parked)  # idle: parked
            other = await RawH2.open(setup.plain_port)
            try:
                sids = [other.request("/slow/0.05") for _ in range(40)]
                await other.send()
                await other.until(lambda c: _answered(c, *sids))
                # The parked ones are reused: only the rest is new.
                assert len(setup.backend.raw) <= opened + 40 - parked
            finally:
                await other.aclose()
            await wait_until(lambda: pool.idle_count() >= parked)  # closed: parked
        finally:
            await client.aclose()


async def test_backend_gets_the_same_bytes_over_http11_and_http2(
    tmp_path: Path,
) -> None:
    # Untrusted spoofed forwarding headers are stripped the same way.
    spoof = [("x-forwarded-for", "6.6.6.6"), ("x-real-ip", "6.6.6.6")]
    async with h2_edge(tmp_path, listener={"forwarded": {"forwarded": True}}) as setup:
        http1 = await _tls_client(setup, "http/1.1")
        for method, target, fields, body, trailers in _DIFFERENTIAL:
            lines = [f"{method} {target} HTTP/1.1", f"host: localhost:{setup.tls_port}"]
            lines += [f"{n}: {v}" for n, v in [*fields, *spoof]]
            if trailers:
                lines.append("transfer-encoding: chunked")
                framed = (
                    b"%x\r\n%s\r\n0\r\n" % (len(body), body)
                    + b"".join(f"{n}: {v}\r\n".encode() for n, v in trailers)
                    + b"\r\n"
                )
            else:
                framed = body
            await http1.send_all("\r\n".join(lines).encode() + b"\r\n\r\n" + framed)
            answer = b""
            while answer.count(b"}") < 1 or not answer.endswith(b"}"):
                answer += await http1.receive_some(65536)
        await http1.aclose()
        over_http1 = bytes(setup.backend.received)
        setup.backend.received.clear()

        client = RawH2(await _tls_client(setup, "h2"))
        client.conn.initiate_connection()
        for method, target, fields, body, trailers in _DIFFERENTIAL:
            sid = client.request(
                target,
                method=method,
                headers=[*fields, *spoof, *([("te", "trailers")] if trailers else [])],
                end_stream=not body,
                authority=f"localhost:{setup.tls_port}",
            )
            if body:
                client.conn.send_data(sid, body, end_stream=not trailers)
            if trailers:
                client.conn.send_headers(
                    sid,
                    [(n.encode(), v.encode()) for n, v in trailers],
                    end_stream=True,
                )
            await client.send()
            await client.until(lambda c, sid=sid: c.ended(sid))
            assert client.status(sid) == 200
        await client.aclose()
        over_http2 = bytes(setup.backend.received)
    # The client's port (in Forwarded) is the only difference: two connections.
    port = re.compile(rb'for="127\.0\.0\.1:[0-9]+"')
    assert port.sub(b"P", over_http2).split(b"\r\n") == port.sub(
        b"P", over_http1
    ).split(b"\r\n")
    assert b"x-forwarded-for: 127.0.0.1\r\n" in over_http2.lower()
    assert b"6.6.6.6" not in over_http2
    assert b"\r\nx-check: 7\r\n" in over_http2


async def test_response_trailers_and_informational_headers(tmp_path: Path) -> None:
    async with h2_edge(tmp_path) as setup:
        client = await RawH2.open(setup.plain_port)
        sid = client.request("/trailers", headers=[("te", "trailers")])
        await client.send()
        await client.until(lambda c: c.ended(sid))
        assert client.status(sid) == 200
        assert client.body(sid) == b"part one,part two"
        (trailers,) = client.of(h2.events.TrailersReceived, sid)
        assert trailers.headers == [(b"x-sum", b"42")]
        (response,) = client.of(h2.events.ResponseReceived, sid)
        names = [n for n, _ in response.headers]
        assert b"transfer-encoding" not in names
        assert b"trailer" in names
        head = client.request("/head", method="HEAD")
        await client.send()
        await client.until(lambda c: c.ended(head))
        assert client.status(head) == 204
        await client.aclose()


async def test_no_content_length_reaches_the_client_on_a_1xx_or_204(
    tmp_path: Path,
) -> None:
    # RFC 9110 8.6: no 1xx or 204 carries one; the HTTP/1.1 client side drops
    # it too (test_h1's test_no_framing_field_reaches_the_client_...).
    async with h2_edge(tmp_path) as setup:
        client = await RawH2.open(setup.plain_port)
        sid = client.request("/framed-wrongly")
        await client.send()
        await client.until(lambda c: c.ended(sid))
        assert client.status(sid) == 204
        (early,) = client.of(h2.events.InformationalResponseReceived, sid)
        assert early.headers == [(b":status", b"103"), (b"link", b"</a>")]
        (response,) = client.of(h2.events.ResponseReceived, sid)
        assert response.headers == [(b":status", b"204"), (b"x", b"1")]
        await client.aclose()


async def test_large_upload_and_download_with_small_windows(tmp_path: Path) -> None:
    # The edge grants 4 KiB per stream; the client grants 4 KiB and opens its
    # window only as it reads: both directions move in small steps.
    async with h2_edge(tmp_path, http2={"initial_window_size": 4096}) as setup:
        client = await RawH2.open(
            setup.plain_port,
            settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 4096},
        )
        payload = hashlib.sha256(b"seed").digest() * 32768  # 1 MiB
        sid = client.request("/echo", method="POST", end_stream=False)
        await client.send()
        sent = 0
        with trio.fail_after(20):
            while sent < len(payload):
                window = min(
                    client.conn.local_flow_control_window(sid),
                    client.conn.max_outbound_frame_size,
                )
                if window <= 0:
                    await client.read()
                    continue
                client.conn.send_data(sid, payload[sent : sent + window])
                sent += window
                await client.send()
        client.conn.end_stream(sid)
        await client.send()
        await client.until(lambda c: c.ended(sid))
        answer = json.loads(client.body(sid))
        assert answer["size"] == len(payload)
        assert answer["sha256"] == hashlib.sha256(payload).hexdigest()

        down = client.request("/big/2000000")
        await client.send()
        received = 0
        with trio.fail_after(20):
            while not client.ended(down):
                for event in await client.read():
                    if isinstance(event, h2.events.DataReceived):
                        received += len(event.data)
                        client.conn.acknowledge_received_data(
                            event.flow_controlled_length, down
                        )
                await client.send()
        assert received == 2000000
        await client.aclose()


# -- defences: each attacked with a raw client ---------------------------------------

ErrorCodes = h2.errors.ErrorCodes


def _goaway_code(client: RawH2) -> int | None:
    event = client.goaway()
    return None if event is None else int(event.error_code or 0)


async def test_streams_beyond_max_concurrent_streams_are_refused(
    tmp_path: Path,
) -> None:
    async with h2_edge(tmp_path, http2={"max_concurrent_streams": 2}) as setup:
        client = await RawH2.open(setup.plain_port)
        sids = [client.request("/slow/0.3") for _ in range(4)]
        await client.send()
        await client.until(lambda c: _answered(c, *sids))
        refused = [
            e.stream_id
            for e in client.of(h2.events.StreamReset)
            if e.error_code == ErrorCodes.REFUSED_STREAM
        ]
        assert refused == sids[2:]
        assert [client.status(sid) for sid in sids[:2]] == [200, 200]
        # The connection goes on: a new stream is served.
        again = client.request("/echo")
        await client.send()
        await client.until(lambda c: c.ended(again))
        assert client.status(again) == 200
        await client.aclose()


async def test_malformed_requests_are_stream_errors(tmp_path: Path) -> None:
    async with h2_edge(tmp_path) as setup:
        client = await RawH2.open(setup.plain_port, validate=False)
        bad = [
            client.request("/echo", headers=[("connection", "keep-alive")]),
            client.request("/echo", headers=[("transfer-encoding", "chunked")]),
            client.request("/echo", headers=[("te", "gzip")]),
            client.request("/echo", headers=[("host", "other.test")]),
            client.request("/echo", headers=[("X-Upper", "1")]),
            client.request("/echo", headers=[(":protocol", "websocket")]),
            client.request("no-slash"),
        ]
        good = client.request(
            "/echo", headers=[("host", "LOCALHOST"), ("te", "trailers")]
        )
        await client.send()
        await client.until(lambda c: _answered(c, *bad, good))
        codes = {e.stream_id: e.error_code for e in client.of(h2.events.StreamReset)}
        assert codes == dict.fromkeys(bad, ErrorCodes.PROTOCOL_ERROR)
        assert client.status(good) == 200
        headers = dict(json.loads(client.body(good))["headers"])
        assert headers["host"] == "localhost"
        assert "te" not in headers
        connect = client.conn.get_next_available_stream_id()
        client.conn.send_headers(
            connect, [(b":method", b"CONNECT"), (b":authority", b"x.test:443")]
        )
        await client.send()
        await client.until(lambda c: c.ended(connect))
        assert client.status(connect) == 501
        assert client.goaway() is None
        await client.aclose()


@dataclass(frozen=True)
class _Smuggle:
    """An HTTP/2 request built to become more than one HTTP/1.1 request."""

    method: str = "POST"
    path: str = "/echo"
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    trailers: tuple[tuple[str, str], ...] = ()


_SMUGGLED = "GET /smuggled HTTP/1.1\r\nhost: x\r\nx-forwarded-for: 6.6.6.6\r\n\r\n"
_SMUGGLING_OVER_H2 = {
    "crlf-in-method": _Smuggle(method=_SMUGGLED + "GET"),
    "sp-in-method": _Smuggle(method="GET /smuggled"),
    "tab-in-method": _Smuggle(method="GET\t/smuggled"),
    "tab-in-path": _Smuggle(path="/echo\t/smuggled"),
    "sp-in-path": _Smuggle(path="/echo /smuggled"),
    "vt-in-path": _Smuggle(path="/echo\x0b/smuggled"),
    "del-in-path": _Smuggle(path="/echo\x7f/smuggled"),
    "ctl-in-path": _Smuggle(path="/echo\x01/smuggled"),
    "crlf-in-trailer-value": _Smuggle(
        body=b"abc", trailers=(("x-sum", "1\r\n\r\n" + _SMUGGLED[:-4]),)
    ),
    "crlf-in-trailer-name": _Smuggle(
        body=b"abc", trailers=(("x-sum\r\n\r\n" + _SMUGGLED[:-6].lower(), "6.6"),)
    ),
    "end-stream-with-content-length": _Smuggle(headers=(("content-length", "20"),)),
    "trailers-short-of-content-length": _Smuggle(
        headers=(("content-length", "10"),), body=b"abc", trailers=(("x-sum", "1"),)
    ),
}


@pytest.mark.parametrize("vector", list(_SMUGGLING_OVER_H2))
async def test_smuggling_vectors_over_http2_are_reset_and_reach_no_backend(
    tmp_path: Path, vector: str
) -> None:
    # Each becomes, through a naive downgrade, a second request with a spoofed
    # X-Forwarded-For, or a body that never comes (so the pooled upstream
    # connection would take the next client's request as its body). The
    # stream is reset (RFC 9113 8.1.1); the next client gets its own answer.
    case = _SMUGGLING_OVER_H2[vector]
    async with h2_edge(tmp_path) as setup:
        attacker = await RawH2.open(setup.plain_port, validate=False)
        sid = attacker.request(
            case.path,
            method=case.method,
            headers=case.headers,
            end_stream=not case.body and not case.trailers,
        )
        if case.body:
            attacker.conn.send_data(sid, case.body, end_stream=not case.trailers)
        if case.trailers:
            attacker.conn.send_headers(
                sid,
                [(n.encode(), v.encode()) for n, v in case.trailers],
                end_stream=True,
            )
        await attacker.send()
        await attacker.until(lambda c: c.ended(sid))
        resets = {e.stream_id: e.error_code for e in attacker.of(h2.events.StreamReset)}
        assert resets.get(sid) == ErrorCodes.PROTOCOL_ERROR
        assert attacker.goaway() is None
        victim = await RawH2.open(setup.plain_port)
        mine = victim.request("/echo", headers=[("x-victim", "1")])
        await victim.send()
        await victim.until(lambda c: c.ended(mine))
        assert victim.status(mine) == 200
        seen = json.loads(victim.body(mine))
        assert seen["target"] == "/echo"
        assert ["x-victim", "1"] in seen["headers"]
        await attacker.aclose()
        await victim.aclose()
    received = bytes(setup.backend.received)
    assert b"smuggled" not in received.lower()
    assert b"6.6.6.6" not in received


@pytest.mark.parametrize(
    ("last", "end_stream", "reason"),
    [
        (b"y" * 5, False, "DATA 1 bytes beyond its content-length"),
        (b"y" * 3, True, "the stream ended 1 bytes short of its content-length"),
    ],
)
async def test_data_that_breaks_the_content_length_resets_only_its_stream(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    last: bytes,
    end_stream: bool,
    reason: str,
) -> None:
    # RFC 9113 8.1.1: a stream error (h2 alone makes it a connection error).
    # Its request is half upstream already: that connection is closed, never
    # reused; the stream beside it, and the next, are served.
    caplog.set_level(logging.INFO, logger="tlsedge")
    async with h2_edge(tmp_path) as setup:
        backend = setup.backend
        client = await RawH2.open(setup.plain_port)
        bad = client.request(
            "/echo",
            method="POST",
            headers=[("content-length", "10")],
            end_stream=False,
        )
        client.conn.send_data(bad, b"x" * 6)
        await client.send()
        await wait_until(lambda: b"x" * 6 in backend.received)
        beside = client.request(
            "/echo", method="POST", headers=[("content-length", "2")], end_stream=False
        )
        client.conn.send_data(beside, b"ok", end_stream=True)
        client.conn.send_data(bad, last, end_stream=end_stream)
        await client.send()
        await client.until(lambda c: _answered(c, bad, beside))
        resets = {e.stream_id: e.error_code for e in client.of(h2.events.StreamReset)}
        assert resets == {bad: ErrorCodes.PROTOCOL_ERROR}
        assert client.status(beside) == 200
        assert json.loads(client.body(beside))["size"] == 2
        await wait_until(lambda: backend.closed == 1)
        after = client.request(
            "/echo", method="POST", headers=[("content-length", "1")], end_stream=False
        )
        client.conn.send_data(after, b"z", end_stream=True)
        await client.send()
        await client.until(lambda c: c.ended(after))
        assert client.status(after) == 200
        assert client.goaway() is None
        await client.aclose()
    dirty = bytes(backend.raw[0])
    assert dirty.count(b"POST /echo") == 1
    assert dirty.endswith(b"\r\n\r\n" + b"x" * 6)
    assert b"y" not in bytes(backend.received)
    assert len(backend.raw) == 2
    line = _the_reset_logged(caplog, reason, served=2)
    assert [r.getMessage() for r in caplog.records if r.name == "tlsedge.http"] == [
        f"listener plain: client {line['client']}: HTTP/2 stream 1 reset: {reason}"
    ]


@pytest.mark.parametrize("where", ["headers", "trailers"])
@pytest.mark.parametrize(
    "lengths", [("abc",), ("-1",), ("1 2",), ("",), ("+5",), ("5", "6")]
)
async def test_a_content_length_h2_cannot_parse_resets_only_its_stream(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    where: str,
    lengths: tuple[str, ...],
) -> None:
    # h2 alone ends the connection over a content-length it cannot parse (in
    # a request's HEADERS or its trailers); RFC 9113 8.1.1 asks a stream
    # error. The stream opened before it and the one after go on; the one
    # after names a field of the bad block by its HPACK dynamic-table index.
    caplog.set_level(logging.INFO, logger="tlsedge")
    async with h2_edge(tmp_path) as setup:
        backend = setup.backend
        client = await RawH2.open(setup.plain_port, validate=False)
        beside = client.request("/echo", method="POST", end_stream=False)
        client.conn.send_data(beside, b"beside")
        fields = [("content-length", value) for value in lengths]
        marker = ("x-in-the-bad-block", "1")
        if where == "headers":
            bad = client.request(
                "/echo", method="POST", headers=[marker, *fields], end_stream=False
            )
            client.conn.send_data(bad, b"abc", end_stream=True)
        else:
            bad = client.request(
                "/echo", method="POST", headers=[marker], end_stream=False
            )
            client.conn.send_data(bad, b"abc")
            await client.send()
            await wait_until(lambda: b"\r\nabc\r\n" in backend.received)
            client.conn.send_headers(
                bad, [(n.encode(), v.encode()) for n, v in fields], end_stream=True
            )
        after = client.request("/echo", headers=[marker])
        client.conn.send_data(beside, b"!", end_stream=True)
        await client.send()
        await client.until(lambda c: _answered(c, bad, beside, after))
        resets = {e.stream_id: e.error_code for e in client.of(h2.events.StreamReset)}
        assert resets == {bad: ErrorCodes.PROTOCOL_ERROR}
        assert client.goaway() is None
        assert client.status(beside) == 200
        assert json.loads(client.body(beside))["size"] == 7
        assert client.status(after) == 200
        assert list(marker) in json.loads(client.body(after))["headers"]
        if where == "trailers":
            # Its request went upstream: that connection is closed.
            await wait_until(lambda: backend.closed == 1)
        await client.aclose()
    received = bytes(backend.received)
    assert b"content-length" not in received.lower()
    assert received.count(b"x-in-the-bad-block") == (2 if where == "trailers" else 1)
    reason = "malformed content-length"
    if where == "trailers":
        reason = f"trailer {reason}"
    line = _the_reset_logged(caplog, reason, served=2)
    assert [r.getMessage() for r in caplog.records if r.name == "tlsedge.http"] == [
        f"listener plain: client {line['client']}: HTTP/2 stream {bad} reset: {reason}"
    ]


async def test_a_1xx_status_in_a_request_resets_only_its_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # h2 alone takes it for an informational response and ends the connection.
    # (Sent past the client's h2, which then ignores the stream's reset.)
    caplog.set_level(logging.INFO, logger="tlsedge")
    async with h2_edge(tmp_path) as setup:
        client = await RawH2.open(setup.plain_port, validate=False)
        beside = client.request("/echo")
        bad = client.conn.get_next_available_stream_id()
        fields = [
            (b":status", b"103"),
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":authority", b"localhost"),
            (b":path", b"/echo"),
        ]
        block = client.conn.encoder.encode(fields)
        frame = HeadersFrame(bad, block, flags=["END_HEADERS", "END_STREAM"])
        await client.send(frame.serialize())
        client.conn.send_headers(bad + 2, [*fields[1:]], end_stream=True)
        await client.send()
        await client.until(lambda c: _answered(c, beside, bad + 2))
        assert client.status(beside) == client.status(bad + 2) == 200
        assert client.goaway() is None
        await client.aclose()
    assert bytes(setup.backend.received).count(b"GET /echo") == 2
    _the_reset_logged(caplog, "unknown pseudo-header ':status'", served=2)


async def test_trailers_without_end_stream_reset_only_their_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # RFC 9113 8.1: a malformed request (h2 alone ends the connection). Its
    # request went upstream: that connection is closed.
    caplog.set_level(logging.INFO, logger="tlsedge")
    async with h2_edge(tmp_path) as setup:
        backend = setup.backend
        client = await RawH2.open(setup.plain_port)
        bad = client.request("/echo", method="POST", end_stream=False)
        client.conn.send_data(bad, b"abc")
        await client.send()
        await wait_until(lambda: b"\r\nabc\r\n" in backend.received)
        block = client.conn.encoder.encode([(b"x-sum", b"1")])
        trailers = HeadersFrame(bad, block, flags=["END_HEADERS"])
        await client.send(trailers.serialize())
        after = client.request("/echo")
        await client.send()
        await client.until(lambda c: _answered(c, bad, after))
        resets = {e.stream_id: e.error_code for e in client.of(h2.events.StreamReset)}
        assert resets == {bad: ErrorCodes.PROTOCOL_ERROR}
        assert client.status(after) == 200
        assert client.goaway() is None
        await wait_until(lambda: backend.closed == 1)
        await client.aclose()
    assert b"x-sum" not in bytes(backend.received)
    reason = "trailers without END_STREAM (RFC 9113 8.1)"
    _the_reset_logged(caplog, reason, served=1)


async def test_a_frame_after_the_request_ended_resets_its_stream_closed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # RFC 9113 5.1: a HEADERS frame on a stream whose request ended (here
    # while it waits for its response) is a stream error STREAM_CLOSED. The
    # edge gives the stream up (h2 alone would reset it and leave it served)
    # and closes its upstream connection; the stream beside it is served.
    caplog.set_level(logging.INFO, logger="tlsedge")
    async with h2_edge(tmp_path) as setup:
        backend = setup.backend
        client = await RawH2.open(setup.plain_port, validate=False)
        held = client.request("/hold")
        await client.send()
        await wait_until(lambda: backend.holding == 1)
        block = client.conn.encoder.encode([(b"x-late", b"1")])
        late = HeadersFrame(held, block, flags=["END_HEADERS", "END_STREAM"])
        await client.send(late.serialize())
        after = client.request("/echo")
        await client.send()
        await client.until(lambda c: _answered(c, held, after))
        resets = {e.stream_id: e.error_code for e in client.of(h2.events.StreamReset)}
        assert resets == {held: ErrorCodes.STREAM_CLOSED}
        assert client.status(after) == 200
        assert client.goaway() is None
        await wait_until(lambda: backend.eofs == 1)
        await client.aclose()
    reason = "a frame after the request ended (RFC 9113 5.1)"
    _the_reset_logged(caplog, reason, served=1)


async def _over_http2(setup: Setup, case: H2Case) -> tuple[bytes, bool]:
    """*case* over h2c: what reached the backend, and whether the edge
    refused the request (reset the stream or ended the connection)."""
    client = await RawH2.open(setup.plain_port, validate=False)
    try:
        sid = client.conn.get_next_available_stream_id()
        pseudo = [
            (b":method", case.method),
            (b":scheme", case.scheme),
            (b":authority", case.authority),
            (b":path", case.path),
        ]
        try:
            client.conn.send_headers(
                sid,
                [*pseudo, *case.fields],
                end_stream=not case.body and not case.trailers,
            )
            if case.body:
                client.conn.send_data(sid, case.body, end_stream=not case.trailers)
            if case.trailers:
                client.conn.send_headers(sid, case.trailers, end_stream=True)
        except Exception:  # noqa: BLE001 (h2 will not even encode it)
            assume(False)
        await client.send()
        await client.until(lambda c: c.ended(sid))
        refused = bool(client.of(h2.events.StreamReset, sid)) or client.closed
    finally:
        await client.aclose()
    if refused:  # what went upstream of it, if anything, is being closed
        backend = setup.backend
        await wait_until(lambda: backend.closed == len(backend.raw), 5.0)
    received = bytes(setup.backend.received)
    setup.backend.received.clear()
    return received, refused


def _complete_requests(data: bytes) -> int:
    """How many whole requests *data* holds for an HTTP/1.1 server (h11)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    count = 0
    while data:  # (no data would be EOF to h11: ConnectionClosed for ever)
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            break
        if event is h11.NEED_DATA or event is h11.PAUSED:
            break
        if isinstance(event, h11.EndOfMessage):
            count += 1
            conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
            conn.send(h11.EndOfMessage())
            conn.start_next_cycle()
    return count


async def _over_http11(setup: Setup, case: H2Case) -> bytes:
    """The same request over HTTP/1.1 on the same port; what reached the
    backend."""
    stream = await trio.open_tcp_stream("127.0.0.1", setup.plain_port)
    chunked = not case.sized and bool(case.body or case.trailers)
    cookies = [v for n, v in case.fields if n == b"cookie"]
    fields = [f for f in case.fields if f[0] != b"cookie"]
    if cookies:
        fields.append((b"cookie", b"; ".join(cookies)))
    lines = [
        case.method + b" " + case.path + b" HTTP/1.1",
        b"host: " + case.authority,
        *[n + b": " + v for n, v in fields],
        *([b"transfer-encoding: chunked"] if chunked else []),
    ]
    data = b"\r\n".join(lines) + b"\r\n\r\n"
    if chunked:
        if case.body:
            data += b"%x\r\n%s\r\n" % (len(case.body), case.body)
        data += b"0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in case.trailers)
        data += b"\r\n"
    else:
        data += case.body
    try:
        await stream.send_all(data)
        with trio.fail_after(10):
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = await stream.receive_some(65536)
                assert chunk, "the edge closed without an answer"
                answer += chunk
    finally:
        await stream.aclose()
    received = bytes(setup.backend.received)
    setup.backend.received.clear()
    return received


@settings(max_examples=100)
@given(case=h2_cases())
@example(case=H2Case(method=b"GET /x HTTP/1.1\r\nhost: e\r\n\r\nGET"))
@example(case=H2Case(path=b"/a\x7f\tb"))
@example(case=H2Case(fields=[(b"content-length", b"5")]))
@example(case=H2Case(body=b"abc", trailers=[(b"x", b"1\r\n\r\nGET /x HTTP/1.1")]))
async def test_the_backend_gets_http2_requests_as_their_http11_equivalents(
    tmp_path_factory: pytest.TempPathFactory, case: H2Case
) -> None:
    # The gate's differential property (tests/tlsedge/http/test_gate.py) over
    # real sockets: what an HTTP/2 request puts on the backend's connection is
    # what the same request over HTTP/1.1 puts there; or it is refused, and
    # the backend gets no whole request.
    tmp_path = tmp_path_factory.mktemp("h2diff")
    async with h2_edge(tmp_path) as setup:
        over_http2, refused = await _over_http2(setup, case)
        if refused:
            assert _complete_requests(over_http2) == 0
            return
        assert over_http2 == await _over_http11(setup, case)


async def test_cookie_crumbs_reach_the_backend_as_one_field(tmp_path: Path) -> None:
    async with h2_edge(tmp_path) as setup:
        client = await RawH2.open(setup.plain_port, validate=False)
        sid = client.request(
            "/echo", headers=[("cookie", "a=1"), ("x-b", "2"), ("cookie", "c=3")]
        )
        await client.send()
        await client.until(lambda c: c.ended(sid))
        headers = json.loads(client.body(sid))["headers"]
        await client.aclose()
    assert [h for h in headers if h[0] == "cookie"] == [["cookie", "a=1; c=3"]]


async def test_request_body_below_min_rate_gets_408_over_http2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # One byte every 0.1 s is never idle for idle_timeout, but falls behind
    # 20 bytes/s once the 0.5 s grace is used up, as over HTTP/1.1.
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    http = {"request_body_timeout": 0.5, "request_body_min_rate": 20}
    async with h2_edge(tmp_path, http=http, listener={"idle_timeout": 5.0}) as setup:
        client = await RawH2.open(setup.plain_port)
        sid = client.request("/echo", method="POST", end_stream=False)
        await client.send()
        with trio.fail_after(20):
            while not client.ended(sid):
                client.conn.send_data(sid, b"x")
                await client.send()
                with trio.move_on_after(0.1):
                    await client.read()
        assert client.status(sid) == 408
        await client.aclose()
    (record,) = [r for r in access_records(caplog) if r.get("type") == "http"]
    assert record["termination"] == "bad_request"
    assert "slower than request_body_min_rate (20 bytes/s)" in record["detail"]
    assert b"POST /echo" not in setup.backend.received or record["status"] == 408


async def test_header_list_size_and_hpack_bomb_end_the_connection(
    tmp_path: Path,
) -> None:
    async with h2_edge(tmp_path) as setup:
        # One 4000-byte field, indexed into the HPACK table, then nine
        # references to it (a byte each): 2.5 KB on the wire, 40 KB decoded.
        client = await RawH2.open(setup.plain_port)
        client.request("/echo", headers=[("x-bomb", "a" * 4000)] * 10)
        sent = client.conn.data_to_send()
        assert len(sent) < 3000
        await client.send(sent)
        await client.until(lambda c: c.goaway() is not None)
        assert _goaway_code(client) == ErrorCodes.ENHANCE_YOUR_CALM
        await client.aclose()
        # One field larger than max_header_list_size (16384): the header block
        # is cut off at that many bytes.
        client = await RawH2.open(setup.plain_port)
        client.request("/echo", headers=[("x-big", "b" * 20000)])
        await client.send()
        await client.until(lambda c: c.goaway() is not None)
        assert _goaway_code(client) == ErrorCodes.ENHANCE_YOUR_CALM
        await client.aclose()
        # A table larger than the 4096 bytes we allow.
        client = await RawH2.open(setup.plain_port)
        await client.until(lambda c: c.of(h2.events.RemoteSettingsChanged))
        client.conn.encoder.header_table_size = 65536
        client.request("/echo")
        await client.send()
        await client.until(lambda c: c.goaway() is not None)
        # A size update past our SETTINGS is a decoding error (RFC 7541 6.3).
        assert _goaway_code(client) == ErrorCodes.COMPRESSION_ERROR
        await client.aclose()


async def test_h2s_own_frame_limits_hold(tmp_path: Path) -> None:
    async with h2_edge(tmp_path) as setup:
        # A frame beyond SETTINGS_MAX_FRAME_SIZE (16384, h2's default).
        client = await RawH2.open(setup.plain_port)
        sid = client.request("/echo", method="POST", end_stream=False)
        await client.send()
        oversized = DataFrame(sid)
        oversized.data = b"x" * 20000
        await client.send(oversized.serialize())
        await client.until(lambda c: c.goaway() is not None)
        assert _goaway_code(client) == ErrorCodes.FRAME_SIZE_ERROR
        await client.aclose()
    async with h2_edge(tmp_path, http2={"initial_window_size": 1024}) as setup:
        # DATA beyond the stream's window, once the client knows it is 1024.
        client = await RawH2.open(setup.plain_port)
        await client.until(lambda c: c.conn.remote_settings.initial_window_size == 1024)
        sid = client.request("/slow/1", method="POST", end_stream=False)
        await client.send()
        frame = DataFrame(sid)
        frame.data = b"x" * 4096
        await client.send(frame.serialize())
        await client.until(lambda c: c.goaway() is not None)
        assert _goaway_code(client) == ErrorCodes.FLOW_CONTROL_ERROR
        await client.aclose()


async def test_rapid_reset_gets_enhance_your_calm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    async with h2_edge(tmp_path, http2={"max_resets": 50}) as setup:
        client = await RawH2.open(setup.plain_port)
        with trio.fail_after(10):
            for _ in range(200):
                sid = client.request("/slow/1")
                client.conn.reset_stream(sid, ErrorCodes.CANCEL)
                try:
                    await client.send()
                except trio.BrokenResourceError:
                    break
        await client.until(lambda c: c.goaway() is not None)
        assert _goaway_code(client) == ErrorCodes.ENHANCE_YOUR_CALM
        await client.until(lambda c: c.closed)
        await client.aclose()
    (connection,) = [
        r for r in access_records(caplog) if r.get("listener") == "plain" and "id" in r
    ]
    assert connection["termination"] == "client_error"
    assert "rapid reset" in connection["detail"]


async def test_continuation_flood_is_cut_off_by_a_byte_limit(tmp_path: Path) -> None:
    async with h2_edge(tmp_path) as setup:
        client = await RawH2.open(setup.plain_port)
        headers = HeadersFrame(1, flags=["END_STREAM"])
        headers.data = client.conn.encoder.encode(
            [
                (b":method", b"GET"),
                (b":scheme", b"http"),
                (b":path", b"/"),
                (b":authority", b"x"),
            ]
        )
        await client.send(headers.serialize())
        sent = 0
        with trio.fail_after(10):
            while sent < 1 << 20:  # the edge stops us long before 1 MiB
                continuation = ContinuationFrame(1)
                continuation.data = b"\x00" * 1000
                try:
                    await client.stream.send_all(continuation.serialize())
                except trio.BrokenResourceError:
                    break
                sent += 1000
                if sent > 32768:
                    break
        await client.until(lambda c: c.goaway() is not None)
        assert _goaway_code(client) == ErrorCodes.ENHANCE_YOUR_CALM
        await client.aclose()


@pytest.mark.parametrize("flood", ["ping", "settings", "window_update", "empty_data"])
async def test_control_and_empty_frame_floods(tmp_path: Path, flood: str) -> None:
    async with h2_edge(tmp_path, http2={"max_control_frames": 100}) as setup:
        client = await RawH2.open(setup.plain_port)
        conn = client.conn
        sid = client.request("/echo", method="POST", end_stream=False)
        with trio.fail_after(10):
            for index in range(300):
                if flood == "ping":
                    conn.ping(index.to_bytes(8, "big"))
                elif flood == "settings":
                    conn.update_settings(
                        {h2.settings.SettingCodes.MAX_FRAME_SIZE: 16384}
                    )
                elif flood == "window_update":
                    conn.increment_flow_control_window(1)
                else:
                    conn.send_data(sid, b"")
                try:
                    await client.send()
                except trio.BrokenResourceError:
                    break
        await client.until(lambda c: c.goaway() is not None)
        assert _goaway_code(client) == ErrorCodes.ENHANCE_YOUR_CALM
        await client.aclose()


async def test_zero_window_stall_is_timed_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    async with h2_edge(
        tmp_path, listener={"idle_timeout": 0.5}, http={"keepalive_timeout": 0.5}
    ) as setup:
        client = await RawH2.open(
            setup.plain_port, settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
        )
        sid = client.request("/big/100000")
        await client.send()
        await client.until(lambda c: c.ended(sid))
        (reset,) = client.of(h2.events.StreamReset, sid)
        assert reset.error_code == ErrorCodes.CANCEL
        assert client.body(sid) == b""
        # Nothing open: keepalive_timeout closes the connection.
        await client.until(lambda c: c.closed)
        assert _goaway_code(client) == ErrorCodes.NO_ERROR
        await client.aclose()
    (line,) = [r for r in access_records(caplog) if r.get("type") == "http"]
    assert line["termination"] == "client_error"
    assert "window" in line["detail"]


async def test_header_timeouts_per_connection_and_per_header_block(
    tmp_path: Path,
) -> None:
    async with h2_edge(tmp_path, http={"request_header_timeout": 0.5}) as setup:
        # The preface and nothing more.
        client = await RawH2.open(setup.plain_port)
        await client.until(lambda c: c.closed)
        assert _goaway_code(client) == ErrorCodes.NO_ERROR
        await client.aclose()
        # A first request served, then a header block never finished.
        client = await RawH2.open(setup.plain_port)
        first = client.request("/echo")
        await client.send()
        await client.until(lambda c: c.ended(first))
        headers = HeadersFrame(3, flags=["END_STREAM"])
        headers.data = client.conn.encoder.encode([(b":method", b"GET")])
        await client.send(headers.serialize())
        await client.until(lambda c: c.closed)
        assert client.goaway() is not None
        await client.aclose()


async def test_request_body_stall_gets_408(tmp_path: Path) -> None:
    async with h2_edge(tmp_path, listener={"idle_timeout": 0.5}) as setup:
        client = await RawH2.open(setup.plain_port)
        sid = client.request("/echo", method="POST", end_stream=False)
        client.conn.send_data(sid, b"start")
        await client.send()
        await client.until(lambda c: c.ended(sid))
        assert client.status(sid) == 408
        await client.aclose()


async def test_drain_sends_goaway_and_lets_the_stream_in_flight_finish(
    tmp_path: Path,
) -> None:
    # nghttp (nghttp2) keeps reading after a graceful GOAWAY, as browsers do;
    # that new streams are then refused is tested on the session.
    async with h2_edge(tmp_path) as setup:
        async with trio.open_nursery() as nursery:
            done: list[subprocess.CompletedProcess[bytes]] = []

            async def fetch() -> None:
                done.append(
                    await trio.run_process(
                        [
                            require("nghttp"),
                            "-nv",
                            f"http://127.0.0.1:{setup.plain_port}/slow/0.5",
                        ],
                        capture_stdout=True,
                        capture_stderr=True,
                    )
                )

            nursery.start_soon(fetch)
            await wait_until(lambda: bool(setup.backend.raw))
            setup.edge.drain()
        out = done[0].stdout.decode()
    goaway = out.index("recv GOAWAY frame")
    assert "error_code=NO_ERROR" in out[goaway:]
    assert "last_stream_id=13" in out[goaway:]
    assert ":status: 200" in out[goaway:]
    assert "END_STREAM" in out[goaway:]


# -- tlsedge check --------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        ("http", '["h2", "http/1.1"]', "", None),
        # A relay passes the ALPN through: h2 is for a backend that speaks it.
        ("tcp", '["h2", "http/1.1"]', "", None),
        (
            "http",
            '["h2"]',
            '[listeners.http2]\ncleartext = "prior-knowledge"\n',
            "listeners[0].http2.cleartext: 'prior-knowledge' is for plain listeners",
        ),
        (
            "tcp",
            '["h2"]',
            '[listeners.http2]\ncleartext = "prior-knowledge"\n',
            'listeners[0].http2: only applies with mode = "http"',
        ),
        (
            "http",
            '["h3", "h2"]',
            "",
            "listeners[0].tls.alpn[0]: 'h3' cannot be served in mode = \"http\"",
        ),
    ],
)
def test_tlsedge_check_accepts_h2_where_it_is_served(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: tuple[str, str, str, str | None],
) -> None:
    mode, alpn, http2, error = case
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "site.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "site.key"))
    path = tmp_path / "edge.toml"
    path.write_text(
        "[[listeners]]\n"
        f'name = "web"\nbind = "127.0.0.1:0"\nmode = "{mode}"\nbackend = "app"\n'
        f"{http2}"
        "[listeners.tls]\n"
        'certificates = [{ cert = "site.pem", key = "site.key" }]\n'
        f"alpn = {alpn}\n"
        '[[backends]]\nname = "app"\nservers = ["127.0.0.1:8080"]\n'
    )
    code = main(["check", str(path)])
    captured = capsys.readouterr()
    if error is None:
        assert code == 0, captured.err
    else:
        assert code == 2
        assert f"{path}: {error}" in captured.err


async def test_too_large_body_gets_413_and_the_rest_is_refused(tmp_path: Path) -> None:
    async with h2_edge(tmp_path, http={"max_body_size": 1000}) as setup:
        client = await RawH2.open(setup.plain_port)
        sid = client.request(
            "/echo",
            method="POST",
            headers=[("content-length", "5000")],
            end_stream=False,
        )
        await client.send()
        await client.until(lambda c: c.ended(sid))
        assert client.status(sid) == 413
        assert b"request body larger than 1000 bytes" in client.body(sid)
        (reset,) = client.of(h2.events.StreamReset, sid)
        assert reset.error_code == ErrorCodes.NO_ERROR
        assert not setup.backend.raw
        await client.aclose()


async def test_response_timeout_gets_504(tmp_path: Path) -> None:
    async with h2_edge(tmp_path, http={"response_timeout": 0.3}) as setup:
        client = await RawH2.open(setup.plain_port)
        sid = client.request("/slow/2")
        await client.send()
        await client.until(lambda c: c.ended(sid))
        assert client.status(sid) == 504
        await client.aclose()


async def test_a_client_gone_mid_stream_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    async with h2_edge(tmp_path) as setup:
        client = await RawH2.open(setup.plain_port)
        client.request("/slow/0.3")
        await client.send()
        await wait_until(lambda: bool(setup.backend.raw))
        await client.aclose()
        await wait_until(
            lambda: any(r.get("type") == "http" for r in access_records(caplog))
        )
    (line,) = [r for r in access_records(caplog) if r.get("type") == "http"]
    assert line["termination"] == "client_error"
    assert line["detail"] == "the connection ended before the response did"
    assert line["status"] is None


# -- the reactor driver: backpressure and cleanup with many streams -------------------


def _sockets() -> set[str]:
    """The sockets this process holds open (the edge's and the backend's)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:"):
                found.add(link)
    return found


async def test_a_client_that_does_not_read_holds_every_upstream_back(
    tmp_path: Path,
) -> None:
    # Ten responses of 16 MB to a client whose windows stay shut: each
    # upstream is read only as far as its stream can send (nothing), so what
    # the backends manage to write is what the sockets buffer, not the bodies.
    size = 16_000_000
    async with h2_edge(tmp_path) as setup:
        pool = setup.edge._keepalive_pool("app")
        client = await RawH2.open(
            setup.plain_port, settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
        )
        sids = [client.request(f"/big/{size}") for _ in range(10)]
        await client.send()
        await client.until(lambda c: len(c.of(h2.events.ResponseReceived)) == 10)
        sent = -1
        while sent != setup.backend.big_sent:  # until every backend is stuck
            sent = setup.backend.big_sent
            await trio.sleep(0.3)
        assert sent < size  # all ten together: less than one body
        assert not any(client.body(sid) for sid in sids)
        # One stream's window opens: it gets its whole body, the rest nothing.
        first = sids[0]
        client.conn.increment_flow_control_window(size, stream_id=first)
        client.conn.increment_flow_control_window(size)
        await client.send()
        with trio.fail_after(30):
            while not client.ended(first):
                await client.read()
        assert client.body(first) == b"x" * size
        assert not any(client.ended(sid) for sid in sids[1:])
        assert not any(client.body(sid) for sid in sids[1:])
        await client.aclose()
        # The nine cut exchanges are closed; the clean one goes to the pool.
        await wait_until(lambda: setup.backend.closed == 9)
        await wait_until(lambda: pool.idle_count() == 1)


async def test_a_stream_reset_mid_body_closes_its_upstream_connection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    async with h2_edge(tmp_path) as setup:
        pool = setup.edge._keepalive_pool("app")
        client = await RawH2.open(setup.plain_port)
        sid = client.request("/echo", method="POST", end_stream=False)
        client.conn.send_data(sid, b"x" * 1000)
        await client.send()
        await wait_until(lambda: b"x" * 1000 in setup.backend.received)
        client.conn.reset_stream(sid, ErrorCodes.CANCEL)
        await client.send()
        # Half a request upstream: that connection cannot be reused.
        await wait_until(lambda: setup.backend.closed == 1)
        assert pool.idle_count() == 0
        again = client.request("/echo")
        await client.send()
        await client.until(lambda c: c.ended(again))
        assert client.status(again) == 200
        assert len(setup.backend.raw) == 2
        await client.aclose()
    lines = [r for r in access_records(caplog) if r.get("type") == "http"]
    assert [r["termination"] for r in lines] == ["client_error", "ok"]
    assert lines[0]["detail"] == "client reset the stream (error code 8)"


async def test_a_client_gone_with_streams_open_closes_every_upstream(
    tmp_path: Path,
) -> None:
    async with h2_edge(tmp_path) as setup:
        before = _sockets()
        client = await RawH2.open(setup.plain_port)
        for _ in range(10):
            client.request("/hold")
        await client.send()
        await wait_until(lambda: setup.backend.holding == 10)
        opened = _sockets() - before
        assert len(opened) >= 22  # the client's two ends, 10 upstreams' two
        await client.aclose()
        # The edge closes its side of every upstream connection (the backend
        # sees EOF and closes its own): no socket of the connection is left.
        await wait_until(lambda: setup.backend.eofs == 10)
        await wait_until(lambda: not (_sockets() & opened))
        assert setup.edge._keepalive_pool("app").idle_count() == 0


async def test_an_edge_cancelled_with_requests_in_flight_ends_them_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Cancelled from outside (no drain first), the edge ends its connections
    # before their jobs' nursery closes: a backend that closes at that moment
    # makes a retry, which must not find that nursery closed (it did: the
    # connection failed with "Nursery is closed to new arrivals" and leaked
    # its upstream socket, which the leak check would report).
    caplog.set_level(logging.INFO, logger="tlsedge")
    with trio.CancelScope() as scope:
        async with h2_edge(tmp_path) as setup:
            client = await RawH2.open(setup.plain_port)
            for _ in range(4):
                client.request("/hold")
            await client.send()
            await wait_until(lambda: setup.backend.holding == 4)
            scope.cancel()
            await trio.sleep_forever()
    await client.aclose()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    records = access_records(caplog)
    assert [r["termination"] for r in records if "type" not in r] == ["drained"]
    # The streams too (they were logged as client_error).
    streams = [r for r in records if r.get("type") == "http"]
    assert [r["termination"] for r in streams] == ["drained"] * 4


async def test_drain_lets_every_stream_in_flight_finish(tmp_path: Path) -> None:
    async with h2_edge(tmp_path) as setup:
        async with trio.open_nursery() as nursery:
            done: list[subprocess.CompletedProcess[bytes]] = []

            async def fetch() -> None:
                done.append(
                    await trio.run_process(
                        [
                            require("nghttp"),
                            "-nv",
                            "-m",
                            "5",
                            f"http://127.0.0.1:{setup.plain_port}/slow/0.5",
                        ],
                        capture_stdout=True,
                        capture_stderr=True,
                    )
                )

            nursery.start_soon(fetch)
            await wait_until(lambda: setup.backend.received.count(b"/slow/0.5") == 5)
            setup.edge.drain()
        out = done[0].stdout.decode()
    goaway = out.index("recv GOAWAY frame")
    assert "error_code=NO_ERROR" in out[goaway:]
    # nghttp's five streams are 13 to 21: all accepted, all answered after it.
    assert "last_stream_id=21" in out[goaway:]
    assert out[goaway:].count(":status: 200") == 5


async def test_streams_to_a_tls_backend_with_send_proxy_keep_their_own_connections(
    tmp_path: Path,
) -> None:
    # Each upstream connection is dedicated to the client connection (a
    # PROXY header, then TLS): its streams reuse them, another client's never.
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert = ca.issue_cert("localhost")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    port = free_port()
    body = (
        "http { access_log off; default_type text/plain; "
        f"ssl_certificate {tmp_path / 'server.pem'}; "
        f"ssl_certificate_key {tmp_path / 'server.key'}; "
        "ssl_protocols TLSv1.2 TLSv1.3; "
        f"server {{ listen 127.0.0.1:{port} ssl proxy_protocol; "
        'location / { return 200 "conn=$connection proxy=$proxy_protocol_addr '
        'tls=$ssl_protocol\\n"; } } }'
    )
    with nginx(body, [port]):
        config = make_config(
            [
                {
                    "name": "web",
                    "backend": "nginx",
                    "mode": "http",
                    "http2": {"cleartext": "prior-knowledge"},
                }
            ],
            [
                {
                    "name": "nginx",
                    "servers": [f"127.0.0.1:{port}"],
                    "send_proxy": "v2",
                    "protocol": "tls",
                    "tls": {"ca": str(tmp_path / "ca.pem"), "sni": "localhost"},
                }
            ],
        )
        async with running_edge(config) as edge:
            used: list[set[str]] = []
            for _ in range(2):  # two client connections
                client = await RawH2.open(address_of(edge, "web")[1])
                rounds = []
                for _ in range(2):
                    sids = [client.request("/") for _ in range(5)]
                    await client.send()
                    await client.until(lambda c, sids=sids: _answered(c, *sids))
                    lines = [client.body(sid).decode() for sid in sids]
                    assert {line.partition(" ")[2] for line in lines} == {
                        "proxy=127.0.0.1 tls=TLSv1.3\n"
                    }
                    rounds.append({line.partition(" ")[0] for line in lines})
                await client.aclose()
                assert rounds[1] <= rounds[0]
                used.append(rounds[0])
    assert not used[0] & used[1]


async def test_window_updates_elsewhere_do_not_keep_a_stalled_stream_alive(
    tmp_path: Path,
) -> None:
    # The stream's window stays shut; the client opens the connection's a
    # byte at a time, more often than idle_timeout: the stream still times out.
    async with h2_edge(tmp_path, listener={"idle_timeout": 0.5}) as setup:
        client = await RawH2.open(
            setup.plain_port, settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
        )
        sid = client.request("/big/100000")
        await client.send()
        with trio.fail_after(10):
            while not client.ended(sid):
                client.conn.increment_flow_control_window(1)
                await client.send()
                with trio.move_on_after(0.1):
                    await client.read()
        (reset,) = client.of(h2.events.StreamReset, sid)
        assert reset.error_code == ErrorCodes.CANCEL
        await client.aclose()


async def test_a_held_upstream_connection_expires_as_a_pooled_one_would(
    tmp_path: Path,
) -> None:
    async with h2_edge(tmp_path) as setup:
        pool = setup.edge._keepalive_pool("app")
        pool.idle_timeout = 0.5
        client = await RawH2.open(setup.plain_port)
        busy = client.request("/slow/5")  # the connection is never idle
        first = client.request("/echo")
        await client.send()
        await client.until(lambda c: c.ended(first))
        # /echo's upstream connection is held for the next streams; unused
        # past the pool's idle timeout, it is closed (not parked).
        await wait_until(lambda: setup.backend.closed == 1)
        assert not client.ended(busy)
        assert pool.idle_count() == 0
        await client.aclose()


# -- connections with no task of their own -------------------------------------------


def _connection_tasks(edge: Edge) -> int:
    """The tasks in the edge's connections nursery (jobs that must await)."""
    assert edge._connections is not None
    return len(edge._connections.child_tasks)


async def test_idle_h2_connections_hold_no_task(tmp_path: Path) -> None:
    async with h2_edge(tmp_path) as setup:
        clients = [await RawH2.open(setup.plain_port) for _ in range(10)]
        for client in clients:
            sid = client.request("/")
            await client.send()
            await client.until(lambda c, sid=sid: _answered(c, sid))
            assert client.status(sid) == 200
        assert in_flight(setup.edge, "http") == 10
        assert _connection_tasks(setup.edge) == 0
        for client in clients:
            await client.aclose()
        await wait_until(lambda: not in_flight(setup.edge, "http"))


async def test_drain_deadline_ends_h2_streams_in_flight_and_connecting(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the drain deadline a stream whose request is upstream and one
    whose upstream connect still runs (in a task) end as ``drained``, with
    their connections, and no task is left."""
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    hang, hanging_now = trio.Event(), trio.Event()
    connect = UpstreamConnections.connect

    async def hanging(self: UpstreamConnections, new: NewConnection) -> Upstream:
        if hang.is_set():
            hanging_now.set()
            await trio.sleep_forever()
        return await connect(self, new)

    monkeypatch.setattr(UpstreamConnections, "connect", hanging)
    async with h2_edge(tmp_path, edge={"drain_timeout": 0.5}) as setup:
        edge = setup.edge
        busy = await RawH2.open(setup.plain_port)
        busy.request("/slow/30")
        await busy.send()
        await wait_until(lambda: bool(setup.backend.raw))
        hang.set()
        connecting = await RawH2.open(setup.plain_port)
        connecting.request("/never")
        await connecting.send()
        with trio.fail_after(5):
            await hanging_now.wait()
        assert _connection_tasks(edge) == 1  # the connect
        assert in_flight(edge, "http") == 2
        edge.drain()
        for client in (busy, connecting):
            await client.until(lambda c: False)  # until the edge closes it
        await wait_until(
            lambda: not in_flight(edge, "http") and _connection_tasks(edge) == 0
        )
        for client in (busy, connecting):
            await client.aclose()
        await wait_until(lambda: len(access_records(caplog)) == 4)
    records = access_records(caplog)
    streams = sorted(
        (r["target"], r["termination"]) for r in records if r.get("type") == "http"
    )
    assert streams == [("/never", "drained"), ("/slow/30", "drained")]
    assert [r["termination"] for r in records if "type" not in r] == ["drained"] * 2


# -- a response head's fields as HTTP/2 sends them ------------------------------------

_RESPONSE_NAMES = st.sampled_from(
    [
        b"Connection",
        b"Keep-Alive",
        b"TE",
        b"Upgrade",
        b"Proxy-Connection",
        b"Transfer-Encoding",
        b"Content-Length",
        b"Host",
        b"X-A",
        b"x-b",
        b"Set-Cookie",
    ]
)
_RESPONSE_VALUES = st.sampled_from(
    [b"close", b"x-a", b"X-A, host", b"content-length", b"chunked", b"1", b"x-b, TE"]
)


@given(st.lists(st.tuples(_RESPONSE_NAMES, _RESPONSE_VALUES), max_size=8))
def test_response_fields_are_the_end_to_end_ones_in_lowercase(
    fields: list[tuple[bytes, bytes]],
) -> None:
    lines = b"".join(name + b": " + value + b"\r\n" for name, value in fields)
    try:
        head = parse_response_head(
            b"HTTP/1.1 200 OK\r\n" + lines + b"\r\n", max_headers=100
        )
    except ResponseRejectedError:
        return
    # What the driver sent before it went straight from the head's fields.
    end_to_end = strip_hop_by_hop(head.headers, keep_upgrade=False)
    assert _response_fields(head) == [
        (name.lower(), value)
        for name, value in end_to_end
        if name.lower() not in {b"transfer-encoding", b"keep-alive", b"upgrade"}
    ]


_RESPONSE_HEAD_FIELDS = st.lists(
    st.tuples(
        st.one_of(
            _RESPONSE_NAMES, st.from_regex(rb"\A[!#$%&'*+.^_`|~0-9A-Za-z-]{1,6}\Z")
        ),
        st.one_of(_RESPONSE_VALUES, st.binary(max_size=8)),
    ),
    max_size=8,
)


@settings(max_examples=500, deadline=None)
@given(
    fields=_RESPONSE_HEAD_FIELDS,
    status=st.sampled_from([b"100", b"103", b"200", b"204", b"304", b"502"]),
)
def test_response_fields_need_none_of_h2s_outbound_validation_or_normalisation(
    fields: list[tuple[bytes, bytes]], status: bytes
) -> None:
    # `H2Session` turns h2's outbound validation and normalisation off: what
    # the driver sends of a response head the HTTP/1.1 parser accepted (as
    # fields, or as trailers) passes h2's validation, and its normalisation
    # (lowercase names, no surrounding whitespace, no connection-specific
    # field) would change nothing.
    lines = b"".join(name + b": " + value + b"\r\n" for name, value in fields)
    try:
        head = parse_response_head(
            b"HTTP/1.1 " + status + b" X\r\n" + lines + b"\r\n", max_headers=100
        )
    except ResponseRejectedError:
        return
    flags = h2.utilities.HeaderValidationFlags(
        is_client=False,
        is_trailer=False,
        is_response_header=True,
        is_push_promise=False,
    )
    for sent, sent_flags in [
        ([(b":status", status), *_response_fields(head)], flags),
        (
            _h2_fields(head.headers),
            flags._replace(is_trailer=True, is_response_header=False),
        ),
    ]:
        assert list(h2.utilities.validate_outbound_headers(sent, sent_flags)) == sent
        normalised = h2.utilities.normalize_outbound_headers(sent, sent_flags)
        assert [(n, v) for n, v in normalised] == sent
    if status in {b"100", b"103", b"204"}:
        assert b"content-length" not in [n for n, _ in _response_fields(head)]
