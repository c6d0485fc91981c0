from __future__ import annotations

import gc
import hashlib
import random
import socket
import ssl
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing
import trustme
from hypothesis import given, strategies as st

from tlsedge._core.termination import RelayStats, Termination
from tlsedge._reactor.loop import current_reactor
from tlsedge._reactor.relay import DetachedRelays, _Flow, relay, set_abortive_close
from tlsedge._tls.stream import TLSStream

MIB = 1 << 20
# Generous hang guard for real-socket tests; only trips if something hangs.
HANG_GUARD = 60.0
# The same in virtual time (autojump_clock), past the longest test's course.
VIRTUAL_HANG_GUARD = 3600.0


# -- helpers ------------------------------------------------------------------


async def tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    try:
        connecting = await trio.testing.open_stream_to_socket_listener(listeners[0])
        accepted = await listeners[0].accept()
    finally:
        for listener in listeners:
            await listener.aclose()
    assert isinstance(connecting, trio.SocketStream)
    assert isinstance(accepted, trio.SocketStream)
    return connecting, accepted


@dataclass
class Wiring:
    """client_peer <-> relay_client ==relay== relay_server <-> server_peer."""

    client_peer: trio.SocketStream
    relay_client: trio.SocketStream
    relay_server: trio.SocketStream
    server_peer: trio.SocketStream
    stats: RelayStats = field(default_factory=RelayStats)

    async def run_relay(
        self,
        idle_timeout: float = 3600.0,
        client_fin_timeout: float = 3600.0,
        server_fin_timeout: float = 3600.0,
    ) -> None:
        """Relay, then close both relay streams like the server's handler does."""
        try:
            await relay(
                self.relay_client,
                self.relay_server,
                stats=self.stats,
                idle_timeout=idle_timeout,
                client_fin_timeout=client_fin_timeout,
                server_fin_timeout=server_fin_timeout,
            )
        finally:
            await trio.aclose_forcefully(self.relay_client)
            await trio.aclose_forcefully(self.relay_server)

    async def aclose(self) -> None:
        for stream in (
            self.client_peer,
            self.relay_client,
            self.relay_server,
            self.server_peer,
        ):
            await trio.aclose_forcefully(stream)


@asynccontextmanager
async def tcp_wiring() -> AsyncIterator[Wiring]:
    """Loopback TCP on both sides: real FIN and RST."""
    client_peer, relay_client = await tcp_pair()
    relay_server, server_peer = await tcp_pair()
    wiring = Wiring(client_peer, relay_client, relay_server, server_peer)
    try:
        yield wiring
    finally:
        await wiring.aclose()


def unix_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    near, far = trio.socket.socketpair()
    return trio.SocketStream(near), trio.SocketStream(far)


@asynccontextmanager
async def unix_wiring() -> AsyncIterator[Wiring]:
    """``socketpair()`` on both sides: the kernel has delivered a send when it
    returns, so virtual time (``autojump_clock``) only jumps when nothing is in
    flight. No RST (AF_UNIX has none); the timeout tests use it."""
    client_peer, relay_client = unix_pair()
    relay_server, server_peer = unix_pair()
    wiring = Wiring(client_peer, relay_client, relay_server, server_peer)
    try:
        yield wiring
    finally:
        await wiring.aclose()


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


async def receive_all(stream: trio.abc.ReceiveStream) -> bytes:
    """Everything until EOF."""
    chunks = []
    while chunk := await stream.receive_some():
        chunks.append(chunk)
    return b"".join(chunks)


async def send_then_eof(stream: trio.abc.HalfCloseableStream, data: bytes) -> None:
    # Several send_all calls so the data spans many chunks on the wire.
    for start in range(0, len(data), 3 * 65536 + 17):
        await stream.send_all(data[start : start + 3 * 65536 + 17])
    await stream.send_eof()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def all_task_names() -> list[str]:
    names = []
    root = trio.lowlevel.current_root_task()
    assert root is not None
    stack = [root]
    while stack:
        task = stack.pop()
        names.append(task.name)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return names


def _stdlib_tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        near = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
    return near, far


