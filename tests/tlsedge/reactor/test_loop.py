"""The reactor, and relays it drives over real sockets (plain and TLS).

`tests/tlsedge/reactor/test_relay.py` and `test_relay_stateful.py` hold the relay's
half-close, timeout and error rules; this file holds what is the reactor's
own: its timers, its isolation of a failing handler, the portable selector,
backpressure, an RST on a side that is not being read, and TLS streams whose
engine already holds bytes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import socket
import ssl
from collections.abc import Callable

import pytest
import trio
import trio.testing
import trustme

from tests.tlsedge.reactor.test_relay import (
    HANG_GUARD,
    MIB,
    payload,
    receive_all,
    send_then_eof,
    tcp_pair,
    tcp_wiring,
)
from tlsedge._core.termination import RelayStats, Termination
from tlsedge._reactor import loop as _reactor
from tlsedge._reactor.loop import READABLE, current_reactor
from tlsedge._reactor.relay import relay
from tlsedge._tls.stream import TLSStream

CA = trustme.CA()
SERVER_CERT = CA.issue_cert("tlsedge.test")


async def test_timers_run_in_deadline_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    reactor = current_reactor()
    assert current_reactor() is reactor  # one per run
    fired: list[tuple[str, float]] = []
    start = trio.current_time()

    def timer(name: str) -> Callable[[], None]:
        return lambda: fired.append((name, trio.current_time() - start))

    for name, delay in (("c", 3.0), ("a", 1.0), ("b", 2.0)):
        reactor.call_at(start + delay, timer(name))
    await trio.sleep(5)
    assert [name for name, _ in fired] == ["a", "b", "c"]
    assert all(at >= delay for (_, at), delay in zip(fired, (1, 2, 3), strict=True))


async def test_called_off_timers_do_not_pile_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Short connections each leave a called-off idle timer behind: the heap
    is rebuilt without them, and the timers still wanted still fire."""
    reactor = current_reactor()
    start = trio.current_time()
    fired: list[int] = []
    kept: list[int] = []
    for i in range(20_000):
        timer = _reactor.Cancellable(functools.partial(fired.append, i))
        reactor.call_at(start + 60 + i / 1000, timer)
        if i % 100:
            timer.cancel()  # the connection ended long before its deadline
        else:
            kept.append(i)
        assert len(reactor._timers) <= 2 * (len(kept) + _reactor._COMPACT_AT_LEAST)
    await trio.sleep(100)
    assert fired == kept


class _Exploding:
    def __init__(self) -> None:
        self.failures: list[Exception] = []
        self.failed_event = trio.Event()

    def ready(self, fd: int, events: int) -> None:
        raise RuntimeError("boom")

    def failed(self, exc: Exception) -> None:
        self.failures.append(exc)
        self.failed_event.set()


async def test_a_failing_handler_ends_only_its_own_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reactor = current_reactor()
    bad_ours, bad_theirs = socket.socketpair()
    try:
        exploding = _Exploding()
        reactor.register(bad_ours.fileno(), READABLE, exploding)
        with caplog.at_level(logging.ERROR, logger="tlsedge.reactor"):
            bad_theirs.send(b"x")
            with trio.fail_after(HANG_GUARD):
                await exploding.failed_event.wait()
        reactor.unregister(bad_ours.fileno())
        assert "handler failed" in caplog.text
        # The reactor still relays for everyone else.
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            nursery.start_soon(w.run_relay)
            await w.client_peer.send_all(b"ping")
            assert await w.server_peer.receive_some() == b"ping"
            await w.client_peer.send_eof()
            await w.server_peer.send_eof()
    finally:
        bad_ours.close()
        bad_theirs.close()


class _Counting:
    def __init__(self) -> None:
        self.called = trio.Event()

    def ready(self, fd: int, events: int) -> None:
        self.called.set()

    def failed(self, exc: Exception) -> None:
        raise AssertionError(exc)


async def test_a_forgotten_descriptor_left_open_is_dropped_by_the_selector() -> None:
    """`Reactor.forget` leaves the removal to the descriptor's close. One its
    owner did not close would be reported at every poll: the reactor
    unregisters it the first time (no handler is called, no busy loop)."""
    reactor = current_reactor()
    ours, theirs = socket.socketpair()
    try:
        handler = _Counting()
        reactor.register(ours.fileno(), READABLE, handler)
        reactor.forget(ours.fileno())
        theirs.send(b"x")  # readable from now on (level-triggered)
        await trio.sleep(0.05)
        # Registering it again works: it is out of the selector.
        reactor.register(ours.fileno(), READABLE, handler)
        with trio.fail_after(HANG_GUARD):
            await handler.called.wait()
        reactor.unregister(ours.fileno())
    finally:
        ours.close()
        theirs.close()


