"""Backend and resource faults end to end: refuse, reset, blackhole, stall, flap,
and the edge itself running out of file descriptors.

Real loopback sockets throughout; the blackhole is a listening socket whose
accept queue is full (Linux drops further SYNs, so connect() hangs), not a
mocked connect.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import tlsedge._backends.upstream
from tests.peers import free_port
from tests.tlsedge.helpers import (
    Backend,
    access_records,
    address_of,
    close_clients,
    connect,
    exchange,
    make_config,
    running_edge,
    tag_handler,
    wait_access_records,
    wait_until,
)
from tlsedge._core.config import Config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


def config(servers: list[str], **backend: Any) -> Config:
    listener: dict[str, Any] = {"name": "in", "backend": "b"}
    for key in ("idle_timeout", "client_fin_timeout"):
        if key in backend:
            listener[key] = backend.pop(key)
    return make_config([listener], [{"name": "b", "servers": servers, **backend}])


def closed_port() -> str:
    """An address where nothing listens (connect is refused)."""
    return f"127.0.0.1:{free_port()}"


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    """An address whose connects hang: a listener with a full accept queue."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    address = listener.getsockname()
    fillers: list[socket.socket] = []
    try:
        for _ in range(3):  # backlog 0 still queues one; fill it with margin
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(address)
            fillers.append(filler)
        yield f"127.0.0.1:{address[1]}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def refused(address: tuple[str, int], data: bytes) -> bytes:
    """Send *data* and read to the end; a reset counts as the end."""
    client = await connect(address)
    with contextlib.suppress(trio.BrokenResourceError):
        await client.send_all(data)
        await client.send_eof()
    got = b""
    with contextlib.suppress(trio.BrokenResourceError):
        while chunk := await client.receive_some(65536):
            got += chunk
    return got


def abort(stream: trio.SocketStream) -> None:
    stream.socket.setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
    )


# -- refuse --------------------------------------------------------------------


