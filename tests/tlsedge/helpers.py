"""Shared helpers for tlsedge's end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from proxyproto import (
    InetAddress,
    ProxyHeader,
    RemoteProtocolError,
    UnixAddress,
    parse,
)
from tlsedge._control.edge import Edge
from tlsedge._core.config import Config, config_from_mapping
from tlsedge._pipeline.handshake import ReactorHandshake
from tlsedge._pipeline.unwrap import ReactorHeaderRead

__all__ = [
    "Backend",
    "access_records",
    "address_of",
    "capture_unraisable",
    "client_hello",
    "close_clients",
    "connect",
    "describe_header",
    "exchange",
    "exchange_then_close_notify",
    "make_config",
    "open_client",
    "proxy_echo_handler",
    "read_all",
    "read_proxy",
    "running_edge",
    "tag_handler",
    "tls_extension",
    "wait_access_records",
    "wait_until",
]


def make_config(
    listeners: list[Mapping[str, Any]],
    backends: list[Mapping[str, Any]],
    edge: Mapping[str, Any] | None = None,
) -> Config:
    """A Config from plain dicts (listeners default to 127.0.0.1:0)."""
    data: dict[str, Any] = {
        "listeners": [{"bind": "127.0.0.1:0", **lst} for lst in listeners],
        "backends": backends,
    }
    if edge is not None:
        data["edge"] = dict(edge)
    return config_from_mapping(data, base_dir=Path.cwd())


async def open_client(address: tuple[str, int]) -> trio.SocketStream:
    """A plain TCP connection to the edge."""
    return await trio.open_tcp_stream(*address)


async def read_all(stream: trio.abc.ReceiveStream, limit: int = 1 << 26) -> bytes:
    """Read until EOF."""
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(bytes(chunk))
        total += len(chunk)
        if total > limit:
            raise AssertionError("more data than expected")


# -- end-to-end helpers (test_server, test_drain_reload, test_cli, ...) -------

Handler = Callable[[trio.SocketStream], Awaitable[None]]


class Backend:
    """A small trio TCP server on 127.0.0.1 standing in for a backend server.

    Start it with ``await backend.start(nursery)``; ``stop()`` closes the
    listening socket and every open connection (``start`` again rebinds the
    same port). ``accepted`` counts connections, ``active`` the open ones.
    """

    def __init__(self, handler: Handler, *, name: str = "", port: int = 0) -> None:
        self.handler = handler
        self.name = name
        self.port = port
        self.accepted = 0
        self.active = 0
        self._scope: trio.CancelScope | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, nursery: trio.Nursery) -> Backend:
        await nursery.start(self._run)
        return self

    def stop(self) -> None:
        assert self._scope is not None
        self._scope.cancel()
        self._scope = None

    async def _run(self, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.CancelScope() as scope:
            self._scope = scope
            listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
            self.port = int(listeners[0].socket.getsockname()[1])
            task_status.started()
            await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        self.active += 1
        try:
            await self.handler(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.active -= 1
            await trio.aclose_forcefully(stream)


async def read_proxy(stream: trio.abc.ReceiveStream) -> tuple[ProxyHeader, bytes]:
    """Read until ``proxyproto.parse`` finds a complete header.

    Returns the header and the bytes received after it.
    """
    data = b""
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise AssertionError(f"EOF before a complete PROXY header: {data!r}")
        data += chunk
        try:
            header, consumed = parse(data)
        except RemoteProtocolError as exc:
            if exc.reason == "incomplete":
                continue
            raise
        return header, data[consumed:]


def tag_handler(name: str, *, hold: bool = False) -> Handler:
    """Send *name*; then close at once, or (*hold*) when the client closes."""

    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(name.encode())
        if hold:
            while await stream.receive_some(65536):
                pass

    return handler


def _inet(address: InetAddress | UnixAddress | None) -> list[Any] | None:
    if isinstance(address, InetAddress):
        return [str(address.host), address.port]
    return None if address is None else [str(address)]


def describe_header(header: ProxyHeader | None) -> dict[str, Any]:
    """The parts of a header the tests compare, as plain data."""
    if header is None:
        return {"header": None}
    return {
        "version": header.version,
        "command": header.command.name,
        "source": _inet(header.source),
        "destination": _inet(header.destination),
        "unique_id": None if header.unique_id is None else header.unique_id.decode(),
        "crc32c": header.crc32c,
    }


def proxy_echo_handler(*, proxy: bool = True) -> Handler:
    """Read the PROXY header (if *proxy*) and everything up to EOF; answer JSON.

    The answer describes the header and the data (``data`` as text, ``size``)
    and the backend closes after sending it.
    """

    async def handler(stream: trio.SocketStream) -> None:
        header: ProxyHeader | None = None
        rest = b""
        if proxy:
            header, rest = await read_proxy(stream)
        data = rest + await read_all(stream)
        answer = describe_header(header)
        answer["data"] = data.decode("latin-1")
        answer["size"] = len(data)
        await stream.send_all(json.dumps(answer).encode())

    return handler


async def exchange(address: tuple[str, int], data: bytes = b"") -> bytes:
    """Connect, send *data*, half-close, read until EOF."""
    client = await connect(address)
    try:
        if data:
            await client.send_all(data)
        await client.send_eof()
        return await read_all(client)
    finally:
        await client.aclose()


async def exchange_then_close_notify(
    address: tuple[str, int], context: ssl.SSLContext, data: bytes
) -> bytes:
    """Connect over TLS; send *data* and a close_notify in one write (one
    read for the peer), TCP left open; the plaintext received until the
    peer closes."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    engine = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    tcp = await connect(address)
    try:
        while True:
            try:
                engine.do_handshake()
                break
            except ssl.SSLWantReadError:
                await tcp.send_all(outgoing.read())
                incoming.write(await tcp.receive_some(65536))
        await tcp.send_all(outgoing.read())
        engine.write(data)
        with contextlib.suppress(ssl.SSLWantReadError):
            engine.unwrap()  # the close_notify, behind *data*
        await tcp.send_all(outgoing.read())
        while chunk := await tcp.receive_some(65536):
            incoming.write(chunk)
        incoming.write_eof()
        received = b""
        # (The end: the peer's close_notify, or its FIN alone.)
        with contextlib.suppress(ssl.SSLZeroReturnError, ssl.SSLEOFError):
            while True:
                received += engine.read(65536)
        return received
    finally:
        await tcp.aclose()


