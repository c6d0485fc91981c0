"""The PROXY unwrap stage (`ReactorHeaderRead`) over real socket pairs: what
it hands on, what it refuses."""

from __future__ import annotations

import gc
import ipaddress
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from proxyproto import Policy, ProxyHeader, TrustPolicy, encode_v1, encode_v2
from tlsedge._core.config import ProxyProtocolConfig
from tlsedge._core.termination import Refused, Termination
from tlsedge._pipeline.unwrap import (
    ReactorHeaderRead,
    Unwrapped,
    UnwrapResult,
)
from tlsedge._reactor.loop import current_reactor
from tlsedge._reactor.relay import set_abortive_close

PEER = ("127.0.0.1", 50000)
LOCAL = ("127.0.0.1", 443)
SETTINGS = ProxyProtocolConfig(
    trusted=(ipaddress.ip_network("127.0.0.1/32"),), timeout=3.0
)
TRUST = TrustPolicy.from_cidrs(["127.0.0.1/32"])


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[socket.socket, trio.SocketStream]]:
    """Our end (a stdlib socket, as accepted) and the peer's stream."""
    ours, right = socket.socketpair()
    ours.setblocking(False)
    with ours:
        async with trio.SocketStream(trio.socket.from_stdlib_socket(right)) as theirs:
            yield ours, theirs


async def unwrap(
    ours: socket.socket, peer: tuple[str, int], trust: TrustPolicy = TRUST
) -> Unwrapped:
    results: list[UnwrapResult] = []
    done = trio.Event()

    def on_done(result: UnwrapResult) -> None:
        results.append(result)
        done.set()

    read = ReactorHeaderRead(
        ours, trust=trust, settings=SETTINGS, peer=peer, local=LOCAL, on_done=on_done
    )
    read.start()
    await done.wait()
    (result,) = results
    if isinstance(result, Exception):
        raise result
    assert result is not None
    return result


async def test_header_and_first_bytes_in_one_send() -> None:
    header = encode_v2(
        ProxyHeader.from_addresses(("203.0.113.7", 4000), ("198.51.100.1", 443))
    )
    async with pair() as (ours, theirs):
        await theirs.send_all(header + b"GET / HTTP/1.1\r\n")
        unwrapped = await unwrap(ours, PEER)
    assert unwrapped.client == ("203.0.113.7", 4000)
    assert unwrapped.destination == ("198.51.100.1", 443)
    assert not unwrapped.health_check
    assert unwrapped.leftover == b"GET / HTTP/1.1\r\n"


