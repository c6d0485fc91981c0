"""A real HAProxy in front of tlsedge: client -> HAProxy -> tlsedge -> backend."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import pytest
import trio

from tests.peers import free_port, haproxy
from tests.tlsedge.helpers import (
    Backend,
    access_records,
    address_of,
    close_clients,
    make_config,
    proxy_echo_handler,
    read_all,
    running_edge,
    wait_until,
)
from tlsedge._config import Config


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


def edge_config(backend: Backend) -> Config:
    return make_config(
        [
            {
                "name": "behind-haproxy",
                "backend": "app",
                "proxy_protocol": {"trusted": ["127.0.0.1/32"]},
            }
        ],
        [{"name": "app", "servers": [backend.address], "send_proxy": "v2"}],
    )


async def connect_from(port: int, source_port: int) -> trio.SocketStream:
    """A client connection from 127.0.0.1:*source_port* (pinned)."""
    sock = trio.socket.socket()
    try:
        await sock.bind(("127.0.0.1", source_port))
        await sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


@pytest.mark.parametrize("send_proxy", ["send-proxy", "send-proxy-v2"])
async def test_haproxy_to_tlsedge_to_backend_keeps_the_real_client(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, send_proxy: str
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    async with running_edge(edge_config(backend)) as edge:
        _, edge_port = address_of(edge, "behind-haproxy")
        front = free_port()
        config = (
            f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
            f"backend be\n    server s1 127.0.0.1:{edge_port} {send_proxy}\n"
        )
        with haproxy(config, [front]):
            source_port = free_port()
            client = await connect_from(front, source_port)
            async with client:
                await client.send_all(b"through two proxies")
                await client.send_eof()
                with trio.fail_after(10):
                    answer = json.loads(await read_all(client))
            await wait_until(
                lambda: any(
                    r["client"] == f"127.0.0.1:{source_port}"
                    for r in access_records(caplog)
                )
            )
    assert answer["version"] == 2
    assert answer["command"] == "PROXY"
    assert answer["source"] == ["127.0.0.1", source_port]
    assert answer["destination"] == ["127.0.0.1", front]
    assert answer["data"] == "through two proxies"
    (record,) = [
        r for r in access_records(caplog) if r["client"] == f"127.0.0.1:{source_port}"
    ]
    assert record["destination"] == f"127.0.0.1:{front}"
    assert record["termination"] in {"client_closed", "server_closed"}


async def test_haproxy_health_checks_with_local_headers(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(proxy_echo_handler()).start(nursery)
    async with running_edge(edge_config(backend)) as edge:
        _, edge_port = address_of(edge, "behind-haproxy")
        front = free_port()
        config = (
            f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
            f"backend be\n    server s1 127.0.0.1:{edge_port} send-proxy-v2"
            " check check-send-proxy inter 100ms rise 1 fall 1\n"
        )
        with haproxy(config, [front]):
            # Three checks reached the edge and were served, not refused.
            await wait_until(lambda: len(access_records(caplog)) >= 4)
            # Traffic still flows: HAProxy kept the server UP.
            source_port = free_port()
            client = await connect_from(front, source_port)
            async with client:
                await client.send_all(b"after the checks")
                await client.send_eof()
                with trio.fail_after(10):
                    answer = json.loads(await read_all(client))
    assert answer["source"] == ["127.0.0.1", source_port]
    assert answer["data"] == "after the checks"
    records = access_records(caplog)
    assert not [r for r in records if r["termination"].startswith("header")]
    assert not [r for r in records if r["termination"] == "rejected"]
    # A check resets its connection right after the LOCAL header: the edge
    # still knows the peer (from accept) and trusts it; nothing is refused.
    assert all(r["peer"] is not None for r in records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert backend.accepted >= 4
