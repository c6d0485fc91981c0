"""The edge end to end over real loopback sockets: unwrap, wrap, balance, relay."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import socket
import ssl
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import trustme

import tlsedge._pipeline.tcp
from proxyproto import ProxyHeader, encode, encode_v2, parse
from tests.peers import free_port
from tests.test_faults import blackhole
from tests.tlsedge.control.test_admin import total
from tests.tlsedge.e2e.test_tls_edge import (
    Pki,
    PrefixFirstSend,
    Seen,
    client_context,
    describe_ssl,
    echo_backend,
    edge_config,
    round_trip,
    tls_connect,
)
from tests.tlsedge.helpers import (
    Backend,
    address_of,
    close_clients,
    connect,
    exchange,
    in_flight,
    make_config,
    proxy_echo_handler,
    read_all,
    read_proxy,
    running_edge,
    tag_handler,
    wait_access_records,
    wait_until,
)
from tests.tlsedge.pipeline.http.test_h1 import Client, EchoBackend as H11Backend
from tlsedge._control.edge import Edge
from tlsedge._core.config import Config
from tlsedge._core.proxy_wrap import proxy_header_for
from tlsedge._pipeline.handshake import ReactorHandshake
from tlsedge._pipeline.stages import Pipeline
from tlsedge._pipeline.unwrap import ReactorHeaderRead
from tlsedge._reactor.relay import set_abortive_close
from tlsedge._tls.stream import TLSStream

LOOPBACK = ["127.0.0.1/32"]
ELSEWHERE = ["10.0.0.0/8"]
CLIENT = ("203.0.113.7", 40000)
DESTINATION = ("198.51.100.1", 443)


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


def unwrap_config(
    backend: Backend,
    *,
    proxy_protocol: dict[str, Any] | None = None,
    send_proxy: str = "v2",
    **backend_options: Any,
) -> Config:
    """One listener "in" (optionally unwrapping) to one backend "b"."""
    listener: dict[str, Any] = {"name": "in", "backend": "b"}
    if proxy_protocol is not None:
        listener["proxy_protocol"] = proxy_protocol
    return make_config(
        [listener],
        [
            {
                "name": "b",
                "servers": [backend.address],
                "send_proxy": send_proxy,
                **backend_options,
            }
        ],
    )


async def read_until_closed(stream: trio.abc.ReceiveStream) -> bytes:
    """Everything until EOF; a reset counts as closed too (returns what came)."""
    chunks = []
    try:
        while chunk := await stream.receive_some(65536):
            chunks.append(bytes(chunk))
    except trio.BrokenResourceError:
        pass
    return b"".join(chunks)


# -- PROXY unwrap -----------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
async def test_unwrap_trusted_peer_header_gives_the_client_address(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, version: int
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_protocol={"trusted": LOOPBACK})
    header = encode(ProxyHeader.from_addresses(CLIENT, DESTINATION, version=version))
    async with running_edge(config) as edge:
        answer = json.loads(await exchange(address_of(edge, "in"), header + b"hello"))
        (record,) = await wait_access_records(caplog)
    assert answer["version"] == 2  # our own header to the backend
    assert answer["command"] == "PROXY"
    assert answer["source"] == list(CLIENT)
    assert answer["destination"] == list(DESTINATION)
    assert answer["data"] == "hello"
    assert record["client"] == "203.0.113.7:40000"
    assert record["destination"] == "198.51.100.1:443"
    assert record["peer"].startswith("127.0.0.1:")
    assert record["termination"] == "client_closed"


async def test_wildcard_bind_reports_the_address_the_client_connected_to(
    nursery: trio.Nursery,
) -> None:
    # A listener bound to one address knows every client's destination
    # already; on 0.0.0.0 each connection's own socket has to say.
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = make_config(
        [{"name": "in", "backend": "b", "bind": "0.0.0.0:0"}],
        [{"name": "b", "servers": [backend.address], "send_proxy": "v2"}],
    )
    async with running_edge(config) as edge:
        host, port = address_of(edge, "in")
        assert host == "0.0.0.0"
        answer = json.loads(await exchange(("127.0.0.1", port), b"hello"))
    assert answer["destination"] == ["127.0.0.1", port]
    assert answer["data"] == "hello"


async def test_unwrap_local_header_uses_the_real_endpoints(
    nursery: trio.Nursery,
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_protocol={"trusted": LOOPBACK})
    async with running_edge(config) as edge:
        host, port = address_of(edge, "in")
        client = await connect((host, port))
        client_port = client.socket.getsockname()[1]
        await client.send_all(encode_v2(ProxyHeader.local()) + b"check")
        await client.send_eof()
        answer = json.loads(await read_all(client))
        await client.aclose()
    assert answer["command"] == "PROXY"
    assert answer["source"] == ["127.0.0.1", client_port]
    assert answer["destination"] == [host, port]
    assert answer["data"] == "check"


@pytest.mark.parametrize(
    ("header", "reset"),
    [
        (encode_v2(ProxyHeader.local()), True),  # HAProxy check-send-proxy
        (encode_v2(ProxyHeader.local()), False),
        (b"PROXY UNKNOWN\r\n", True),
    ],
)
async def test_health_check_through_a_local_header_is_logged_as_such(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    header: bytes,
    reset: bool,
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_protocol={"trusted": LOOPBACK})
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(header)
        await wait_until(lambda: backend.accepted == 1)
        if reset:
            set_abortive_close(client)
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    # Not client_error: a load balancer's checks are no client's failure.
    assert record["termination"] == "health_check", record
    assert record["bytes_from_client"] == 0


async def test_local_header_with_data_is_ordinary_traffic(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_protocol={"trusted": LOOPBACK})
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(encode_v2(ProxyHeader.local()) + b"GET /")
        await client.send_eof()
        await read_all(client)
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert record["termination"] == "client_closed"


async def test_unwrap_bytes_after_the_header_arrive_intact_and_first(
    nursery: trio.Nursery,
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_protocol={"trusted": LOOPBACK})
    # Looks like another header and starts with CRLF: must be passed on as is.
    tail = b"\r\nPROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n" + bytes(range(256)) * 64
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        header = encode(ProxyHeader.from_addresses(CLIENT, DESTINATION, version=1))
        await client.send_all(header + tail)  # one segment
        await client.send_all(b"-later")
        await client.send_eof()
        answer = json.loads(await read_all(client))
        await client.aclose()
    assert answer["data"].encode("latin-1") == tail + b"-later"
    assert answer["source"] == list(CLIENT)


async def test_unwrap_untrusted_peer_rejected_without_a_byte_upstream(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(
        backend, proxy_protocol={"trusted": ELSEWHERE, "untrusted": "reject"}
    )
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        header = encode(ProxyHeader.from_addresses(CLIENT, DESTINATION))
        await client.send_all(header + b"hello")
        with trio.fail_after(5):
            assert await read_until_closed(client) == b""
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert backend.accepted == 0
    assert record["termination"] == "rejected"
    assert record["backend"] is None


async def test_unwrap_untrusted_peer_direct_is_served_as_itself(
    nursery: trio.Nursery,
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(
        backend, proxy_protocol={"trusted": ELSEWHERE, "untrusted": "direct"}
    )
    # A direct client's "header" is data, never believed.
    spoof = encode(ProxyHeader.from_addresses(CLIENT, DESTINATION, version=1))
    async with running_edge(config) as edge:
        host, port = address_of(edge, "in")
        client = await connect((host, port))
        client_port = client.socket.getsockname()[1]
        await client.send_all(spoof + b"direct")
        await client.send_eof()
        answer = json.loads(await read_all(client))
        await client.aclose()
    assert answer["source"] == ["127.0.0.1", client_port]
    assert answer["destination"] == [host, port]
    assert answer["data"].encode() == spoof + b"direct"


@pytest.mark.parametrize(
    ("versions", "data", "detail"),
    [
        ([1, 2], b"PROXY GARBAGE\r\n", "GARBAGE"),
        ([1, 2], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", ""),
        ([2], b"PROXY TCP4 203.0.113.7 198.51.100.1 40000 443\r\n", "1"),
    ],
    ids=["garbage", "no-header", "v1-when-only-v2"],
)
async def test_unwrap_bad_header_closes_and_logs_header_error(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    versions: list[int],
    data: bytes,
    detail: str,
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(
        backend, proxy_protocol={"trusted": LOOPBACK, "versions": versions}
    )
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(data)
        with trio.fail_after(5):
            assert await read_until_closed(client) == b""
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert backend.accepted == 0
    assert record["termination"] == "header_error"
    assert detail in record["detail"]
    assert record["bytes_from_client"] == 0


async def test_unwrap_silent_client_closed_after_timeout(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(
        backend, proxy_protocol={"trusted": LOOPBACK, "timeout": 4.0}
    )
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        start = trio.current_time()
        await client.send_all(b"PROXY TCP4 ")  # a start, never finished
        assert await read_until_closed(client) == b""
        elapsed = trio.current_time() - start
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert 4.0 <= elapsed < 5.0
    assert record["termination"] == "header_timeout"
    assert backend.accepted == 0


# -- PROXY wrap -------------------------------------------------------------


@pytest.mark.parametrize("send_proxy", ["v1", "v2"])
async def test_wrap_header_describes_client_and_edge_address(
    nursery: trio.Nursery, send_proxy: str
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, send_proxy=send_proxy)
    async with running_edge(config) as edge:
        host, port = address_of(edge, "in")
        client = await connect((host, port))
        client_port = client.socket.getsockname()[1]
        await client.send_all(b"payload")
        await client.send_eof()
        answer = json.loads(await read_all(client))
        await client.aclose()
    assert answer["version"] == int(send_proxy[1])
    assert answer["source"] == ["127.0.0.1", client_port]
    assert answer["destination"] == [host, port]
    assert answer["data"] == "payload"


async def test_wrap_v2_unique_id_is_the_log_id_with_crc32c(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_tlvs=["unique-id", "crc32c"])
    async with running_edge(config) as edge:
        answer = json.loads(await exchange(address_of(edge, "in"), b"x"))
        (record,) = await wait_access_records(caplog)
    # proxyproto.parse verifies the checksum: present here means valid.
    assert answer["crc32c"] is not None
    assert answer["unique_id"] == record["id"]
    assert len(record["id"]) == 16


@pytest.mark.parametrize("tlvs", [["unique-id"], []])
async def test_wrap_v2_without_crc32c_has_no_crc_tlv(
    nursery: trio.Nursery, tlvs: list[str]
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_tlvs=tlvs)
    async with running_edge(config) as edge:
        answer = json.loads(await exchange(address_of(edge, "in"), b"x"))
    assert answer["crc32c"] is None
    assert (answer["unique_id"] is not None) == ("unique-id" in tlvs)


# -- balancing ----------------------------------------------------------------


async def start_tagged(
    nursery: trio.Nursery, names: str, *, hold: bool = False
) -> dict[str, Backend]:
    return {
        name: await Backend(tag_handler(name, hold=hold), name=name).start(nursery)
        for name in names
    }


def balanced_config(
    servers: list[Any], *, proxy_protocol: bool = False, **options: Any
) -> Config:
    listener: dict[str, Any] = {"name": "in", "backend": "b"}
    if proxy_protocol:
        listener["proxy_protocol"] = {"trusted": LOOPBACK}
    return make_config([listener], [{"name": "b", "servers": servers, **options}])


def active_by_port(edge: Edge) -> dict[int, int]:
    return {h.server.address[1]: h.server.active for h in edge._pools["b"].servers}


async def test_round_robin_follows_weights(nursery: trio.Nursery) -> None:
    backends = await start_tagged(nursery, "ab")
    config = balanced_config(
        [backends["a"].address, {"address": backends["b"].address, "weight": 2}]
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        tags = Counter([(await exchange(address)).decode() for _ in range(60)])
    assert tags == {"a": 20, "b": 40}


async def test_least_connections_fills_the_emptier_server(
    nursery: trio.Nursery,
) -> None:
    backends = await start_tagged(nursery, "ab", hold=True)
    config = balanced_config(
        [b.address for b in backends.values()], balance="least-connections"
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        clients: dict[str, list[trio.SocketStream]] = {"a": [], "b": []}
        for _ in range(4):
            client = await connect(address)
            clients[(await client.receive_some(10)).decode()].append(client)
        assert [len(c) for c in clients.values()] == [2, 2]
        for client in clients.pop("a"):
            await client.aclose()
        await wait_until(lambda: active_by_port(edge)[backends["a"].port] == 0)
        late = []
        for _ in range(2):
            client = await connect(address)
            late.append((await client.receive_some(10)).decode())
            clients["b"].append(client)
        for client in clients["b"]:
            await client.aclose()
    assert late == ["a", "a"]


async def test_source_ip_affinity_follows_the_proxied_client(
    nursery: trio.Nursery,
) -> None:
    backends = await start_tagged(nursery, "ab")
    config = balanced_config(
        [b.address for b in backends.values()],
        balance="source-ip",
        proxy_protocol=True,
    )
    seen: dict[str, set[str]] = {}
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        for round_ in range(3):
            for ip in ("192.0.2.1", "192.0.2.2", "192.0.2.3", "192.0.2.4"):
                header = encode(
                    ProxyHeader.from_addresses((ip, 1000 + round_), DESTINATION)
                )
                tag = (await exchange(address, header)).decode()
                seen.setdefault(ip, set()).add(tag)
    assert all(len(tags) == 1 for tags in seen.values()), seen
    assert set().union(*seen.values()) == {"a", "b"}


async def test_random_two_spreads_long_lived_connections(
    nursery: trio.Nursery,
) -> None:
    backends = await start_tagged(nursery, "abc", hold=True)
    config = balanced_config(
        [b.address for b in backends.values()], balance="random-two"
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        clients = []
        tags: Counter[str] = Counter()
        for _ in range(24):
            client = await connect(address)
            tags[(await client.receive_some(10)).decode()] += 1
            clients.append(client)
        for client in clients:
            await client.aclose()
    # Two choices keep the loads close (typically 8/8/8); pure chance would not
    # reliably give every server at least 5 of 24.
    assert set(tags) == {"a", "b", "c"}
    assert min(tags.values()) >= 5, tags


# -- retries and health -------------------------------------------------------


async def test_refused_server_retried_elsewhere_and_marked_down(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    good = await Backend(tag_handler("good")).start(nursery)
    refused = f"127.0.0.1:{free_port()}"
    # No [backends.health]: passive marking with the default threshold (6).
    config = balanced_config([refused, good.address], retries=3)
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        health = {str(h.server): h for h in edge._pools["b"].servers}
        tags = [(await exchange(address)).decode() for _ in range(4)]
        records = await wait_access_records(caplog, 4)
        assert not health[refused].server.healthy
        assert health[good.address].server.healthy
    assert tags == ["good"] * 4
    assert {r["termination"] for r in records} <= {"client_closed", "server_closed"}
    assert {r["server"] for r in records} == {good.address}
    assert f"server {refused} is DOWN after 6 failed connects" in caplog.text


async def test_all_servers_refused_closes_cleanly(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    ports = [free_port(), free_port()]
    config = balanced_config([f"127.0.0.1:{p}" for p in ports], retries=1)
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(b"anyone?")
        with trio.fail_after(5):
            assert await read_until_closed(client) == b""
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert record["termination"] == "connect_failed"
    assert "2 connect attempts failed" in record["detail"]
    assert record["server"] is None
    assert any(
        r.name == "tlsedge.server" and "connect attempts failed" in r.getMessage()
        for r in caplog.records
    )


async def test_no_healthy_server(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    config = balanced_config(
        [f"127.0.0.1:{free_port()}"], health={"interval": 60.0, "timeout": 1.0}
    )
    async with running_edge(config) as edge:
        server = edge._pools["b"].servers[0].server
        await wait_until(lambda: not server.healthy)
        async with await connect(address_of(edge, "in")) as client:
            await client.send_all(b"x")
            with trio.fail_after(5):
                assert await read_until_closed(client) == b""
        (record,) = await wait_access_records(caplog)
    assert record["termination"] == "no_server"
    assert "no healthy server" in record["detail"]


async def http_health_handler(
    status: dict[str, int], stream: trio.SocketStream
) -> None:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await stream.receive_some(4096)
        if not chunk:
            return
        head += chunk
    await stream.send_all(
        f"HTTP/1.1 {status['code']} X\r\nContent-Length: 0\r\n\r\n".encode()
    )


async def test_active_tcp_checks_take_a_server_down_and_up(
    nursery: trio.Nursery,
) -> None:
    backends = await start_tagged(nursery, "ab")
    config = balanced_config(
        [b.address for b in backends.values()],
        health={
            "interval": 0.1,
            "timeout": 0.1,
            "healthy_threshold": 1,
            "unhealthy_threshold": 1,
        },
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        servers = {h.server.address[1]: h.server for h in edge._pools["b"].servers}
        a = servers[backends["a"].port]
        backends["a"].stop()
        await wait_until(lambda: not a.healthy)
        assert {(await exchange(address)).decode() for _ in range(4)} == {"b"}
        await backends["a"].start(nursery)  # the same port again
        await wait_until(lambda: a.healthy)
        assert {(await exchange(address)).decode() for _ in range(4)} == {"a", "b"}


async def test_active_http_checks_follow_the_status(nursery: trio.Nursery) -> None:
    status = {"code": 200}

    async def handler(stream: trio.SocketStream) -> None:
        await http_health_handler(status, stream)

    backend = await Backend(handler).start(nursery)
    config = balanced_config(
        [backend.address],
        health={
            "kind": "http",
            "path": "/ready",
            "interval": 0.1,
            "timeout": 0.1,
            "healthy_threshold": 2,
            "unhealthy_threshold": 2,
        },
    )
    async with running_edge(config) as edge:
        health = edge._pools["b"].servers[0]
        await wait_until(lambda: len(health.state.history) >= 1)
        assert health.server.healthy
        status["code"] = 503
        await wait_until(lambda: not health.server.healthy)
        assert health.state.last_detail == "HTTP 503 (expected 200-399)"
        status["code"] = 204
        await wait_until(lambda: health.server.healthy)


# -- relaying -----------------------------------------------------------------


def pattern(size: int, seed: bytes) -> bytes:
    block = hashlib.sha256(seed).digest() * 2048  # 64 KiB
    return (block * (size // len(block) + 1))[:size]


async def test_client_half_close_then_large_response(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    request = os.urandom(1 << 20)
    response = pattern(8 << 20, b"response")
    received: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        received.append(await read_all(stream))  # up to the client's EOF
        await stream.send_all(response)  # then answer, at length

    backend = await Backend(handler).start(nursery)
    config = unwrap_config(backend, send_proxy="none")
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(request)
        await client.send_eof()
        with trio.fail_after(30):
            answer = await read_all(client, limit=1 << 30)
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert received == [request]
    assert hashlib.sha256(answer).digest() == hashlib.sha256(response).digest()
    assert record["termination"] == "client_closed"
    assert record["bytes_from_client"] == len(request)
    assert record["bytes_from_server"] == len(response)


async def test_server_half_close_then_client_keeps_sending(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    greeting = pattern(4 << 20, b"greeting")
    upload = os.urandom(2 << 20)
    received: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(greeting)
        await stream.send_eof()  # the server is done talking, still listening
        received.append(await read_all(stream))

    backend = await Backend(handler).start(nursery)
    config = unwrap_config(backend, send_proxy="none")
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        with trio.fail_after(30):
            got = await read_all(client, limit=1 << 30)  # up to the FIN
            await client.send_all(upload)
            await client.send_eof()
            await wait_until(lambda: bool(received))
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert got == greeting
    assert received == [upload]
    assert record["termination"] == "server_closed"


async def test_32_mib_each_way_at_once(nursery: trio.Nursery) -> None:
    size = 32 << 20
    upload = pattern(size, b"up")
    download = pattern(size, b"down")
    digests: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        async def receive() -> None:
            digest = hashlib.sha256()
            while chunk := await stream.receive_some(1 << 16):
                digest.update(chunk)
            digests.append(digest.digest())

        async with trio.open_nursery() as inner:
            inner.start_soon(receive)
            await stream.send_all(download)
            await stream.send_eof()

    backend = await Backend(handler).start(nursery)
    config = unwrap_config(backend, send_proxy="none")
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        down = hashlib.sha256()

        async def send() -> None:
            await client.send_all(upload)
            await client.send_eof()

        with trio.fail_after(60):
            async with trio.open_nursery() as inner:
                inner.start_soon(send)
                total = 0
                while chunk := await client.receive_some(1 << 16):
                    down.update(chunk)
                    total += len(chunk)
            await wait_until(lambda: bool(digests))
        await client.aclose()
    assert total == size
    assert down.digest() == hashlib.sha256(download).digest()
    assert digests == [hashlib.sha256(upload).digest()]


async def test_idle_timeout_closes_an_idle_connection(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    config = make_config(
        [{"name": "in", "backend": "b", "idle_timeout": 60.0}],
        [{"name": "b", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        assert await client.receive_some(10) == b"hi"
        start = trio.current_time()
        with pytest.raises(trio.BrokenResourceError):  # RST, see _relay.py
            await client.receive_some(10)
        elapsed = trio.current_time() - start
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert 59.0 <= elapsed <= 61.0
    assert record["termination"] == "idle_timeout"
    await wait_until(lambda: backend.active == 0)


# -- connections set up from the accept loop ------------------------------------


@pytest.fixture
def tasks_started(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The connections `Edge` started a task for (from now on)."""
    started: list[object] = []
    handle = Pipeline._wait_in_task

    async def counted(self: Pipeline, conn: Any, begun: Any) -> None:
        started.append(conn)
        await handle(self, conn, begun)

    monkeypatch.setattr(Pipeline, "_wait_in_task", counted)
    return started