async def test_relay_pumps_over_the_callers_sockets_and_leaves_them_attached() -> None:
    """With ``sockets``, relay() uses the caller's stdlib sockets and never
    detaches them: the caller's streams still own their descriptors after."""
    client_peer_raw, relay_client_raw = _stdlib_tcp_pair()
    relay_server_raw, server_peer_raw = _stdlib_tcp_pair()
    streams = [
        trio.SocketStream(trio.socket.from_stdlib_socket(raw))
        for raw in (
            client_peer_raw,
            relay_client_raw,
            relay_server_raw,
            server_peer_raw,
        )
    ]
    client_peer, relay_client, relay_server, server_peer = streams
    stats = RelayStats()
    got: dict[str, bytes] = {}
    try:
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:

                async def server_side() -> None:
                    got["server"] = await receive_all(server_peer)
                    await send_then_eof(server_peer, b"pong")

                nursery.start_soon(server_side)
                await send_then_eof(client_peer, b"ping")
                await relay(
                    relay_client,
                    relay_server,
                    stats=stats,
                    idle_timeout=3600.0,
                    client_fin_timeout=3600.0,
                    server_fin_timeout=3600.0,
                    sockets=(relay_client_raw, relay_server_raw),
                )
                got["client"] = await receive_all(client_peer)
        assert got == {"server": b"ping", "client": b"pong"}
        assert (stats.bytes_from_client, stats.bytes_from_server) == (4, 4)
        assert relay_client_raw.fileno() == relay_client.socket.fileno() != -1
        assert relay_server_raw.fileno() == relay_server.socket.fileno() != -1
    finally:
        for stream in streams:
            await trio.aclose_forcefully(stream)


async def test_a_tls_side_over_a_stdlib_socket_is_relayed_on_that_socket() -> None:
    """The client's TLS stream made over the accepted socket (as a handshake
    on the reactor leaves it): relayed both ways with the half-close, on
    that socket, which the relay neither closes nor detaches."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("relay.test").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    client_peer_raw, edge_raw = _stdlib_tcp_pair()
    edge_up_raw, server_peer_raw = _stdlib_tcp_pair()
    edge_raw.setblocking(False)
    edge_up_raw.setblocking(False)
    client_peer = TLSStream(
        trio.SocketStream(trio.socket.from_stdlib_socket(client_peer_raw)),
        client_context,
        server_side=False,
        server_hostname="relay.test",
    )
    edge_tls = TLSStream(edge_raw, server_context, server_side=True)
    server_peer = trio.SocketStream(trio.socket.from_stdlib_socket(server_peer_raw))
    relays = DetachedRelays()
    stats = RelayStats()
    got: dict[str, bytes] = {}
    try:
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client_peer.do_handshake)
                await edge_tls.do_handshake()
            # The handshake waited on the socket through a trio transport
            # made on demand; the relay then drives the socket itself.
            ended = trio.Event()
            relays.start(
                edge_tls,
                edge_up_raw,
                stats=stats,
                idle_timeout=3600.0,
                client_fin_timeout=3600.0,
                server_fin_timeout=3600.0,
                on_done=ended.set,
            )
            async with trio.open_nursery() as nursery:

                async def server_side() -> None:
                    got["server"] = await receive_all(server_peer)
                    await send_then_eof(server_peer, b"pong" * 5000)

                nursery.start_soon(server_side)
                await send_then_eof(client_peer, b"ping" * 5000)
                got["client"] = await receive_all(client_peer)
            await ended.wait()
        assert got == {"server": b"ping" * 5000, "client": b"pong" * 5000}
        assert stats.termination == Termination.CLIENT_CLOSED
        assert edge_raw.fileno() != -1  # the relay never closes or detaches it
    finally:
        for stream in (client_peer, server_peer):
            await trio.aclose_forcefully(stream)
        edge_raw.close()
        edge_up_raw.close()


async def test_an_aborted_tls_side_over_a_stdlib_socket_closes_with_an_rst() -> None:
    """An RST from the server side: both sockets, the TLS side's included,
    are set to close with an RST (the relay has no trio stream to follow)."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("relay.test").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    client_peer_raw, edge_raw = _stdlib_tcp_pair()
    edge_up_raw, server_peer_raw = _stdlib_tcp_pair()
    edge_raw.setblocking(False)
    edge_up_raw.setblocking(False)
    client_peer = TLSStream(
        trio.SocketStream(trio.socket.from_stdlib_socket(client_peer_raw)),
        client_context,
        server_side=False,
        server_hostname="relay.test",
    )
    edge_tls = TLSStream(edge_raw, server_context, server_side=True)
    relays = DetachedRelays()
    stats = RelayStats()
    try:
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client_peer.do_handshake)
                await edge_tls.do_handshake()
            ended = trio.Event()
            relays.start(
                edge_tls,
                edge_up_raw,
                stats=stats,
                idle_timeout=3600.0,
                client_fin_timeout=3600.0,
                server_fin_timeout=3600.0,
                on_done=ended.set,
            )
            set_abortive_close(server_peer_raw)
            server_peer_raw.close()
            await ended.wait()
        assert stats.termination == Termination.SERVER_ERROR
        for raw in (edge_raw, edge_up_raw):
            linger = raw.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)
            assert struct.unpack("ii", linger) == (1, 0)
    finally:
        await trio.aclose_forcefully(client_peer)
        edge_raw.close()
        edge_up_raw.close()


class _RecordingPoller:
    """The reactor's selector, with a log of the descriptors unregistered."""

    def __init__(self, poller: Any) -> None:
        self._poller = poller
        self.unregistered: list[int] = []

    def unregister(self, fd: int) -> None:
        self.unregistered.append(fd)
        self._poller.unregister(fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._poller, name)


