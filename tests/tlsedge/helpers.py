"""Shared helpers for tlsedge's end-to-end tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
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
from tlsedge._config import Config, config_from_mapping
from tlsedge._server import Edge

__all__ = [
    "Backend",
    "access_records",
    "address_of",
    "close_clients",
    "connect",
    "describe_header",
    "exchange",
    "make_config",
    "open_client",
    "proxy_echo_handler",
    "read_all",
    "read_proxy",
    "running_edge",
    "tag_handler",
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


@asynccontextmanager
async def running_edge(config: Config) -> AsyncIterator[Edge]:
    """Run an Edge for the block; stopped (hard) when the block ends."""
    async with trio.open_nursery() as nursery:
        edge: Edge = await nursery.start(Edge(config).run)
        try:
            yield edge
        finally:
            edge.stop()


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
