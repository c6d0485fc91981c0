"""proxyproto.requests: the headers requests sends reach real PROXY receivers.

Receivers: proxyproto's trio adapter, HAProxy with ``accept-proxy`` and a
tlsedge HTTP listener with ``[listeners.proxy_protocol]``, plain and TLS.
requests is blocking: it runs in a worker thread while the trio receivers
serve on the test's event loop.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import requests
import trio

from proxyproto import TLV, LocalProtocolError, ProxyHeader
from proxyproto.requests import ProxyHeaderAdapter
from tests.proxyproto.client_peers import (
    TrioReceiver,
    describe,
    haproxy_receiver,
    running_tlsedge,
    tls_files,
)

LB_CLIENT = ("203.0.113.7", 5555)


def get_all(adapter: ProxyHeaderAdapter, urls: list[str], **kwargs: Any) -> list[Any]:
    """GET each URL with one session using *adapter*; the JSON (or text)
    answers."""
    with requests.Session() as session:
        session.trust_env = False
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        answers = []
        for url in urls:
            response = session.get(url, timeout=10, **kwargs)
            response.raise_for_status()
            if response.headers["content-type"] == "application/json":
                answers.append(response.json())
            else:
                answers.append(response.text)
        return answers


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
async def test_adapter_reaches_the_trio_adapter(
    nursery: trio.Nursery, tmp_path: Path, version: int, use_tls: bool
) -> None:
    files = tls_files(tmp_path)
    receiver = TrioReceiver(tls=files.server_context() if use_tls else None)
    port = await receiver.start(nursery)
    url = f"{'https' if use_tls else 'http'}://127.0.0.1:{port}/"
    adapter = ProxyHeaderAdapter(version=version, source=LB_CLIENT)
    first, second = await trio.to_thread.run_sync(
        lambda: get_all(adapter, [url, url], verify=str(files.ca_pem))
    )
    assert first["version"] == version
    assert first["source"] == list(LB_CLIENT)
    assert first["destination"] == ["127.0.0.1", port]
    # Keep-alive: the second request rides the same connection and header.
    assert (first["connection"], second["connection"]) == (0, 0)
    assert second["request"] == 2
    assert len(receiver.headers) == 1


async def test_default_header_names_the_connection_and_tlvs_travel(
    nursery: trio.Nursery,
) -> None:
    receiver = TrioReceiver()
    port = await receiver.start(nursery)
    url = f"http://127.0.0.1:{port}/"
    adapter = ProxyHeaderAdapter(tlvs=(TLV.authority("example.com"),), crc32c=True)
    (answer,) = await trio.to_thread.run_sync(get_all, adapter, [url])
    assert answer["source"][0] == "127.0.0.1"
    assert answer["destination"] == ["127.0.0.1", port]
    assert answer["authority"] == "example.com"
    assert answer["crc32c"] is True

    fixed = ProxyHeader.local()
    (answer,) = await trio.to_thread.run_sync(get_all, ProxyHeaderAdapter(fixed), [url])
    assert answer == {**describe(fixed), "connection": 1, "request": 1}


async def test_two_adapters_never_share_a_connection(nursery: trio.Nursery) -> None:
    receiver = TrioReceiver()
    port = await receiver.start(nursery)
    url = f"http://127.0.0.1:{port}/"

    def run() -> list[Any]:
        with requests.Session() as session:
            session.mount(
                f"http://127.0.0.1:{port}/a", ProxyHeaderAdapter(source=LB_CLIENT)
            )
            session.mount(
                f"http://127.0.0.1:{port}/b",
                ProxyHeaderAdapter(source=("198.51.100.9", 9)),
            )
            return [
                session.get(url + path, timeout=10).json()
                for path in ("a", "b", "a", "b")
            ]

    answers = await trio.to_thread.run_sync(run)
    assert [(a["connection"], a["source"][0]) for a in answers] == [
        (0, "203.0.113.7"),
        (1, "198.51.100.9"),
        (0, "203.0.113.7"),
        (1, "198.51.100.9"),
    ]


@pytest.mark.peers
@pytest.mark.parametrize("version", [1, 2])
async def test_haproxy_accept_proxy_takes_the_header_plain_and_tls(
    tmp_path: Path, version: int
) -> None:
    files = tls_files(tmp_path)
    tlvs = (TLV.authority("example.com"),) if version == 2 else ()
    with haproxy_receiver(files) as ports:
        adapter = ProxyHeaderAdapter(version=version, source=LB_CLIENT, tlvs=tlvs)
        plain, tls = await trio.to_thread.run_sync(
            lambda: get_all(
                adapter,
                [
                    f"http://127.0.0.1:{ports.plain}/",
                    f"https://127.0.0.1:{ports.tls}/",
                ],
                verify=str(files.ca_pem),
            )
        )
    authority = "example.com" if version == 2 else ""
    assert plain == f"203.0.113.7 5555 127.0.0.1 {ports.plain} {authority} 0"
    assert tls == f"203.0.113.7 5555 127.0.0.1 {ports.tls} {authority} 1"


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
async def test_tlsedge_listener_takes_the_header(
    nursery: trio.Nursery, tmp_path: Path, use_tls: bool
) -> None:
    files = tls_files(tmp_path)
    async with running_tlsedge(nursery, files if use_tls else None) as port:
        url = f"{'https' if use_tls else 'http'}://127.0.0.1:{port}/"
        adapter = ProxyHeaderAdapter(version=1, source=LB_CLIENT)
        (answer,) = await trio.to_thread.run_sync(
            lambda: get_all(adapter, [url], verify=str(files.ca_pem))
        )
    assert answer["x-forwarded-for"] == "203.0.113.7"
    assert answer["x-forwarded-proto"] == ("https" if use_tls else "http")


def test_http_proxies_are_refused() -> None:
    with requests.Session() as session:
        session.trust_env = False
        session.mount("http://", ProxyHeaderAdapter())
        with pytest.raises(requests.exceptions.ProxyError, match="cannot go through"):
            session.get(
                "http://127.0.0.1:9/",
                proxies={"http": "http://127.0.0.1:3128"},
                timeout=5,
            )


def test_no_connection_is_a_connection_error() -> None:
    with pytest.raises(requests.exceptions.ConnectionError):
        get_all(ProxyHeaderAdapter(), ["http://127.0.0.1:9/"])


def test_the_adapter_pickles_with_its_plan() -> None:
    adapter = ProxyHeaderAdapter(version=1, source=LB_CLIENT)
    copy = pickle.loads(pickle.dumps(adapter))
    assert copy.plan == adapter.plan
    adapter.close()
    copy.close()


def test_bad_header_arguments_fail_at_construction() -> None:
    with pytest.raises(LocalProtocolError, match="v1 headers cannot carry TLVs"):
        ProxyHeaderAdapter(version=1, tlvs=(TLV.alpn(b"h2"),))
