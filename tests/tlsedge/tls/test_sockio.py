"""Socket I/O that waits only when it must, over real socket pairs."""

from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from tlsedge._tls import sockio


def stream_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_data_both_ways_and_eof() -> None:
    left, right = stream_pair()
    async with left, right:
        await sockio.send_all(left, b"hello")
        assert await sockio.receive_some(right, 100) == b"hello"
        await left.send_eof()
        assert await sockio.receive_some(right, 100) == b""


async def test_a_large_send_waits_for_the_reader() -> None:
    left, right = stream_pair()
    payload = bytes(range(256)) * 40_000  # far more than the socket buffers
    received = bytearray()

    async def read_all() -> None:
        while len(received) < len(payload):
            received.extend(await sockio.receive_some(right, 65536))

    async with left, right, trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await sockio.send_all(left, payload)
    assert received == payload


async def test_a_waiting_read_is_cancellable_and_resumes_with_data() -> None:
    left, right = stream_pair()
    async with left, right:
        with trio.move_on_after(0.05) as scope:
            await sockio.receive_some(right, 10)
        assert scope.cancelled_caught
        await sockio.send_all(left, b"x")
        assert await sockio.receive_some(right, 10) == b"x"


@pytest.mark.parametrize("yields", [False, True], ids=["cancel-point", "fair-share"])
async def test_a_cancelled_operation_reads_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, yields: bool
) -> None:
    # Cancelled before the read or write, whether or not this is the call
    # that yields for fairness: no data read and lost, none half written.
    left, right = stream_pair()
    async with left, right:
        await sockio.send_all(left, b"ready")
        monkeypatch.setattr(
            sockio._BUDGET, "not_waited", sockio.FAIR_SHARE - 1 if yields else 0
        )
        with trio.CancelScope() as scope:
            scope.cancel()
            with pytest.raises(trio.Cancelled):
                await sockio.receive_some(right, 10)
            with pytest.raises(trio.Cancelled):
                await sockio.send_all(left, b"never")
        assert await sockio.receive_some(right, 10) == b"ready"


async def test_operations_that_never_wait_still_let_others_run() -> None:
    left, right = stream_pair()
    ran = trio.Event()

    async def other() -> None:
        ran.set()

    async with left, right, trio.open_nursery() as nursery:
        nursery.start_soon(other)
        for _ in range(sockio.FAIR_SHARE):
            await sockio.send_all(left, b"x")
            await sockio.receive_some(right, 10)
        assert ran.is_set()


async def test_closed_socket_and_reset_peer() -> None:
    left, right = stream_pair()
    await left.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await sockio.receive_some(left, 10)
    with pytest.raises(trio.ClosedResourceError):
        await sockio.send_all(left, b"x")
    await right.aclose()
    # A TCP peer that resets: the read fails as a broken stream.
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = await trio.open_tcp_stream(*listener.getsockname())
    server_sock, _ = await listener.accept()
    server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    server_sock.close()
    with pytest.raises(trio.BrokenResourceError):
        await sockio.receive_some(client, 10)
    await client.aclose()
    listener.close()


async def test_other_streams_use_their_own_methods() -> None:
    left, right = trio.testing.memory_stream_pair()
    await sockio.send_all(left, b"abc")
    assert await sockio.receive_some(right, 10) == b"abc"


async def test_wait_first_reads_what_is_already_there_and_what_comes() -> None:
    left, right = stream_pair()
    async with left, right:
        await sockio.send_all(left, b"early")
        assert await sockio.receive_some(right, 10, wait_first=True) == b"early"

        async def late() -> None:
            await trio.sleep(0.01)
            await sockio.send_all(left, b"late")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(late)
            assert await sockio.receive_some(right, 10, wait_first=True) == b"late"
