"""HTTP mode: request checks (sans-IO) and the h11 proxy over real sockets."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import re
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
import trio.testing
from hypothesis import given, strategies as st

from tests.peers import free_port, nginx, require
from tests.tlsedge.helpers import Backend, make_config, wait_until
from tlsedge._backends.keepalive import KeepAlivePool
from tlsedge._backends.upstream import BackendPool
from tlsedge._core.config import Config, ConfigError
from tlsedge._core.downstream import Downstream
from tlsedge._http.body import ChunkedDecoder
from tlsedge._http.gate import MAX_INFORMATIONAL
from tlsedge._http.head import RequestRejectedError, parse_request_head
from tlsedge._http.log import HttpConnectionResult
from tlsedge._http.rules import origin_form, strip_hop_by_hop
from tlsedge._pipeline.http.h1 import _HttpConnection, serve_http
from tlsedge._pipeline.http.site import HttpSite
from tlsedge._reactor.drain import Drain
from tlsedge._reactor.relay import set_abortive_close

# -- sans-IO: request-head checks ---------------------------------------------

GOOD_HEAD = b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n"


def test_good_heads_pass() -> None:
    parse_request_head(GOOD_HEAD, max_headers=100)
    parse_request_head(b"GET / HTTP/1.0\r\n\r\n", max_headers=100)
    parse_request_head(
        b"POST /x HTTP/1.1\r\nHost: [::1]:8080\r\nContent-Length:  12 \r\n\r\n",
        max_headers=100,
    )
    parse_request_head(
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: Chunked\r\n\r\n",
        max_headers=100,
    )


# Every vector is refused before h11 (or any backend) sees it.
SMUGGLING_VECTORS: list[tuple[str, bytes, int]] = [
    (
        "cl-and-te",
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        400,
    ),
    (
        "te-and-cl",
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 5\r\n\r\n",
        400,
    ),
    (
        "duplicate-cl-same",
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
        400,
    ),
    (
        "duplicate-cl-conflict",
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        400,
    ),
    ("cl-list", b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5, 5\r\n\r\n", 400),
    ("cl-plus", b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: +5\r\n\r\n", 400),
    ("cl-minus", b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -5\r\n\r\n", 400),
    (
        "cl-inner-space",
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1 0\r\n\r\n",
        400,
    ),
    ("cl-hex", b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 0x5\r\n\r\n", 400),
    (
        "cl-huge",
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 99999999999999999999\r\n\r\n",
        400,
    ),
    (
        "space-before-colon",
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length : 5\r\n\r\n",
        400,
    ),
    (
        "te-twice",
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        400,
    ),
    (
        "te-obfuscated",
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: xchunked\r\n\r\n",
        501,
    ),
    (
        "te-list",
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        501,
    ),
    (
        "te-garbage",
        b'POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: "chunked"\r\n\r\n',
        400,
    ),
    (
        "te-http10",
        b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
        400,
    ),
    (
        "obs-fold",
        b"GET / HTTP/1.1\r\nHost: h\r\nX-A: a\r\n b\r\n\r\n",
        400,
    ),
    (
        "obs-fold-te",
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding:\r\n chunked\r\n\r\n",
        400,
    ),
    ("bare-lf", b"GET / HTTP/1.1\nHost: h\n\n", 400),
    ("bare-lf-inside", b"GET / HTTP/1.1\r\nHost: h\nX: y\r\n\r\n", 400),
    ("bare-cr", b"GET / HTTP/1.1\r\nHost: h\rX: y\r\n\r\n", 400),
    ("nul", b"GET / HTTP/1.1\r\nHost: h\r\nX: a\x00b\r\n\r\n", 400),
    ("missing-host", b"GET / HTTP/1.1\r\nX: y\r\n\r\n", 400),
    ("two-hosts", b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    ("bad-host-space", b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", 400),
    ("bad-host-slash", b"GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", 400),
    ("bad-host-userinfo", b"GET / HTTP/1.1\r\nHost: u@a\r\n\r\n", 400),
    ("bad-request-line", b"GET  / HTTP/1.1\r\nHost: h\r\n\r\n", 400),
    ("http2-version", b"GET / HTTP/2.0\r\nHost: h\r\n\r\n", 505),
]


@pytest.mark.parametrize(
    ("head", "status"),
    [pytest.param(head, status, id=name) for name, head, status in SMUGGLING_VECTORS],
)
def test_parse_request_head_refuses(head: bytes, status: int) -> None:
    with pytest.raises(RequestRejectedError) as info:
        parse_request_head(head, max_headers=100)
    assert info.value.status == status


def test_too_many_headers_is_431() -> None:
    head = b"GET / HTTP/1.1\r\nHost: h\r\n" + b"X: y\r\n" * 10 + b"\r\n"
    parse_request_head(head, max_headers=11)
    with pytest.raises(RequestRejectedError) as info:
        parse_request_head(head, max_headers=10)
    assert info.value.status == 431


# -- sans-IO: request targets -----------------------------------------------------

TARGETS: list[tuple[bytes, bytes, bytes, bytes | None]] = [
    (b"GET", b"/x?y=1", b"/x?y=1", None),
    (b"OPTIONS", b"*", b"*", None),
    (b"GET", b"http://evil.test/x?y=1", b"/x?y=1", b"evil.test"),
    (b"GET", b"HTTPS://Evil.Test:8443/a/b", b"/a/b", b"Evil.Test:8443"),
    (b"GET", b"http://evil.test", b"/", b"evil.test"),
    (b"GET", b"http://evil.test?q", b"/?q", b"evil.test"),
    (b"GET", b"http://[2001:db8::1]:8080/", b"/", b"[2001:db8::1]:8080"),
    (b"OPTIONS", b"http://evil.test", b"*", b"evil.test"),
    (b"OPTIONS", b"http://evil.test/", b"/", b"evil.test"),
]


@pytest.mark.parametrize(("method", "target", "sent", "authority"), TARGETS)
def test_origin_form(
    method: bytes, target: bytes, sent: bytes, authority: bytes | None
) -> None:
    assert origin_form(method, target) == (sent, authority)


BAD_TARGETS: dict[str, tuple[bytes, str]] = {
    "ftp-scheme": (b"ftp://evil.test/x", "scheme 'ftp'"),
    "userinfo": (b"http://user:pw@evil.test/x", "userinfo"),
    "no-slashes": (b"http:evil.test/x", "without '//host'"),
    "empty-host": (b"http:///x", "empty host"),
    "port-only": (b"http://:80/x", "empty host"),
    "fragment": (b"http://evil.test/x#top", "fragment"),
    "bad-host": (b"http://ev%il<.test/x", "malformed host"),
    "bad-ipv6": (b"http://[::1/x", "malformed host"),
    "asterisk-get": (b"*", "only for OPTIONS"),
    "relative": (b"x/y", "malformed request target"),
    "authority-form": (b"evil.test:443", "scheme 'evil.test'"),
}


@pytest.mark.parametrize(
    ("target", "reason"), list(BAD_TARGETS.values()), ids=list(BAD_TARGETS)
)
def test_origin_form_refuses(target: bytes, reason: str) -> None:
    with pytest.raises(RequestRejectedError, match=re.escape(reason)) as info:
        origin_form(b"GET", target)
    assert info.value.status == 400


# -- sans-IO: chunked body decoder ----------------------------------------------


def scan(body: bytes) -> ChunkedDecoder:
    scanner = ChunkedDecoder(max_trailer_bytes=1024, max_trailers=4)
    scanner.feed(body)
    return scanner


def test_chunk_scanner_accepts_and_finds_the_end() -> None:
    body = b'5\r\nhello\r\n1;ext="q\\"x";a\r\n!\r\n0\r\nX-Sum: 1\r\n\r\n'
    scanner = scan(body + b"GET / HTTP/1.1\r\n")
    assert scanner.done
    assert scanner.excess == len(b"GET / HTTP/1.1\r\n")


BAD_CHUNKS = {
    "0x-prefix": b"0x10\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n",
    "negative": b"-1\r\na\r\n0\r\n\r\n",
    "overflow": b"1" + b"0" * 16 + b"\r\na\r\n0\r\n\r\n",
    "space-after-size": b"5 \r\nhello\r\n0\r\n\r\n",
    "space-before-size": b" 5\r\nhello\r\n0\r\n\r\n",
    "empty-size": b"\r\nhello\r\n0\r\n\r\n",
    "bare-lf-size": b"5\nhello\r\n0\r\n\r\n",
    "bare-lf-after-data": b"5\r\nhello\n0\r\n\r\n",
    "data-too-long": b"5\r\nhelloX\r\n0\r\n\r\n",
    "bad-extension": b"5;=x\r\nhello\r\n0\r\n\r\n",
    "obs-fold-trailer": b"0\r\nX: a\r\n b\r\n\r\n",
    "bad-trailer": b"0\r\nnot a header\r\n\r\n",
}


@pytest.mark.parametrize("body", list(BAD_CHUNKS.values()), ids=list(BAD_CHUNKS))
def test_chunk_scanner_refuses(body: bytes) -> None:
    with pytest.raises(RequestRejectedError):
        scan(body)


def test_chunk_scanner_trailer_limits() -> None:
    with pytest.raises(RequestRejectedError) as info:
        scan(b"0\r\n" + b"X: y\r\n" * 5 + b"\r\n")
    assert info.value.status == 431


@given(st.lists(st.integers(0, 60), max_size=6), st.binary(max_size=10))
def test_chunk_scanner_any_split_same_result(cuts: list[int], tail: bytes) -> None:
    body = b"a\r\n0123456789\r\n3;x=y\r\nabc\r\n0\r\nT: v\r\n\r\n"
    data = body + tail
    scanner = ChunkedDecoder(max_trailer_bytes=1024, max_trailers=4)
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        stop = min(cut, len(data))
        scanner.feed(data[start:stop])
        start = max(start, stop)
    assert scanner.done
    assert scanner.excess == len(tail)


def test_strip_hop_by_hop() -> None:
    headers = [
        (b"Host", b"h"),
        (b"Connection", b"keep-alive, X-Secret, content-length, Host"),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Secret", b"1"),
        (b"Content-Length", b"3"),
        (b"TE", b"trailers"),
        (b"Upgrade", b"websocket"),
        (b"Proxy-Connection", b"keep-alive"),
    ]
    assert strip_hop_by_hop(headers, keep_upgrade=False) == [
        (b"Host", b"h"),
        (b"Content-Length", b"3"),
    ]
    assert strip_hop_by_hop(headers, keep_upgrade=True) == [
        (b"Host", b"h"),
        (b"Content-Length", b"3"),
        (b"Upgrade", b"websocket"),
        (b"Connection", b"upgrade"),
    ]


# -- backends -------------------------------------------------------------------

PATTERN = bytes(range(256)) * 256  # 64 KiB


def pattern_bytes(size: int) -> Iterable[bytes]:
    while size > 0:
        chunk = PATTERN[: min(size, len(PATTERN))]
        size -= len(chunk)
        yield chunk


def pattern_sha256(size: int) -> str:
    digest = hashlib.sha256()
    for chunk in pattern_bytes(size):
        digest.update(chunk)
    return digest.hexdigest()


async def _next(conn: h11.Connection, stream: trio.SocketStream) -> h11.Event:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
            continue
        assert isinstance(event, h11.Event)
        return event


@dataclass
class EchoBackend:
    """An h11 backend; by default answers JSON describing what it received."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    close_on_request: int | None = None  # drop the connection at this request no.
    backend: Backend | None = None

    @property
    def address(self) -> str:
        assert self.backend is not None
        return self.backend.address

    @property
    def accepted(self) -> int:
        assert self.backend is not None
        return self.backend.accepted

    async def start(self, nursery: trio.Nursery) -> EchoBackend:
        self.backend = await Backend(self.handle).start(nursery)
        return self

    async def handle(self, stream: trio.SocketStream) -> None:
        # The proxy cuts requests it refuses half way: that is not a test failure.
        with contextlib.suppress(h11.RemoteProtocolError):
            await self.serve(stream)

    async def serve(self, stream: trio.SocketStream) -> None:
        assert self.backend is not None
        conn_no = self.backend.accepted
        conn = h11.Connection(h11.SERVER)
        request_no = 0
        while True:
            event = await _next(conn, stream)
            if isinstance(event, h11.ConnectionClosed):
                return
            assert isinstance(event, h11.Request), event
            request_no += 1
            if self.close_on_request == request_no:
                return
            if conn.they_are_waiting_for_100_continue:
                await stream.send_all(
                    conn.send(h11.InformationalResponse(status_code=100, headers=[]))
                    or b""
                )
            path = event.target.decode()
            if path == "/upgrade":
                await self.upgrade(conn, stream, event)
                return
            digest = hashlib.sha256()
            size = 0
            trailers: list[list[str]] = []
            while True:
                body_event = await _next(conn, stream)
                if isinstance(body_event, h11.Data):
                    digest.update(body_event.data)
                    size += len(body_event.data)
                elif isinstance(body_event, h11.EndOfMessage):
                    trailers = [[n.decode(), v.decode()] for n, v in body_event.headers]
                    break
            info = {
                "method": event.method.decode(),
                "target": path,
                "headers": [
                    [n.decode(), v.decode("latin-1")] for n, v in event.headers
                ],
                "size": size,
                "sha256": digest.hexdigest(),
                "trailers": trailers,
                "connection": conn_no,
                "request": request_no,
            }
            self.requests.append(info)
            if not await self.respond(conn, stream, path, info):
                return
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()

    async def respond(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        path: str,
        info: dict[str, Any],
    ) -> bool:
        send = stream.send_all
        if path.startswith("/download/"):
            size = int(path.rsplit("/", 1)[1])
            await send(
                conn.send(
                    h11.Response(
                        status_code=200, headers=[("Content-Length", str(size))]
                    )
                )
                or b""
            )
            for chunk in pattern_bytes(size):
                await send(conn.send(h11.Data(data=chunk)) or b"")
            await send(conn.send(h11.EndOfMessage()) or b"")
            return True
        if path == "/chunked":
            await send(
                conn.send(
                    h11.Response(
                        status_code=200,
                        headers=[
                            ("Transfer-Encoding", "chunked"),
                            ("Trailer", "X-Sum"),
                        ],
                    )
                )
                or b""
            )
            for part in (b"first,", b"second,", b"third"):
                await send(conn.send(h11.Data(data=part)) or b"")
            await send(conn.send(h11.EndOfMessage(headers=[("X-Sum", "3")])) or b"")
            return True
        if path == "/hang":
            await trio.sleep_forever()
        if path.startswith("/slow/"):
            await trio.sleep(float(path.rsplit("/", 1)[1]))
        if path in {"/die-cl", "/die-chunked"}:
            framing = (
                ("Content-Length", "1000")
                if path == "/die-cl"
                else ("Transfer-Encoding", "chunked")
            )
            await send(
                conn.send(h11.Response(status_code=200, headers=[framing])) or b""
            )
            await send(conn.send(h11.Data(data=b"x" * 100)) or b"")
            await trio.sleep(0.05)
            set_abortive_close(stream)
            return False
        body = json.dumps(info).encode()
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
        ]
        headers += [
            ("Connection", "keep-alive, X-Hop"),
            ("X-Hop", "1"),
            ("Keep-Alive", "5"),
        ]
        if path == "/close":
            headers.append(("Connection", "close"))
        await send(conn.send(h11.Response(status_code=200, headers=headers)) or b"")
        await send(conn.send(h11.Data(data=body)) or b"")
        await send(conn.send(h11.EndOfMessage()) or b"")
        return True

    async def upgrade(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request
    ) -> None:
        assert (await _next(conn, stream)) == h11.EndOfMessage()
        head = conn.send(
            h11.InformationalResponse(
                status_code=101,
                headers=[("Upgrade", "echo"), ("Connection", "Upgrade")],
            )
        )
        # The first bytes of the new protocol go out with the 101 head.
        await stream.send_all((head or b"") + b"server-hello|")
        early, _ = conn.trailing_data
        if early:
            await stream.send_all(early.upper())
        while True:
            data = await stream.receive_some(65536)
            if not data:
                break
            await stream.send_all(bytes(data).upper())
        await stream.send_all(b"|bye")