class _Deferring:
    """Reads its socket at each event and puts the reckoning off to the
    batch's end, as an HTTP/2 connection puts off its write."""

    def __init__(
        self, sock: socket.socket, log: list[str], name: str, done: trio.Event
    ) -> None:
        self.sock = sock
        self.log = log
        self.name = name
        self.done = done
        self.failures: list[Exception] = []

    def ready(self, fd: int, events: int) -> None:
        self.sock.recv(1)
        self.log.append(f"ready {self.name}")
        current_reactor().defer(self.settle, self)

    def settle(self) -> None:
        self.log.append(f"settle {self.name}")
        if len(self.log) == 6:
            self.done.set()
        if self.name == "b":
            raise RuntimeError("boom")

    def failed(self, exc: Exception) -> None:
        self.failures.append(exc)


async def test_deferred_calls_run_after_every_handler_of_the_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reactor = current_reactor()
    pairs = [socket.socketpair() for _ in range(3)]
    log: list[str] = []
    done = trio.Event()
    handlers = [
        _Deferring(ours, log, name, done)
        for (ours, _), name in zip(pairs, "abc", strict=True)
    ]
    try:
        for (ours, theirs), handler in zip(pairs, handlers, strict=True):
            reactor.register(ours.fileno(), READABLE, handler)
            theirs.send(b"x")
        with caplog.at_level(logging.ERROR, logger="tlsedge.reactor"):
            with trio.fail_after(HANG_GUARD):
                await done.wait()
        for ours, _ in pairs:
            reactor.unregister(ours.fileno())
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
    # One batch: the three handlers, then the three deferred calls.
    assert sorted(log[:3]) == ["ready a", "ready b", "ready c"]
    assert sorted(log[3:6]) == ["settle a", "settle b", "settle c"]
    # A deferred call that raises is its handler's bug, and only its.
    assert [type(e) for e in handlers[1].failures] == [RuntimeError]
    assert not handlers[0].failures
    assert not handlers[2].failures
    assert "deferred call failed" in caplog.text


async def test_portable_selector_relays_with_half_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where there is no epoll the reactor uses `selectors`; the relay's rules
    # are the same. (The reactor is per run, and this run starts with none.)
    monkeypatch.setattr(_reactor, "_make_poller", _reactor._PortableSelector)
    assert isinstance(current_reactor()._poller, _reactor._PortableSelector)
    upload, download = payload(3 * MIB, 1), payload(2 * MIB, 2)
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            got: dict[str, bytes] = {}

            async def server() -> None:
                got["server"] = await receive_all(w.server_peer)
                await send_then_eof(w.server_peer, download)

            async def client() -> None:
                await send_then_eof(w.client_peer, upload)
                got["client"] = await receive_all(w.client_peer)

            nursery.start_soon(w.run_relay)
            nursery.start_soon(server)
            nursery.start_soon(client)
    assert got == {"server": upload, "client": download}
    assert w.stats.termination is Termination.CLIENT_CLOSED


def _small_buffers(stream: trio.SocketStream) -> None:
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)


async def test_a_slow_reader_stops_the_relay_reading_its_source() -> None:
    # Backpressure: the relay holds at most one buffer per direction, so a
    # server that does not read stops the relay from reading the client.
    buffer_size = 65536
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            for stream in (
                w.client_peer,
                w.relay_client,
                w.relay_server,
                w.server_peer,
            ):
                assert isinstance(stream, trio.SocketStream)
                _small_buffers(stream)

            async def run_relay() -> None:
                await relay(
                    w.relay_client,
                    w.relay_server,
                    stats=w.stats,
                    idle_timeout=3600,
                    client_fin_timeout=3600,
                    server_fin_timeout=3600,
                    buffer_size=buffer_size,
                )

            data = payload(64 * MIB, 3)
            sent = trio.Event()

            async def send_payload() -> None:
                await w.client_peer.send_all(data)
                sent.set()

            nursery.start_soon(run_relay)
            nursery.start_soon(send_payload)
            # Wait until the relay is stuck: its count stops moving.
            last = -1
            while w.stats.bytes_from_client != last:
                last = w.stats.bytes_from_client
                await trio.sleep(0.2)
            # Kernel buffers (a few hundred KiB at most with 64 KiB socket
            # buffers, autotuning aside) plus the relay's one buffer.
            assert 0 < w.stats.bytes_from_client < 8 * MIB
            received = 0
            digest = hashlib.sha256()
            expected = hashlib.sha256(data).hexdigest()
            while received < 64 * MIB:
                chunk = await w.server_peer.receive_some(1 << 20)
                received += len(chunk)
                digest.update(chunk)
            assert digest.hexdigest() == expected
            # The server may have every byte before send_all has returned
            # (its task is scheduled after the reactor's turn).
            await sent.wait()
            await w.client_peer.send_eof()
            assert await w.server_peer.receive_some() == b""
            await w.server_peer.send_eof()
    assert w.stats.termination is Termination.CLIENT_CLOSED


