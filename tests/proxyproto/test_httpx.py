"""proxyproto.httpx: the headers httpx sends reach real PROXY receivers.

Receivers: proxyproto's trio and asyncio adapters, HAProxy with
``accept-proxy`` and a tlsedge HTTP listener with ``[listeners.proxy_protocol]``,
over plain TCP and TLS after the header. The sync transport runs in a worker
thread (the trio receivers share the test's event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from proxyproto import (
    TLV,
    LocalProtocolError,
    Policy,
    ProxyHeader,
    TrustPolicy,
)
from proxyproto.asyncio import start_server
from proxyproto.httpx import (
    PROXY_HEADER,
    AsyncProxyHeaderTransport,
    ProxyHeaderTransport,
)
from tests.proxyproto.client_peers import (
    TrioReceiver,
    describe,
    haproxy_receiver,
    http_answer,
    running_tlsedge,
    tls_files,
)

LB_CLIENT = ("203.0.113.7", 5555)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "proxy_client.py"


def sync_get(
    transport: ProxyHeaderTransport, urls: list[str], **kwargs: Any
) -> list[Any]:
    """GET each URL with one client; the JSON (or text) answers."""
    with httpx.Client(transport=transport) as client:
        answers = []
        for url in urls:
            response = client.get(url, **kwargs)
            response.raise_for_status()
            is_json = response.headers["content-type"] == "application/json"
            answers.append(response.json() if is_json else response.text)
        return answers


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
async def test_sync_and_async_transports_reach_the_trio_adapter(
    nursery: trio.Nursery, tmp_path: Path, version: int, use_tls: bool
) -> None:
    files = tls_files(tmp_path)
    receiver = TrioReceiver(tls=files.server_context() if use_tls else None)
    port = await receiver.start(nursery)
    url = f"{'https' if use_tls else 'http'}://127.0.0.1:{port}/"
    verify = files.client_context()
    sync = ProxyHeaderTransport(version=version, source=LB_CLIENT, verify=verify)
    (answer,) = await trio.to_thread.run_sync(sync_get, sync, [url])
    assert answer["version"] == version
    assert answer["source"] == list(LB_CLIENT)
    assert answer["destination"] == ["127.0.0.1", port]

    transport = AsyncProxyHeaderTransport(version=version, verify=verify)
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.get(url)
    answer = response.json()
    # By default the header names the connection's own endpoints, as curl's.
    assert answer["version"] == version
    assert answer["source"][0] == "127.0.0.1"
    assert answer["source"][1] != port
    assert answer["destination"] == ["127.0.0.1", port]


async def test_tlvs_crc32c_and_a_fixed_header(nursery: trio.Nursery) -> None:
    receiver = TrioReceiver()
    port = await receiver.start(nursery)
    url = f"http://127.0.0.1:{port}/"
    tlvs = (TLV.authority("example.com"), TLV.unique_id(b"req-1"))
    transport = AsyncProxyHeaderTransport(tlvs=tlvs, crc32c=True, pad_to=256)
    async with httpx.AsyncClient(transport=transport) as client:
        answer = (await client.get(url)).json()
    assert answer["authority"] == "example.com"
    assert answer["crc32c"] is True
    assert answer["tlv_types"][:2] == [0x02, 0x05]

    fixed = ProxyHeader.from_addresses(("2001:db8::1", 1), ("2001:db8::2", 443))
    async with httpx.AsyncClient(transport=AsyncProxyHeaderTransport(fixed)) as client:
        answer = (await client.get(url)).json()
    assert answer == {**describe(fixed), "connection": 1, "request": 1}


async def test_pooled_connections_keep_their_header_and_own_headers_get_their_own(
    nursery: trio.Nursery,
) -> None:
    receiver = TrioReceiver()
    port = await receiver.start(nursery)
    url = f"http://127.0.0.1:{port}/"
    other = ProxyHeader.from_addresses(("198.51.100.9", 9999), ("192.0.2.1", 443))
    third = ProxyHeader.from_addresses(("198.51.100.10", 1), ("192.0.2.1", 443))
    transport = AsyncProxyHeaderTransport(source=LB_CLIENT)
    async with httpx.AsyncClient(transport=transport) as client:
        answers = [(await client.get(url)).json() for _ in range(2)]
        answers.append((await client.get(url, extensions={PROXY_HEADER: other})).json())
        answers.append((await client.get(url, extensions={PROXY_HEADER: other})).json())
        answers.append((await client.get(url, extensions={PROXY_HEADER: third})).json())
        answers.append((await client.get(url)).json())
    seen = [(a["connection"], a["request"], a["source"]) for a in answers]
    lb = list(LB_CLIENT)
    assert seen == [
        # One pooled connection, one header, several requests.
        (0, 1, lb),
        (0, 2, lb),
        # A request's own header: a connection of its own, every time.
        (1, 1, ["198.51.100.9", 9999]),
        (2, 1, ["198.51.100.9", 9999]),
        (3, 1, ["198.51.100.10", 1]),
        # The pooled connection is still there, with its own header.
        (0, 3, lb),
    ]
    assert len(receiver.headers) == 4


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def asyncio_receiver(handle: Handler) -> AsyncIterator[int]:
    """proxyproto.asyncio's ``start_server`` running *handle* per connection;
    yields the port; on exit, waits for every handler and closes its writer."""
    handlers: set[asyncio.Task[Any]] = set()

    async def tracked(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await handle(reader, writer)
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await start_server(
        tracked, "127.0.0.1", 0, trust=TrustPolicy.everyone(Policy.REQUIRE)
    )
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()
        await asyncio.gather(*handlers)


def test_sync_own_header_connections_are_closed_with_the_response() -> None:
    seen: list[tuple[Any, int]] = []

    async def handle(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        header = writer.get_extra_info("proxyproto.header")
        count = 0
        while True:
            await reader.readuntil(b"\r\n\r\n")
            count += 1
            seen.append((describe(header)["source"], count))
            writer.write(http_answer(b"{}"))
            await writer.drain()

    own = ProxyHeader.from_addresses(("198.51.100.9", 9), ("192.0.2.1", 80))

    async def main() -> list[int]:
        async with asyncio_receiver(handle) as port:
            url = f"http://127.0.0.1:{port}/"
            with httpx.Client(transport=ProxyHeaderTransport(source=LB_CLIENT)) as c:
                return [
                    (await asyncio.to_thread(c.get, url, extensions=ext)).status_code
                    for ext in ({}, {PROXY_HEADER: own}, {})
                ]

    assert asyncio.run(main()) == [200, 200, 200]
    assert seen == [
        (list(LB_CLIENT), 1),
        (["198.51.100.9", 9], 1),
        (list(LB_CLIENT), 2),
    ]


def test_async_transport_on_asyncio_reaches_the_asyncio_adapter() -> None:
    async def handle(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = {
            "peername": list(writer.get_extra_info("peername")),
            "header": describe(writer.get_extra_info("proxyproto.header")),
        }
        writer.write(http_answer(json.dumps(body).encode()))
        await writer.drain()

    async def main() -> Any:
        async with asyncio_receiver(handle) as port:
            transport = AsyncProxyHeaderTransport(version=1, source=LB_CLIENT)
            async with httpx.AsyncClient(transport=transport) as client:
                response = await client.get(f"http://127.0.0.1:{port}/")
        return response.json()

    answer = asyncio.run(main())
    assert answer["peername"] == list(LB_CLIENT)
    assert answer["header"]["version"] == 1


@pytest.mark.peers
@pytest.mark.parametrize("version", [1, 2])
async def test_haproxy_accept_proxy_takes_the_header_plain_and_tls(
    tmp_path: Path, version: int
) -> None:
    files = tls_files(tmp_path)
    verify = files.client_context()
    tlvs = (TLV.authority("example.com"),) if version == 2 else ()
    with haproxy_receiver(files) as ports:
        transport = ProxyHeaderTransport(
            version=version, source=LB_CLIENT, tlvs=tlvs, verify=verify
        )
        plain, tls = await trio.to_thread.run_sync(
            sync_get,
            transport,
            [f"http://127.0.0.1:{ports.plain}/", f"https://127.0.0.1:{ports.tls}/"],
        )
        async_transport = AsyncProxyHeaderTransport(
            version=version, source=LB_CLIENT, tlvs=tlvs, verify=verify
        )
        async with httpx.AsyncClient(transport=async_transport) as client:
            async_tls = (await client.get(f"https://127.0.0.1:{ports.tls}/")).text
    authority = "example.com" if version == 2 else ""
    assert plain == f"203.0.113.7 5555 127.0.0.1 {ports.plain} {authority} 0"
    assert tls == f"203.0.113.7 5555 127.0.0.1 {ports.tls} {authority} 1"
    assert async_tls == tls


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
async def test_tlsedge_listener_takes_the_header(
    nursery: trio.Nursery, tmp_path: Path, use_tls: bool
) -> None:
    files = tls_files(tmp_path)
    async with running_tlsedge(nursery, files if use_tls else None) as port:
        url = f"{'https' if use_tls else 'http'}://127.0.0.1:{port}/"
        transport = AsyncProxyHeaderTransport(
            source=LB_CLIENT, verify=files.client_context()
        )
        async with httpx.AsyncClient(transport=transport) as client:
            answer = (await client.get(url)).json()
        sync = ProxyHeaderTransport(version=1, source=("198.51.100.1", 1))
        if not use_tls:
            (sync_answer,) = await trio.to_thread.run_sync(sync_get, sync, [url])
            assert sync_answer["x-forwarded-for"] == "198.51.100.1"
    assert answer["x-forwarded-for"] == "203.0.113.7"
    assert answer["x-forwarded-proto"] == ("https" if use_tls else "http")


async def test_a_refused_header_is_an_httpx_error(nursery: trio.Nursery) -> None:
    receiver = TrioReceiver()
    port = await receiver.start(nursery)
    # PROXY UNSPEC (v2): the strict reader refuses it and closes.
    unspec = ProxyHeader.unknown(version=2)
    async with httpx.AsyncClient(transport=AsyncProxyHeaderTransport(unspec)) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(f"http://127.0.0.1:{port}/")


async def test_no_connection_is_a_connect_error() -> None:
    transport = AsyncProxyHeaderTransport()
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get("http://127.0.0.1:9/")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"version": 1, "tlvs": (TLV.alpn(b"h2"),)}, "v1 headers cannot carry TLVs"),
        ({"version": 1, "crc32c": True}, "cannot carry a CRC32C"),
        ({"version": 3}, "version must be 1 or 2"),
        ({"source": ("not an address", 1)}, "not an IP address"),
        (
            {"header": ProxyHeader.local(), "source": LB_CLIENT},
            "give a header, or source/destination/tlvs",
        ),
    ],
)
def test_bad_header_arguments_fail_at_construction(
    kwargs: dict[str, Any], message: str
) -> None:
    for transport in (ProxyHeaderTransport, AsyncProxyHeaderTransport):
        with pytest.raises(LocalProtocolError, match=message):
            transport(**kwargs)


async def test_a_bad_request_extension_is_refused_before_connecting() -> None:
    async with httpx.AsyncClient(transport=AsyncProxyHeaderTransport()) as client:
        with pytest.raises(LocalProtocolError, match="must be a ProxyHeader"):
            await client.get("http://127.0.0.1:9/", extensions={PROXY_HEADER: "x"})


async def test_the_example_client(nursery: trio.Nursery) -> None:
    receiver = TrioReceiver()
    port = await receiver.start(nursery)
    result = await trio.run_process(
        [sys.executable, str(EXAMPLE), f"http://127.0.0.1:{port}/"],
        capture_stdout=True,
        capture_stderr=True,
    )
    answers = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert [(a["version"], a["source"][0], a["authority"]) for a in answers] == [
        (2, "203.0.113.7", "example.com"),
        (2, "198.51.100.9", None),
        (1, "127.0.0.1", None),
    ]
