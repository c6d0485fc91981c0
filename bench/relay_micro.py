"""Micro-benchmark for ``tlsedge._reactor.relay``: stream vs raw-socket path vs splice.

Run: ``python bench/relay_micro.py [--bulk-mib 1024] [--conns 50] [--exchanges 2000]``

The relay runs in this process (one trio thread); the peers (clients and a backend)
run in a forked child process using asyncio protocols, so the relay gets a core of
its own. Three relay variants are measured in the same run:

* ``stream``: :func:`tlsedge._reactor.relay.relay` on streams wrapped in a pass-through
  ``HalfCloseableStream`` (forces the generic trio stream path),
* ``raw``: :func:`tlsedge._reactor.relay.relay` on plain ``trio.SocketStream``
  (fast path),
* ``splice``: a minimal ``os.splice``-through-a-pipe relay written here, Linux only.

Workloads: ``bulk`` (one connection sends ``--bulk-mib`` MiB client->server, then
FIN) and ``pingpong`` (``--conns`` connections each doing ``--exchanges`` 100-byte
request/response round trips through the relay). Absolute numbers on a shared box
are noise; compare the ratios between variants of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import os
import socket
import time
from typing import TYPE_CHECKING

import trio

from tlsedge._core.termination import RelayStats
from tlsedge._reactor.relay import relay

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

CHUNK = 1 << 20
MESSAGE = b"x" * 100


# -- peers (child process, asyncio) -------------------------------------------


class _Backend(asyncio.Protocol):
    """Echoes (pingpong) or discards (bulk); closes after the client's EOF."""

    def __init__(self, *, echo: bool) -> None:
        self.echo = echo
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.echo and self.transport is not None:
            self.transport.write(data)

    def eof_received(self) -> bool:
        return False  # close the transport


class _PingClient(asyncio.Protocol):
    def __init__(self, exchanges: int, done: asyncio.Future[None]) -> None:
        self.left = exchanges
        self.pending = 0
        self.done = done
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(MESSAGE)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.pending += len(data)
        if self.pending < len(MESSAGE):
            return
        self.pending = 0
        self.left -= 1
        if self.left:
            self.transport.write(MESSAGE)
        else:
            self.transport.close()
            self.done.set_result(None)


async def _peers(
    backend: socket.socket, relay_port: int, args: argparse.Namespace, workload: str
) -> float:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Backend(echo=workload == "pingpong"), sock=backend
    )
    start = time.perf_counter()
    if workload == "bulk":
        sock = socket.create_connection(("127.0.0.1", relay_port))
        sock.setblocking(False)
        buf = b"\0" * CHUNK
        for _ in range(args.bulk_mib):
            await loop.sock_sendall(sock, buf)
        sock.shutdown(socket.SHUT_WR)
        assert await loop.sock_recv(sock, 1) == b""
        sock.close()
    else:
        futures = []
        for _ in range(args.conns):
            done: asyncio.Future[None] = loop.create_future()
            await loop.create_connection(
                functools.partial(_PingClient, args.exchanges, done),
                "127.0.0.1",
                relay_port,
            )
            futures.append(done)
        await asyncio.gather(*futures)
    elapsed = time.perf_counter() - start
    server.close()
    return elapsed


def _child(
    backend: socket.socket,
    relay_port: int,
    args: argparse.Namespace,
    workload: str,
    conn: Connection,
) -> None:
    conn.send(asyncio.run(_peers(backend, relay_port, args, workload)))


# -- relay variants (this process, trio) --------------------------------------


class _Passthrough(trio.abc.HalfCloseableStream):
    """Hides the SocketStream type so relay() takes the generic stream path."""

    def __init__(self, inner: trio.SocketStream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _splice_pump(
    src_sock: trio.socket.SocketType, dst_sock: trio.socket.SocketType
) -> None:
    src, dst = src_sock.fileno(), dst_sock.fileno()
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
    unyielded = 0
    try:
        while True:
            try:
                n = os.splice(src, write_end, CHUNK, flags=flags)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(src)
                unyielded = 0
                continue
            if not n:
                break
            while n:
                try:
                    n -= os.splice(read_end, dst, n, flags=flags)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(dst)
                    unyielded = 0
            unyielded += 1
            if unyielded >= 16:
                await trio.lowlevel.checkpoint()
                unyielded = 0
        dst_sock.shutdown(socket.SHUT_WR)
    finally:
        os.close(read_end)
        os.close(write_end)


async def _splice_relay(client: trio.SocketStream, server: trio.SocketStream) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_splice_pump, client.socket, server.socket)
        nursery.start_soon(_splice_pump, server.socket, client.socket)


async def _handle(
    client: trio.SocketStream, backend_addr: tuple[str, int], variant: str
) -> None:
    sock = trio.socket.socket()
    await sock.connect(backend_addr)
    server = trio.SocketStream(sock)
    try:
        if variant == "splice":
            await _splice_relay(client, server)
            return
        stats = RelayStats()
        a: trio.abc.Stream = client
        b: trio.abc.Stream = server
        if variant == "stream":
            a, b = _Passthrough(client), _Passthrough(server)
        await relay(
            a,
            b,
            stats=stats,
            idle_timeout=60,
            client_fin_timeout=60,
            server_fin_timeout=60,
        )
    finally:
        await server.aclose()
        await client.aclose()


async def _serve(
    listener_sock: socket.socket,
    backend_addr: tuple[str, int],
    variant: str,
    conn: Connection,
) -> None:
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(listener_sock))
    async with trio.open_nursery() as nursery:

        async def accept_loop() -> None:
            while True:
                stream = await listener.accept()
                assert isinstance(stream, trio.SocketStream)
                nursery.start_soon(_handle, stream, backend_addr, variant)

        nursery.start_soon(accept_loop)
        # The child's result on the pipe means the workload is over.
        await trio.lowlevel.wait_readable(conn.fileno())
        nursery.cancel_scope.cancel()


def _run_one(
    args: argparse.Namespace, variant: str, workload: str
) -> tuple[float, float]:
    front = socket.create_server(("127.0.0.1", 0), backlog=1024)
    back = socket.create_server(("127.0.0.1", 0), backlog=1024)
    parent_conn, child_conn = multiprocessing.Pipe()
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(
        target=_child,
        args=(back, front.getsockname()[1], args, workload, child_conn),
    )
    proc.start()
    cpu = time.process_time()
    trio.run(_serve, front, back.getsockname(), variant, parent_conn)
    cpu = time.process_time() - cpu
    elapsed = float(parent_conn.recv())
    proc.join()
    back.close()
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk-mib", type=int, default=1024)
    parser.add_argument("--conns", type=int, default=50)
    parser.add_argument("--exchanges", type=int, default=2000)
    parser.add_argument(
        "--variants", default="stream,raw,splice", help="comma-separated"
    )
    args = parser.parse_args()
    for variant in args.variants.split(","):
        bulk, bulk_cpu = _run_one(args, variant, "bulk")
        ping, ping_cpu = _run_one(args, variant, "pingpong")
        exchanges = args.conns * args.exchanges
        print(
            f"{variant:7s} bulk {args.bulk_mib} MiB: {args.bulk_mib / 1024 / bulk:5.2f}"
            f" GiB/s, relay CPU {bulk_cpu / args.bulk_mib * 1e3:6.3f} ms/MiB |"
            f" pingpong {args.conns}x{args.exchanges}: {exchanges / ping:7.0f}/s,"
            f" relay CPU {ping_cpu / exchanges * 1e6:5.1f} us/exchange"
        )


if __name__ == "__main__":
    main()
