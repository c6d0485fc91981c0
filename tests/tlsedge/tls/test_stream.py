"""TLSStream: trio's stream-conformance checks and TLS half-close."""

from __future__ import annotations

import contextlib
import ctypes
import socket
import ssl
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing
import trustme

from tlsedge._tls.stream import TLSStream

CA = trustme.CA()
SERVER_CERT = CA.issue_cert("tlsedge.test")

StreamPair = tuple[TLSStream, TLSStream]


def _contexts(version: ssl.TLSVersion) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    SERVER_CERT.configure_cert(server)
    client = ssl.create_default_context()
    CA.configure_trust(client)
    client.minimum_version = client.maximum_version = version
    return server, client


def _pair(
    transports: tuple[trio.abc.Stream, trio.abc.Stream],
    version: ssl.TLSVersion,
    *,
    tickets: bool = True,
) -> StreamPair:
    server_ctx, client_ctx = _contexts(version)
    if not tickets:
        # A TLS 1.3 server sends its session tickets right after the
        # handshake; over an unbuffered lockstep pair that send waits for a
        # client that has finished its handshake and reads nothing yet.
        server_ctx.num_tickets = 0
    client = TLSStream(
        transports[0], client_ctx, server_side=False, server_hostname="tlsedge.test"
    )
    server = TLSStream(transports[1], server_ctx, server_side=True)
    return client, server


async def _handshake(pair: StreamPair) -> StreamPair:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pair[0].do_handshake)
        nursery.start_soon(pair[1].do_handshake)
    return pair


VERSIONS = [
    pytest.param(ssl.TLSVersion.TLSv1_3, id="tls13"),
    pytest.param(ssl.TLSVersion.TLSv1_2, id="tls12"),
]


@pytest.mark.parametrize("version", VERSIONS)
async def test_two_way_stream_conformance(version: ssl.TLSVersion) -> None:
    async def stream_maker() -> StreamPair:
        return _pair(trio.testing.memory_stream_pair(), version)

    async def clogged_stream_maker() -> StreamPair:
        # Lockstep streams have no buffering; finish the handshakes first so
        # the checker's clogged sends do not deadlock them (as trio's own
        # SSLStream tests do).
        return await _handshake(
            _pair(trio.testing.lockstep_stream_pair(), version, tickets=False)
        )

    await trio.testing.check_two_way_stream(stream_maker, clogged_stream_maker)


async def test_half_closeable_stream_conformance() -> None:
    async def stream_maker() -> StreamPair:
        return _pair(trio.testing.memory_stream_pair(), ssl.TLSVersion.TLSv1_3)

    async def clogged_stream_maker() -> StreamPair:
        return await _handshake(
            _pair(
                trio.testing.lockstep_stream_pair(),
                ssl.TLSVersion.TLSv1_3,
                tickets=False,
            )
        )

    await trio.testing.check_half_closeable_stream(stream_maker, clogged_stream_maker)


async def _read_all(stream: trio.abc.ReceiveStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some():
        data += chunk
    return data


Peer = Callable[[TLSStream], Awaitable[None]]


@pytest.mark.parametrize("version", VERSIONS)
async def test_send_eof_then_keep_reading(version: ssl.TLSVersion) -> None:
    client, server = _pair(trio.testing.memory_stream_pair(), version)
    payload = bytes(range(256)) * 4000
    received: dict[str, bytes] = {}

    async def server_side() -> None:
        await server.send_all(b"bye")
        await server.send_eof()  # close_notify: our direction is done
        received["server"] = await _read_all(server)  # but we keep reading

    async def client_side() -> None:
        received["client"] = await _read_all(client)
        await client.send_all(payload)  # the client still sends after our EOF
        await client.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server_side)
        nursery.start_soon(client_side)
    assert received == {"client": b"bye", "server": payload}


async def test_send_eof_with_peer_data_already_waiting() -> None:
    # The case Python's unwrap() gets wrong: application data from the peer is
    # already in the incoming buffer when we send close_notify.
    client, server = _pair(trio.testing.memory_stream_pair(), ssl.TLSVersion.TLSv1_3)
    await _handshake((client, server))
    await client.send_all(b"first")
    await trio.testing.wait_all_tasks_blocked()
    await server.send_eof()
    await client.send_all(b" second")
    await client.send_eof()
    assert await _read_all(server) == b"first second"
    assert await _read_all(client) == b""


