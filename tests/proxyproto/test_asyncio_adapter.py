"""proxyproto.asyncio: start_server and ProxyProtocolWrapper over real sockets.

The tests are plain functions running ``asyncio.run`` (the suite's async tests
run under trio).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme

from proxyproto import (
    TLV,
    Command,
    Policy,
    ProxyHeader,
    SSLClient,
    SSLInfo,
    TrustPolicy,
    encode_v1,
    encode_v2,
)
from proxyproto.asyncio import ProxyProtocolWrapper, start_server
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
        TLV.authority("example.com"),
        TLV.ssl(SSLInfo(client=SSLClient.SSL, verify=0, version="TLSv1.3", cn="me")),
        TLV(0xE5, b"custom"),
    ),
)
PAYLOAD = b"hello after the header\n"
TRUST_LOOPBACK = TrustPolicy.from_cidrs(["127.0.0.1"])
LOGGER_NAME = "proxyproto.asyncio"

Seen = dict[str, Any]


def make_handler(
    seen: list[Seen],
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        line = await reader.readline()
        info = {
            key: writer.get_extra_info(key)
            for key in (
                "peername",
                "sockname",
                "proxyproto.header",
                "proxyproto.peername",
                "proxyproto.sockname",
                "proxyproto.policy",
            )
        }
        info["line"] = line
        seen.append(info)
        writer.write(b"ok " + line)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    return handler


async def exchange(port: int, data: bytes, *, eof: bool = False) -> tuple[bytes, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sockname = writer.get_extra_info("sockname")
    writer.write(data)
    if eof:
        writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    await writer.wait_closed()
    return answer, sockname


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro, 20)

    return asyncio.run(main())


def server_port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


@pytest.mark.parametrize(("header", "raw"), [(V1, encode_v1(V1)), (V2, encode_v2(V2))])
def test_start_server_real_addresses_and_leftover(
    header: ProxyHeader, raw: bytes
) -> None:
    seen: list[Seen] = []

    async def main() -> tuple[bytes, Any]:
        server = await start_server(
            make_handler(seen), "127.0.0.1", 0, trust=TRUST_LOOPBACK
        )
        async with server:
            return await exchange(server_port(server), raw + PAYLOAD)

    answer, me = run(main())
    assert answer == b"ok " + PAYLOAD
    [info] = seen
    assert info["line"] == PAYLOAD
    assert info["proxyproto.header"] == header
    assert info["peername"] == (str(header.source.host), header.source.port)  # type: ignore[union-attr]
    assert info["sockname"] == (
        str(header.destination.host),  # type: ignore[union-attr]
        header.destination.port,  # type: ignore[union-attr]
    )
    assert info["proxyproto.peername"] == me
    assert info["proxyproto.policy"] is Policy.REQUIRE
    if header.version == 2:
        ssl_info = info["proxyproto.header"].ssl
        assert ssl_info.cn == "me"
        assert info["proxyproto.header"].tlv(0xE5) == b"custom"


def test_header_arriving_byte_by_byte() -> None:
    seen: list[Seen] = []
    raw = encode_v2(V2) + PAYLOAD

    async def main() -> bytes:
        server = await start_server(
            make_handler(seen), "127.0.0.1", 0, trust=TRUST_LOOPBACK
        )
        async with server:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", server_port(server)
            )
            for i in range(len(raw)):
                writer.write(raw[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.001)
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return answer

    assert run(main()) == b"ok " + PAYLOAD
    assert seen[0]["proxyproto.header"] == V2


def test_local_uses_socket_endpoints() -> None:
    seen: list[Seen] = []

    async def main() -> tuple[bytes, Any, int]:
        server = await start_server(
            make_handler(seen), "127.0.0.1", 0, trust=TRUST_LOOPBACK
        )
        async with server:
            port = server_port(server)
            answer, me = await exchange(port, encode_v2(ProxyHeader.local()) + PAYLOAD)
            return answer, me, port

    answer, me, port = run(main())
    assert answer == b"ok " + PAYLOAD
    [info] = seen
    assert info["proxyproto.header"].command is Command.LOCAL
    assert info["peername"] == me
    assert info["sockname"] == ("127.0.0.1", port)


@pytest.mark.parametrize(
    ("trust", "data", "message"),
    [
        (TRUST_LOOPBACK, b"GET / HTTP/1.1\r\n\r\n", "not a PROXY header"),
        (TrustPolicy.from_cidrs(["10.0.0.0/8"]), encode_v1(V1) + PAYLOAD, "REJECT"),
    ],
)
def test_bad_connections_are_closed_and_logged(
    caplog: pytest.LogCaptureFixture,
    trust: TrustPolicy,
    data: bytes,
    message: str,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    seen: list[Seen] = []

    async def main() -> bytes:
        server = await start_server(make_handler(seen), "127.0.0.1", 0, trust=trust)
        async with server:
            answer, _ = await exchange(server_port(server), data)
            # the server is still fine afterwards
            if trust is TRUST_LOOPBACK:
                good, _ = await exchange(server_port(server), encode_v1(V1) + PAYLOAD)
                assert good == b"ok " + PAYLOAD
            return answer

    assert run(main()) == b""
    assert all(info["proxyproto.header"] is not None for info in seen)
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert any(message in m for m in messages), messages


@pytest.mark.parametrize(("data", "level", "text"), CLOSED_BEFORE_HEADER)
def test_close_before_header_is_logged_once(
    caplog: pytest.LogCaptureFixture, data: bytes, level: str, text: str
) -> None:
    # A TCP health check closes without a byte: one INFO line, no WARNING.
    # After part of a header the sender is broken: one WARNING.
    caplog.set_level(logging.INFO)
    seen: list[Seen] = []

    async def main() -> int:
        server = await start_server(
            make_handler(seen), "127.0.0.1", 0, trust=TRUST_LOOPBACK
        )
        async with server:
            return await asyncio.to_thread(
                close_before_header, server_port(server), data
            )

    client_port = run(main())
    assert seen == []
    assert_logged_once(caplog, client_port, LOGGER_NAME, level, text)


def test_silent_client_times_out_without_blocking_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    seen: list[Seen] = []

    async def main() -> tuple[bytes, bytes, float]:
        server = await start_server(
            make_handler(seen), "127.0.0.1", 0, trust=TRUST_LOOPBACK, header_timeout=0.5
        )
        async with server:
            port = server_port(server)
            silent_reader, silent_writer = await asyncio.open_connection(
                "127.0.0.1", port
            )
            loop = asyncio.get_running_loop()
            start = loop.time()
            good, _ = await exchange(port, encode_v1(V1) + PAYLOAD)
            served_after = loop.time() - start
            closed = await asyncio.wait_for(silent_reader.read(), 5)
            silent_writer.close()
            return good, closed, served_after

    good, closed, served_after = run(main())
    assert good == b"ok " + PAYLOAD
    assert served_after < 0.4
    assert closed == b""
    assert any("within 0.5 s" in r.getMessage() for r in caplog.records)


def test_skip_and_use_policies() -> None:
    seen: list[Seen] = []
    skip = TrustPolicy.everyone(Policy.SKIP)
    use = TrustPolicy.everyone(Policy.USE)

    async def main() -> list[tuple[bytes, Any]]:
        results = []
        for trust, data in [
            (skip, PAYLOAD),
            (use, PAYLOAD),
            (use, encode_v1(V1) + PAYLOAD),
        ]:
            server = await start_server(make_handler(seen), "127.0.0.1", 0, trust=trust)
            async with server:
                results.append(await exchange(server_port(server), data))
        return results

    results = run(main())
    assert [answer for answer, _ in results] == [b"ok " + PAYLOAD] * 3
    assert seen[0]["proxyproto.header"] is None
    assert seen[0]["peername"] == results[0][1]
    assert seen[0]["proxyproto.policy"] is Policy.SKIP
    assert seen[1]["proxyproto.header"] is None
    assert seen[1]["peername"] == results[1][1]
    assert seen[2]["proxyproto.header"] == V1
    assert seen[2]["peername"] == ("192.0.2.7", 51234)


def test_ignore_policy_keeps_header_but_reports_socket() -> None:
    seen: list[Seen] = []

    async def main() -> tuple[bytes, Any]:
        server = await start_server(
            make_handler(seen),
            "127.0.0.1",
            0,
            trust=TrustPolicy.everyone(Policy.IGNORE),
        )
        async with server:
            return await exchange(server_port(server), encode_v2(V2) + PAYLOAD)

    answer, me = run(main())
    assert answer == b"ok " + PAYLOAD
    assert seen[0]["proxyproto.header"] == V2
    assert seen[0]["peername"] == me


# -- TLS right after the header ------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_client(
    port: int, header: bytes, client_ctx: ssl.SSLContext
) -> tuple[bytes, str | None]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(header)  # the ClientHello follows right after the header
        with client_ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(PAYLOAD)
            data = b""
            while chunk := tls.recv(4096):
                data += chunk
            return data, tls.version()


def test_tls_after_header_with_start_server(ca: trustme.CA) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    seen: list[Seen] = []
    tls_versions: list[object] = []

    handler = make_handler(seen)

    async def tls_handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        tls_versions.append(writer.get_extra_info("ssl_object").version())
        await handler(reader, writer)

    async def main() -> tuple[bytes, str | None]:
        server = await start_server(
            tls_handler, "127.0.0.1", 0, trust=TRUST_LOOPBACK, ssl=server_ctx
        )
        async with server:
            return await asyncio.to_thread(
                tls_client, server_port(server), encode_v2(V2), client_ctx
            )

    answer, version = run(main())
    assert answer == b"ok " + PAYLOAD
    assert tls_versions == [version]
    assert seen[0]["proxyproto.header"] == V2
    assert seen[0]["peername"] == ("2001:db8::7", 40000)


# -- ProxyProtocolWrapper with protocols -------------------------------------------


class BufferedEcho(asyncio.BufferedProtocol):
    def __init__(self, done: asyncio.Future[Any]) -> None:
        self.buf = bytearray(3)  # tiny on purpose: several get_buffer calls
        self.received = b""
        self.done = done
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.received += bytes(self.buf[:nbytes])
        if self.received.endswith(b"\n"):
            assert self.transport is not None
            self.transport.write(self.received)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        assert self.transport is not None
        self.done.set_result((self.received, self.transport.get_extra_info("peername")))


class PausingProtocol(asyncio.Protocol):
    """Pauses reading in connection_made; resumes a little later."""

    def __init__(self, done: asyncio.Future[Any]) -> None:
        self.done = done
        self.received = b""
        self.paused_until = 0.0
        self.early = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.pause_reading()
        assert not transport.is_reading()
        loop = asyncio.get_running_loop()
        self.paused_until = loop.time() + 0.1
        loop.call_later(0.1, transport.resume_reading)

    def data_received(self, data: bytes) -> None:
        if asyncio.get_running_loop().time() < self.paused_until:
            self.early = True
        self.received += data

    def eof_received(self) -> bool:
        self.transport.write(self.received)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.done.set_result((self.received, self.early))


def test_wrapper_with_buffered_protocol() -> None:
    async def main() -> tuple[bytes, Any, bytes]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        server = await loop.create_server(
            lambda: ProxyProtocolWrapper(BufferedEcho(done), trust=TRUST_LOOPBACK),
            "127.0.0.1",
            0,
        )
        async with server:
            answer, _ = await exchange(server_port(server), encode_v1(V1) + PAYLOAD)
            received, peer = await asyncio.wait_for(done, 5)
            return received, peer, answer

    received, peer, answer = run(main())
    assert received == PAYLOAD
    assert answer == PAYLOAD
    assert peer == ("192.0.2.7", 51234)


def test_wrapper_holds_leftover_while_inner_is_paused() -> None:
    async def main() -> tuple[bytes, bool, bytes]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        server = await loop.create_server(
            lambda: ProxyProtocolWrapper(PausingProtocol(done), trust=TRUST_LOOPBACK),
            "127.0.0.1",
            0,
        )
        async with server:
            answer, _ = await exchange(
                server_port(server), encode_v2(V2) + PAYLOAD, eof=True
            )
            received, early = await asyncio.wait_for(done, 5)
            return received, early, answer

    received, early, answer = run(main())
    assert received == PAYLOAD
    assert not early
    assert answer == PAYLOAD


def test_loop_sendfile_on_the_handed_over_transport(tmp_path: Path) -> None:
    # aiohttp's FileResponse calls loop.sendfile(transport, ...): asyncio
    # refused the wrapper's transport ("sendfile is not supported"), so static
    # files went out as headers without a body. A file larger than the write
    # buffer also takes the fallback through pause/resume_writing.
    content = bytes(range(256)) * 8192  # 2 MiB
    path = tmp_path / "file.bin"
    path.write_bytes(content)

    async def handler(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.readline()
        with path.open("rb") as file:
            await asyncio.get_running_loop().sendfile(writer.transport, file)
        writer.write(b"after")
        writer.close()
        await writer.wait_closed()

    async def main() -> bytes:
        server = await start_server(handler, "127.0.0.1", 0, trust=TRUST_LOOPBACK)
        async with server:
            answer, _ = await exchange(server_port(server), encode_v1(V1) + PAYLOAD)
            return answer

    assert run(main()) == content + b"after"