def metric(edge: Edge, name: str, **labels: str) -> float:
    """The sum of the samples of *name* whose labels include *labels*."""
    return total(edge._metrics.exposition()[0].decode(), name, **labels)


async def test_a_connection_needing_no_wait_gets_no_task(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
) -> None:
    """No PROXY header, no TLS, a loopback backend: the accept loop connects
    and hands the relay to the reactor. The connection has no task, and ends
    as one with a task: PROXY header, log line, counters, slots, lease."""
    backend = await Backend(proxy_echo_handler()).start(nursery)
    async with running_edge(unwrap_config(backend)) as edge:
        assert edge._connections is not None
        listener = edge._listeners["in"]
        server = edge._pools["b"].servers[0].server
        client = await connect(address_of(edge, "in"))
        await client.send_all(b"hello")
        await wait_until(lambda: backend.accepted == 1)
        assert not tasks_started
        assert len(edge._relays) == 1
        assert edge.active_connections == 1
        assert listener.limiter.borrowed_tokens == 1
        assert server.active == 1
        await client.send_eof()
        answer = json.loads(await read_all(client))
        (record,) = await wait_access_records(caplog)
        await wait_until(lambda: edge.active_connections == 0)
        assert listener.limiter.borrowed_tokens == 0
        assert edge._edge_limiter.borrowed_tokens == 0
        assert server.active == 0
        assert metric(edge, "tlsedge_connections_total", listener="in") == 1
        assert metric(edge, "tlsedge_connections_active", listener="in") == 0
        assert (
            metric(
                edge,
                "tlsedge_connections_closed_total",
                listener="in",
                termination=record["termination"],
            )
            == 1
        )
    port = client.socket.getsockname()[1]
    peer = f"127.0.0.1:{port}"
    assert answer["data"] == "hello"
    assert answer["source"] == ["127.0.0.1", port]
    assert answer["unique_id"] == record["id"]
    assert len(record["id"]) == 16
    int(record["id"], 16)
    assert record["peer"] == record["client"] == peer
    assert record["server"] == backend.address
    assert record["backend"] == "b"
    assert record["bytes_from_client"] == 5
    assert record["bytes_from_server"] == len(json.dumps(answer))
    assert record["termination"] in {"client_closed", "server_closed"}