@pytest.mark.parametrize("closed_at_end", [True, False])
async def test_a_detached_relay_closed_at_end_leaves_the_last_fin_to_the_close(
    closed_at_end: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``closed_at_end`` (the owner closes both sockets in on_done), the
    last EOF is not ``shutdown``: it goes with the close, as a FIN, and the
    closed descriptors leave the selector without an ``epoll_ctl``."""
    client_peer, relay_client = _stdlib_tcp_pair()
    relay_server, server_peer = _stdlib_tcp_pair()
    for sock in (relay_client, relay_server):
        sock.setblocking(False)
    reactor = current_reactor()
    poller = _RecordingPoller(reactor._poller)
    monkeypatch.setattr(reactor, "_poller", poller)
    ends = (relay_client.fileno(), relay_server.fileno())
    seen_at_end: list[bytes | None] = []
    ended = trio.Event()

    def on_done() -> None:
        # The server's EOF came first: the client got its FIN by shutdown;
        # the server's comes now, with the close (or came by shutdown).
        try:
            seen_at_end.append(server_peer.recv(100, socket.MSG_DONTWAIT))
        except BlockingIOError:
            seen_at_end.append(None)
        relay_client.close()
        relay_server.close()
        ended.set()

    relays = DetachedRelays()
    stats = RelayStats()
    try:
        relays.start(
            relay_client,
            relay_server,
            stats=stats,
            idle_timeout=3600.0,
            client_fin_timeout=3600.0,
            server_fin_timeout=3600.0,
            on_done=on_done,
            closed_at_end=closed_at_end,
        )
        with trio.fail_after(HANG_GUARD):
            server_peer.sendall(b"pong")
            server_peer.shutdown(socket.SHUT_WR)
            await trio.to_thread.run_sync(client_peer.recv, 100)  # b"pong"
            assert await trio.to_thread.run_sync(client_peer.recv, 100) == b""
            client_peer.shutdown(socket.SHUT_WR)
            await ended.wait()
            assert await trio.to_thread.run_sync(server_peer.recv, 100) == b""
    finally:
        for sock in (client_peer, relay_client, relay_server, server_peer):
            sock.close()
    assert stats.termination is Termination.SERVER_CLOSED
    if closed_at_end:
        assert seen_at_end == [None]  # no FIN before the close
        assert ends[0] not in poller.unregistered  # the close took it out
    else:
        assert seen_at_end == [b""]
        assert ends[0] in poller.unregistered


async def test_a_detached_relay_closed_at_end_sends_eofs_of_one_batch_by_the_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both EOFs ready at once (the usual end of a request): the first one's
    FIN waits for the end of the reactor's batch, where the relay has ended,
    so both go with the closes: no ``shutdown`` (neither peer has a FIN when
    the relay ends), no ``epoll_ctl`` to unregister, no fin timer, no RST."""
    client_peer, relay_client = _stdlib_tcp_pair()
    relay_server, server_peer = _stdlib_tcp_pair()
    for sock in (relay_client, relay_server):
        sock.setblocking(False)
    reactor = current_reactor()
    poller = _RecordingPoller(reactor._poller)
    monkeypatch.setattr(reactor, "_poller", poller)
    seen_at_end: list[bytes | None] = []
    ended = trio.Event()

    def on_done() -> None:
        for peer in (client_peer, server_peer):
            try:
                seen_at_end.append(peer.recv(100, socket.MSG_DONTWAIT))
            except BlockingIOError:
                seen_at_end.append(None)
        relay_client.close()
        relay_server.close()
        ended.set()

    stats = RelayStats()
    try:
        DetachedRelays().start(
            relay_client,
            relay_server,
            stats=stats,
            idle_timeout=3600.0,
            client_fin_timeout=1800.0,  # earlier than the idle timer
            server_fin_timeout=1800.0,
            on_done=on_done,
            closed_at_end=True,
        )
        timers = len(reactor._timers)  # the idle timer's
        with trio.fail_after(HANG_GUARD):
            # No checkpoint between them: the reactor sees both at once.
            server_peer.shutdown(socket.SHUT_WR)
            client_peer.shutdown(socket.SHUT_WR)
            await ended.wait()
            for peer in (client_peer, server_peer):
                assert await trio.to_thread.run_sync(peer.recv, 100) == b""
    finally:
        for sock in (client_peer, relay_client, relay_server, server_peer):
            sock.close()
    assert seen_at_end == [None, None]
    assert poller.unregistered == []
    assert len(reactor._timers) == timers  # no fin timer armed for nothing
    assert stats.termination in {Termination.CLIENT_CLOSED, Termination.SERVER_CLOSED}


async def test_an_ended_relay_is_not_kept_alive_by_its_timers() -> None:
    """The reactor's timer heap keeps a relay's idle timer until its deadline
    (60 s by default); the relay itself, with its streams and buffers, must
    be let go when it ends."""
    client_peer, relay_client = _stdlib_tcp_pair()
    relay_server, server_peer = _stdlib_tcp_pair()
    for sock in (relay_client, relay_server):
        sock.setblocking(False)
    stats = RelayStats()
    ended = trio.Event()
    try:
        DetachedRelays().start(
            relay_client,
            relay_server,
            stats=stats,
            idle_timeout=3600.0,
            client_fin_timeout=3600.0,
            server_fin_timeout=3600.0,
            on_done=ended.set,
        )
        client_peer.shutdown(socket.SHUT_WR)
        server_peer.shutdown(socket.SHUT_WR)
        with trio.fail_after(HANG_GUARD):
            await ended.wait()
    finally:
        for sock in (client_peer, relay_client, relay_server, server_peer):
            sock.close()
    gc.collect()
    assert not [
        flow
        for flow in gc.get_objects()
        if isinstance(flow, _Flow) and flow.stats is stats
    ]


# -- half-close matrix over real loopback TCP ---------------------------------


async def test_client_fin_first_server_sends_8mib_after() -> None:
    response = payload(8 * MIB, 1)
    got: dict[str, bytes] = {}
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            nursery.start_soon(w.run_relay)

            async def client() -> None:
                await send_then_eof(w.client_peer, b"request")
                got["client"] = await receive_all(w.client_peer)

            async def server() -> None:
                got["server"] = await receive_all(w.server_peer)
                # Only now, with the client's FIN seen, does the server answer.
                await send_then_eof(w.server_peer, response)

            nursery.start_soon(client)
            nursery.start_soon(server)
    assert got["server"] == b"request"
    assert sha(got["client"]) == sha(response)
    assert w.stats.termination is Termination.CLIENT_CLOSED
    assert w.stats.bytes_from_client == len(b"request")
    assert w.stats.bytes_from_server == len(response)


async def test_server_fin_first_client_sends_8mib_after() -> None:
    upload = payload(8 * MIB, 2)
    got: dict[str, bytes] = {}
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            nursery.start_soon(w.run_relay)

            async def server() -> None:
                await send_then_eof(w.server_peer, b"banner")
                got["server"] = await receive_all(w.server_peer)

            async def client() -> None:
                got["client"] = await receive_all(w.client_peer)
                await send_then_eof(w.client_peer, upload)

            nursery.start_soon(client)
            nursery.start_soon(server)
    assert got["client"] == b"banner"
    assert sha(got["server"]) == sha(upload)
    assert w.stats.termination is Termination.SERVER_CLOSED
    assert w.stats.bytes_from_client == len(upload)
    assert w.stats.bytes_from_server == len(b"banner")


@pytest.mark.parametrize("size", [5, 8 * MIB])
async def test_both_fin_at_once_with_data_in_flight(size: int) -> None:
    upload, download = payload(size, 3), payload(size, 4)
    got: dict[str, bytes] = {}
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            nursery.start_soon(w.run_relay)

            async def collect(name: str, stream: trio.abc.ReceiveStream) -> None:
                got[name] = await receive_all(stream)

            nursery.start_soon(send_then_eof, w.client_peer, upload)
            nursery.start_soon(send_then_eof, w.server_peer, download)
            nursery.start_soon(collect, "client", w.client_peer)
            nursery.start_soon(collect, "server", w.server_peer)
    assert sha(got["server"]) == sha(upload)
    assert sha(got["client"]) == sha(download)
    assert w.stats.termination in {Termination.CLIENT_CLOSED, Termination.SERVER_CLOSED}
    assert w.stats.bytes_from_client == size
    assert w.stats.bytes_from_server == size


# -- RST / errors ---------------------------------------------------------------


async def _blast(
    stream: trio.abc.SendStream, outcome: dict[str, str], key: str
) -> None:
    chunk = b"z" * 65536
    try:
        while True:
            await stream.send_all(chunk)
    except trio.BrokenResourceError:
        outcome[key] = "broken"


async def _drain(
    stream: trio.abc.ReceiveStream, outcome: dict[str, str], key: str
) -> None:
    try:
        while await stream.receive_some():
            pass
    except trio.BrokenResourceError:
        outcome[key] = "broken"
    else:
        outcome[key] = "eof"


@pytest.mark.parametrize("resetting", ["server", "client"])
@pytest.mark.parametrize("flow", ["toward_survivor", "toward_resetter"])
async def test_rst_mid_transfer_aborts_both_sides(resetting: str, flow: str) -> None:
    # A socket reports an RST's error only once, so the survivor uses exactly one
    # task on its socket: the one that observes the abort.
    outcome: dict[str, str] = {}
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w:
            if resetting == "server":
                resetter, survivor = w.server_peer, w.client_peer
            else:
                resetter, survivor = w.client_peer, w.server_peer
            async with trio.open_nursery() as nursery:
                nursery.start_soon(w.run_relay)
                if flow == "toward_survivor":
                    nursery.start_soon(_drain, survivor, outcome, "survivor")
                    for _ in range(16):
                        await resetter.send_all(b"r" * 65536)
                else:
                    nursery.start_soon(_blast, survivor, outcome, "survivor")
                    received = 0
                    while received < MIB:
                        received += len(await resetter.receive_some())
                set_abortive_close(resetter)
                await resetter.aclose()
    expected = (
        Termination.SERVER_ERROR if resetting == "server" else Termination.CLIENT_ERROR
    )
    assert w.stats.termination is expected
    # The survivor saw an abort (RST), never a clean FIN.
    assert outcome == {"survivor": "broken"}


@pytest.mark.parametrize("resetting", ["server", "client"])
async def test_an_rst_from_an_idle_side_is_blamed_on_it(resetting: str) -> None:
    """Nothing in flight: the relay's read of the reset side fails, that side
    is blamed, and the other peer gets an RST too."""
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            if resetting == "server":
                resetter, survivor = w.server_peer, w.client_peer
            else:
                resetter, survivor = w.client_peer, w.server_peer
            nursery.start_soon(w.run_relay)
            set_abortive_close(resetter)
            await resetter.aclose()
            with pytest.raises(trio.BrokenResourceError):
                await survivor.receive_some()
    expected = (
        Termination.SERVER_ERROR if resetting == "server" else Termination.CLIENT_ERROR
    )
    assert w.stats.termination is expected


def test_set_abortive_close_follows_transport_stream() -> None:
    a, b = socket.socketpair()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with a, b:
        inner = trio.SocketStream(trio.socket.from_stdlib_socket(a))
        tls = TLSStream(inner, context, server_side=True)
        set_abortive_close(trio.SSLStream(tls, context, server_side=True))
        assert struct.unpack(
            "ii", a.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)
        ) == (
            1,
            0,
        )
    # No socket anywhere, or an already-closed one: silently nothing.
    set_abortive_close(trio.testing.memory_stream_pair()[0])
    set_abortive_close(inner)


