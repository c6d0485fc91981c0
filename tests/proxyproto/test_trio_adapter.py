"""proxyproto.trio: ProxyStream conformance, read_proxy_header, open_proxy_listener."""

from __future__ import annotations

import logging
import socket
import ssl
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
import trustme

from proxyproto import (
    TLV,
    Command,
    Policy,
    ProxyHeader,
    RemoteProtocolError,
    SSLClient,
    SSLInfo,
    TrustPolicy,
    encode_v1,
    encode_v2,
)
from proxyproto.trio import (
    ProxyStream,
    open_proxy_listener,
    read_proxy_header,
    socket_addresses,
)
from tests.proxyproto.lb_checks import (
    CLOSED_BEFORE_HEADER,
    assert_logged_once,
    close_before_header,
)

V1 = ProxyHeader.from_addresses(("192.0.2.7", 51234), ("198.51.100.1", 443), version=1)
V2 = ProxyHeader.from_addresses(
    ("2001:db8::7", 40000),
    ("2001:db8::1", 8443),
    tlvs=(
        TLV.alpn(b"h2"),
        TLV.ssl(SSLInfo(client=SSLClient.SSL, verify=0, version="TLSv1.3", cn="me")),
    ),
)
PAYLOAD = b"hello after the header\n"
TRUST_LOOPBACK = TrustPolicy.from_cidrs(["127.0.0.1"])
LOGGER_NAME = "proxyproto.trio"


# -- stream conformance (empty leftover: the checkers compare exact bytes) -------------


def wrap(stream: trio.abc.Stream) -> ProxyStream:
    return ProxyStream(stream, header=None, policy=Policy.SKIP)


async def test_conformance_over_memory_streams() -> None:
    async def maker() -> tuple[ProxyStream, ProxyStream]:
        left, right = trio.testing.memory_stream_pair()
        return wrap(left), wrap(right)

    await trio.testing.check_half_closeable_stream(maker, None)


async def fill_stream(stream: trio.abc.SendStream) -> None:
    # As trio's own SocketStream tests: send until the kernel buffers are full.
    async def sender() -> None:
        while True:
            await stream.send_all(b"x" * 10000)

    async def waiter(nursery: trio.Nursery) -> None:
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        nursery.start_soon(waiter, nursery)


async def test_conformance_over_socket_pairs() -> None:
    async def maker() -> tuple[ProxyStream, ProxyStream]:
        left, right = trio.socket.socketpair()
        return wrap(trio.SocketStream(left)), wrap(trio.SocketStream(right))

    async def clogged_maker() -> tuple[ProxyStream, ProxyStream]:
        left, right = await maker()
        await fill_stream(left)
        await fill_stream(right)
        return left, right

    await trio.testing.check_half_closeable_stream(maker, clogged_maker)


# -- a non-empty leftover --------------------------------------------------------------


def leftover_pair(
    leftover: bytes = b"abcdef",
) -> tuple[ProxyStream, trio.abc.HalfCloseableStream]:
    server, client = trio.testing.memory_stream_pair()
    return ProxyStream(
        server, header=V2, policy=Policy.REQUIRE, leftover=leftover
    ), client


async def test_leftover_first_with_checkpoints_and_max_bytes() -> None:
    stream, client = leftover_pair()
    await client.send_all(b"later")
    with trio.testing.assert_checkpoints():
        assert await stream.receive_some(4) == b"abcd"
    with trio.testing.assert_checkpoints():
        assert await stream.receive_some() == b"ef"
    assert await stream.receive_some(100) == b"later"
    await client.send_eof()
    assert await stream.receive_some() == b""


async def test_leftover_argument_checks() -> None:
    stream, _ = leftover_pair()
    with pytest.raises(ValueError, match="max_bytes"):
        await stream.receive_some(0)
    with pytest.raises(TypeError):
        await stream.receive_some(1.5)  # type: ignore[arg-type]
    assert await stream.receive_some(None) == b"abcdef"


async def test_leftover_busy_on_concurrent_receive() -> None:
    stream, _ = leftover_pair()
    results: list[bytes | bytearray] = []

    async def receive() -> None:
        results.append(await stream.receive_some(3))

    async def both() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            nursery.start_soon(receive)

    with pytest.raises(ExceptionGroup) as info:
        await both()
    assert info.value.subgroup(trio.BusyResourceError) is not None
    assert results == []  # the first receiver was cancelled by the error


async def test_leftover_aclose_clears_it_and_closes() -> None:
    stream, client = leftover_pair()
    with trio.testing.assert_checkpoints():
        await stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive_some()
    with pytest.raises(trio.ClosedResourceError):
        await stream.send_all(b"x")
    with pytest.raises(trio.ClosedResourceError):
        await stream.send_eof()
    with pytest.raises(trio.ClosedResourceError):
        await stream.wait_send_all_might_not_block()
    await stream.aclose()  # idempotent
    assert await client.receive_some() == b""  # the transport was closed too