# -- handshakes on the reactor ------------------------------------------------


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


async def test_a_tls_connection_without_proxy_header_gets_no_task(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
) -> None:
    """No PROXY header to read: the handshake runs on the reactor from the
    accepted socket, then the backend connect and the relay, with no task for
    the connection; it ends as one with a task (log line, counters, PROXY
    header with the TLS facts)."""
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    async with running_edge(edge_config(pki, backend)) as edge:
        client = await tls_connect(address_of(edge, "in"), client_context(pki))
        await round_trip(client)
        assert not tasks_started
        assert len(edge._relays) == 1
        assert in_flight(edge, "handshake") == 0
        await client.send_eof()
        assert await read_until_closed(client) == b""
        (record,) = await wait_access_records(caplog)
        await wait_until(lambda: edge.active_connections == 0)
        assert edge._listeners["in"].limiter.borrowed_tokens == 0
        version = record["tls"].split(" ")[0]
        assert metric(edge, "tlsedge_tls_handshakes_total", version=version) == 1
        # Its timeout's timer is still pending: it must not keep the
        # handshake (nor its stream) alive.
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, ReactorHandshake)]
    assert record["sni"] == "a.test"
    assert record["termination"] in {"client_closed", "server_closed"}
    assert record["bytes_from_client"] == record["bytes_from_server"] == 4
    (header,) = seen.headers
    assert describe_ssl(header)["ssl"]["version"] == version
    assert header.authority == "a.test"