@asynccontextmanager
async def running_edge(config: Config) -> AsyncIterator[Edge]:
    """Run an Edge for the block; stopped (hard) when the block ends."""
    async with trio.open_nursery() as nursery:
        edge: Edge = await nursery.start(Edge(config).run)
        try:
            yield edge
        finally:
            edge.stop()


def in_flight(edge: Edge, stage: str) -> int:
    """How many of *edge*'s connections run *stage* on the reactor with no
    task: ``"header"`` (PROXY header reads), ``"handshake"`` (TLS
    handshakes) or ``"http"`` (HTTP connections, h2c preface reads)."""
    kinds = {"header": ReactorHeaderRead, "handshake": ReactorHandshake}
    running = list(edge._pipeline.in_flight)
    if stage in kinds:
        return sum(isinstance(r, kinds[stage]) for r in running)
    assert stage == "http"
    return sum(not isinstance(r, tuple(kinds.values())) for r in running)


def address_of(edge: Edge, listener: str) -> tuple[str, int]:
    """The first bound address of *listener*."""
    return edge.listen_addresses[listener][0]


def access_records(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The access-log lines captured so far, decoded."""
    return [
        json.loads(record.getMessage())
        for record in caplog.records
        if record.name == "tlsedge.access"
    ]


async def wait_access_records(
    caplog: pytest.LogCaptureFixture, count: int = 1, within: float = 10.0
) -> list[dict[str, Any]]:
    """Poll until at least *count* access-log lines were written."""
    await wait_until(lambda: len(access_records(caplog)) >= count, within)
    return access_records(caplog)


async def wait_until(
    predicate: Callable[[], bool], within: float = 10.0, interval: float = 0.01
) -> None:
    """Poll *predicate* until it is true (``trio.TooSlowError`` after *within* s)."""
    with trio.fail_after(within):
        while True:
            if predicate():
                return
            await trio.sleep(interval)


_CLIENTS: list[trio.SocketStream] = []


async def connect(address: tuple[str, int]) -> trio.SocketStream:
    """`open_client`, remembered so that `close_clients` closes it after the test
    even when an assertion failed half way (no ResourceWarning in later tests)."""
    client = await open_client(address)
    _CLIENTS.append(client)
    return client


async def close_clients() -> None:
    """Close every client `connect` opened (call from a fixture's teardown)."""
    while _CLIENTS:
        await trio.aclose_forcefully(_CLIENTS.pop())


@contextmanager
def capture_unraisable() -> Iterator[list[Any]]:
    """What ``sys.unraisablehook`` is given while the block runs (exceptions
    Python could not raise: it would print them to stderr)."""
    seen: list[Any] = []
    previous = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        yield seen
    finally:
        sys.unraisablehook = previous


# -- TLS by hand ------------------------------------------------------------------


def tls_extension(kind: int, body: bytes) -> bytes:
    """A TLS extension: type, length, body."""
    return struct.pack("!HH", kind, len(body)) + body


def server_name_extension(name: bytes) -> bytes:
    """The server_name extension holding one host_name: *name*, as it is."""
    entry = struct.pack("!BH", 0, len(name)) + name
    return tls_extension(0, struct.pack("!H", len(entry)) + entry)


def client_hello(server_name: bytes | None, *, key_share: bool = True) -> bytes:
    """A TLS 1.3 ClientHello record (x25519; *key_share* False makes the
    server answer with a HelloRetryRequest), naming *server_name*."""
    share = struct.pack("!HH", 0x001D, 32) + os.urandom(32) if key_share else b""
    extensions = b"".join(
        [
            b"" if server_name is None else server_name_extension(server_name),
            tls_extension(10, struct.pack("!HH", 2, 0x001D)),  # supported_groups
            tls_extension(13, struct.pack("!HHHH", 6, 0x0403, 0x0804, 0x0401)),
            tls_extension(43, b"\x02\x03\x04"),  # supported_versions: TLS 1.3
            tls_extension(51, struct.pack("!H", len(share)) + share),  # key_share
        ]
    )
    body = b"".join(
        [
            b"\x03\x03" + os.urandom(32),
            b"\x20" + os.urandom(32),  # session id
            struct.pack("!HH", 2, 0x1301),  # TLS_AES_128_GCM_SHA256
            b"\x01\x00",  # no compression
            struct.pack("!H", len(extensions)) + extensions,
        ]
    )
    message = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(message)) + message
