"""The PROXY unwrap stage over real socket pairs: what it hands on, what it refuses."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from proxyproto import ProxyHeader, TrustPolicy, encode_v1, encode_v2
from tlsedge._config import ProxyProtocolConfig
from tlsedge._termination import Refused, Termination
from tlsedge._unwrap import unwrap_proxy_header

PEER = ("127.0.0.1", 50000)
LOCAL = ("127.0.0.1", 443)
SETTINGS = ProxyProtocolConfig(
    trusted=(ipaddress.ip_network("127.0.0.1/32"),), timeout=3.0
)
TRUST = TrustPolicy.from_cidrs(["127.0.0.1/32"])


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    left, right = trio.socket.socketpair()
    async with trio.SocketStream(left) as ours, trio.SocketStream(right) as theirs:
        yield ours, theirs


async def test_header_and_first_bytes_in_one_send() -> None:
    header = encode_v2(
        ProxyHeader.from_addresses(("203.0.113.7", 4000), ("198.51.100.1", 443))
    )
    async with pair() as (ours, theirs):
        await theirs.send_all(header + b"GET / HTTP/1.1\r\n")
        unwrapped = await unwrap_proxy_header(
            ours, trust=TRUST, settings=SETTINGS, peer=PEER, local=LOCAL
        )
    assert unwrapped.client == ("203.0.113.7", 4000)
    assert unwrapped.destination == ("198.51.100.1", 443)
    assert not unwrapped.health_check
    assert unwrapped.leftover == b"GET / HTTP/1.1\r\n"


@pytest.mark.parametrize(
    "header", [encode_v2(ProxyHeader.local()), encode_v1(ProxyHeader.unknown())]
)
async def test_a_header_without_a_client_is_a_health_check(header: bytes) -> None:
    async with pair() as (ours, theirs):
        await theirs.send_all(header)
        unwrapped = await unwrap_proxy_header(
            ours, trust=TRUST, settings=SETTINGS, peer=PEER, local=LOCAL
        )
    assert unwrapped.health_check
    assert (unwrapped.client, unwrapped.destination) == (PEER, LOCAL)
    assert unwrapped.leftover == b""


async def test_malformed_header_is_a_header_error_with_the_codec_reason() -> None:
    async with pair() as (ours, theirs):
        await theirs.send_all(b"PROXY TCP4 1.2.3.4 5.6.7.8 +1 2\r\n")
        with pytest.raises(Refused) as info:
            await unwrap_proxy_header(
                ours, trust=TRUST, settings=SETTINGS, peer=PEER, local=LOCAL
            )
    assert info.value.termination is Termination.HEADER_ERROR
    assert info.value.reason is not None
    assert "+1" in info.value.detail


async def test_untrusted_peer_is_rejected_before_reading() -> None:
    async with pair() as (ours, theirs):
        await theirs.send_all(encode_v1(ProxyHeader.unknown()))
        with pytest.raises(Refused) as info:
            await unwrap_proxy_header(
                ours,
                trust=TRUST,
                settings=SETTINGS,
                peer=("192.0.2.1", 1000),
                local=LOCAL,
            )
    assert info.value.termination is Termination.REJECTED
    assert info.value.reason == "rejected"


async def test_silent_peer_times_out(autojump_clock: trio.testing.MockClock) -> None:
    async with pair() as (ours, _):
        with pytest.raises(Refused) as info:
            await unwrap_proxy_header(
                ours, trust=TRUST, settings=SETTINGS, peer=PEER, local=LOCAL
            )
    assert info.value.termination is Termination.HEADER_TIMEOUT


async def test_eof_inside_the_header_is_a_header_error() -> None:
    async with pair() as (ours, theirs):
        await theirs.send_all(b"PROXY TCP4 ")
        await theirs.send_eof()
        with pytest.raises(Refused) as info:
            await unwrap_proxy_header(
                ours, trust=TRUST, settings=SETTINGS, peer=PEER, local=LOCAL
            )
    assert info.value.termination is Termination.HEADER_ERROR