# -- the proxy under test --------------------------------------------------------


@dataclass
class Proxy:
    address: tuple[str, int]
    config: Config
    pool: BackendPool
    keepalive: KeepAlivePool
    drain: Drain
    results: list[HttpConnectionResult]


@asynccontextmanager
async def running_proxy(
    servers: list[str],
    *,
    http: dict[str, Any] | None = None,
    forwarded: dict[str, Any] | None = None,
    backend: dict[str, Any] | None = None,
    host: str = "127.0.0.1",
    idle_timeout: float = 30.0,
    proxy_header: bytes | None = None,
) -> AsyncIterator[Proxy]:
    listener: dict[str, Any] = {
        "name": "web",
        "mode": "http",
        "backend": "app",
        "idle_timeout": idle_timeout,
    }
    if http is not None:
        listener["http"] = http
    if forwarded is not None:
        listener["forwarded"] = forwarded
    config = make_config(
        [listener],
        [
            {
                "name": "app",
                "servers": servers,
                "retries": 0,
                "connect_timeout": 2.0,
                **(backend or {}),
            }
        ],
    )
    pool = await BackendPool.create(config.backends[0])
    keepalive = KeepAlivePool()
    drain = Drain()
    results: list[HttpConnectionResult] = []

    async def handler(stream: trio.SocketStream) -> None:
        peer = stream.socket.getpeername()
        local = stream.socket.getsockname()
        try:
            result = await serve_http(
                stream,
                Downstream(
                    id=os.urandom(4).hex(),
                    listener="web",
                    peer=(peer[0], peer[1]),
                    client=(peer[0], peer[1]),
                    destination=(local[0], local[1]),
                ),
                HttpSite(
                    listener=config.listeners[0],
                    backend=pool,
                    keepalive=keepalive,
                    drain=drain,
                ),
                proxy_header=proxy_header,
            )
            results.append(result)
        finally:
            await trio.aclose_forcefully(stream)

    try:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_tcp, handler, 0, host=host)
            )
            sockname = listeners[0].socket.getsockname()
            yield Proxy(
                (sockname[0], sockname[1]), config, pool, keepalive, drain, results
            )
            nursery.cancel_scope.cancel()
    finally:
        keepalive.close()