async def test_initial_data_feeds_the_handshake() -> None:
    # Bytes read before the stream existed (past a PROXY header) are the
    # ClientHello: the server must use them.
    client_transport, server_transport = trio.testing.memory_stream_pair()
    server_ctx, client_ctx = _contexts(ssl.TLSVersion.TLSv1_3)
    client = TLSStream(
        client_transport, client_ctx, server_side=False, server_hostname="tlsedge.test"
    )

    async def first_flight() -> bytes:
        with trio.move_on_after(1):
            await client.do_handshake()
        return b""

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first_flight)
        hello = await server_transport.receive_some()
        server = TLSStream(
            server_transport, server_ctx, server_side=True, initial_data=bytes(hello)
        )
        await server.do_handshake()
    await client.send_all(b"ping")
    assert await server.receive_some() == b"ping"


async def test_ragged_eof_reads_as_eof() -> None:
    client, server = _pair(trio.testing.memory_stream_pair(), ssl.TLSVersion.TLSv1_3)
    await _handshake((client, server))
    await client.send_all(b"data")
    await client.transport_stream.aclose()  # no close_notify
    assert await _read_all(server) == b"data"
    assert server.ragged_eof


async def test_handshake_failure_is_broken_resource() -> None:
    client_transport, server_transport = trio.testing.memory_stream_pair()
    server_ctx, _ = _contexts(ssl.TLSVersion.TLSv1_3)
    server = TLSStream(server_transport, server_ctx, server_side=True)
    await client_transport.send_all(b"\x16\x03\x01\x00\x05hello-this-is-not-tls")
    with pytest.raises(trio.BrokenResourceError) as info:
        await server.do_handshake()
    assert isinstance(info.value.__cause__, ssl.SSLError)
    with pytest.raises(trio.BrokenResourceError):
        await server.receive_some()
    await server.aclose()


@pytest.mark.parametrize("version", VERSIONS)
async def test_receive_available_from_transport_bytes_fed_by_the_caller(
    version: ssl.TLSVersion,
) -> None:
    # The reactor reads the socket itself and feeds the engine: a record split
    # anywhere gives nothing until it is whole; several records and the
    # close_notify behind them come out of one call.
    client_transport, server_transport = trio.testing.memory_stream_pair()
    client, server = _pair((client_transport, server_transport), version)
    await _handshake((client, server))
    await client.send_all(b"first")
    await client.send_all(b"second")
    await client.send_eof()
    wire = bytes(await server_transport.receive_some())  # all of it, buffered
    assert server.receive_available(wire[:3]) == (b"", False)
    data, closed = server.receive_available(wire[3:])
    assert (data, closed) == (b"firstsecond", True)
    assert server.receive_available() == (b"", True)  # and it stays closed


@pytest.mark.parametrize("version", VERSIONS)
async def test_handshake_nowait_is_driven_by_the_caller(
    version: ssl.TLSVersion,
) -> None:
    """The server's handshake driven without waiting (the reactor's way): the
    caller moves the bytes; the stream is established at the end and carries
    data like one that ran `do_handshake`."""
    near, far = trio.testing.memory_stream_pair()
    client, server = _pair((near, far), version)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.do_handshake)
        done = False
        while not done:
            done = server.handshake_nowait(bytes(await far.receive_some()))
            assert server.established is done
            if records := server.take_transport_data():
                await far.send_all(records)
    assert server.handshake_nowait() is True  # done stays done
    await client.send_all(b"ping")
    data, eof = server.receive_available(bytes(await far.receive_some()))
    assert (data, eof) == (b"ping", False)