async def test_detach() -> None:
    stream, client = leftover_pair()
    assert await stream.receive_some(2) == b"ab"
    transport, leftover = stream.detach()
    assert leftover == b"cdef"
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive_some()
    await client.send_all(b"more")
    assert await transport.receive_some() == b"more"  # the transport still works
    await transport.aclose()


async def test_send_eof_needs_half_closeable_transport() -> None:
    transport, _ = trio.testing.memory_stream_pair()
    tls = trio.SSLStream(transport, ssl.create_default_context())  # cannot half-close
    stream = ProxyStream(tls, header=None, policy=Policy.SKIP)
    with pytest.raises(TypeError, match="cannot half-close"):
        await stream.send_eof()


# -- read_proxy_header -----------------------------------------------------------------


@pytest.mark.parametrize(("header", "raw"), [(V1, encode_v1(V1)), (V2, encode_v2(V2))])
async def test_read_require(header: ProxyHeader, raw: bytes) -> None:
    server, client = trio.testing.memory_stream_pair()
    await client.send_all(raw + PAYLOAD)
    stream = await read_proxy_header(server)
    assert stream.header == header
    assert stream.policy is Policy.REQUIRE
    assert stream.client_address == (str(header.source.host), header.source.port)  # type: ignore[union-attr]
    assert stream.server_address == (
        str(header.destination.host),  # type: ignore[union-attr]
        header.destination.port,  # type: ignore[union-attr]
    )
    assert stream.peer_address is None  # memory streams have no socket
    assert await stream.receive_some() == PAYLOAD


async def test_read_header_in_pieces() -> None:
    server, client = trio.testing.memory_stream_pair()
    raw = encode_v2(V2) + PAYLOAD

    async def dribble() -> None:
        for i in range(len(raw)):
            await client.send_all(raw[i : i + 1])
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(dribble)
        stream = await read_proxy_header(server)
    data = b""
    while len(data) < len(PAYLOAD):
        data += await stream.receive_some()
    assert stream.header == V2
    assert data == PAYLOAD


async def test_read_ignore_keeps_header_reports_peer() -> None:
    server, client = trio.testing.memory_stream_pair()
    await client.send_all(encode_v2(V2) + PAYLOAD)
    stream = await read_proxy_header(server, policy=Policy.IGNORE)
    assert stream.header == V2
    assert stream.client_address is None  # the real peer: none for memory streams
    assert await stream.receive_some() == PAYLOAD


async def test_read_use_with_and_without_header() -> None:
    server, client = trio.testing.memory_stream_pair()
    await client.send_all(encode_v1(V1) + PAYLOAD)
    stream = await read_proxy_header(server, policy=Policy.USE)
    assert stream.header == V1
    assert stream.client_address == ("192.0.2.7", 51234)
    server, client = trio.testing.memory_stream_pair()
    await client.send_all(PAYLOAD)
    stream = await read_proxy_header(server, policy=Policy.USE)
    assert stream.header is None
    assert await stream.receive_some() == PAYLOAD


async def test_read_skip_reads_nothing() -> None:
    server, client = trio.testing.memory_stream_pair()
    await client.send_all(encode_v2(V2))
    stream = await read_proxy_header(server, policy=Policy.SKIP)
    assert stream.header is None
    assert await stream.receive_some() == encode_v2(V2)


async def test_read_reject() -> None:
    server, _ = trio.testing.memory_stream_pair()
    with pytest.raises(RemoteProtocolError) as info:
        await read_proxy_header(server, policy=Policy.REJECT)
    assert info.value.reason == "rejected"


async def test_read_timeout(autojump_clock: trio.testing.MockClock) -> None:
    server, client = trio.testing.memory_stream_pair()
    await client.send_all(b"PROXY TCP4 ")
    start = trio.current_time()
    with pytest.raises(RemoteProtocolError) as info:
        await read_proxy_header(server, header_timeout=3600)
    assert info.value.reason == "timeout"
    assert trio.current_time() - start == pytest.approx(3600)


async def test_read_default_timeout(autojump_clock: trio.testing.MockClock) -> None:
    server, _ = trio.testing.memory_stream_pair()
    start = trio.current_time()
    with pytest.raises(RemoteProtocolError):
        await read_proxy_header(server)
    assert trio.current_time() - start == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("sent", "reason"),
    [
        (b"", "empty"),
        (b"PROXY TCP4 1.2.3.4", "eof"),
        (encode_v2(V2)[:20], "eof"),
    ],
)
async def test_read_eof(sent: bytes, reason: str) -> None:
    server, client = trio.testing.memory_stream_pair()
    await client.send_all(sent)
    await client.send_eof()
    with pytest.raises(RemoteProtocolError) as info:
        await read_proxy_header(server)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x02\x00", b"PROXY TCP4 x\r\n"],
)
async def test_read_garbage(garbage: bytes) -> None:
    server, client = trio.testing.memory_stream_pair()
    await client.send_all(garbage)
    with pytest.raises(RemoteProtocolError):
        await read_proxy_header(server)