# -- clients ----------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    trailers: list[tuple[bytes, bytes]]

    def header(self, name: bytes) -> bytes | None:
        values = [v for n, v in self.headers if n == name.lower()]
        return b", ".join(values) if values else None

    def json(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.body)
        return result


def seen_headers(info: dict[str, Any], name: str) -> list[str]:
    return [v for n, v in info["headers"] if n == name.lower()]


class Client:
    """One client connection speaking h11 (one request at a time)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, address: tuple[str, int]) -> Client:
        return cls(await trio.open_tcp_stream(*address))

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def request(  # noqa: PLR0917
        self,
        method: str = "GET",
        target: str = "/",
        headers: list[tuple[str, str]] | None = None,
        body: bytes | Iterable[bytes] = b"",
        trailers: list[tuple[str, str]] | None = None,
        sink: Callable[[bytes], None] | None = None,
    ) -> Response:
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        all_headers = [("Host", "example.com"), *(headers or [])]
        if (
            isinstance(body, bytes)
            and body
            and not any(
                n.lower() in {"content-length", "transfer-encoding"}
                for n, _ in all_headers
            )
        ):
            all_headers.append(("Content-Length", str(len(body))))
        await self.stream.send_all(
            self.conn.send(
                h11.Request(method=method, target=target, headers=all_headers)
            )
            or b""
        )
        async with trio.open_nursery() as nursery:

            async def send_body() -> None:
                chunks = [body] if isinstance(body, bytes) else body
                for chunk in chunks:
                    if chunk:
                        await self.stream.send_all(
                            self.conn.send(h11.Data(data=chunk)) or b""
                        )
                await self.stream.send_all(
                    self.conn.send(h11.EndOfMessage(headers=trailers or [])) or b""
                )

            nursery.start_soon(send_body)
            return await self.read_response(sink)

    async def read_response(
        self, sink: Callable[[bytes], None] | None = None
    ) -> Response:
        response: h11.Response | None = None
        body = bytearray()
        while True:
            event = await _next(self.conn, self.stream)
            if isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                if sink is not None:
                    sink(bytes(event.data))
                else:
                    body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert response is not None
                return Response(
                    response.status_code,
                    list(response.headers),
                    bytes(body),
                    list(event.headers),
                )


async def wait_results(proxy: Proxy, count: int = 1) -> list[HttpConnectionResult]:
    """Wait until *count* client connections have ended."""
    with trio.fail_after(10):
        while len(proxy.results) < count:  # noqa: ASYNC110
            await trio.sleep(0.01)
    return proxy.results


async def get(address: tuple[str, int], target: str = "/", **kwargs: Any) -> Response:
    client = await Client.open(address)
    try:
        return await client.request("GET", target, **kwargs)
    finally:
        await client.aclose()


async def raw(
    address: tuple[str, int], data: bytes, *, eof: bool = False, then: bytes = b""
) -> bytes:
    """Send raw bytes (and *then* a moment later); read until the proxy
    closes (or resets)."""
    stream = await trio.open_tcp_stream(*address)
    try:
        await stream.send_all(data)
        if then:
            await trio.sleep(0.1)
            await stream.send_all(then)
        if eof:
            await stream.send_eof()
        out = bytearray()
        with trio.fail_after(10):
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                out += chunk
        return bytes(out)
    finally:
        await stream.aclose()


def parse_responses(data: bytes, methods: list[bytes] | None = None) -> list[Response]:
    """Every response in *data* (a pipelined stream), in order."""
    conn = h11.Connection(h11.CLIENT)
    conn.receive_data(data)
    out: list[Response] = []
    for method in methods or [b"GET"] * 100:
        conn.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
        conn.send(h11.EndOfMessage())
        response: h11.Response | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                return out
            if isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert response is not None
                out.append(
                    Response(
                        response.status_code, list(response.headers), bytes(body), []
                    )
                )
                break
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return out
        conn.start_next_cycle()
    return out


@asynccontextmanager
async def echo_and_proxy(**kwargs: Any) -> AsyncIterator[tuple[EchoBackend, Proxy]]:
    async with trio.open_nursery() as nursery:
        echo = await EchoBackend().start(nursery)
        async with running_proxy([echo.address], **kwargs) as proxy:
            yield echo, proxy
        nursery.cancel_scope.cancel()


# -- forwarding headers end to end -------------------------------------------------


async def test_forwarding_headers_replace_spoofed_ones() -> None:
    async with echo_and_proxy(forwarded={"forwarded": True}) as (_, proxy):
        response = await get(
            proxy.address,
            "/path?q=1",
            headers=[
                ("X-Forwarded-For", "1.2.3.4"),
                ("X-Forwarded-Proto", "https"),
                ("X-Real-IP", "1.2.3.4"),
                ("Forwarded", "for=1.2.3.4"),
                ("X-Forwarded-Host", "evil"),
                ("X-Forwarded-Port", "1"),
                ("Connection", "X-Private"),
                ("X-Private", "secret"),
            ],
        )
    assert response.status == 200
    info = response.json()
    assert info["target"] == "/path?q=1"
    port = proxy.address[1]
    assert seen_headers(info, "x-forwarded-for") == ["127.0.0.1"]
    assert seen_headers(info, "x-forwarded-proto") == ["http"]
    assert seen_headers(info, "x-forwarded-port") == [str(port)]
    assert seen_headers(info, "x-real-ip") == []
    assert seen_headers(info, "x-forwarded-host") == []
    assert seen_headers(info, "x-private") == []
    (fwd,) = seen_headers(info, "forwarded")
    assert re.fullmatch(
        rf'for="127\.0\.0\.1:\d+";proto=http;host=example\.com;by="127\.0\.0\.1:{port}"',
        fwd,
    ), fwd
    # Hop-by-hop fields of the response never reach the client.
    assert response.header(b"x-hop") is None
    assert response.header(b"keep-alive") is None


async def _one(address: tuple[str, int], head: bytes) -> Response:
    """Send one raw request head (the proxy answers and closes); its response."""
    (response,) = parse_responses(await raw(address, head))
    return response


@pytest.mark.parametrize(
    ("request_line", "host", "target", "backend_host"),
    [
        (b"GET http://evil.test/x?y=1 HTTP/1.1", b"good.test", "/x?y=1", "evil.test"),
        (b"GET HTTP://evil.test:8080 HTTP/1.1", b"good.test", "/", "evil.test:8080"),
        (b"OPTIONS http://evil.test HTTP/1.1", b"good.test", "*", "evil.test"),
        (b"GET http://evil.test/x HTTP/1.0", None, "/x", "evil.test"),
    ],
)
async def test_absolute_form_target_rewritten_to_origin_form_and_host(
    request_line: bytes, host: bytes | None, target: str, backend_host: str
) -> None:
    # RFC 9112 3.2.2: the target's authority wins over Host. The backend must
    # get one story: origin-form target, Host and Forwarded host= agree.
    head = request_line + b"\r\n"
    if host is not None:
        head += b"Host: " + host + b"\r\n"
    head += b"Connection: close\r\n\r\n"
    async with echo_and_proxy(forwarded={"forwarded": True}) as (_, proxy):
        response = await _one(proxy.address, head)
    assert response.status == 200
    info = response.json()
    assert info["target"] == target
    assert seen_headers(info, "host") == [backend_host]
    (fwd,) = seen_headers(info, "forwarded")
    assert f";host={backend_host};" in fwd or f';host="{backend_host}";' in fwd, fwd


@pytest.mark.parametrize(
    "target",
    [
        b"ftp://evil.test/x",
        b"http://user@evil.test/x",
        b"http:///x",
        b"http://evil.test/x#frag",
        b"*",
        b"x",
    ],
)
async def test_bad_request_targets_refused_with_400(target: bytes) -> None:
    async with echo_and_proxy() as (echo, proxy):
        out = await raw(
            proxy.address, b"GET " + target + b" HTTP/1.1\r\nHost: good.test\r\n\r\n"
        )
    assert out.startswith(b"HTTP/1.1 400 "), out
    assert b"\r\nconnection: close\r\n" in out.lower()
    assert echo.accepted == 0


UNDERSCORED = [
    ("X_Forwarded_For", "6.6.6.6"),
    ("X_Real_IP", "6.6.6.6"),
    ("X_Forwarded_Proto", "https"),
    ("Foo_Bar", "1"),
]


@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trusted"])
async def test_header_names_with_underscores_dropped(trusted: bool) -> None:
    # WSGI/CGI would read X_Forwarded_For as HTTP_X_FORWARDED_FOR (nginx's
    # underscores_in_headers off): by default no "_" name reaches the backend.
    forwarded = {"trusted_proxies": ["127.0.0.1"]} if trusted else {}
    async with echo_and_proxy(forwarded=forwarded) as (_, proxy):
        client = await Client.open(proxy.address)
        response = await client.request(
            "POST",
            "/",
            headers=[*UNDERSCORED, ("Transfer-Encoding", "chunked")],
            body=[b"abc"],
            trailers=[("Foo_Bar", "t"), ("X_Real_IP", "6.6.6.6"), ("X-Sum", "1")],
        )
        await client.aclose()
    info = response.json()
    names = [name for name, _ in info["headers"]]
    assert not [name for name in names if "_" in name], names
    assert seen_headers(info, "x-forwarded-for") == ["127.0.0.1"]
    assert seen_headers(info, "x-forwarded-proto") == ["http"]
    assert info["trailers"] == [["x-sum", "1"]]


def test_underscores_in_headers_must_be_a_boolean() -> None:
    listener = {"name": "web", "mode": "http", "backend": "app"}
    backend = {"name": "app", "servers": ["127.0.0.1:1"]}
    config = make_config([{**listener, "http": {}}], [backend])
    assert config.listeners[0].http.underscores_in_headers is False
    with pytest.raises(ConfigError) as info:
        make_config([{**listener, "http": {"underscores_in_headers": "on"}}], [backend])
    assert str(info.value) == (
        "listeners[0].http.underscores_in_headers: expected true or false, "
        "got a string ('on')"
    )


async def test_underscores_in_headers_on_keeps_others_not_forwarding_lookalikes() -> (
    None
):
    async with echo_and_proxy(http={"underscores_in_headers": True}) as (_, proxy):
        client = await Client.open(proxy.address)
        response = await client.request(
            "POST",
            "/",
            headers=[*UNDERSCORED, ("Transfer-Encoding", "chunked")],
            body=[b"abc"],
            trailers=[("Foo_Bar", "t"), ("X_Real_IP", "6.6.6.6")],
        )
        await client.aclose()
    info = response.json()
    assert seen_headers(info, "foo_bar") == ["1"]
    for name in ("x_forwarded_for", "x_real_ip", "x_forwarded_proto"):
        assert seen_headers(info, name) == [], name
    assert seen_headers(info, "x-forwarded-for") == ["127.0.0.1"]
    assert info["trailers"] == [["foo_bar", "t"]]


async def test_trusted_proxy_chain_is_appended() -> None:
    forwarded = {"trusted_proxies": ["127.0.0.0/8"], "forwarded": True}
    async with echo_and_proxy(forwarded=forwarded) as (_, proxy):
        response = await get(
            proxy.address,
            headers=[
                ("X-Forwarded-For", "203.0.113.9"),
                ("X-Forwarded-Proto", "https"),
                ("Forwarded", "for=203.0.113.9;proto=https"),
            ],
        )
    info = response.json()
    assert seen_headers(info, "x-forwarded-for") == ["203.0.113.9, 127.0.0.1"]
    assert seen_headers(info, "x-forwarded-proto") == ["https"]
    (fwd,) = seen_headers(info, "forwarded")
    assert fwd.startswith('for=203.0.113.9;proto=https, for="127.0.0.1:')


async def test_ipv6_client() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    async with echo_and_proxy(host="::1", forwarded={"forwarded": True}) as (_, proxy):
        response = await get(proxy.address)
    info = response.json()
    assert seen_headers(info, "x-forwarded-for") == ["::1"]
    (fwd,) = seen_headers(info, "forwarded")
    assert re.fullmatch(
        rf'for="\[::1\]:\d+";proto=http;host=example\.com;by="\[::1\]:{proxy.address[1]}"',
        fwd,
    ), fwd


async def test_request_id_generated_logged_and_kept_from_trusted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    async with echo_and_proxy(forwarded={"request_id": "X-Request-Id"}) as (_, proxy):
        response = await get(proxy.address, headers=[("X-Request-Id", "spoofed")])
    (rid,) = seen_headers(response.json(), "x-request-id")
    assert re.fullmatch("[0-9a-f]{32}", rid)
    lines = [
        json.loads(r.getMessage()) for r in caplog.records if r.name == "tlsedge.access"
    ]
    (line,) = [x for x in lines if x.get("type") == "http"]
    assert line["request_id"] == rid
    assert line["method"] == "GET"
    assert line["target"] == "/"
    assert line["status"] == 200
    assert line["termination"] == "ok"
    assert line["bytes_out"] > 0
    assert line["server"].startswith("127.0.0.1:")
    for key in ("connect", "first_byte", "total"):
        assert 0 <= line[key] < 5
    forwarded = {"request_id": "X-Request-Id", "trusted_proxies": ["127.0.0.1"]}
    async with echo_and_proxy(forwarded=forwarded) as (_, proxy):
        response = await get(proxy.address, headers=[("X-Request-Id", "abc-123")])
    assert seen_headers(response.json(), "x-request-id") == ["abc-123"]


# -- keep-alive and pipelining ----------------------------------------------------


async def test_keepalive_on_both_sides() -> None:
    async with echo_and_proxy() as (echo, proxy):
        client = await Client.open(proxy.address)
        for _ in range(5):
            response = await client.request("GET", "/")
            assert response.status == 200
        await client.aclose()
        # The client connection held its upstream connection; once it is
        # gone, the next client connection reuses it from the pool.
        for _ in range(2):
            await wait_until(lambda: proxy.keepalive.idle_count() == 1)
            response = await get(proxy.address)
        assert echo.accepted == 1
        assert [r["request"] for r in echo.requests] == [1, 2, 3, 4, 5, 6, 7]
        await wait_until(lambda: proxy.keepalive.idle_count() == 1)
        # An upstream "Connection: close" is not pooled (and not passed on).
        response = await get(proxy.address, "/close")
        assert response.header(b"connection") is None
        await get(proxy.address)
        assert echo.accepted == 2


async def test_an_ended_connection_is_not_kept_alive_by_its_timers() -> None:
    # The reactor's timer heap keeps what it is given until the deadline
    # (keepalive_timeout: an hour here); the connection itself, with its
    # session, buffers and log record, must be let go when it ends.
    async with echo_and_proxy(http={"keepalive_timeout": 3600.0}) as (_, proxy):
        client = await Client.open(proxy.address)
        assert (await client.request("GET", "/")).status == 200
        await client.aclose()
        await wait_until(lambda: len(proxy.results) == 1)
        gc.collect()
        assert not [
            connection
            for connection in gc.get_objects()
            if isinstance(connection, _HttpConnection)
            and connection.result is proxy.results[0]
        ]


async def test_pipelined_requests_answered_in_order() -> None:
    async with echo_and_proxy() as (echo, proxy):
        data = (
            b"".join(b"GET /%d HTTP/1.1\r\nHost: h\r\n\r\n" % i for i in range(3))
            + b"POST /3 HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n"
            + b"Connection: close\r\n\r\nbody"
        )
        out = await raw(proxy.address, data)
        responses = parse_responses(out)
        assert [r.json()["target"] for r in responses] == ["/0", "/1", "/2", "/3"]
        assert responses[3].json()["size"] == 4
        assert responses[3].header(b"connection") == b"close"
        assert echo.accepted == 1


async def test_http10_client_and_leading_crlf() -> None:
    async with echo_and_proxy() as (_, proxy):
        out = await raw(proxy.address, b"\r\nGET /old HTTP/1.0\r\n\r\n")
    (response,) = parse_responses(out)
    info = response.json()
    assert info["target"] == "/old"
    assert seen_headers(info, "host") == [
        f"127.0.0.1:{info and proxy.config.backends[0].servers[0].address.port}"
    ]


async def test_http10_client_gets_a_chunked_response_delimited_by_the_close() -> None:
    # HTTP/1.0 has no chunked coding: the body goes as it is, the end is our
    # close, and the trailers are left out.
    async with echo_and_proxy() as (_, proxy):
        out = await raw(proxy.address, b"GET /chunked HTTP/1.0\r\n\r\n")
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding" not in head.lower()
    assert b"\r\nConnection: close" in head
    assert body == b"first,second,third"


# -- bodies -----------------------------------------------------------------------


async def test_chunked_both_ways_with_trailers() -> None:
    async with echo_and_proxy() as (_, proxy):
        client = await Client.open(proxy.address)
        response = await client.request(
            "POST",
            "/",
            headers=[("Transfer-Encoding", "chunked")],
            body=[b"abc", b"def", b"g" * 70000],
            trailers=[("X-Checksum", "42"), ("X-Forwarded-For", "6.6.6.6")],
        )
        info = response.json()
        assert info["size"] == 70006
        assert info["sha256"] == hashlib.sha256(b"abcdef" + b"g" * 70000).hexdigest()
        assert info["trailers"] == [["x-checksum", "42"]]
        response = await client.request("GET", "/chunked")
        assert response.body == b"first,second,third"
        assert response.header(b"transfer-encoding") == b"chunked"
        assert response.trailers == [(b"x-sum", b"3")]
        await client.aclose()


async def test_keepalive_survives_a_backend_answering_at_once() -> None:
    # The backend answers the moment the request's last byte reaches it, which
    # can be before the edge's task writing that byte runs again. The client's
    # connection must stay open all the same: its request was read in full.
    async with echo_and_proxy() as (echo, proxy):
        client = await Client.open(proxy.address)
        for i in range(200):
            response = await client.request(
                "POST",
                f"/{i}",
                headers=[("Transfer-Encoding", "chunked")] if i % 2 else [],
                body=b"x" * (i + 1),
            )
            assert response.status == 200
            assert response.header(b"connection") is None
            assert response.json()["size"] == i + 1
        await client.aclose()
    assert echo.accepted == 1


async def test_keepalive_when_the_answer_overtakes_the_body() -> None:
    # Found by campaigns/http_clients.py: with the backend in another process
    # and the edge loaded, the backend's answer can be read before the edge
    # has seen the last body bytes leave. The request was read in full all the
    # same: no "Connection: close", and the request pipelined behind it is
    # served (it used to be dropped with the close).
    async with echo_and_proxy() as (echo, proxy):
        # The body comes after the head, so it is pumped on its own (a body
        # that came with its head goes upstream with it, in one write).
        out = await raw(
            proxy.address,
            b"POST /1 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n",
            then=b"helloGET /2 HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        )
    responses = parse_responses(out, [b"POST", b"GET"])
    assert [r.json()["target"] for r in responses] == ["/1", "/2"]
    assert responses[0].header(b"connection") is None
    assert responses[0].json()["size"] == 5
    assert echo.accepted == 1


async def test_large_streamed_upload_and_download_bounded_memory() -> None:
    size = 50 * 1024 * 1024
    async with echo_and_proxy() as (_, proxy):
        client = await Client.open(proxy.address)
        digest = hashlib.sha256()
        tracemalloc.start()
        try:
            upload = await client.request(
                "PUT",
                "/upload",
                headers=[("Content-Length", str(size))],
                body=pattern_bytes(size),
            )
            download = await client.request(
                "GET", f"/download/{size}", sink=digest.update
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await client.aclose()
    assert upload.json()["size"] == size
    assert upload.json()["sha256"] == pattern_sha256(size)
    assert download.status == 200
    assert digest.hexdigest() == pattern_sha256(size)
    assert peak < 10 * 1024 * 1024, peak


# -- 100-continue, upgrade, CONNECT -----------------------------------------------


async def test_expect_100_continue_relayed() -> None:
    async with echo_and_proxy() as (_, proxy):
        client = await Client.open(proxy.address)
        conn = client.conn
        await client.stream.send_all(
            conn.send(
                h11.Request(
                    method="POST",
                    target="/",
                    headers=[
                        ("Host", "h"),
                        ("Content-Length", "5"),
                        ("Expect", "100-continue"),
                    ],
                )
            )
            or b""
        )
        event = await _next(conn, client.stream)
        assert isinstance(event, h11.InformationalResponse)
        assert event.status_code == 100
        await client.stream.send_all(
            (conn.send(h11.Data(data=b"hello")) or b"")
            + (conn.send(h11.EndOfMessage()) or b"")
        )
        response = await client.read_response()
        assert response.json()["size"] == 5
        assert seen_headers(response.json(), "expect") == ["100-continue"]
        await client.aclose()


async def test_max_body_size_with_expect_refuses_before_upload() -> None:
    async with echo_and_proxy(http={"max_body_size": 10}) as (echo, proxy):
        out = await raw(
            proxy.address,
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 11\r\n"
            b"Expect: 100-continue\r\n\r\n",
        )
        assert out.startswith(b"HTTP/1.1 413 ")
        assert b"connection: close" in out.lower()
        # Chunked bodies are counted as they stream.
        out = await raw(
            proxy.address,
            b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"6\r\n123456\r\n6\r\n789012\r\n0\r\n\r\n",
        )
        assert out.startswith(b"HTTP/1.1 413 ")
        response = await get(proxy.address, body=b"0123456789")
        assert response.status == 200
        assert len(echo.requests) == 1


async def test_upgrade_relays_both_ways_and_half_closes() -> None:
    async with echo_and_proxy() as (_, proxy):
        stream = await trio.open_tcp_stream(*proxy.address)
        await stream.send_all(
            b"GET /upgrade HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, Upgrade\r\n"
            b"Upgrade: echo\r\n\r\nearly-frame|"
        )
        received = b""
        with trio.fail_after(10):
            while b"EARLY-FRAME|" not in received:
                chunk = await stream.receive_some(65536)
                assert chunk, received
                received += chunk
            head, _, rest = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101 ")
            assert b"upgrade: echo" in head.lower()
            assert rest == b"server-hello|EARLY-FRAME|"
            await stream.send_all(b"frame2")
            while not rest.endswith(b"FRAME2"):
                rest += await stream.receive_some(65536)
            await stream.send_eof()  # half-close: the backend still answers
            while True:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                rest += chunk
        assert rest == b"server-hello|EARLY-FRAME|FRAME2|bye"
        await stream.aclose()
        with trio.fail_after(5):
            while not proxy.results:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert proxy.results[0].termination.startswith("upgraded:")


async def test_upgrade_survives_an_upstream_reset_while_the_client_lags() -> None:
    """After a 101 the relay starts once the client has taken what came with
    it; an upstream event meanwhile (here the backend's reset, with nothing of
    the client's left to send it) must not derail the connection: it ends as
    an upgraded one, logged, not as an internal error."""
    burst = b"s" * (8 * 1024 * 1024)

    async def upgrade_then_reset(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(65536)
        await stream.send_all(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
            b"Upgrade: test\r\n\r\n" + burst
        )
        await trio.sleep(0.2)
        set_abortive_close(stream)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        backend = await Backend(upgrade_then_reset).start(nursery)
        async with running_proxy([backend.address]) as proxy:
            sock = trio.socket.socket()
            # A small window: what came with the 101 waits in the proxy.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect(proxy.address)
            stream = trio.SocketStream(sock)
            await stream.send_all(
                b"GET / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\n"
                b"Upgrade: test\r\n\r\n"
            )
            await trio.sleep(0.5)  # the client lags; the backend resets
            received = 0
            with trio.fail_after(10):
                with contextlib.suppress(trio.BrokenResourceError):
                    while chunk := await stream.receive_some(1 << 20):
                        received += len(chunk)
                await stream.aclose()
                while not proxy.results:  # noqa: ASYNC110
                    await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert received > 0
    result = proxy.results[0]
    assert result.termination.startswith("upgraded:"), (
        result.termination,
        result.detail,
    )


def switching_backend(
    heads: list[bytes], switches: Callable[[bytes], bool], protocol: bytes
) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """A backend's handler that records each request head in *heads* and
    answers ``101`` to *protocol* (then ``server-hello``) when *switches*
    says so of the head, else ``204``."""

    async def switching(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(65536)
        heads.append(head)
        if switches(head):
            await stream.send_all(
                b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                b"Upgrade: %s\r\n\r\nserver-hello" % protocol
            )
        else:
            await stream.send_all(b"HTTP/1.1 204 No Content\r\n\r\n")
        await stream.receive_some(65536)

    return switching


async def test_h2c_upgrade_is_never_asked_of_the_backend() -> None:
    # After a 101 the edge would relay bytes: HTTP/2 requests inside would
    # pass without X-Forwarded-For, request ids or access-log lines. The h2c
    # upgrade is dropped (as nginx does): the backend sees a plain request,
    # and a backend that switches anyway is not relayed.
    heads: list[bytes] = []
    switching = switching_backend(
        heads, lambda head: head.startswith(b"GET /upgrade "), b"h2c"
    )

    h2c = (
        b"Host: h\r\nConnection: Upgrade, HTTP2-Settings, close\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
    )
    async with trio.open_nursery() as nursery:
        backend = await Backend(switching).start(nursery)
        async with running_proxy([backend.address]) as proxy:
            plain = await raw(proxy.address, b"GET /echo HTTP/1.1\r\n" + h2c)
            switched = await raw(proxy.address, b"GET /upgrade HTTP/1.1\r\n" + h2c)
        nursery.cancel_scope.cancel()
    assert plain.startswith(b"HTTP/1.1 204 "), plain
    for head in heads:
        lowered = head.lower()
        assert b"upgrade" not in lowered.replace(b"get /upgrade ", b"")
        assert b"http2-settings" not in lowered
    assert switched.startswith(b"HTTP/1.1 502 "), switched
    assert b"server-hello" not in switched


async def test_an_upgrade_in_an_http10_request_is_ignored() -> None:
    # RFC 9110 section 7.8: a server MUST ignore it. It went to the backend,
    # which switched, and the 101 was relayed to the HTTP/1.0 client.
    heads: list[bytes] = []
    switching = switching_backend(
        heads, lambda head: b"\r\nupgrade:" in head.lower(), b"websocket"
    )

    async with trio.open_nursery() as nursery:
        backend = await Backend(switching).start(nursery)
        async with running_proxy([backend.address]) as proxy:
            answer = await raw(
                proxy.address,
                b"GET /ws HTTP/1.0\r\nHost: h\r\nConnection: upgrade\r\n"
                b"Upgrade: websocket\r\n\r\n",
            )
        nursery.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.1 204 "), answer
    (head,) = heads
    assert b"upgrade" not in head.lower()


async def test_no_framing_field_reaches_the_client_on_a_response_without_a_body() -> (
    None
):
    # A backend's Transfer-Encoding on a 1xx or a 204 went to the client as it
    # came, the 204 followed by the next response on the same connection: a
    # client that believed it read that response as chunks.
    async def framed_wrongly(stream: trio.SocketStream) -> None:
        for _ in range(2):
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some(65536)
            await stream.send_all(
                b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\nContent-Length: 3\r\n\r\n"
                b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\nX: 1\r\n\r\n"
            )

    async with trio.open_nursery() as nursery:
        backend = await Backend(framed_wrongly).start(nursery)
        async with running_proxy([backend.address]) as proxy:
            out = await raw(
                proxy.address,
                b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n"
                b"GET /b HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
            )
        nursery.cancel_scope.cancel()
    assert out.count(b"HTTP/1.1 204 No Content\r\n") == 2, out
    assert b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" in out
    assert b"transfer-encoding" not in out.lower()
    assert b"content-length" not in out.lower()


async def test_informational_responses_beyond_the_cap_are_a_bad_answer() -> None:
    async def chatty(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(65536)
        hints = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
        await stream.send_all(
            hints * (MAX_INFORMATIONAL + 1)
            + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        )
        await stream.receive_some(65536)

    async with trio.open_nursery() as nursery:
        backend = await Backend(chatty).start(nursery)
        async with running_proxy([backend.address]) as proxy:
            out = await raw(
                proxy.address, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
            )
            results = await wait_results(proxy, 1)
        nursery.cancel_scope.cancel()
    assert out.count(b"HTTP/1.1 103 ") == MAX_INFORMATIONAL
    assert b"HTTP/1.1 502 " in out
    assert b"HTTP/1.1 200 " not in out
    assert f"more than {MAX_INFORMATIONAL} informational" in str(results[0].detail)


async def test_connect_refused_with_501() -> None:
    async with echo_and_proxy() as (echo, proxy):
        out = await raw(
            proxy.address,
            b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
        )
    assert out.startswith(b"HTTP/1.1 501 ")
    assert b"connection: close" in out.lower()
    assert echo.accepted == 0


# -- limits ----------------------------------------------------------------------


async def test_header_limits_431() -> None:
    async with echo_and_proxy(http={"max_header_bytes": 2048, "max_headers": 5}) as (
        echo,
        proxy,
    ):
        out = await raw(
            proxy.address,
            b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * 3000 + b"\r\n\r\n",
        )
        assert out.startswith(b"HTTP/1.1 431 ")
        out = await raw(
            proxy.address, b"GET / HTTP/1.1\r\nHost: h\r\n" + b"X: y\r\n" * 5 + b"\r\n"
        )
        assert out.startswith(b"HTTP/1.1 431 ")
        # A head that never ends is refused once it passes the limit.
        out = await raw(
            proxy.address, b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * 4000
        )
        assert out.startswith(b"HTTP/1.1 431 ")
        assert echo.accepted == 0


@pytest.mark.parametrize(
    ("head", "status"),
    [pytest.param(head, status, id=name) for name, head, status in SMUGGLING_VECTORS],
)
async def test_smuggling_vectors_refused_end_to_end(head: bytes, status: int) -> None:
    async with echo_and_proxy() as (echo, proxy):
        out = await raw(
            proxy.address, head + b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n"
        )
    assert out.startswith(b"HTTP/1.1 %d " % status), out
    assert b"\r\nconnection: close\r\n" in out.lower()
    assert len(re.findall(rb"(?:^|\n)HTTP/1\.1 \d{3} ", out)) == 1
    assert echo.accepted == 0


@pytest.mark.parametrize("body", list(BAD_CHUNKS.values()), ids=list(BAD_CHUNKS))
async def test_bad_chunked_bodies_refused_end_to_end(body: bytes) -> None:
    async with echo_and_proxy() as (echo, proxy):
        out = await raw(
            proxy.address,
            b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
            + body
            + b"GET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n",
        )
    assert out.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 431 ")), out
    assert b"connection: close" in out.lower()
    assert all(r["target"] != "/smuggled" for r in echo.requests)


async def _paired_proxy(
    http: dict[str, Any], drain: Drain | None = None
) -> tuple[trio.SocketStream, Callable[[], Awaitable[HttpConnectionResult]]]:
    config = make_config(
        [{"name": "web", "mode": "http", "backend": "app", "http": http}],
        [{"name": "app", "servers": ["127.0.0.1:9"], "retries": 0}],
    )
    pool = await BackendPool.create(config.backends[0])
    client_sock, server_sock = trio.socket.socketpair()
    client, server = trio.SocketStream(client_sock), trio.SocketStream(server_sock)

    async def run() -> HttpConnectionResult:
        try:
            return await serve_http(
                server,
                Downstream(
                    id="mem",
                    listener="web",
                    peer=("192.0.2.1", 1234),
                    client=("192.0.2.1", 1234),
                    destination=("192.0.2.2", 80),
                ),
                HttpSite(
                    listener=config.listeners[0],
                    backend=pool,
                    keepalive=KeepAlivePool(),
                    drain=drain if drain is not None else Drain(),
                ),
                proxy_header=None,
            )
        finally:
            await server.aclose()

    return client, run


async def _read_until_eof(stream: trio.abc.ReceiveStream) -> bytes:
    out = b""
    while chunk := await stream.receive_some():
        out += chunk
    return out


async def test_request_header_timeout_408(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, run = await _paired_proxy({"request_header_timeout": 10.0})
    async with client, trio.open_nursery() as nursery:
        results: list[HttpConnectionResult] = []

        async def serve() -> None:
            results.append(await run())

        nursery.start_soon(serve)
        await client.send_all(b"GET / HTTP/1.1\r\nHost: h\r\n")
        start = trio.current_time()
        out = await _read_until_eof(client)
        assert 9.9 < trio.current_time() - start <= 10.1
    assert out.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert results[0].termination == "request_header_timeout"


async def test_silent_connection_closed_quietly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, run = await _paired_proxy({"request_header_timeout": 10.0})
    async with client, trio.open_nursery() as nursery:
        results: list[HttpConnectionResult] = []

        async def serve() -> None:
            results.append(await run())

        nursery.start_soon(serve)
        assert await _read_until_eof(client) == b""
    assert results[0].termination == "request_header_timeout"


async def test_keepalive_timeout_and_drain_close_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A request that fails (503: the only server is down) still keeps nothing
    # open; use a bad request instead to reach the idle state: not possible, so
    # check the first-request path and the drain path on an idle connection.
    drain = Drain()
    client, run = await _paired_proxy({"keepalive_timeout": 5.0}, drain)
    async with client, trio.open_nursery() as nursery:
        results: list[HttpConnectionResult] = []

        async def serve() -> None:
            results.append(await run())

        nursery.start_soon(serve)
        await trio.sleep(1)
        drain.set()  # waiting for the first request is not "idle": not closed
        await trio.sleep(1)
        assert not results
        await client.send_all(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        out = await _read_until_eof(client)
    assert out.startswith(b"HTTP/1.1 502 ")  # nothing listens on port 9
    assert b"connection: close" in out.lower()


async def _trickle_body(
    proxy: Proxy, *, length: int, pause: float
) -> tuple[bytes, float]:
    """Send a head announcing *length* body bytes, then one byte per *pause*."""
    stream = await trio.open_tcp_stream(*proxy.address)
    out = bytearray()
    start = time.monotonic()
    try:
        await stream.send_all(
            b"POST /up HTTP/1.1\r\nHost: h\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % length
        )
        async with trio.open_nursery() as nursery:

            async def trickle() -> None:
                with contextlib.suppress(trio.BrokenResourceError):
                    for _ in range(length):
                        await stream.send_all(b"x")
                        await trio.sleep(pause)

            nursery.start_soon(trickle)
            # Generous, for a loaded machine; shorter than any trickle here.
            with trio.fail_after(20):
                while chunk := await stream.receive_some():
                    out += chunk
            nursery.cancel_scope.cancel()
    finally:
        await stream.aclose()
    return bytes(out), time.monotonic() - start


async def test_request_body_below_min_rate_408() -> None:
    # One byte every 0.1 s is never idle for idle_timeout, but at 10 bytes/s
    # it falls behind 20 bytes/s once the 0.5 s grace is used up: the deadline
    # 0.5 + received/20 is passed at about 1 s.
    http = {"request_body_timeout": 0.5, "request_body_min_rate": 20}
    async with echo_and_proxy(http=http, idle_timeout=5.0) as (echo, proxy):
        out, elapsed = await _trickle_body(proxy, length=1000, pause=0.1)
        results = await wait_results(proxy, 1)
    assert out.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert elapsed >= 0.5  # never before the grace is over
    assert results[0].termination == "bad_request"
    assert "slower than request_body_min_rate (20 bytes/s)" in str(results[0].detail)
    assert echo.requests == []  # the backend never got a whole request


async def test_request_body_at_min_rate_is_not_cut() -> None:
    # The same trickle with a rate check it keeps up with (10 bytes/s against
    # 2, after a 2 s grace: only a client stalled for 2 s would fail) passes.
    http = {"request_body_timeout": 2.0, "request_body_min_rate": 2}
    async with echo_and_proxy(http=http, idle_timeout=5.0) as (_, proxy):
        out, _ = await _trickle_body(proxy, length=15, pause=0.1)
    (response,) = parse_responses(out, [b"POST"])
    assert response.json()["size"] == 15


async def test_request_body_stalled_for_idle_timeout_408() -> None:
    http = {"request_body_min_rate": 0}
    async with echo_and_proxy(http=http, idle_timeout=0.5) as (_, proxy):
        out, elapsed = await _trickle_body(proxy, length=10, pause=30)
        results = await wait_results(proxy, 1)
    assert out.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert elapsed > 0.4  # not before idle_timeout
    assert results[0].detail == "request body stalled for idle_timeout"


async def test_keepalive_timeout_real_backend() -> None:
    async with echo_and_proxy(http={"keepalive_timeout": 0.3}) as (_, proxy):
        client = await Client.open(proxy.address)
        await client.request()
        start = time.monotonic()
        assert await client.stream.receive_some() == b""
        assert 0.2 < time.monotonic() - start < 3
        await client.aclose()
        with trio.fail_after(5):
            while not proxy.results:  # noqa: ASYNC110
                await trio.sleep(0.01)
    assert proxy.results[0].termination == "keepalive_timeout"
    assert proxy.results[0].requests == 1


# -- backend failures ------------------------------------------------------------


async def test_no_healthy_server_503() -> None:
    async with echo_and_proxy() as (echo, proxy):
        for health in proxy.pool.servers:
            health.server.healthy = False
        response = await get(proxy.address)
    assert response.status == 503
    assert response.header(b"connection") == b"close"
    assert b"no healthy server" in response.body
    assert echo.accepted == 0


async def test_connect_refused_502(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")
    port = free_port()
    async with running_proxy([f"127.0.0.1:{port}"]) as proxy:
        response = await get(proxy.address)
        (result,) = await wait_results(proxy)
    assert response.status == 502
    # The backend failed, not the client: the operator should hear of it.
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.name == "tlsedge.http"
    assert "-> 502: backend app" in warning.getMessage()
    assert response.header(b"content-type") == b"text/plain; charset=utf-8"
    assert b"1 connect attempts failed (127.0.0.1:" in response.body
    assert b"connection refused" in response.body
    assert result.termination == "connect_failed"
    # With retries the backend's usual connect sequence follows.
    async with running_proxy([f"127.0.0.1:{port}"], backend={"retries": 2}) as proxy:
        response = await get(proxy.address)
    assert response.status == 502
    assert b"3 connect attempts failed" in response.body


async def test_response_timeout_504() -> None:
    async with echo_and_proxy(http={"response_timeout": 0.3}) as (_, proxy):
        start = time.monotonic()
        response = await get(proxy.address, "/hang")
        assert 0.25 < time.monotonic() - start < 3
        (result,) = await wait_results(proxy)
    assert response.status == 504
    assert result.termination == "response_timeout"


@pytest.mark.parametrize("target", ["/die-cl", "/die-chunked"])
async def test_backend_dies_mid_response_resets_client(target: str) -> None:
    async with echo_and_proxy() as (_, proxy):
        stream = await trio.open_tcp_stream(*proxy.address)
        await stream.send_all(b"GET %s HTTP/1.1\r\nHost: h\r\n\r\n" % target.encode())
        received = b""
        reset = False
        with trio.fail_after(10):
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    reset = True
                    break
                if not chunk:
                    break
                received += chunk
        await stream.aclose()
    assert received.startswith(b"HTTP/1.1 200 ")
    assert reset
    body = received.partition(b"\r\n\r\n")[2]
    if target == "/die-cl":
        assert len(body) < 1000
    else:
        assert not body.endswith(b"0\r\n\r\n")
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "h")]))
    conn.receive_data(received)
    conn.receive_data(b"")
    with pytest.raises(h11.RemoteProtocolError):  # noqa: PT012 (drain the events)
        while conn.next_event() is not h11.PAUSED:
            pass


async def test_stale_pooled_connection_retried_on_fresh_one() -> None:
    async with trio.open_nursery() as nursery:
        echo = await EchoBackend(close_on_request=2).start(nursery)
        async with running_proxy([echo.address]) as proxy:
            assert (await get(proxy.address)).status == 200
            # Even a POST without a body: the pooled connection sent nothing back.
            client = await Client.open(proxy.address)
            response = await client.request("POST", "/")
            await client.aclose()
            assert response.status == 200
            assert echo.accepted == 2
        nursery.cancel_scope.cancel()


async def test_idempotent_request_retried_on_another_server() -> None:
    async def slam(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        set_abortive_close(stream)

    async with trio.open_nursery() as nursery:
        bad = await Backend(slam).start(nursery)
        echo = await EchoBackend().start(nursery)
        async with running_proxy([bad.address, echo.address]) as proxy:
            # Round robin starts with the first server: the bad one.
            assert (await get(proxy.address)).status == 200
            assert (bad.accepted, echo.accepted) == (1, 1)
            # A request with a body is never retried: 502 when it meets "bad".
            for _ in range(4):
                before = bad.accepted
                response = await get(proxy.address, body=b"data")
                if bad.accepted > before:
                    assert response.status == 502
                    break
                assert response.status == 200
            else:
                pytest.fail("round robin never picked the bad server")
        nursery.cancel_scope.cancel()


async def test_send_proxy_uses_dedicated_connection() -> None:
    async with trio.open_nursery() as nursery:
        headers: list[bytes] = []

        async def proxy_then_echo(stream: trio.SocketStream) -> None:
            data = await stream.receive_some(65536)
            line, _, rest = bytes(data).partition(b"\r\n")
            headers.append(line)
            conn = h11.Connection(h11.SERVER)
            if rest:
                conn.receive_data(rest)
            while True:
                event = await _next(conn, stream)
                if isinstance(event, h11.ConnectionClosed):
                    return
                if isinstance(event, h11.EndOfMessage):
                    await stream.send_all(
                        (conn.send(h11.Response(status_code=204, headers=[])) or b"")
                        + (conn.send(h11.EndOfMessage()) or b"")
                    )
                    conn.start_next_cycle()

        backend = await Backend(proxy_then_echo).start(nursery)
        header = b"PROXY TCP4 192.0.2.1 192.0.2.2 1234 80\r\n"
        async with running_proxy([backend.address], proxy_header=header) as proxy:
            client = await Client.open(proxy.address)
            for _ in range(3):
                assert (await client.request()).status == 204
            await client.aclose()
            client = await Client.open(proxy.address)
            assert (await client.request()).status == 204
            await client.aclose()
            assert proxy.keepalive.idle_count() == 0
        assert headers == [header.rstrip(b"\r\n")] * 2
        assert backend.accepted == 2
        nursery.cancel_scope.cancel()


# -- drain -----------------------------------------------------------------------


async def test_drain_finishes_in_flight_and_closes_idle() -> None:
    async with echo_and_proxy() as (echo, proxy):
        idle = await Client.open(proxy.address)
        assert (await idle.request()).status == 200
        busy = await Client.open(proxy.address)
        async with trio.open_nursery() as nursery:
            responses: list[Response] = []

            async def slow() -> None:
                responses.append(await busy.request("GET", "/slow/0.5"))

            nursery.start_soon(slow)
            await trio.sleep(0.2)
            proxy.drain.set()
            with trio.fail_after(2):
                assert await idle.stream.receive_some() == b""  # idle: closed at once
        (response,) = responses
        assert response.status == 200
        assert response.header(b"connection") == b"close"
        assert await busy.stream.receive_some() == b""
        await idle.aclose()
        await busy.aclose()
        with trio.fail_after(5):
            while len(proxy.results) < 2:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert sorted(r.termination for r in proxy.results) == ["drained", "drained"]
        # The idle client connection held its upstream connection (for the
        # next request, until PARK_AFTER): the busy one opened its own.
        assert echo.accepted == 2


# -- real clients and servers ------------------------------------------------------


async def run_curl(*args: str) -> tuple[str, str]:
    curl = require("curl")
    result = await trio.run_process(
        [curl, "-sS", "-v", "--max-time", "20", *args],
        capture_stdout=True,
        capture_stderr=True,
    )
    return result.stdout.decode(), result.stderr.decode()


async def test_curl_get_and_spoofing() -> None:
    async with echo_and_proxy() as (_, proxy):
        url = f"http://127.0.0.1:{proxy.address[1]}/curl"
        out, err = await run_curl("-H", "X-Forwarded-For: 1.2.3.4", url, url)
    first, second = re.findall(r"\{.*?\}(?=\{|$)", out)
    for body in (first, second):
        assert seen_headers(json.loads(body), "x-forwarded-for") == ["127.0.0.1"]
    assert "< HTTP/1.1 200" in err
    assert "Re-using existing connection" in err or "Reusing existing connection" in err


async def test_curl_expect_100_continue(tmp_path: Path) -> None:
    data = os.urandom(300_000)
    file = tmp_path / "upload.bin"
    file.write_bytes(data)
    async with echo_and_proxy() as (_, proxy):
        url = f"http://127.0.0.1:{proxy.address[1]}/upload"
        out, err = await run_curl(
            "-H",
            "Expect: 100-continue",
            "--expect100-timeout",
            "15",
            "--data-binary",
            f"@{file}",
            url,
        )
    # curl got the 100 from the backend through the edge (it would otherwise
    # send the body after its 15 s expect100 timeout, without one).
    assert "< HTTP/1.1 100 Continue" in err
    info = json.loads(out)
    assert info["size"] == len(data)
    assert info["sha256"] == hashlib.sha256(data).hexdigest()


async def test_curl_sees_503_and_drained_close() -> None:
    async with echo_and_proxy() as (_, proxy):
        for health in proxy.pool.servers:
            health.server.healthy = False
        url = f"http://127.0.0.1:{proxy.address[1]}/"
        out, err = await run_curl(url)
    assert "< HTTP/1.1 503 Service Unavailable" in err
    assert "< Connection: close" in err
    assert out.startswith("503 Service Unavailable: backend app: no healthy server")


async def test_nginx_backend_keepalive_and_headers() -> None:
    port = free_port()
    body = (
        "http { access_log off; keepalive_timeout 60s; server { listen 127.0.0.1:"
        + str(port)
        + "; location / { return 200 "
        + '"xff=$http_x_forwarded_for proto=$http_x_forwarded_proto '
        + 'n=$connection_requests"; } } }'
    )
    with nginx(body, [port]):
        async with running_proxy([f"127.0.0.1:{port}"]) as proxy:
            first = await get(proxy.address, headers=[("X-Forwarded-For", "6.6.6.6")])
            second = await get(proxy.address)
    assert first.body == b"xff=127.0.0.1 proto=http n=1"
    assert second.body == b"xff=127.0.0.1 proto=http n=2"