async def test_a_header_already_there_is_read_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The usual case (the load balancer sent its header as it connected):
    read from `start`, with no registration, no wait and no timer."""
    header = encode_v2(
        ProxyHeader.from_addresses(("203.0.113.7", 4000), ("198.51.100.1", 443))
    )
    reactor = current_reactor()
    registered: list[int] = []
    monkeypatch.setattr(
        reactor, "register", lambda fd, events, handler: registered.append(fd)
    )
    timers = len(reactor._timers)
    results: list[UnwrapResult] = []
    async with pair() as (ours, theirs):
        await theirs.send_all(header + b"GET / HTTP/1.1\r\n")
        ReactorHeaderRead(
            ours,
            trust=TRUST,
            settings=SETTINGS,
            peer=PEER,
            local=LOCAL,
            on_done=results.append,
        ).start()
    assert results == [
        Unwrapped(
            client=("203.0.113.7", 4000),
            destination=("198.51.100.1", 443),
            health_check=False,
            leftover=b"GET / HTTP/1.1\r\n",
        )
    ]
    assert registered == []
    assert len(reactor._timers) == timers


async def test_a_header_in_pieces() -> None:
    header = encode_v1(
        ProxyHeader.from_addresses(
            ("203.0.113.7", 4000), ("198.51.100.1", 443), version=1
        )
    )
    async with pair() as (ours, theirs), trio.open_nursery() as nursery:

        async def send_in_pieces() -> None:
            for index in range(len(header)):
                await theirs.send_all(header[index : index + 1])
                await trio.sleep(0.001)

        nursery.start_soon(send_in_pieces)
        unwrapped = await unwrap(ours, PEER)
    assert unwrapped.client == ("203.0.113.7", 4000)
    assert unwrapped.leftover == b""


@pytest.mark.parametrize(
    "header", [encode_v2(ProxyHeader.local()), encode_v1(ProxyHeader.unknown())]
)
async def test_a_header_without_a_client_is_a_health_check(header: bytes) -> None:
    async with pair() as (ours, theirs):
        await theirs.send_all(header)
        unwrapped = await unwrap(ours, PEER)
    assert unwrapped.health_check
    assert (unwrapped.client, unwrapped.destination) == (PEER, LOCAL)
    assert unwrapped.leftover == b""


async def test_malformed_header_is_a_header_error_with_the_codec_reason() -> None:
    async with pair() as (ours, theirs):
        await theirs.send_all(b"PROXY TCP4 1.2.3.4 5.6.7.8 +1 2\r\n")
        with pytest.raises(Refused) as info:
            await unwrap(ours, PEER)
    assert info.value.termination is Termination.HEADER_ERROR
    assert info.value.reason is not None
    assert "+1" in info.value.detail


async def test_untrusted_peer_is_rejected_before_reading() -> None:
    async with pair() as (ours, theirs):
        await theirs.send_all(encode_v1(ProxyHeader.unknown()))
        with pytest.raises(Refused) as info:
            await unwrap(ours, ("192.0.2.1", 1000))
    assert info.value.termination is Termination.REJECTED
    assert info.value.reason == "rejected"
    assert info.value.detail == (
        "peer 192.0.2.1:1000 may not connect here (trust policy REJECT)"
    )


async def test_untrusted_peer_is_direct_with_skip() -> None:
    async with pair() as (ours, theirs):
        await theirs.send_all(encode_v1(ProxyHeader.unknown()))
        trust = TrustPolicy.from_cidrs(["10.0.0.0/8"], untrusted=Policy.SKIP)
        unwrapped = await unwrap(ours, PEER, trust)
    assert (unwrapped.client, unwrapped.destination) == (PEER, LOCAL)
    assert not unwrapped.health_check
    assert unwrapped.leftover == b""


async def test_silent_peer_times_out(autojump_clock: trio.testing.MockClock) -> None:
    async with pair() as (ours, _):
        with pytest.raises(Refused) as info:
            await unwrap(ours, PEER)
    assert info.value.termination is Termination.HEADER_TIMEOUT
    assert info.value.reason == "timeout"
    assert info.value.detail == (
        "no complete PROXY header from 127.0.0.1:50000 within 3.0 s"
    )


async def test_eof_inside_the_header_is_a_header_error() -> None:
    async with pair() as (ours, theirs):
        await theirs.send_all(b"PROXY TCP4 ")
        await theirs.send_eof()
        with pytest.raises(Refused) as info:
            await unwrap(ours, PEER)
    assert info.value.termination is Termination.HEADER_ERROR
    assert info.value.reason == "eof"


async def test_a_close_without_a_byte_has_its_own_reason() -> None:
    # A TCP health check or a port scan, counted apart from a header cut
    # short (tlsedge_proxy_header_errors_total{reason="empty"}).
    async with pair() as (ours, theirs):
        await theirs.send_eof()
        with pytest.raises(Refused) as info:
            await unwrap(ours, PEER)
    assert info.value.termination is Termination.HEADER_ERROR
    assert info.value.reason == "empty"
    assert (
        info.value.detail
        == "connection closed without sending a byte (no PROXY header)"
    )


async def test_a_reset_inside_the_header_is_a_client_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        right = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    ours.setblocking(False)
    with ours:
        right.sendall(b"PROXY TCP4 ")
        set_abortive_close(right)
        right.close()
        with pytest.raises(Refused) as info:
            await unwrap(ours, PEER)
    assert info.value.termination is Termination.CLIENT_ERROR
    assert info.value.reason is None
    assert info.value.detail.startswith("socket connection broken: ")


async def test_a_read_on_the_reactor_drained_ends_with_none() -> None:
    results: list[UnwrapResult] = []
    async with pair() as (ours, _):
        read = ReactorHeaderRead(
            ours,
            trust=TRUST,
            settings=SETTINGS,
            peer=PEER,
            local=LOCAL,
            on_done=results.append,
        )
        read.start()
        await trio.testing.wait_all_tasks_blocked()
        assert not results
        read.drain()
        read.drain()  # once only
        assert results == [None]
        del read
        # The timeout's timer is still in the reactor's heap: it must not
        # keep the read alive.
        gc.collect()
        assert not [o for o in gc.get_objects() if isinstance(o, ReactorHeaderRead)]