async def test_read_options() -> None:
    server, client = trio.testing.memory_stream_pair()
    await client.send_all(encode_v2(V2))
    with pytest.raises(RemoteProtocolError, match="only v1"):
        await read_proxy_header(server, versions=[1])


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def blocking_tls_client(
    port: int, header: bytes, client_ctx: ssl.SSLContext
) -> tuple[bytes, tuple[str, int]]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        me = raw.getsockname()
        raw.sendall(header)  # the ClientHello follows right after the header
        with client_ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(PAYLOAD)
            data = b""
            while chunk := tls.recv(4096):
                data += chunk
            return data, me


async def test_tls_client_hello_after_header(ca: trustme.CA) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    seen: dict[str, Any] = {}

    async def serve() -> None:
        raw = await listeners[0].accept()
        stream = await read_proxy_header(raw)
        seen["peer"] = stream.peer_address
        tls = trio.SSLStream(stream, server_ctx, server_side=True)
        data = await tls.receive_some()
        await tls.send_all(b"ok " + data)
        await tls.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        answer, me = await trio.to_thread.run_sync(
            blocking_tls_client, port, encode_v2(V2), client_ctx
        )
    await listeners[0].aclose()
    assert answer == b"ok " + PAYLOAD
    assert seen["peer"] == me


# -- open_proxy_listener + serve_listeners over real TCP -------------------------------


async def handler_factory(seen: list[dict[str, Any]]) -> Any:
    async def handler(stream: ProxyStream) -> None:
        data = b""
        while not data.endswith(b"\n"):
            chunk = await stream.receive_some()
            if not chunk:
                break
            data += chunk
        seen.append(
            {
                "client": stream.client_address,
                "server": stream.server_address,
                "peer": stream.peer_address,
                "local": stream.local_address,
                "header": stream.header,
                "data": data,
            }
        )
        await stream.send_all(b"ok " + data)
        await stream.aclose()

    return handler


async def start(
    nursery: trio.Nursery,
    seen: list[dict[str, Any]],
    trust: TrustPolicy,
    **options: Any,
) -> int:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port: int = listeners[0].socket.getsockname()[1]
    handler = await handler_factory(seen)

    async def run(task_status: trio.TaskStatus[None]) -> None:
        async with open_proxy_listener(
            listeners[0], trust=trust, **options
        ) as listener:
            await nursery.start(trio.serve_listeners, handler, [listener])
            task_status.started()
            await trio.sleep_forever()

    await nursery.start(run)
    return port


async def ask(port: int, data: bytes) -> tuple[bytes, tuple[str, int]]:
    # A refused connection may be reset rather than closed: closing a socket
    # with unread bytes makes the kernel send RST. Both count as "closed".
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    me = stream.socket.getsockname()
    answer = b""
    try:
        await stream.send_all(data)
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                answer += chunk
    except trio.BrokenResourceError:
        pass
    finally:
        await stream.aclose()
    return answer, me


@pytest.mark.parametrize(("header", "raw"), [(V1, encode_v1(V1)), (V2, encode_v2(V2))])
async def test_listener_good_headers(
    nursery: trio.Nursery, header: ProxyHeader, raw: bytes
) -> None:
    seen: list[dict[str, Any]] = []
    port = await start(nursery, seen, TRUST_LOOPBACK)
    answer, me = await ask(port, raw + PAYLOAD)
    assert answer == b"ok " + PAYLOAD
    [info] = seen
    assert info["header"] == header
    assert info["client"] == (str(header.source.host), header.source.port)  # type: ignore[union-attr]
    assert info["server"][1] == header.destination.port  # type: ignore[union-attr]
    assert info["peer"] == me
    assert info["local"] == ("127.0.0.1", port)
    nursery.cancel_scope.cancel()


async def test_listener_local_uses_socket_endpoints(nursery: trio.Nursery) -> None:
    seen: list[dict[str, Any]] = []
    port = await start(nursery, seen, TRUST_LOOPBACK)
    answer, me = await ask(port, encode_v2(ProxyHeader.local()) + PAYLOAD)
    assert answer == b"ok " + PAYLOAD
    assert seen[0]["header"].command is Command.LOCAL
    assert seen[0]["client"] == me
    assert seen[0]["server"] == ("127.0.0.1", port)
    nursery.cancel_scope.cancel()