async def test_a_tls_handshake_on_the_reactor_is_drained(
    nursery: trio.Nursery, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that never sends its ClientHello keeps the edge at most for
    the drain timeout; its line says drained."""
    backend = await Backend(echo_backend(Seen())).start(nursery)
    config = make_config(
        [
            {
                "name": "in",
                "backend": "b",
                "tls": {"certificates": [pki.entry("default")]},
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
        edge={"drain_timeout": 0.2},
    )
    async with trio.open_nursery() as edge_nursery:
        edge: Edge = await edge_nursery.start(Edge(config).run)
        client = await connect(address_of(edge, "in"))
        await wait_until(lambda: in_flight(edge, "handshake") == 1)
        edge.drain()
        with trio.fail_after(5):
            assert await read_until_closed(client) == b""
    (record,) = await wait_access_records(caplog)
    assert record["termination"] == "drained"
    assert edge.active_connections == 0
    assert backend.accepted == 0


# -- PROXY headers on the reactor ------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
async def test_a_proxy_connection_needing_no_wait_gets_no_task(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
    version: int,
) -> None:
    """The PROXY header is read on the reactor from the accepted socket; the
    bytes that came with it in one segment are the backend's first, and the
    connection has no task."""
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_protocol={"trusted": LOOPBACK})
    header = encode(ProxyHeader.from_addresses(CLIENT, DESTINATION, version=version))
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(header + b"hello")  # one segment
        await wait_until(lambda: backend.accepted == 1)
        assert not tasks_started
        assert len(edge._relays) == 1
        assert in_flight(edge, "header") == 0
        await client.send_eof()
        answer = json.loads(await read_all(client))
        (record,) = await wait_access_records(caplog)
        await wait_until(lambda: edge.active_connections == 0)
        assert edge._listeners["in"].limiter.borrowed_tokens == 0
        # Its timeout's timer is still pending: it must not keep the read
        # (nor its socket) alive.
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, ReactorHeaderRead)]
    assert answer["source"] == list(CLIENT)
    assert answer["destination"] == list(DESTINATION)
    assert answer["data"] == "hello"
    assert record["client"] == "203.0.113.7:40000"
    assert record["bytes_from_client"] == 5
    assert record["termination"] in {"client_closed", "server_closed"}


@pytest.mark.parametrize("version", [1, 2])
async def test_a_tls_connection_after_a_proxy_header_gets_no_task(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
    version: int,
) -> None:
    """The header and the ClientHello in one segment: the header is read on
    the reactor, the handshake starts from the bytes after it, and the
    connection has no task."""
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    config = edge_config(
        pki, backend, listener={"proxy_protocol": {"trusted": LOOPBACK}}
    )
    header = encode(ProxyHeader.from_addresses(CLIENT, DESTINATION, version=version))
    async with running_edge(config) as edge:
        tcp = await connect(address_of(edge, "in"))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        transport = PrefixFirstSend(tcp, header)
        client = TLSStream(
            transport, client_context(pki), server_side=False, server_hostname="a.test"
        )
        with trio.fail_after(10):
            await client.do_handshake()
        assert transport.first_send is not None
        assert transport.first_send[len(header)] == 0x16  # a TLS handshake record
        await round_trip(client)
        assert not tasks_started
        assert in_flight(edge, "header") == in_flight(edge, "handshake") == 0
        await client.send_eof()
        assert await read_until_closed(client) == b""
        (record,) = await wait_access_records(caplog)
    (received,) = seen.headers
    assert received.source is not None
    assert str(received.source.host) == CLIENT[0]  # type: ignore[union-attr]
    assert record["client"] == "203.0.113.7:40000"
    assert record["sni"] == "a.test"


# -- HTTP mode: its task starts after the reactor's stages -------------------


@pytest.fixture
def tasks_begun(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Where the reactor stopped (``begun``) for each connection `Edge`
    started a task for: None if the task runs every stage."""
    started: list[object] = []
    handle = Pipeline._wait_in_task

    async def counted(self: Pipeline, conn: Any, begun: Any) -> None:
        started.append(begun)
        await handle(self, conn, begun)

    monkeypatch.setattr(Pipeline, "_wait_in_task", counted)
    return started


def https_config(
    pki: Pki, app: H11Backend, tls: dict[str, Any] | None = None, **listener: Any
) -> Config:
    """An http-mode listener "in" with TLS in front of the h11 backend "b"."""
    certificates = [pki.entry("default"), pki.entry("a")]
    return make_config(
        [
            {
                "name": "in",
                "backend": "b",
                "mode": "http",
                "tls": {"certificates": certificates, **(tls or {})},
                **listener,
            }
        ],
        [{"name": "b", "servers": [app.address]}],
    )


async def test_an_https_connection_runs_with_no_task_after_the_handshake(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    tasks_begun: list[object],
) -> None:
    """An http-mode listener runs the handshake on the reactor: a client
    that sent nothing yet has no task; once the handshake is done the
    reactor serves its requests, still with no task of its own."""
    app = await H11Backend().start(nursery)
    async with running_edge(https_config(pki, app)) as edge:
        tcp = await connect(address_of(edge, "in"))
        await wait_until(lambda: in_flight(edge, "handshake") == 1)
        assert not tasks_begun
        stream = TLSStream(
            tcp, client_context(pki), server_side=False, server_hostname="a.test"
        )
        with trio.fail_after(10):
            await stream.do_handshake()
        client = Client(stream)  # type: ignore[arg-type]
        response = await client.request("GET", "/page")
        assert in_flight(edge, "handshake") == 0
        assert in_flight(edge, "http") == 1
        assert not tasks_begun
        await client.aclose()
        _, record = await wait_access_records(caplog, 2)  # request, connection
        assert in_flight(edge, "http") == 0
    assert response.status == 200
    assert response.json()["target"] == "/page"
    assert record["sni"] == "a.test"
    assert record["tls"]
    assert record["requests"] == 1
    assert record["termination"] == "client_closed"


@pytest.mark.parametrize("version", [1, 2])
async def test_https_after_a_proxy_header_runs_with_no_task(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    tasks_begun: list[object],
    version: int,
) -> None:
    """The header and the ClientHello in one segment to an http-mode
    listener: both are read on the reactor, then the requests are served
    there too, with no task; the request goes out with the client of the
    header."""
    app = await H11Backend().start(nursery)
    config = https_config(pki, app, proxy_protocol={"trusted": LOOPBACK})
    header = encode(ProxyHeader.from_addresses(CLIENT, DESTINATION, version=version))
    async with running_edge(config) as edge:
        tcp = await connect(address_of(edge, "in"))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        transport = PrefixFirstSend(tcp, header)
        stream = TLSStream(
            transport, client_context(pki), server_side=False, server_hostname="a.test"
        )
        with trio.fail_after(10):
            await stream.do_handshake()
        assert transport.first_send is not None
        assert transport.first_send[len(header)] == 0x16  # a TLS handshake record
        client = Client(stream)  # type: ignore[arg-type]
        response = await client.request("GET", "/")
        assert not tasks_begun
        assert in_flight(edge, "http") == 1
        assert in_flight(edge, "header") == in_flight(edge, "handshake") == 0
        await client.aclose()
        _, record = await wait_access_records(caplog, 2)  # request, connection
    assert response.status == 200
    headers = dict(response.json()["headers"])
    assert headers["x-forwarded-for"] == CLIENT[0]
    assert headers["x-forwarded-proto"] == "https"
    assert record["client"] == "203.0.113.7:40000"
    assert record["sni"] == "a.test"
    assert record["requests"] == 1


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_local_header_to_an_http_listener_is_a_health_check(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    tasks_begun: list[object],
    tls: bool,
) -> None:
    """A LOCAL header read on the reactor, then a close: a health check
    (over TLS the handshake on the reactor ends it, in plain the HTTP
    connection on the reactor sees the client end), with no task."""
    app = await H11Backend().start(nursery)
    config = https_config(pki, app, proxy_protocol={"trusted": LOOPBACK})
    if not tls:
        config = make_config(
            [
                {
                    "name": "in",
                    "backend": "b",
                    "mode": "http",
                    "proxy_protocol": {"trusted": LOOPBACK},
                }
            ],
            [{"name": "b", "servers": [app.address]}],
        )
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(encode_v2(ProxyHeader.local()))
        await wait_until(
            lambda: bool(in_flight(edge, "handshake")) or bool(in_flight(edge, "http"))
        )
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert record["termination"] == "health_check", record
    assert record["bytes_from_client"] == 0
    assert app.accepted == 0
    assert not tasks_begun


async def test_an_https_handshake_times_out_on_the_reactor(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    autojump_clock: trio.testing.MockClock,
    tasks_begun: list[object],
) -> None:
    """A client that never finishes its handshake to an http-mode listener
    ends as ``tls_handshake_timeout``, with no task."""
    app = await H11Backend().start(nursery)
    config = https_config(pki, app, tls={"handshake_timeout": 3.0})
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        assert await read_until_closed(client) == b""
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert not tasks_begun
    assert record["termination"] == "tls_handshake_timeout"
    assert app.accepted == 0


#: A listener's ``proxy_protocol``, what its client sends, and the
#: termination and metric reason it ends with.
_REFUSED_HEADERS: dict[str, tuple[dict[str, Any], bytes, str, str]] = {
    "bad-header": (
        {"trusted": LOOPBACK},
        b"PROXY GARBAGE\r\n",
        "header_error",
        "bad_v1_protocol",
    ),
    "eof-inside": ({"trusted": LOOPBACK}, b"PROXY TCP4 ", "header_error", "eof"),
    "no-byte": ({"trusted": LOOPBACK}, b"", "header_error", "empty"),
    "rejected": (
        {"trusted": ELSEWHERE, "untrusted": "reject"},
        b"PROXY UNKNOWN\r\n",
        "rejected",
        "rejected",
    ),
}


@pytest.mark.parametrize("case", list(_REFUSED_HEADERS))
async def test_a_refused_proxy_header_on_the_reactor(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
    case: str,
) -> None:
    """A refused header ends the connection from the reactor, with no task:
    the same termination, metric reason and detail as the task's path."""
    proxy_protocol, data, termination, reason = _REFUSED_HEADERS[case]
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_protocol=proxy_protocol)
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        # A rejected peer may be closed before it sent a byte.
        with contextlib.suppress(trio.BrokenResourceError):
            await client.send_all(data)
            await client.send_eof()
        with trio.fail_after(5):
            assert await read_until_closed(client) == b""
        await client.aclose()
        (record,) = await wait_access_records(caplog)
        errors = metric(edge, "tlsedge_proxy_header_errors_total", reason=reason)
    assert not tasks_started
    assert backend.accepted == 0
    assert record["termination"] == termination
    assert record["detail"]
    assert errors == 1


