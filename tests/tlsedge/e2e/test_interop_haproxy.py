"""A real HAProxy in front of tlsedge: client -> HAProxy -> tlsedge -> backend."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from tests.peers import free_port, haproxy, require
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
from tlsedge._core.config import Config


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


@pytest.mark.parametrize("listener", ["tls", "http", "http+tls"])
async def test_haproxy_health_checks_are_health_checks_on_tls_and_http_listeners(
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    listener: str,
) -> None:
    # HAProxy's `check-send-proxy`: connect, a v2 LOCAL header, then an RST.
    # On every kind of listener that is a load balancer's check, not a TLS
    # failure or a client error to count and alert on.
    backend = await Backend(proxy_echo_handler(proxy=False)).start(nursery)
    settings: dict[str, Any] = {
        "name": "behind-haproxy",
        "backend": "app",
        "mode": "http" if listener.startswith("http") else "tcp",
        "proxy_protocol": {"trusted": ["127.0.0.1/32"]},
    }
    if listener.endswith("tls"):
        ca = trustme.CA()
        leaf = ca.issue_cert("edge.test")
        leaf.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "e.pem"))
        leaf.private_key_pem.write_to_path(str(tmp_path / "e.key"))
        settings["tls"] = {
            "certificates": [
                {"cert": str(tmp_path / "e.pem"), "key": str(tmp_path / "e.key")}
            ]
        }
    config = make_config([settings], [{"name": "app", "servers": [backend.address]}])
    async with running_edge(config) as edge:
        _, edge_port = address_of(edge, "behind-haproxy")
        front = free_port()
        haproxy_config = (
            f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
            f"backend be\n    server s1 127.0.0.1:{edge_port} send-proxy-v2"
            " check check-send-proxy inter 100ms rise 1 fall 1\n"
        )
        with haproxy(haproxy_config, [front]):
            await wait_until(lambda: len(checks(access_records(caplog))) >= 3)
        failures = sum(
            value
            for name, _, value in edge._metrics.samples()
            if name == "tlsedge_tls_handshake_failures_total"
        )
    records = checks(access_records(caplog))
    assert {r["termination"] for r in records} == {"health_check"}, records
    # Only the harness's port probe (a real client header, then a close) can
    # count as a TLS failure.
    probes = [r for r in access_records(caplog) if r not in records]
    assert failures == sum(r["termination"] == "tls_error" for r in probes)
    assert not [
        r
        for r in caplog.records
        if "TLS handshake" in r.getMessage()
        and any(c["client"] in r.getMessage() for c in records)
    ]
    assert backend.accepted <= 1  # only the harness's port probe, never a check


def checks(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The connection lines of HAProxy's checks: a LOCAL header keeps the
    real endpoints (the harness's port probe carries a PROXY header)."""
    return [r for r in records if "type" not in r and r["client"] == r["peer"]]


@pytest.mark.parametrize("send_proxy", ["send-proxy", "send-proxy-v2"])
async def test_curl_through_haproxy_to_an_http_listener(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, send_proxy: str
) -> None:
    # HAProxy sends its PROXY header and the client's first request together:
    # the request must reach the HTTP layer (it used to be dropped).
    heads: list[bytes] = []

    async def http_backend(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            head += chunk
        heads.append(head)
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nhi\n")

    backend = await Backend(http_backend).start(nursery)
    config = make_config(
        [
            {
                "name": "web",
                "backend": "app",
                "mode": "http",
                "proxy_protocol": {"trusted": ["127.0.0.1/32"]},
            }
        ],
        [{"name": "app", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        _, edge_port = address_of(edge, "web")
        front = free_port()
        haproxy_config = (
            f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
            f"backend be\n    server s1 127.0.0.1:{edge_port} {send_proxy}\n"
        )
        with haproxy(haproxy_config, [front]):
            result = await trio.run_process(
                [
                    require("curl"),
                    "-sS",
                    "--max-time",
                    "10",
                    f"http://127.0.0.1:{front}/x",
                ],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"hi\n"
    (head,) = heads
    assert head.startswith(b"GET /x HTTP/1.1\r\n")
    assert b"\r\nx-forwarded-for: 127.0.0.1\r\n" in head.lower()