async def test_listener_on_a_unix_socket(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # A UNIX peer has no IP address (it gets the policy's default); that is
    # not a peer gone before its header.
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    path = str(tmp_path / "proxy.sock")
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(8)
    served: list[ProxyHeader | None] = []

    async def handler(stream: ProxyStream) -> None:
        served.append(stream.header)
        async with stream:
            await stream.send_all(b"ok " + await stream.receive_some())

    async with (
        open_proxy_listener(
            trio.SocketListener(sock), trust=TrustPolicy.everyone(Policy.REQUIRE)
        ) as listener,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(trio.serve_listeners, handler, [listener])
        async with await trio.open_unix_socket(path) as client:
            await client.send_all(encode_v1(V1) + PAYLOAD)
            with trio.fail_after(5):
                assert await client.receive_some() == b"ok " + PAYLOAD
        nursery.cancel_scope.cancel()
    assert served == [V1]
    assert caplog.records == []


@pytest.mark.parametrize(
    ("trusted", "data", "message"),
    [
        ("10.0.0.0/8", encode_v1(V1) + PAYLOAD, "REJECT"),
        ("127.0.0.1", b"GET / HTTP/1.1\r\n\r\n", "not a PROXY header"),
        ("127.0.0.1", b"PROXY TCP4 999.1.1.1 1.1.1.1 1 1\r\n", "closing connection"),
    ],
)
async def test_listener_closes_and_logs_bad_connections(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    trusted: str,
    data: bytes,
    message: str,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    seen: list[dict[str, Any]] = []
    port = await start(nursery, seen, TrustPolicy.from_cidrs([trusted]))
    answer, _ = await ask(port, data)
    assert answer == b""
    assert seen == []
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert any(message in m for m in messages), messages
    if trusted == "127.0.0.1":  # the accept loop still works
        answer, _ = await ask(port, encode_v1(V1) + PAYLOAD)
        assert answer == b"ok " + PAYLOAD
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("data", "level", "text"), CLOSED_BEFORE_HEADER)
async def test_listener_logs_a_close_before_header_once(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    data: bytes,
    level: str,
    text: str,
) -> None:
    # A TCP health check closes without a byte: one INFO line, no WARNING.
    # After part of a header the sender is broken: one WARNING.
    caplog.set_level(logging.INFO)
    port = await start(nursery, [], TRUST_LOOPBACK)
    client_port = await trio.to_thread.run_sync(close_before_header, port, data)
    assert_logged_once(caplog, client_port, LOGGER_NAME, level, text)
    nursery.cancel_scope.cancel()


async def test_listener_silent_client_does_not_block_others(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    seen: list[dict[str, Any]] = []
    port = await start(nursery, seen, TRUST_LOOPBACK, header_timeout=0.5)
    silent = await trio.open_tcp_stream("127.0.0.1", port)
    await silent.send_all(b"PROXY ")
    start_time = trio.current_time()
    answer, _ = await ask(port, encode_v1(V1) + PAYLOAD)
    assert trio.current_time() - start_time < 0.4
    assert answer == b"ok " + PAYLOAD
    with trio.fail_after(5):
        assert await silent.receive_some() == b""  # closed at the timeout
    assert trio.current_time() - start_time >= 0.4
    await silent.aclose()
    assert any("within 0.5 s" in r.getMessage() for r in caplog.records)
    nursery.cancel_scope.cancel()


async def test_listener_closes_pending_connections_on_exit() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with open_proxy_listener(listeners[0], trust=TRUST_LOOPBACK) as listener:
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        await trio.testing.wait_all_tasks_blocked()
    await listener.aclose()
    with trio.fail_after(5):
        assert await silent.receive_some() == b""  # not leaked
    await silent.aclose()


async def test_socket_addresses_follows_transport_stream() -> None:
    left, right = trio.socket.socketpair(socket.AF_UNIX)
    stream = trio.SocketStream(left)
    assert socket_addresses(stream) == (None, None)  # UNIX: no (host, port)
    await stream.aclose()
    right.close()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    wrapped = ProxyStream(client, header=None, policy=Policy.SKIP)
    peer, local = socket_addresses(wrapped)  # through .transport_stream
    assert peer == ("127.0.0.1", port)
    assert local == client.socket.getsockname()
    await client.aclose()
    await listeners[0].aclose()


async def test_serve_with_partial_is_possible() -> None:
    # The documented recipe: nursery.start takes no keyword arguments.
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    seen: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        port = listeners[0].socket.getsockname()[1]
        async with open_proxy_listener(listeners[0], trust=TRUST_LOOPBACK) as listener:
            await nursery.start(
                partial(trio.serve_listeners, await handler_factory(seen), [listener])
            )
            answer, _ = await ask(port, encode_v2(V2) + PAYLOAD)
            nursery.cancel_scope.cancel()
    assert answer == b"ok " + PAYLOAD