async def test_a_silent_client_times_out_on_the_reactor(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    autojump_clock: trio.testing.MockClock,
    tasks_started: list[object],
) -> None:
    """The header timeout is a reactor timer: the connection has no task."""
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(
        backend, proxy_protocol={"trusted": LOOPBACK, "timeout": 4.0}
    )
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(b"PROXY TCP4 ")  # a start, never finished
        assert await read_until_closed(client) == b""
        await client.aclose()
        (record,) = await wait_access_records(caplog)
        errors = metric(edge, "tlsedge_proxy_header_errors_total", reason="timeout")
    assert not tasks_started
    assert record["termination"] == "header_timeout"
    assert record["detail"].startswith("no complete PROXY header from ")
    assert record["detail"].endswith(" within 4.0 s")
    assert errors == 1


async def test_a_local_header_on_the_reactor_is_a_health_check(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
) -> None:
    """A load balancer's check (LOCAL header, then a reset) has no task and
    is logged as a health check."""
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = unwrap_config(backend, proxy_protocol={"trusted": LOOPBACK})
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(encode_v2(ProxyHeader.local()))
        await wait_until(lambda: backend.accepted == 1)
        set_abortive_close(client)
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert not tasks_started
    assert record["termination"] == "health_check", record
    assert record["bytes_from_client"] == 0


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_a_local_header_before_tls_on_the_reactor_is_a_health_check(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
    reset: bool,
) -> None:
    """A LOCAL header, then a close (or a reset, as HAProxy's checks do)
    without a byte of TLS: a health check, not a failed handshake (with no
    task)."""
    backend = await Backend(echo_backend(Seen())).start(nursery)
    config = edge_config(
        pki, backend, listener={"proxy_protocol": {"trusted": LOOPBACK}}
    )
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        await client.send_all(encode_v2(ProxyHeader.local()))
        await wait_until(lambda: in_flight(edge, "handshake") == 1)
        if reset:
            set_abortive_close(client)
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    assert not tasks_started
    assert record["termination"] == "health_check", record
    assert backend.accepted == 0