async def test_handshake_nowait_fails_with_an_alert_to_send() -> None:
    """Garbage instead of a ClientHello: BrokenResourceError with the TLS
    error as its cause, and the alert left for the caller to send; the
    transport's EOF mid-handshake fails it too."""
    server_ctx, _ = _contexts(ssl.TLSVersion.TLSv1_3)
    near, far = trio.testing.memory_stream_pair()
    server = TLSStream(far, server_ctx, server_side=True)
    with pytest.raises(trio.BrokenResourceError) as failed:
        server.handshake_nowait(b"\x16\x03\x01\x00\x05hello-this-is-not-tls")
    assert isinstance(failed.value.__cause__, ssl.SSLError)
    assert server.take_transport_data()[:1] == b"\x15"  # an alert record
    quiet = TLSStream(near, server_ctx, server_side=True)
    assert quiet.handshake_nowait(None) is False
    with pytest.raises(trio.BrokenResourceError):
        quiet.handshake_nowait(b"")


def _nowait_pair(transports: tuple[socket.socket, socket.socket]) -> StreamPair:
    """Two streams over stdlib sockets, their handshake driven by the test
    moving the records (the sockets are never used: no async operation)."""
    client, server = _pair(transports, ssl.TLSVersion.TLSv1_3)  # type: ignore[arg-type]
    records: bytes | None = None
    while not (client.established and server.established):
        client.handshake_nowait(records)
        server.handshake_nowait(client.take_transport_data() or None)
        records = server.take_transport_data() or None
    # The server's session tickets: records of no application data.
    assert client.receive_available(records) == (b"", False)
    return client, server


def test_a_large_delivery_reaches_the_engine_whole() -> None:
    """What the caller read in one go, far more than a record, comes out of
    one `receive_available`, the close_notify behind it included; records
    made from one large `send_nowait` are well formed."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(s) for s in socket.socketpair()]
        client, server = _nowait_pair((sockets[0], sockets[1]))
        payload = bytes(range(256)) * 4096  # 1 MiB
        wire = client.send_nowait(payload) + client.send_eof_nowait()
        assert server.receive_available(wire) == (payload, True)
        # Delivered in two parts cut anywhere: the same.
        client2, server2 = _nowait_pair((sockets[0], sockets[1]))
        wire = client2.send_nowait(payload)
        first, closed = server2.receive_available(wire[:100_001])
        second, closed = server2.receive_available(wire[100_001:])
        assert (first + second, closed) == (payload, False)


def _malloc_in_use() -> int | None:
    """Bytes glibc's malloc has handed out and not got back (OpenSSL's
    buffers included); None where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    mallinfo2.restype = MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def test_engine_buffers_do_not_keep_a_large_transfer() -> None:
    """A MemoryBIO keeps the largest size it ever held: after 1 MiB each way
    through `send_nowait` and `receive_available`, an idle pair holds under
    90 KiB per buffer, not the megabyte it once carried."""
    if _malloc_in_use() is None:
        pytest.skip("needs glibc's mallinfo2")
    payload = b"x" * (1 << 20)
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(s) for s in socket.socketpair()]
        pairs = [_nowait_pair((sockets[0], sockets[1])) for _ in range(4)]
        before = _malloc_in_use()
        for client, server in pairs:
            assert server.receive_available(client.send_nowait(payload))[0] == payload
            assert client.receive_available(server.send_nowait(payload))[0] == payload
        after = _malloc_in_use()
        assert before is not None
        assert after is not None
        # Four BIOs a pair, about 87 KiB each at most (four records and the
        # buffer's growth step); 1.4 MiB each without the bound.
        assert (after - before) / len(pairs) < 512 * 1024


async def test_a_stream_over_a_stdlib_socket_makes_its_transport_when_needed() -> None:
    """Given a socket (a handshake on the reactor), the stream has no trio
    transport until an async operation needs one, then works as usual."""
    near, far = socket.socketpair()
    far.setblocking(False)
    server_ctx, client_ctx = _contexts(ssl.TLSVersion.TLSv1_3)
    server = TLSStream(far, server_ctx, server_side=True)
    assert server.transport_socket is far
    client = TLSStream(
        trio.SocketStream(trio.socket.from_stdlib_socket(near)),
        client_ctx,
        server_side=False,
        server_hostname="tlsedge.test",
    )
    await _handshake((client, server))
    assert isinstance(server.transport_stream, trio.SocketStream)
    assert server.transport_stream.socket.fileno() == far.fileno()
    await client.send_all(b"ping")
    assert await server.receive_some() == b"ping"
    await server.send_eof()
    assert await _read_all(client) == b""
    await client.aclose()
    await server.aclose()
