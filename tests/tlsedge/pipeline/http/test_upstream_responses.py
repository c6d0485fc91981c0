"""What a misbehaving backend's response can do to the clients behind the edge.

A scripted backend answers each request with the exact bytes of a case; real
clients go through a real edge: raw HTTP/1.1 keep-alive clients (a second
client after the first, so that a pooled upstream connection is reused across
clients) and HTTP/2 (`RawH2`). Each case checks what the client sees and
whether the upstream connection the response came on is used again: a response
whose framing leaves bytes over (a second "response" smuggled behind it) or
cannot be trusted must never leave its connection to the next request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import h2.events
import pytest
import trio
import trio.lowlevel

from tests.tlsedge.helpers import make_config
from tests.tlsedge.pipeline.http.test_h1 import (
    Proxy,
    Response,
    running_proxy,
    wait_results,
)
from tests.tlsedge.pipeline.http.test_h2 import RawH2
from tlsedge._control.edge import Edge

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
#: What a buggy backend sends behind a response: another one.
SMUGGLED = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nEVIL!!"

#: A case's answer: its bytes, or a coroutine that writes them.
Answer = bytes | Callable[[trio.SocketStream], Awaitable[None]]


@dataclass
class ScriptedBackend:
    """Answers each request with the bytes its target maps to (``OK`` for
    any other target); ``seen`` records (connection number, target). An
    answer ending in ``CLOSE`` closes the connection after the bytes before
    it. With ``read_body`` False the request body is not read."""

    script: dict[bytes, Answer]
    read_body: bool = True
    seen: list[tuple[int, bytes]] = field(default_factory=list)
    port: int = 0
    connections: int = 0

    CLOSE = b"<close>"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def connection_of(self, target: bytes) -> int:
        (number,) = [n for n, t in self.seen if t == target]
        return number

    async def start(self, nursery: trio.Nursery) -> ScriptedBackend:
        listeners = await nursery.start(
            partial(trio.serve_tcp, self.handle, 0, host="127.0.0.1")
        )
        self.port = listeners[0].socket.getsockname()[1]
        return self

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        number = self.connections
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                target = head.split(b" ")[1]
                self.seen.append((number, target))
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                if self.read_body:
                    while len(buffer) < length:
                        data = await stream.receive_some(65536)
                        if not data:
                            return
                        buffer += data
                    buffer = buffer[length:]
                answer = self.script.get(target, OK)
                if not isinstance(answer, bytes):
                    await answer(stream)
                    continue
                await stream.send_all(answer.removesuffix(self.CLOSE))
                if answer.endswith(self.CLOSE):
                    return
        except trio.BrokenResourceError:
            pass


@asynccontextmanager
async def scripted(
    script: dict[bytes, Answer], *, read_body: bool = True
) -> AsyncIterator[tuple[ScriptedBackend, Proxy]]:
    async with trio.open_nursery() as nursery:
        backend = await ScriptedBackend(script, read_body).start(nursery)
        async with running_proxy([backend.address]) as proxy:
            yield backend, proxy
        nursery.cancel_scope.cancel()


def request(target: bytes, method: bytes = b"GET", fields: bytes = b"") -> bytes:
    return method + b" " + target + b" HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n"


def parse_responses(data: bytes, methods: list[bytes]) -> list[Response]:
    """The complete final responses at the start of *data* (an HTTP/1.1
    client's view: 1xx skipped, a body framed by Content-Length, chunked, or
    none for HEAD, 204 and 304; a body until the close is never complete),
    one per method."""
    out: list[Response] = []
    rest = data
    for method in methods:
        while True:
            head, found, after = rest.partition(b"\r\n\r\n")
            if not found:
                return out
            lines = head.split(b"\r\n")
            status = int(lines[0].split(b" ")[1])
            headers = [
                (name.strip().lower(), value.strip())
                for name, _, value in (line.partition(b":") for line in lines[1:])
            ]
            rest = after
            if status >= 200:
                break
        fields = dict(headers)
        body = b""
        trailers: list[tuple[bytes, bytes]] = []
        if method == b"HEAD" or status in {204, 304}:
            pass
        elif b"content-length" in fields:
            length = int(fields[b"content-length"])
            if len(rest) < length:
                return out
            body, rest = rest[:length], rest[length:]
        elif fields.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                line, found, after = rest.partition(b"\r\n")
                if not found:
                    return out
                size = int(line.split(b";")[0], 16)
                if not size:
                    if after[:2] == b"\r\n":
                        rest = after[2:]
                        break
                    section, found, rest = after.partition(b"\r\n\r\n")
                    if not found:
                        return out
                    trailers = [
                        (name.strip().lower(), value.strip())
                        for name, _, value in (
                            line.partition(b":") for line in section.split(b"\r\n")
                        )
                    ]
                    break
                if len(after) < size + 2:
                    return out
                body += after[:size]
                rest = after[size + 2 :]
        else:
            return out
        out.append(Response(status, headers, body, trailers))
    return out


async def exchange(
    address: tuple[str, int],
    data: bytes,
    *,
    responses: int,
    methods: list[bytes] | None = None,
) -> tuple[bytes, list[Response], bool]:
    """Send *data* on a new connection; read until *responses* complete
    responses came, or the edge closed (or reset) it. The raw bytes, the
    responses, and whether it was closed."""
    methods = methods or [b"GET"] * responses
    stream = await trio.open_tcp_stream(*address)
    out = b""
    closed = False
    try:
        await stream.send_all(data)
        with trio.fail_after(10):
            while len(parse_responses(out, methods)) < responses:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    chunk = b""
                if not chunk:
                    closed = True
                    break
                out += chunk
    finally:
        await stream.aclose()
    return out, parse_responses(out, methods), closed


async def next_client_gets_ok(backend: ScriptedBackend, proxy: Proxy) -> int:
    """Another client's request is answered ``ok``: the upstream connection
    it went on."""
    _, (response,), _ = await exchange(proxy.address, request(b"/next"), responses=1)
    assert (response.status, response.body) == (200, b"ok")
    return backend.connection_of(b"/next")


# -- responses refused: 502, their connection closed ------------------------------

REFUSED = {
    "two equal Content-Length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nhi",
        "more than one Content-Length in the response",
    ),
    "two different Content-Length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi!",
        "more than one Content-Length in the response",
    ),
    "a Content-Length list": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nhi",
        "malformed Content-Length in the response",
    ),
    "a signed Content-Length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nhi",
        "malformed Content-Length in the response",
    ),
    "Content-Length and Transfer-Encoding": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nhi\r\n0\r\n\r\n",
        "both Content-Length and Transfer-Encoding in the response",
    ),
    "a coding other than chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhi",
        "response Transfer-Encoding other than a single 'chunked'",
    ),
    "chunked not the only coding": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b"2\r\nhi\r\n0\r\n\r\n",
        "response Transfer-Encoding other than a single 'chunked'",
    ),
    "chunked, chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n"
        b"2\r\nhi\r\n0\r\n\r\n",
        "response Transfer-Encoding other than a single 'chunked'",
    ),
    "two Transfer-Encoding fields": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
        "response Transfer-Encoding other than a single 'chunked'",
    ),
    "Transfer-Encoding in HTTP/1.0": (
        b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
        "Transfer-Encoding in an HTTP/1.0 response",
    ),
    "obs-fold": (
        b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 2\r\n\r\nhi",
        "obs-fold in the response head",
    ),
    "bare LF line ends": (
        b"HTTP/1.1 200 OK\nContent-Length: 2\n\nhi",
        "bare LF in the head",
    ),
    "a bare LF": (
        b"HTTP/1.1 200 OK\r\nX: a\nContent-Length: 2\r\n\r\nhi",
        "bare CR or LF in the response head",
    ),
    "a bare CR": (
        b"HTTP/1.1 200 OK\r\nX: a\rContent-Length: 9\r\nContent-Length: 2\r\n\r\nhi",
        "bare CR or LF in the response head",
    ),
    "NUL in a field": (
        b"HTTP/1.1 200 OK\r\nX: a\x00b\r\nContent-Length: 2\r\n\r\nhi",
        "control character in the response head",
    ),
    "space before the colon": (
        b"HTTP/1.1 200 OK\r\nContent-Length : 6\r\nContent-Length: 2\r\n\r\nhi",
        "malformed response header field",
    ),
    "HTTP/2.0": (
        b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nhi",
        "response version HTTP/2.0",
    ),
    "status 600": (
        b"HTTP/1.1 600 X\r\nContent-Length: 2\r\n\r\nhi",
        "response status 600 (expected 100-599)",
    ),
    "a head over 64 KiB": (
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000 + b"\r\nContent-Length: 2\r\n\r\nhi",
        "response head larger than 65536 bytes",
    ),
    "101 to a request that asked no upgrade": (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: evil\r\n"
        b"Connection: upgrade\r\n\r\n" + SMUGGLED,
        "unexpected 101 from upstream: no upgrade was asked",
    ),
    "33 informational responses": (
        b"HTTP/1.1 103 Early Hints\r\n\r\n" * 33 + OK,
        "more than 32 informational (1xx) responses",
    ),
}


@pytest.mark.parametrize(("answer", "reason"), REFUSED.values(), ids=REFUSED.keys())
async def test_a_response_refused_is_a_502_and_its_connection_is_closed(
    answer: bytes, reason: str
) -> None:
    async with scripted({b"/case": answer}) as (backend, proxy):
        raw, (response,), closed = await exchange(
            proxy.address, request(b"/case") + request(b"/second"), responses=2
        )
        assert response.status == 502
        assert reason in response.body.decode()
        assert closed
        assert b"EVIL" not in raw
        (result,) = await wait_results(proxy)
        assert result.termination == "server_error"
        assert result.detail is not None
        assert reason in result.detail
        assert await next_client_gets_ok(backend, proxy) == 2
        assert b"/second" not in [target for _, target in backend.seen]


# -- trailers -----------------------------------------------------------------------

FORBIDDEN_TRAILERS = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n"
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\nHost: evil\r\n"
    b"Trailer: X-T\r\nConnection: x-gone\r\nX-Gone: 1\r\nKeep-Alive: 5\r\n"
    b"X-T: 1\r\n\r\n"
)


async def test_response_trailers_lose_framing_routing_and_hop_by_hop_fields() -> None:
    async with scripted({b"/case": FORBIDDEN_TRAILERS}) as (backend, proxy):
        _, (response, second), closed = await exchange(
            proxy.address,
            request(b"/case", fields=b"TE: trailers\r\n") + request(b"/second"),
            responses=2,
        )
        assert (response.body, response.trailers) == (b"hi", [(b"x-t", b"1")])
        assert (second.body, closed) == (b"ok", False)
        assert backend.connection_of(b"/second") == 1


@asynccontextmanager
async def scripted_h2(
    script: dict[bytes, Answer],
) -> AsyncIterator[tuple[ScriptedBackend, RawH2]]:
    """The scripted backend behind an edge serving h2c (prior knowledge),
    and a client connected to it."""
    async with trio.open_nursery() as nursery:
        backend = await ScriptedBackend(script).start(nursery)
        config = make_config(
            [
                {
                    "name": "plain",
                    "backend": "app",
                    "mode": "http",
                    "http2": {"cleartext": "prior-knowledge"},
                }
            ],
            [{"name": "app", "servers": [backend.address]}],
            {"drain_timeout": 1.0},
        )
        edge: Edge = await nursery.start(Edge(config).run)
        client = await RawH2.open(edge.listen_addresses["plain"][0][1])
        try:
            yield backend, client
        finally:
            await client.aclose()
            edge.drain()
            nursery.cancel_scope.cancel()


async def h2_get(client: RawH2, path: str, method: str = "GET") -> int:
    sid = client.request(path, method=method, headers=[("te", "trailers")])
    await client.send()
    await client.until(lambda c: c.ended(sid))
    return sid


async def test_http2_response_trailers_lose_framing_routing_and_hop_by_hop_fields() -> (
    None
):
    async with scripted_h2({b"/case": FORBIDDEN_TRAILERS}) as (backend, client):
        sid = await h2_get(client, "/case")
        assert client.body(sid) == b"hi"
        (trailers,) = client.of(h2.events.TrailersReceived, sid)
        assert trailers.headers == [(b"x-t", b"1")]
        second = await h2_get(client, "/second")
        assert client.body(second) == b"ok"
        assert backend.connection_of(b"/second") == 1
        assert not client.of(h2.events.StreamReset)


# -- a body whose framing breaks after the head went out: the client is cut --------

CUT = {
    "a chunk size over 16 hex digits": (
        b"10000000000000002\r\nhi\r\n0\r\n\r\n",
        "malformed chunk size line",
    ),
    "a 0x chunk size": (b"0x2\r\nhi\r\n0\r\n\r\n", "malformed chunk size line"),
    "a negative chunk size": (b"-2\r\nhi\r\n0\r\n\r\n", "malformed chunk size line"),
    "a space after the chunk size": (
        b"2 \r\nhi\r\n0\r\n\r\n",
        "malformed chunk size line",
    ),
    "a CR in a quoted chunk extension": (
        b'2;a="x\ry"\r\nhi\r\n0\r\n\r\n',
        "bare CR or LF in chunked framing",
    ),
    "chunk data longer than its size": (
        b"2\r\nhix\r\n0\r\n\r\n",
        "chunk data longer than its size",
    ),
    "a forbidden trailer line": (
        b"2\r\nhi\r\n0\r\n bad\r\n\r\n",
        "malformed trailer field",
    ),
}


@pytest.mark.parametrize(("body", "reason"), CUT.values(), ids=CUT.keys())
async def test_a_chunked_body_that_breaks_its_framing_cuts_the_client(
    body: bytes, reason: str
) -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + SMUGGLED
    async with scripted({b"/case": answer}) as (backend, proxy):
        raw, responses, closed = await exchange(
            proxy.address, request(b"/case") + request(b"/second"), responses=1
        )
        assert (responses, closed) == ([], True)
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"EVIL" not in raw
        (result,) = await wait_results(proxy)
        assert (result.termination, result.detail) == (
            "server_aborted",
            f"bad chunked response body: {reason}",
        )
        assert await next_client_gets_ok(backend, proxy) == 2


async def test_a_body_short_of_its_content_length_then_a_close_cuts_the_client() -> (
    None
):
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhi" + ScriptedBackend.CLOSE
    async with scripted({b"/case": answer}) as (backend, proxy):
        raw, responses, closed = await exchange(
            proxy.address, request(b"/case"), responses=1
        )
        assert (raw, responses, closed) == (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhi",
            [],
            True,
        )
        (result,) = await wait_results(proxy)
        assert result.detail == "upstream closed the connection mid-response"
        assert await next_client_gets_ok(backend, proxy) == 2


# -- bytes beyond the response: relayed as framed, the connection never reused -----

BEYOND = {
    "a body longer than its Content-Length": (
        b"GET",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi" + SMUGGLED,
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    ),
    "bytes after the last chunk": (
        b"GET",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
        + SMUGGLED,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    ),
    "a 204 with a body": (
        b"GET",
        b"HTTP/1.1 204 No Content\r\n\r\n" + SMUGGLED,
        b"HTTP/1.1 204 No Content\r\n\r\n",
    ),
    "a 304 with a sized body": (
        b"GET",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 6\r\n\r\nEVIL!!",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 6\r\n\r\n",
    ),
    "a 304 with a chunked body": (
        b"GET",
        b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"6\r\nEVIL!!\r\n0\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
    ),
    "a HEAD response with a body": (
        b"HEAD",
        b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nEVIL!!",
        b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n",
    ),
    "a chunked HEAD response with a body": (
        b"HEAD",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"6\r\nEVIL!!\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
    ),
    "more bytes after Connection: close": (
        b"GET",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi"
        + SMUGGLED,
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    ),
    "an HTTP/1.0 response with a Content-Length": (
        b"GET",
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nhi",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    ),
}


@pytest.mark.parametrize(("method", "answer", "relayed"), BEYOND.values(), ids=BEYOND)
async def test_bytes_beyond_a_response_never_reach_the_next_request(
    method: bytes, answer: bytes, relayed: bytes
) -> None:
    async with scripted({b"/case": answer}) as (backend, proxy):
        raw, (_, second), closed = await exchange(
            proxy.address,
            request(b"/case", method) + request(b"/second"),
            responses=2,
            methods=[method, b"GET"],
        )
        assert raw == relayed + OK
        assert (second.body, closed) == (b"ok", False)
        assert backend.connection_of(b"/second") == 2
        assert await next_client_gets_ok(backend, proxy) == 2


# -- well-formed oddities: relayed, the connection reused ---------------------------

REUSED = {
    "a status line without a reason": (
        b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nhi",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    ),
    "a status line with an empty reason": (
        b"HTTP/1.1 200 \r\nContent-Length: 2\r\n\r\nhi",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi",
    ),
    "a 100 the client did not ask for": (
        b"HTTP/1.1 100 Continue\r\n\r\n" + OK,
        OK,
    ),
    "32 103 Early Hints": (
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * 32 + OK,
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * 32 + OK,
    ),
    "a 103 with a Content-Length": (
        b"HTTP/1.1 103 Early Hints\r\nContent-Length: 5\r\n\r\n" + OK,
        b"HTTP/1.1 103 Early Hints\r\n\r\n" + OK,
    ),
    "Transfer-Encoding: Chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    ),
    "a quoted chunk extension with a semicolon": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'2;a="x;y"\r\nhi\r\n0\r\n\r\n',
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    ),
}


@pytest.mark.parametrize(("answer", "relayed"), REUSED.values(), ids=REUSED)
async def test_a_well_formed_oddity_is_relayed_and_its_connection_reused(
    answer: bytes, relayed: bytes
) -> None:
    async with scripted({b"/case": answer}) as (backend, proxy):
        raw, _, closed = await exchange(
            proxy.address, request(b"/case") + request(b"/second"), responses=2
        )
        assert (raw, closed) == (relayed + OK, False)
        assert backend.connection_of(b"/second") == 1


async def test_a_response_in_one_byte_writes_is_relayed_whole() -> None:
    answer = (
        b"HTTP/1.1 103 Early Hints\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;x=y\r\nhi\r\n0\r\n"
        b"X-T: 1\r\n\r\n"
    )

    async def trickle(stream: trio.SocketStream) -> None:
        for byte in answer:
            await stream.send_all(bytes([byte]))
            await trio.lowlevel.checkpoint()  # a write per byte, each its own segment

    async with scripted({b"/case": trickle}) as (backend, proxy):
        _, (response, second), closed = await exchange(
            proxy.address,
            request(b"/case", fields=b"TE: trailers\r\n") + request(b"/second"),
            responses=2,
        )
        assert (response.body, response.trailers) == (b"hi", [(b"x-t", b"1")])
        assert (second.body, closed) == (b"ok", False)
        assert backend.connection_of(b"/second") == 1


# -- unsolicited bytes on an idle pooled connection ---------------------------------


async def test_bytes_on_an_idle_pooled_connection_retire_it() -> None:
    sent = trio.Event()

    async def answer_then_stray(stream: trio.SocketStream) -> None:
        await stream.send_all(OK)
        await sent.wait()  # the client has its response and has gone
        await stream.send_all(SMUGGLED)
        stray.set()

    stray = trio.Event()
    async with scripted({b"/case": answer_then_stray}) as (backend, proxy):
        _, (response,), _ = await exchange(
            proxy.address, request(b"/case"), responses=1
        )
        assert response.body == b"ok"
        await wait_results(proxy)
        assert proxy.keepalive.idle_count() == 1
        sent.set()
        await stray.wait()
        assert await next_client_gets_ok(backend, proxy) == 2


# -- an answer before the request body was sent -------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["sized", "chunked"])
async def test_an_early_answer_to_an_upload_closes_both_connections(
    chunked: bool,
) -> None:
    early = b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 3\r\n\r\nbig"
    if chunked:
        upload = request(b"/case", b"POST", b"Transfer-Encoding: chunked\r\n")
        upload += b"10\r\n" + b"x" * 16 + b"\r\n"
    else:
        upload = request(b"/case", b"POST", b"Content-Length: 100000\r\n") + b"x" * 16
    async with scripted({b"/case": early}, read_body=False) as (backend, proxy):
        raw, (response,), _ = await exchange(
            proxy.address, upload, responses=1, methods=[b"POST"]
        )
        assert (response.status, response.body) == (413, b"big")
        assert response.header(b"connection") == b"close"
        assert b"EVIL" not in raw
        assert await next_client_gets_ok(backend, proxy) == 2


# -- HTTP/2 clients -------------------------------------------------------------------


async def test_http2_refused_responses_and_bytes_beyond_one_never_reach_a_stream() -> (
    None
):
    script: dict[bytes, Answer] = {
        b"/http10-chunked": REFUSED["Transfer-Encoding in HTTP/1.0"][0],
        b"/longer": BEYOND["a body longer than its Content-Length"][1],
        b"/head": BEYOND["a HEAD response with a body"][1],
    }
    async with scripted_h2(script) as (backend, client):
        refused = await h2_get(client, "/http10-chunked")
        assert client.status(refused) == 502
        assert b"Transfer-Encoding in an HTTP/1.0 response" in client.body(refused)
        longer = await h2_get(client, "/longer")
        assert (client.status(longer), client.body(longer)) == (200, b"hi")
        head = await h2_get(client, "/head", "HEAD")
        assert (client.status(head), client.body(head)) == (200, b"")
        second = await h2_get(client, "/second")
        assert client.body(second) == b"ok"
        connections = [number for number, _ in backend.seen]
        assert connections == [1, 2, 3, 4]
        assert not client.of(h2.events.StreamReset)