def test_set_abortive_close_takes_a_stdlib_socket() -> None:
    """A reactor relay's side may be a plain socket (no stream around it)."""
    a, b = socket.socketpair()
    with a, b:
        set_abortive_close(a)
        linger = a.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)
        assert struct.unpack("ii", linger) == (1, 0)
    set_abortive_close(a)  # closed: silently nothing


# -- cancellation -----------------------------------------------------------------


async def test_cancel_from_outside_records_cancelled() -> None:
    current_reactor()  # runs for the whole run: not a task left behind
    await trio.testing.wait_all_tasks_blocked()  # its timer task started
    before = sorted(all_task_names())
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    stats = w.stats

                    async def run() -> None:
                        await relay(
                            w.relay_client,
                            w.relay_server,
                            stats=stats,
                            idle_timeout=3600,
                            client_fin_timeout=3600,
                            server_fin_timeout=3600,
                        )

                    nursery.start_soon(run)
                    nursery.start_soon(w.client_peer.send_all, b"a" * MIB)
                    received = 0
                    while received < MIB:
                        received += len(await w.server_peer.receive_some())
                    scope.cancel()
            assert scope.cancelled_caught
            assert w.stats.termination is Termination.DRAINED
            assert w.stats.bytes_from_client == MIB
            assert sorted(all_task_names()) == before
            # Both streams are still usable and closable by the caller.
            await w.relay_client.aclose()
            await w.relay_server.aclose()
            assert await w.client_peer.receive_some() == b""