async def test_a_proxy_header_read_on_the_reactor_is_drained(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that never sends its header keeps the edge at most for the
    drain timeout; its line says drained."""
    backend = await Backend(proxy_echo_handler()).start(nursery)
    config = make_config(
        [{"name": "in", "backend": "b", "proxy_protocol": {"trusted": LOOPBACK}}],
        [{"name": "b", "servers": [backend.address]}],
        edge={"drain_timeout": 0.2},
    )
    async with trio.open_nursery() as edge_nursery:
        edge: Edge = await edge_nursery.start(Edge(config).run)
        client = await connect(address_of(edge, "in"))
        await wait_until(lambda: in_flight(edge, "header") == 1)
        edge.drain()
        with trio.fail_after(5):
            assert await read_until_closed(client) == b""
    (record,) = await wait_access_records(caplog)
    assert record["termination"] == "drained"
    assert edge.active_connections == 0
    assert backend.accepted == 0


async def test_sockets_relayed_without_streams_have_the_stream_options(
    nursery: trio.Nursery,
) -> None:
    """Both sides of a relay built without trio streams have the TCP options
    a `trio.SocketStream` sets (TCP_NODELAY, TCP_NOTSENT_LOWAT)."""
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    async with running_edge(unwrap_config(backend, send_proxy="none")) as edge:
        client = await connect(address_of(edge, "in"))
        assert await client.receive_some(10) == b"hi"
        (flow,) = edge._relays._flows
        for end in (flow.a, flow.b):
            assert end.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            if hasattr(socket, "TCP_NOTSENT_LOWAT"):
                lowat = end.sock.getsockopt(
                    socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT
                )
                assert lowat == 2**14
        await client.aclose()


async def test_connection_ids_are_distinct(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(tag_handler("hi")).start(nursery)
    async with running_edge(unwrap_config(backend, send_proxy="none")) as edge:
        for _ in range(20):
            await exchange(address_of(edge, "in"))
        records = await wait_access_records(caplog, 20)
    assert len({r["id"] for r in records}) == 20


async def test_a_connect_that_must_wait_goes_on_in_a_task(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
) -> None:
    """A first connect attempt that does not complete at once (the server's
    accept queue is full) is finished by a task, with timeouts and retries
    as before; everything is given back at the end."""
    with blackhole() as hole:
        config = balanced_config([hole], retries=1, connect_timeout=0.2)
        async with running_edge(config) as edge:
            assert edge._connections is not None
            server = edge._pools["b"].servers[0].server
            client = await connect(address_of(edge, "in"))
            await wait_until(lambda: edge.active_connections == 1)
            assert len(tasks_started) == 1
            assert len(edge._connections.child_tasks) == 1
            with trio.fail_after(5):
                assert await read_until_closed(client) == b""
            (record,) = await wait_access_records(caplog)
            await wait_until(lambda: edge.active_connections == 0)
            assert not edge._connections.child_tasks
            assert edge._listeners["in"].limiter.borrowed_tokens == 0
            assert server.active == 0
    assert record["termination"] == "connect_failed"
    assert "2 connect attempts failed" in record["detail"]
    assert "timeout after 0.2 s" in record["detail"]


async def test_a_tls_connect_that_must_wait_goes_on_in_a_task(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
) -> None:
    """After a handshake on the reactor, a connect that does not complete at
    once is finished by a task (here: a timeout, then the retry on the other
    server), which relays the TLS stream the reactor handshook."""
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    with blackhole() as hole:
        config = edge_config(
            pki,
            backend,
            backend_options={
                "servers": [hole, backend.address],
                "retries": 1,
                "connect_timeout": 0.2,
            },
        )
        async with running_edge(config) as edge:
            client = await tls_connect(address_of(edge, "in"), client_context(pki))
            await round_trip(client, b"after a retry")
            assert len(tasks_started) == 1
            await client.send_eof()
            assert await read_until_closed(client) == b""
            (record,) = await wait_access_records(caplog)
            await wait_until(lambda: edge.active_connections == 0)
    assert record["server"] == backend.address
    assert record["tls"].startswith("TLSv1.3")
    assert record["bytes_from_client"] == len(b"after a retry")
    assert len(seen.headers) == 1


async def test_bytes_after_a_proxy_header_wait_for_a_connect_in_a_task(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    tasks_started: list[object],
) -> None:
    """After a header read on the reactor, a connect that does not complete
    at once goes on in a task (a timeout, then the retry on the other
    server): the bytes that came with the header are the backend's first."""
    backend = await Backend(proxy_echo_handler()).start(nursery)
    with blackhole() as hole:
        config = unwrap_config(
            backend,
            proxy_protocol={"trusted": LOOPBACK},
            servers=[hole, backend.address],
            retries=1,
            connect_timeout=0.2,
        )
        header = encode(ProxyHeader.from_addresses(CLIENT, DESTINATION))
        async with running_edge(config) as edge:
            client = await connect(address_of(edge, "in"))
            await client.send_all(header + b"first")  # one segment
            await wait_until(lambda: backend.accepted == 1)
            assert len(tasks_started) == 1
            await client.send_all(b"-then")
            await client.send_eof()
            answer = json.loads(await read_all(client))
            (record,) = await wait_access_records(caplog)
    assert answer["data"] == "first-then"
    assert answer["source"] == list(CLIENT)
    assert record["server"] == backend.address
    assert record["bytes_from_client"] == len(b"first-then")


# -- max_connections ----------------------------------------------------------


async def assert_not_served(client: trio.SocketStream, backend: Backend) -> None:
    before = backend.accepted
    with trio.move_on_after(0.3):
        data = await client.receive_some(10)
        raise AssertionError(f"served beyond max_connections: {data!r}")
    assert backend.accepted == before


async def test_listener_max_connections_holds_the_third_client(
    nursery: trio.Nursery,
) -> None:
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    config = make_config(
        [{"name": "in", "backend": "b", "max_connections": 2}],
        [{"name": "b", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        first, second = await connect(address), await connect(address)
        assert await first.receive_some(10) == b"hi"
        assert await second.receive_some(10) == b"hi"
        third = await connect(address)  # the kernel's backlog takes it
        await assert_not_served(third, backend)
        await first.aclose()
        with trio.fail_after(5):
            assert await third.receive_some(10) == b"hi"
        for client in (second, third):
            await client.aclose()


async def test_edge_max_connections_counts_all_listeners(
    nursery: trio.Nursery,
) -> None:
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    config = make_config(
        [{"name": "one", "backend": "b"}, {"name": "two", "backend": "b"}],
        [{"name": "b", "servers": [backend.address]}],
        edge={"max_connections": 2},
    )
    async with running_edge(config) as edge:
        one, two = address_of(edge, "one"), address_of(edge, "two")
        first, second = await connect(one), await connect(one)
        with trio.fail_after(5):
            assert await first.receive_some(10) == b"hi"
            assert await second.receive_some(10) == b"hi"
        third = await connect(two)
        await assert_not_served(third, backend)
        await second.aclose()
        with trio.fail_after(5):
            assert await third.receive_some(10) == b"hi"
        for client in (first, third):
            await client.aclose()


async def test_client_reset_while_queued_keeps_its_address(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """getpeername() fails on a reset connection; accept() still says who it was."""
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    config = make_config(
        [
            {
                "name": "in",
                "backend": "b",
                "max_connections": 1,
                "proxy_protocol": {"trusted": LOOPBACK},
            }
        ],
        [{"name": "b", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        first = await connect(address)
        await first.send_all(encode_v2(ProxyHeader.local()))
        assert await first.receive_some(2) == b"hi"
        queued = await connect(address)  # waits in the backlog
        queued_port = queued.socket.getsockname()[1]
        await queued.send_all(encode_v2(ProxyHeader.local()))
        set_abortive_close(queued)
        await queued.aclose()  # RST while still queued
        await first.aclose()
        records = await wait_access_records(caplog, 2)
    assert len(records) == 2
    (record,) = [r for r in records if r["peer"] == f"127.0.0.1:{queued_port}"]
    # LOCAL then an RST, without data: how HAProxy's health checks look.
    assert record["termination"] == "health_check"


async def test_a_bug_on_one_connection_does_not_stop_the_edge(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        data = await read_all(stream)
        if data:  # nothing at all from the connection that hit the bug
            _, consumed = parse(data)
            await stream.send_all(
                json.dumps({"data": data[consumed:].decode()}).encode()
            )

    backend = await Backend(handler).start(nursery)
    config = unwrap_config(backend)
    calls = []

    def broken_once(*args: Any, **kwargs: Any) -> bytes | None:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("simulated bug")
        return proxy_header_for(*args, **kwargs)

    monkeypatch.setattr(tlsedge._pipeline.tcp, "proxy_header_for", broken_once)
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        async with await connect(address) as client:
            await client.send_eof()
            with trio.fail_after(5):
                assert await read_until_closed(client) == b""
        (record,) = await wait_access_records(caplog)
        answer = json.loads(await exchange(address, b"next"))  # still serving
    assert record["termination"] == "internal_error"
    assert "simulated bug" in record["detail"]
    assert answer["data"] == "next"
    await wait_until(lambda: backend.active == 0)  # its upstream was closed


# -- bytes after the PROXY header, every mode --------------------------------


def _http_backend_handler(seen: list[bytes]) -> Any:
    """Answers one HTTP request with 200 and records the head it received."""

    async def handler(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            head += chunk
        seen.append(head)
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
        )

    return handler


def _tls_listener(tmp_path: Path) -> tuple[dict[str, Any], ssl.SSLContext]:
    ca = trustme.CA()
    leaf = ca.issue_cert("edge.test")
    leaf.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "edge.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "edge.key"))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    tls = {
        "certificates": [
            {"cert": str(tmp_path / "edge.pem"), "key": str(tmp_path / "edge.key")}
        ]
    }
    return tls, context


@pytest.mark.parametrize("mode", ["tcp", "tls", "http", "http+tls"])
async def test_bytes_in_the_segment_of_the_proxy_header_reach_the_next_stage(
    nursery: trio.Nursery, tmp_path: Path, mode: str
) -> None:
    # The PROXY header and the client's first bytes in one send(), as
    # HAProxy's send-proxy and AWS NLB send them.
    seen: list[bytes] = []
    http = mode.startswith("http")
    handler = _http_backend_handler(seen) if http else proxy_echo_handler(proxy=False)
    backend = await Backend(handler).start(nursery)
    listener: dict[str, Any] = {
        "name": "in",
        "backend": "b",
        "mode": "http" if http else "tcp",
        "proxy_protocol": {"trusted": LOOPBACK},
    }
    context = None
    if mode.endswith("tls"):
        listener["tls"], context = _tls_listener(tmp_path)
    config = make_config([listener], [{"name": "b", "servers": [backend.address]}])
    header = encode(ProxyHeader.from_addresses(CLIENT, DESTINATION, version=1))
    request = (
        b"GET /first HTTP/1.1\r\nHost: edge.test\r\nConnection: close\r\n\r\n"
        if http
        else b"first"
    )
    async with running_edge(config) as edge:
        tcp = await connect(address_of(edge, "in"))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        client: trio.abc.Stream
        if context is None:
            await tcp.send_all(header + request)
            client = tcp
        else:
            prefixed = PrefixFirstSend(tcp, header)
            client = TLSStream(
                prefixed, context, server_side=False, server_hostname="edge.test"
            )
            with trio.fail_after(10):
                await client.do_handshake()
            assert prefixed.first_send is not None
            assert prefixed.first_send[len(header)] == 0x16  # the ClientHello
            await client.send_all(request)
        if not http:
            assert isinstance(client, trio.abc.HalfCloseableStream)
            await client.send_eof()
        with trio.fail_after(10):
            answer = await read_until_closed(client)
        await trio.aclose_forcefully(client)
    if http:
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer
        assert answer.endswith(b"ok")
        (head,) = seen
        assert head.startswith(b"GET /first HTTP/1.1\r\n")
        assert b"x-forwarded-for: 203.0.113.7\r\n" in head.lower()
    else:
        assert json.loads(answer)["data"] == "first"


# -- a server's connection count: one lease per use, every mode ----------------


def _server_metrics(edge: Edge) -> dict[tuple[str, str], float]:
    return {
        (name, labels["server"]): value
        for name, labels, value in edge._metrics.samples()
        if name
        in {"tlsedge_server_active_connections", "tlsedge_server_connections_total"}
    }


def _keepalive_http_handler(seen: list[bytes], *, proxy: bool) -> Any:
    """Answers every request on a connection with ``200 ok`` (keep-alive)."""

    async def handler(stream: trio.SocketStream) -> None:
        buffer = b""
        if proxy:
            _, buffer = await read_proxy(stream)
        while True:
            while b"\r\n\r\n" not in buffer:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                buffer += chunk
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            seen.append(head)
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    return handler


@pytest.mark.parametrize("send_proxy", ["none", "v2"])
async def test_http_mode_server_counts_return_to_zero(
    nursery: trio.Nursery, send_proxy: str
) -> None:
    seen: list[bytes] = []
    handler = _keepalive_http_handler(seen, proxy=send_proxy != "none")
    a = await Backend(handler).start(nursery)
    b = await Backend(handler).start(nursery)
    config = make_config(
        [{"name": "in", "backend": "app", "mode": "http"}],
        [
            {
                "name": "app",
                "servers": [a.address, b.address],
                "send_proxy": send_proxy,
            }
        ],
    )
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        for requests in (3, 4, 4):  # 11 requests on three connections
            async with await connect(address) as client:
                for _ in range(requests):
                    await client.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    answer = b""
                    with trio.fail_after(10):
                        while not answer.endswith(b"ok"):
                            answer += await client.receive_some(65536)
                    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        await wait_until(lambda: edge.active_connections == 0)
        pool = edge._pools["app"]
        counts = {h.server.address[1]: h.server.active for h in pool.servers}
        metrics = _server_metrics(edge)
    assert len(seen) == 11
    assert counts == {a.port: 0, b.port: 0}
    active = {
        server: value
        for (name, server), value in metrics.items()
        if name == "tlsedge_server_active_connections"
    }
    opened = {
        server: value
        for (name, server), value in metrics.items()
        if name == "tlsedge_server_connections_total"
    }
    assert active == {a.address: 0.0, b.address: 0.0}, metrics
    # Both servers got connections: one per client connection with send_proxy
    # (dedicated), fewer when pooled.
    assert set(opened) == {a.address, b.address}, metrics
    assert (
        sum(opened.values()) == 3
        if send_proxy == "v2"
        else 2 <= sum(opened.values()) <= 3
    )


async def test_http_mode_counts_a_request_in_flight(nursery: trio.Nursery) -> None:
    release = trio.Event()

    async def slow(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(65536)
        await release.wait()
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    backend = await Backend(slow).start(nursery)
    config = make_config(
        [{"name": "in", "backend": "app", "mode": "http"}],
        [{"name": "app", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        (health,) = edge._pools["app"].servers
        async with await connect(address_of(edge, "in")) as client:
            await client.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await wait_until(lambda: backend.active == 1)
            in_flight = health.server.active
            in_flight_metric = _server_metrics(edge)[
                ("tlsedge_server_active_connections", backend.address)
            ]
            release.set()
            answer = b""
            with trio.fail_after(10):
                while not answer.endswith(b"ok"):
                    answer += await client.receive_some(65536)
        idle = health.server.active  # the upstream is pooled, not in use
        idle_metric = _server_metrics(edge)[
            ("tlsedge_server_active_connections", backend.address)
        ]
    assert (in_flight, in_flight_metric) == (1, 1.0)
    assert (idle, idle_metric) == (0, 0.0)