async def test_refusing_server_is_retried_on_another(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    good = await Backend(tag_handler("good")).start(nursery)
    cfg = config([closed_port(), good.address], retries=1, balance="round-robin")
    async with running_edge(cfg) as edge:
        answers = [await exchange(address_of(edge, "in")) for _ in range(6)]
        records = await wait_access_records(caplog, 6)
    assert answers == [b"good"] * 6
    assert {r["termination"] for r in records} <= {"server_closed", "client_closed"}
    assert {r["server"] for r in records} == {good.address}


async def test_every_server_refusing_is_a_clean_close_and_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = config([closed_port(), closed_port()], retries=2)
    async with running_edge(cfg) as edge:
        assert await refused(address_of(edge, "in"), b"hello") == b""
        (record,) = await wait_access_records(caplog)
    assert record["termination"] == "connect_failed"
    assert "refused" in record["detail"].lower()


# -- reset mid-transfer --------------------------------------------------------


async def test_backend_reset_mid_transfer_reaches_the_client_as_a_reset(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    async def half_then_reset(stream: trio.SocketStream) -> None:
        await stream.send_all(b"x" * 200_000)
        await trio.sleep(0.1)
        abort(stream)

    backend = await Backend(half_then_reset).start(nursery)
    async with running_edge(config([backend.address])) as edge:
        client = await connect(address_of(edge, "in"))
        received = 0
        outcome = "clean EOF"  # would look like a complete transfer: wrong
        with trio.fail_after(10):
            try:
                while chunk := await client.receive_some(65536):
                    received += len(chunk)
            except trio.BrokenResourceError:
                outcome = "reset"
        (record,) = await wait_access_records(caplog)
    assert outcome == "reset", f"{outcome} after {received} bytes"
    assert record["termination"] == "server_error"
    assert received <= 200_000


# -- blackhole -----------------------------------------------------------------


async def test_blackholed_server_times_out_and_the_retry_goes_elsewhere(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    good = await Backend(tag_handler("good")).start(nursery)
    with blackhole() as hole:
        cfg = config([hole, good.address], retries=1, connect_timeout=0.3)
        async with running_edge(cfg) as edge:
            answers = [await exchange(address_of(edge, "in")) for _ in range(4)]
            records = await wait_access_records(caplog, 4)
    assert answers == [b"good"] * 4
    assert {r["server"] for r in records} == {good.address}


async def test_blackhole_only_ends_in_connect_failed_within_the_timeouts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with blackhole() as hole:
        cfg = config([hole], retries=1, connect_timeout=0.3)
        async with running_edge(cfg) as edge:
            with trio.fail_after(30):  # it ends (how fast depends on the load)
                assert await refused(address_of(edge, "in"), b"hi") == b""
            (record,) = await wait_access_records(caplog)
    assert record["termination"] == "connect_failed"
    # Two attempts, each ended by its own connect_timeout.
    assert record["detail"].count("timeout after 0.3 s") == 2, record["detail"]


# -- stall mid-response --------------------------------------------------------


async def test_stalled_response_is_ended_by_idle_timeout(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    async def stall(stream: trio.SocketStream) -> None:
        await stream.send_all(b"partial")
        while await stream.receive_some(100):  # silent; notices the close
            pass

    backend = await Backend(stall).start(nursery)
    async with running_edge(config([backend.address], idle_timeout=0.5)) as edge:
        client = await connect(address_of(edge, "in"))
        got = b""
        reset = False
        with trio.fail_after(30):  # it ends (how fast depends on the load)
            try:
                while chunk := await client.receive_some(100):
                    got += chunk
            except trio.BrokenResourceError:
                reset = True
        (record,) = await wait_access_records(caplog)
        await wait_until(lambda: backend.active == 0)
    assert got == b"partial"
    # A reset, never a FIN: the cut response must not look complete.
    assert reset
    assert record["termination"] == "idle_timeout"


# -- flapping health -----------------------------------------------------------


async def test_traffic_follows_a_flapping_server(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    a = await Backend(tag_handler("a"), port=free_port()).start(nursery)
    b = await Backend(tag_handler("b")).start(nursery)
    cfg = config(
        [a.address, b.address],
        retries=0,
        health={
            "interval": 0.2,
            "timeout": 0.1,
            "healthy_threshold": 1,
            "unhealthy_threshold": 1,
        },
    )

    async def tags(n: int) -> Counter[bytes]:
        return Counter([await exchange(address_of(edge, "in")) for _ in range(n)])

    async with running_edge(cfg) as edge:
        pool = edge._pools["b"]

        def healthy(address: str) -> bool:
            return any(
                s.healthy
                for s in pool.balancer.servers
                if f"{s.address[0]}:{s.address[1]}" == address
            )

        for _ in range(3):  # flap a few times
            await wait_until(lambda: healthy(a.address), 5)
            assert set(await tags(6)) == {b"a", b"b"}
            a.stop()
            await wait_until(lambda: not healthy(a.address), 5)
            assert set(await tags(6)) == {b"b"}  # no client sees the dead one
            await a.start(nursery)
    ok = {"server_closed", "client_closed"}
    failed = [r for r in access_records(caplog) if r["termination"] not in ok]
    assert failed == []


# -- out of file descriptors ---------------------------------------------------


def _low_fd_limit() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))


async def test_edge_survives_running_out_of_file_descriptors(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = await Backend(tag_handler("ok", hold=True)).start(nursery)
    port = free_port()
    conf = tmp_path / "edge.toml"
    conf.write_text(
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n'
        f'[[backends]]\nname = "b"\nservers = ["{backend.address}"]\nretries = 0\n'
    )
    log = tmp_path / "edge.log"
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tlsedge", "run", str(conf)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            preexec_fn=_low_fd_limit,
        )
    clients: list[trio.SocketStream] = []
    try:
        with trio.fail_after(20):
            while True:
                try:
                    probe = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    assert process.returncode is None, log.read_text()
                    await trio.sleep(0.05)
                    continue
                await probe.aclose()
                break
        # 2 fds per relayed connection: the limit is hit at ~20 connections.
        clients.extend(
            [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(60)]
        )
        await wait_until(lambda: "accept failed" in log.read_text(), 10, 0.05)
        assert process.returncode is None
        for client in clients:
            await client.aclose()
        clients.clear()
        # Served again once the connections are gone.
        with trio.fail_after(15):
            while True:
                answer = b""
                with contextlib.suppress(OSError, trio.BrokenResourceError):
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    try:
                        with trio.move_on_after(1):
                            answer = await stream.receive_some(10)
                    finally:
                        await stream.aclose()
                if answer == b"ok":
                    break
                await trio.sleep(0.1)
        assert process.returncode is None
        text = log.read_text()
        assert "Too many open files" in text
    finally:
        for client in clients:
            await trio.aclose_forcefully(client)
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            await process.wait()


class _SocketModule:
    """``socket`` as seen by tlsedge._backends.upstream, whose ``socket()`` fails with
    EMFILE the first *failures* times (the process is out of fds)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)

    def socket(self, *args: Any) -> socket.socket:
        if self.failures > 0:
            self.failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return socket.socket(*args)


async def test_running_out_of_fds_does_not_mark_the_server_down(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by campaigns/load.py: EMFILE on the upstream socket counted as a
    failed connect to the server, which was marked DOWN after 6 of them, and
    every later client got no_server for the 30 s until the next trial."""
    backend = await Backend(tag_handler("ok")).start(nursery)
    monkeypatch.setattr(
        tlsedge._backends.upstream, "socket", _SocketModule(failures=10)
    )
    async with running_edge(config([backend.address], retries=0)) as edge:
        for _ in range(10):
            assert await refused(address_of(edge, "in"), b"") == b""
        assert await exchange(address_of(edge, "in")) == b"ok"
        records = await wait_access_records(caplog, 11)
    assert [r["termination"] for r in records[:10]] == ["connect_failed"] * 10
    assert "too many open files" in records[0]["detail"]
    assert "DOWN" not in caplog.text