# -- timeouts (socketpair, virtual time) --------------------------------------------


async def test_idle_timeout_fires(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w:
            start = trio.current_time()
            await w.run_relay(
                idle_timeout=10, client_fin_timeout=1, server_fin_timeout=1
            )
    assert w.stats.termination is Termination.IDLE_TIMEOUT
    assert trio.current_time() - start == pytest.approx(10)


async def test_idle_timeout_not_fired_while_bytes_flow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w, trio.open_nursery() as nursery:
            nursery.start_soon(w.run_relay, 10.0)

            async def client() -> None:
                for _ in range(6):  # 36 s in total, never 10 s of silence
                    await trio.sleep(6)
                    await w.client_peer.send_all(b"x")
                await w.client_peer.send_eof()

            async def server() -> None:
                assert await receive_all(w.server_peer) == b"x" * 6
                await w.server_peer.send_eof()

            nursery.start_soon(client)
            nursery.start_soon(server)
    assert w.stats.termination is Termination.CLIENT_CLOSED


async def test_server_fin_timeout_fires(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w, trio.open_nursery() as nursery:
            start = trio.current_time()
            nursery.start_soon(w.run_relay, 100.0, 50.0, 5.0)
            await w.client_peer.send_eof()  # the server just sits there
    assert w.stats.termination is Termination.SERVER_FIN_TIMEOUT
    assert trio.current_time() - start == pytest.approx(5)


async def test_client_fin_timeout_fires(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w:
            async with trio.open_nursery() as nursery:
                start = trio.current_time()
                nursery.start_soon(w.run_relay, 100.0, 7.0, 50.0)
                await w.server_peer.send_all(b"bye")
                await w.server_peer.send_eof()  # the client just sits there
            assert w.stats.termination is Termination.CLIENT_FIN_TIMEOUT
            assert trio.current_time() - start == pytest.approx(7)
            assert await receive_all(w.client_peer) == b"bye"


async def test_a_fin_put_off_to_the_batch_end_arms_the_fin_timer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A detached relay closed at its end forwards a lone first EOF at the
    end of the reactor's batch; the fin timer is armed there and fires."""
    client_peer, relay_client = socket.socketpair()
    relay_server, server_peer = socket.socketpair()
    for sock in (relay_client, relay_server):
        sock.setblocking(False)
    stats = RelayStats()
    ended = trio.Event()
    try:
        start = trio.current_time()
        DetachedRelays().start(
            relay_client,
            relay_server,
            stats=stats,
            idle_timeout=100.0,
            client_fin_timeout=7.0,
            server_fin_timeout=50.0,
            on_done=ended.set,
            closed_at_end=True,
        )
        with trio.fail_after(VIRTUAL_HANG_GUARD):
            server_peer.sendall(b"bye")
            server_peer.shutdown(socket.SHUT_WR)  # the client just sits there
            await ended.wait()
        assert stats.termination is Termination.CLIENT_FIN_TIMEOUT
        assert trio.current_time() - start == pytest.approx(7)
        client_peer.setblocking(False)
        assert client_peer.recv(100) == b"bye"
        assert client_peer.recv(100) == b""  # the FIN went before the timeout
    finally:
        for sock in (client_peer, relay_client, relay_server, server_peer):
            sock.close()


@pytest.mark.parametrize("first", ["client", "server"])
async def test_fin_timeout_not_fired_when_peer_finishes_in_time(
    autojump_clock: trio.testing.MockClock, first: str
) -> None:
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w, trio.open_nursery() as nursery:
            early, late = (
                (w.client_peer, w.server_peer)
                if first == "client"
                else (w.server_peer, w.client_peer)
            )
            nursery.start_soon(w.run_relay, 100.0, 5.0, 5.0)
            await early.send_eof()
            assert await late.receive_some() == b""
            await trio.sleep(4.9)
            await late.send_all(b"late but in time")
            await late.send_eof()
            assert await receive_all(early) == b"late but in time"
    expected = (
        Termination.CLIENT_CLOSED if first == "client" else Termination.SERVER_CLOSED
    )
    assert w.stats.termination is expected


async def test_timeout_validation() -> None:
    async with unix_wiring() as w:
        for bad in ({"idle_timeout": -1.0}, {"server_fin_timeout": float("nan")}):
            with pytest.raises(ValueError, match="must be >= 0"):
                await w.run_relay(**bad)
    async with unix_wiring() as w:
        with pytest.raises(ValueError, match="buffer_size"):
            await relay(
                w.relay_client,
                w.relay_server,
                stats=w.stats,
                idle_timeout=1,
                client_fin_timeout=1,
                server_fin_timeout=1,
                buffer_size=0,
            )


# -- what the reactor cannot drive ---------------------------------------------------


async def test_relay_refuses_a_stream_the_reactor_cannot_drive() -> None:
    """A side that is not socket-backed (here: a memory stream, a TLSStream
    before its handshake) is refused before anything starts: no task, no
    registration, and a socket-backed other side left as it was."""
    reactor = current_reactor()
    await trio.testing.wait_all_tasks_blocked()  # its timer task started
    before = sorted(all_task_names())
    memory, _ = trio.testing.memory_stream_pair()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    async with tcp_wiring() as w:
        unshaken = TLSStream(w.relay_server, context, server_side=True)
        for server, seen in (
            (memory, "got StapledStream"),
            (unshaken, "got a TLSStream whose handshake is not done"),
        ):
            with pytest.raises(TypeError, match="server side must be a trio") as err:
                await relay(
                    w.relay_client,
                    server,
                    stats=w.stats,
                    idle_timeout=1,
                    client_fin_timeout=1,
                    server_fin_timeout=1,
                )
            assert seen in str(err.value)
        assert w.stats == RelayStats()
        assert sorted(all_task_names()) == before
        assert not reactor._handlers
        assert not reactor._timers
        # The client side's socket (a stdlib object was built on it) still
        # belongs to its stream.
        await w.client_peer.send_all(b"ping")
        assert await w.relay_client.receive_some() == b"ping"


# -- property: any chunking, any FIN order, over real sockets ------------------------

schedules = st.lists(
    st.tuples(st.integers(0, 4), st.integers(1, 200) | st.integers(201, 8192)),
    max_size=6,
)
"""One side's writes: (checkpoints to wait first, bytes to send)."""


@dataclass
class Scenario:
    client_sends: list[tuple[int, int]]
    server_sends: list[tuple[int, int]]
    client_fin_delay: int
    server_fin_delay: int
    receive_sizes: tuple[int, int]
    buffer_size: int
    transport: str
    small_kernel_buffers: bool


scenarios = st.builds(
    Scenario,
    client_sends=schedules,
    server_sends=schedules,
    client_fin_delay=st.integers(0, 6),
    server_fin_delay=st.integers(0, 6),
    receive_sizes=st.tuples(st.integers(256, 65536), st.integers(256, 65536)),
    buffer_size=st.integers(1, 256) | st.integers(257, 65536),
    transport=st.sampled_from(["tcp", "unix"]),
    small_kernel_buffers=st.booleans(),
)
"""Both sides' writes, receive sizes, relay buffer, socket kind, and whether
the kernel's buffers toward the peers are at their smallest (the relay then
often holds bytes a destination did not take: backpressure)."""


@given(scenario=scenarios)
async def test_relay_property(scenario: Scenario) -> None:
    client_sends = [
        (delay, payload(size, 2 * i))
        for i, (delay, size) in enumerate(scenario.client_sends)
    ]
    server_sends = [
        (delay, payload(size, 2 * i + 1))
        for i, (delay, size) in enumerate(scenario.server_sends)
    ]
    receive_sizes = scenario.receive_sizes
    got: dict[str, bytes] = {}

    async def sender(
        stream: trio.SocketStream, sends: list[tuple[int, bytes]], fin_delay: int
    ) -> None:
        for delay, data in sends:
            for _ in range(delay):
                await trio.lowlevel.checkpoint()
            await stream.send_all(data)
        for _ in range(fin_delay):
            await trio.lowlevel.checkpoint()
        await stream.send_eof()

    async def receiver(name: str, stream: trio.SocketStream, size: int) -> None:
        chunks = []
        while chunk := await stream.receive_some(size):
            chunks.append(chunk)
        got[name] = b"".join(chunks)

    wiring = tcp_wiring() if scenario.transport == "tcp" else unix_wiring()
    with trio.fail_after(HANG_GUARD):
        async with wiring as w, trio.open_nursery() as nursery:
            if scenario.small_kernel_buffers:
                # Toward the peers only: the relay reads large chunks and
                # its destination takes them a little at a time.
                for relay_side in (w.relay_client, w.relay_server):
                    relay_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
                for peer in (w.client_peer, w.server_peer):
                    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)

            async def run_relay() -> None:
                await relay(
                    w.relay_client,
                    w.relay_server,
                    stats=w.stats,
                    idle_timeout=3600,
                    client_fin_timeout=3600,
                    server_fin_timeout=3600,
                    buffer_size=scenario.buffer_size,
                )

            nursery.start_soon(run_relay)
            nursery.start_soon(
                sender, w.client_peer, client_sends, scenario.client_fin_delay
            )
            nursery.start_soon(
                sender, w.server_peer, server_sends, scenario.server_fin_delay
            )
            nursery.start_soon(receiver, "server", w.server_peer, receive_sizes[0])
            nursery.start_soon(receiver, "client", w.client_peer, receive_sizes[1])
    upload = b"".join(data for _, data in client_sends)
    download = b"".join(data for _, data in server_sends)
    # In order, nothing lost, and EOF only after the last byte (receiver stops at b"").
    assert got == {"server": upload, "client": download}
    assert w.stats.bytes_from_client == len(upload)
    assert w.stats.bytes_from_server == len(download)
    assert w.stats.termination in {
        Termination.CLIENT_CLOSED,
        Termination.SERVER_CLOSED,
    }


# -- fin timeouts are inactivity timers in the half-closed state -------------------


async def test_server_fin_timeout_is_inactivity_not_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The client half-closes; the server streams slowly but steadily for 40 s in
    # total, far longer than server_fin_timeout, with gaps shorter than it.
    got: dict[str, bytes] = {}
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w, trio.open_nursery() as nursery:
            nursery.start_soon(w.run_relay, 100.0, 50.0, 5.0)

            async def client() -> None:
                await send_then_eof(w.client_peer, b"GET")
                got["client"] = await receive_all(w.client_peer)

            async def server() -> None:
                got["server"] = await receive_all(w.server_peer)
                for i in range(10):
                    await trio.sleep(4)
                    await w.server_peer.send_all(b"%d" % i)
                await w.server_peer.send_eof()

            nursery.start_soon(client)
            nursery.start_soon(server)
    assert got == {"server": b"GET", "client": b"0123456789"}
    # The client's EOF came first (the module's naming rule).
    assert w.stats.termination is Termination.CLIENT_CLOSED


async def test_server_fin_timeout_counts_from_last_progress(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(w.run_relay, 100.0, 50.0, 5.0)
                await w.client_peer.send_eof()
                assert await w.server_peer.receive_some() == b""
                for _ in range(3):
                    await trio.sleep(4)
                    await w.server_peer.send_all(b"x")
                stalled = trio.current_time()  # ...then the server stalls
            assert w.stats.termination is Termination.SERVER_FIN_TIMEOUT
            assert trio.current_time() - stalled == pytest.approx(5)
            assert await receive_all(w.client_peer) == b"xxx"


async def test_client_fin_timeout_is_inactivity_not_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(w.run_relay, 100.0, 5.0, 50.0)
                await w.server_peer.send_eof()
                assert await w.client_peer.receive_some() == b""
                for _ in range(10):  # 30 s of a slow upload after the server finished
                    await trio.sleep(3)
                    await w.client_peer.send_all(b"u")
                stalled = trio.current_time()
            assert w.stats.termination is Termination.CLIENT_FIN_TIMEOUT
            assert trio.current_time() - stalled == pytest.approx(5)
            assert await receive_all(w.server_peer) == b"u" * 10


async def test_slow_reader_progress_keeps_the_fin_timer_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The server sends everything at once; the *client* reads slowly, so the relay
    # is stuck writing, not reading. Each piece the client takes is progress.
    download = payload(8 * 65536, 7)
    got = bytearray()
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w, trio.open_nursery() as nursery:
            # A small send buffer toward the client: the relay holds most of the
            # download and reads the server again only once the client took it
            # all, far more than server_fin_timeout later.
            w.relay_client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            nursery.start_soon(w.run_relay, 100.0, 50.0, 5.0)
            await w.client_peer.send_eof()
            nursery.start_soon(send_then_eof, w.server_peer, download)
            while chunk := await w.client_peer.receive_some(65536):
                got += chunk
                await trio.sleep(3)  # never 5 s without progress
    assert sha(bytes(got)) == sha(download)
    assert w.stats.termination is Termination.CLIENT_CLOSED


async def test_idle_timeout_still_applies_when_half_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(VIRTUAL_HANG_GUARD):
        async with unix_wiring() as w, trio.open_nursery() as nursery:
            start = trio.current_time()
            nursery.start_soon(w.run_relay, 3.0, 50.0, 50.0)
            await w.client_peer.send_eof()
    assert w.stats.termination is Termination.IDLE_TIMEOUT
    assert trio.current_time() - start == pytest.approx(3)


# -- buffers -------------------------------------------------------------------------


@pytest.mark.parametrize("buffer_size", [7, 16384, 20000, 262144])
async def test_any_buffer_size(buffer_size: int) -> None:
    # Tiny (many reads per wake-up), a TLS record, above it, and the default:
    # nothing is lost or reordered. The tiny buffer moves 7 bytes per read:
    # a smaller load keeps it to a second.
    scale = 16 if buffer_size < 1024 else 1
    upload = payload(MIB // 2 // scale, 8)
    download = payload(3 * MIB // scale, 9)
    got: dict[str, bytes] = {}
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:

            async def run() -> None:
                try:
                    await relay(
                        w.relay_client,
                        w.relay_server,
                        stats=w.stats,
                        idle_timeout=3600,
                        client_fin_timeout=3600,
                        server_fin_timeout=3600,
                        buffer_size=buffer_size,
                    )
                finally:
                    await trio.aclose_forcefully(w.relay_client)
                    await trio.aclose_forcefully(w.relay_server)

            async def collect(name: str, stream: trio.abc.ReceiveStream) -> None:
                got[name] = await receive_all(stream)

            nursery.start_soon(run)
            nursery.start_soon(send_then_eof, w.client_peer, upload)
            nursery.start_soon(send_then_eof, w.server_peer, download)
            nursery.start_soon(collect, "client", w.client_peer)
            nursery.start_soon(collect, "server", w.server_peer)
    assert sha(got["server"]) == sha(upload)
    assert sha(got["client"]) == sha(download)
    assert w.stats.bytes_from_client == len(upload)
    assert w.stats.bytes_from_server == len(download)


async def test_relay_tasks() -> None:
    # The reactor drives the sockets: the caller's task waits, and the relay
    # has no task of its own (its timer is the reactor's).
    current_reactor()
    await trio.testing.wait_all_tasks_blocked()  # its timer task started
    before = len(all_task_names())
    with trio.fail_after(HANG_GUARD):
        async with tcp_wiring() as w, trio.open_nursery() as nursery:
            nursery.start_soon(w.run_relay)
            await w.client_peer.send_all(b"ping")
            assert await w.server_peer.receive_some() == b"ping"
            added = len(all_task_names()) - before
            await w.client_peer.send_eof()
            await w.server_peer.send_eof()
    assert added == 1  # run_relay itself