async def test_an_rst_on_a_side_not_being_read_ends_the_relay() -> None:
    # The client is not read while the server does not take its bytes; its
    # RST still ends the relay at once, blamed on the client.
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            for stream in (
                w.client_peer,
                w.relay_client,
                w.relay_server,
                w.server_peer,
            ):
                assert isinstance(stream, trio.SocketStream)
                _small_buffers(stream)
            done = trio.Event()

            async def run_relay() -> None:
                await w.run_relay()
                done.set()

            nursery.start_soon(run_relay)
            chunk = b"x" * 65536
            with trio.move_on_after(1):
                while True:  # until the relay stops reading us
                    await w.client_peer.send_all(chunk)
            assert isinstance(w.client_peer, trio.SocketStream)
            w.client_peer.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            w.client_peer.socket.close()
            await done.wait()
    assert w.stats.termination is Termination.CLIENT_ERROR


def _tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    SERVER_CERT.configure_cert(server)
    client = ssl.create_default_context()
    CA.configure_trust(client)
    return server, client


async def test_tls_bytes_the_engine_already_holds_are_relayed_first() -> None:
    # The edge's TLSStream read past what it returned: the rest sits in its
    # engine (or its transport read), and the socket may never be readable
    # again for it. The reactor hands it on before waiting.
    server_ctx, client_ctx = _tls_contexts()
    client_transport, edge_transport = await tcp_pair()
    relay_server, server_peer = await tcp_pair()
    tls_client = TLSStream(
        client_transport, client_ctx, server_side=False, server_hostname="tlsedge.test"
    )
    tls_edge = TLSStream(edge_transport, server_ctx, server_side=True)
    stats = RelayStats()
    try:
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(tls_client.do_handshake)
                nursery.start_soon(tls_edge.do_handshake)
            await tls_client.send_all(b"first")
            await tls_client.send_all(b"second")
            await tls_client.send_all(b"third")
            await trio.sleep(0.1)  # all three records are in the edge's socket
            assert await tls_edge.receive_some(2) == b"fi"
            async with trio.open_nursery() as nursery:

                async def run_relay() -> None:
                    await relay(
                        tls_edge,
                        relay_server,
                        stats=stats,
                        idle_timeout=3600,
                        client_fin_timeout=3600,
                        server_fin_timeout=3600,
                    )

                nursery.start_soon(run_relay)
                got = b""
                while len(got) < len(b"rstsecondthird"):
                    got += await server_peer.receive_some()
                assert got == b"rstsecondthird"
                # TLS half-close both ways through the reactor.
                await tls_client.send_eof()  # close_notify
                assert await server_peer.receive_some() == b""  # a FIN
                await server_peer.send_all(b"answer")
                await server_peer.send_eof()
                assert await receive_all(tls_client) == b"answer"
    finally:
        for stream in (tls_client, tls_edge, relay_server, server_peer):
            await trio.aclose_forcefully(stream)
    assert stats.termination is Termination.CLIENT_CLOSED
    assert stats.bytes_from_client == len(b"rstsecondthird")
    assert stats.bytes_from_server == len(b"answer")


async def test_a_finished_relay_leaves_nothing_registered() -> None:
    reactor = current_reactor()
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            nursery.start_soon(w.run_relay)
            await w.client_peer.send_all(b"ping")
            assert await w.server_peer.receive_some() == b"ping"
            assert len(reactor._handlers) == 2
            await w.client_peer.send_eof()
            await w.server_peer.send_eof()
    assert reactor._handlers == {}
    assert w.stats.termination is Termination.CLIENT_CLOSED
