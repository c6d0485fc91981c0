"""Stateful test of relay()'s half-close state machine over real kernel TCP sockets.

Hypothesis drives two peers, a client and a server, each one end of a loopback TCP
connection whose other end is handed to :func:`tlsedge._reactor.relay.relay`.
The peers are plain blocking stdlib sockets used from the test's thread; the relay
runs in its own ``trio.run`` in a helper thread with a
:class:`trio.testing.MockClock` that only moves when a rule makes time pass, so the
idle and fin timers are deterministic.

After every step the ``relay_matches_model`` invariant waits until the relay has
*settled* into the state the model predicts, and fails if it reaches a different
one: the bytes each side sent have all been received by the relay (its
``RelayStats`` counters), exactly the peers that should have seen a FIN or an RST
from the relay have (the kernel's TCP state), and the relay has returned exactly
when it should, with the expected ``Termination``. Reads check the bytes arrive in
order and exactly once, and that a peer sees a clean EOF or a reset exactly as the
rules of ``_relay.py``'s docstring say:

* a FIN is forwarded as soon as every byte before it was delivered (the reader gets
  the bytes, then EOF), the other direction keeps flowing, and the relay returns when
  both directions ended, as ``CLIENT_CLOSED``/``SERVER_CLOSED`` after whichever EOF
  came first;
* an RST from a side the relay is still reading ends the relay (``*_ERROR``) and the
  other side gets an RST after the bytes already delivered, never a clean EOF
  (unless it had already received a FIN, which stays a clean end of that direction);
* an RST from a side whose direction had already ended is only noticed when the
  relay next writes to it (documented: a side with nothing left to do is no longer
  watched);
* ``idle_timeout`` and the fin timers (inactivity of the half-closed state) fire at
  exactly the model's deadline, and the relay's sockets then close with an RST, as
  after an error (a peer that already got a forwarded FIN keeps its clean EOF).

The teardown drives every example to its end (shuts the live peers' write halves),
reads what is left, checks the counters and joins the relay's thread; the suite's
conftest checks that no descriptor or thread is left behind.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import functools
import hashlib
import os
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import trio
import trio.testing
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tlsedge._core.termination import RelayStats, Termination
from tlsedge._reactor.relay import relay

# Longest a settle or a blocking read may take before the test calls it a hang.
# Loopback delivery takes microseconds; this only matters when something is wrong.
SETTLE_TIMEOUT = 5.0
# A wrong state that has not changed for this long with the relay idle is final
# (keeps a failing example, and so shrinking, fast).
STUCK_AFTER = 0.2
# Bytes sent toward a peer and not yet read by it. Small enough that they always
# fit in the kernel's buffers, so no send ever blocks and the relay never waits for
# a writer (which would make its byte counts and fin timer depend on timing).
MAX_IN_FLIGHT = 48 * 1024
# Mock-clock timeouts are whole seconds so the model's arithmetic is exact.
IDLE_TIMEOUT = 100.0

_LINGER_ABORT = struct.pack("ii", 1, 0)
# TCP states (include/net/tcp_states.h) in which nothing ending the stream came in:
# ESTABLISHED, FIN_WAIT1, FIN_WAIT2. Any other state of a socket we have not closed
# means the relay's side sent a FIN or an RST.
_OPEN_STATES = frozenset({1, 4, 5})

Side = Literal["client", "server"]
_CLEAN = {Termination.CLIENT_CLOSED, Termination.SERVER_CLOSED}

F = TypeVar("F", bound=Callable[..., None])


# -- the relay under test, in its own trio run ------------------------------------


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair (real FIN and RST semantics)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        connecting = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    for sock in (connecting, accepted):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connecting, accepted


@dataclass
class RelayTimeouts:
    idle: float
    client_fin: float
    server_fin: float


class RelayThread:
    """relay() between two sockets, run by ``trio.run`` in a thread on a MockClock.

    ``done`` is set once relay() returned and both of its streams were closed the
    way tlsedge's handlers do (``aclose_forcefully``; after an error relay() has
    set them to close with an RST).
    """

    def __init__(
        self,
        client_sock: socket.socket,
        server_sock: socket.socket,
        *,
        buffer_size: int,
        timeouts: RelayTimeouts,
    ) -> None:
        self._client_sock = client_sock
        self._server_sock = server_sock
        self._buffer_size = buffer_size
        self._timeouts = timeouts
        self.clock = trio.testing.MockClock()  # rate 0: time moves only by jump()
        self.stats = RelayStats()
        self.done = threading.Event()
        self.crashed: BaseException | None = None
        self._started = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=self._run, name="relay-under-test")
        self._thread.start()
        if not self._started.wait(SETTLE_TIMEOUT):
            msg = f"relay thread did not start: {self.crashed!r}"
            raise AssertionError(msg)

    def _run(self) -> None:
        try:
            trio.run(self._main, clock=self.clock)
        except BaseException as exc:  # noqa: BLE001 (check_alive() reports it)
            self.crashed = exc
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        client = trio.SocketStream(trio.socket.from_stdlib_socket(self._client_sock))
        server = trio.SocketStream(trio.socket.from_stdlib_socket(self._server_sock))
        with trio.CancelScope() as self._scope:
            self._started.set()
            try:
                await relay(
                    client,
                    server,
                    stats=self.stats,
                    idle_timeout=self._timeouts.idle,
                    client_fin_timeout=self._timeouts.client_fin,
                    server_fin_timeout=self._timeouts.server_fin,
                    buffer_size=self._buffer_size,
                )
            finally:
                await trio.aclose_forcefully(client)
                await trio.aclose_forcefully(server)
            self.done.set()

    def check_alive(self) -> None:
        if self.crashed is not None:
            msg = f"relay() raised {self.crashed!r}"
            raise AssertionError(msg) from self.crashed

    def quiesce(self) -> None:
        """Return once every task in the relay's run is blocked (nothing to do)."""
        if self.done.is_set() or self._token is None:
            return
        # If relay() returns meanwhile, the run ends: before the call
        # (RunFinishedError) or while the waiting system task is cancelled.
        with contextlib.suppress(trio.RunFinishedError, trio.Cancelled):
            trio.from_thread.run(
                trio.testing.wait_all_tasks_blocked, 0.001, trio_token=self._token
            )

    def jump(self, seconds: float) -> None:
        """Move the relay's clock (and so its timers) forward."""
        if self._token is None:
            return
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(self.clock.jump, seconds, trio_token=self._token)

    def stop(self) -> None:
        """Cancel relay() if it still runs, wait for the thread, close the sockets."""
        if self._thread.is_alive() and self._token is not None:
            scope = self._scope
            if scope is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(scope.cancel, trio_token=self._token)
        self._thread.join(SETTLE_TIMEOUT)
        # Normally closed by the relay's own finally; idempotent otherwise.
        self._client_sock.close()
        self._server_sock.close()
        assert not self._thread.is_alive(), "relay thread did not end"


# -- the model ---------------------------------------------------------------------


def chunk(side: Side, offset: int, size: int) -> bytes:
    """Pseudo-random bytes keyed by direction and stream offset, so a lost,
    repeated or reordered chunk cannot go unnoticed."""
    return hashlib.shake_128(f"{side}:{offset}".encode()).digest(size)


@dataclass
class Peer:
    """One end the test drives, and what the model says it should see."""

    side: Side
    sock: socket.socket
    sent: int = 0  # bytes this peer sent toward the relay
    # How many of them the relay reads, as a range: exact, except that a write
    # error stops it after one chunk of a send.
    relay_received: tuple[int, int] = (0, 0)
    shut: bool = False  # shut its write half (sent FIN)
    reset: bool = False  # closed with an RST by the test; the socket is gone
    fin_from_relay: bool = False  # the relay forwarded the other side's FIN to it
    expected: bytearray = field(default_factory=bytearray)  # sent to it, unread
    saw_end: bool = False  # read its EOF / reset already

    @property
    def live(self) -> bool:
        return not self.reset

    def tcp_state(self) -> int:
        return self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]

    def unread(self) -> int:
        """Bytes waiting in the kernel's receive queue (SIOCINQ)."""
        count = array.array("i", [0])
        fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, count)
        return count[0]

    def read_exact(self, size: int) -> bytes:
        got = bytearray()
        while len(got) < size:
            try:
                data = self.sock.recv(size - len(got))
            except TimeoutError:
                msg = (
                    f"{self.side} peer: only {len(got)} of {size} expected bytes "
                    f"arrived within {SETTLE_TIMEOUT} s"
                )
                raise AssertionError(msg) from None
            except ConnectionResetError:
                msg = f"{self.side} peer: reset with {size - len(got)} bytes missing"
                raise AssertionError(msg) from None
            if not data:
                msg = (
                    f"{self.side} peer: EOF with {size - len(got)} expected bytes "
                    "missing (FIN before the data, or data lost)"
                )
                raise AssertionError(msg)
            got += data
        return bytes(got)

    def read_end(self) -> Literal["eof", "reset"]:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return "reset"
        except TimeoutError:
            msg = f"{self.side} peer: neither EOF nor reset came"
            raise AssertionError(msg) from None
        assert data == b"", f"{self.side} peer: unexpected bytes {data[:40]!r}"
        return "eof"


def _guarded(method: F) -> F:
    """Mark the machine broken when a step fails, so teardown only cleans up
    (its end-of-example checks would hide the real failure)."""

    @functools.wraps(method)
    def wrapper(self: RelayMachine, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return wrapper  # type: ignore[return-value]


sizes = st.integers(1, 2048) | st.sampled_from([16383, 16384, 16385, 40000])
"""Send sizes: small, around the 16 KiB relay buffer (one of those drawn), and bulk."""


class RelayMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.relay: RelayThread | None = None
        self.peers: dict[Side, Peer] = {}
        self.sockets: list[socket.socket] = []
        self.buffer_size = 0
        self.timeouts = RelayTimeouts(IDLE_TIMEOUT, IDLE_TIMEOUT, IDLE_TIMEOUT)
        # Model of relay()'s timers, in mock seconds.
        self.now = 0.0
        self.last_activity = 0.0
        self.first_eof: Side | None = None
        # The termination the model expects; None while relay() should run.
        self.termination: Termination | None = None

    # -- setup -----------------------------------------------------------------

    @initialize(
        buffer_size=st.sampled_from([64, 4096, 16384, 262144]),
        client_fin=st.sampled_from([10.0, 50.0, 150.0]),
        server_fin=st.sampled_from([10.0, 50.0, 150.0]),
    )
    @_guarded
    def start(self, buffer_size: int, client_fin: float, server_fin: float) -> None:
        self.buffer_size = buffer_size
        self.timeouts = RelayTimeouts(IDLE_TIMEOUT, client_fin, server_fin)
        client_peer, relay_client = tcp_pair()
        self.sockets += [client_peer, relay_client]
        relay_server, server_peer = tcp_pair()
        self.sockets += [relay_server, server_peer]
        for sock in (client_peer, server_peer):
            sock.settimeout(SETTLE_TIMEOUT)
        self.peers = {
            "client": Peer("client", client_peer),
            "server": Peer("server", server_peer),
        }
        self.relay = RelayThread(
            relay_client,
            relay_server,
            buffer_size=buffer_size,
            timeouts=self.timeouts,
        )

    def teardown(self) -> None:
        try:
            if not self.broken and self.relay is not None:
                self._finish()
        finally:
            if self.relay is not None:
                self.relay.stop()
            for sock in self.sockets:
                sock.close()

    # -- model helpers -----------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.relay is not None and self.termination is None

    def _other(self, side: Side) -> Peer:
        return self.peers["server" if side == "client" else "client"]

    def _end(self, termination: Termination) -> None:
        if self.termination is None:
            self.termination = termination

    def _error_of(self, side: Side) -> Termination:
        return (
            Termination.CLIENT_ERROR if side == "client" else Termination.SERVER_ERROR
        )

    def _next_deadline(self) -> tuple[float, Termination]:
        """Mirror of _Flow.next_deadline (no send ever blocks here)."""
        idle = self.last_activity + self.timeouts.idle
        if self.first_eof is None:
            return idle, Termination.IDLE_TIMEOUT
        if self.first_eof == "client":
            fin = self.last_activity + self.timeouts.server_fin
            cause = Termination.SERVER_FIN_TIMEOUT
        else:
            fin = self.last_activity + self.timeouts.client_fin
            cause = Termination.CLIENT_FIN_TIMEOUT
        return (fin, cause) if fin <= idle else (idle, Termination.IDLE_TIMEOUT)

    def _expected_end(self, peer: Peer) -> Literal["eof", "reset"]:
        """A forwarded FIN stays a clean end of that direction; otherwise only a
        clean close ends with a FIN: errors and timeouts close with an RST."""
        if peer.fin_from_relay or self.termination in _CLEAN:
            return "eof"
        return "reset"

    def _send(self, side: Side, size: int) -> None:
        peer, other = self.peers[side], self._other(side)
        size = min(size, MAX_IN_FLIGHT - len(other.expected))
        data = chunk(side, peer.sent, size)
        peer.sock.sendall(data)
        peer.sent += size
        self.last_activity = self.now
        if other.reset:
            # Reset after its FIN, unnoticed so far: the relay's write of the
            # first chunk it reads fails, and it reads no more.
            first_chunk = min(size, self.buffer_size)
            received = peer.relay_received[0]
            peer.relay_received = (received + 1, received + first_chunk)
            self._end(self._error_of(other.side))
        else:
            peer.relay_received = (peer.sent, peer.sent)
            other.expected += data

    def _shut(self, side: Side) -> None:
        peer, other = self.peers[side], self._other(side)
        peer.sock.shutdown(socket.SHUT_WR)
        peer.shut = True
        self.last_activity = self.now
        if self.first_eof is None:
            self.first_eof = side
        if other.reset:
            self._end(self._error_of(other.side))  # shutdown() fails: ENOTCONN
        else:
            other.fin_from_relay = True
        if other.shut:
            self._end(
                Termination.CLIENT_CLOSED
                if self.first_eof == "client"
                else Termination.SERVER_CLOSED
            )

    def _reset(self, side: Side) -> None:
        peer = self.peers[side]
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ABORT)
        peer.sock.close()
        peer.reset = True
        if not peer.shut:
            # The relay is still reading this side: it sees the RST at once.
            self._end(self._error_of(side))
        # else: this direction already ended; the relay only notices the RST when
        # it next writes here (or a timer fires).

    def _read(self, side: Side, size: int) -> None:
        peer = self.peers[side]
        size = min(size, len(peer.expected))
        got = peer.read_exact(size)
        want = bytes(peer.expected[:size])
        assert got == want, (
            f"{side} peer: bytes lost, repeated, reordered or corrupted "
            f"(read {size} bytes, {len(peer.expected)} were expected in all)"
        )
        del peer.expected[:size]

    def _read_end(self, side: Side) -> None:
        peer = self.peers[side]
        got = peer.read_end()
        assert got == self._expected_end(peer), (
            f"{side} peer saw {got}, expected {self._expected_end(peer)} "
            f"(termination {self.termination})"
        )
        peer.saw_end = True

    # -- rules -------------------------------------------------------------------

    def _can_send(self, side: Side) -> bool:
        if not self.running:
            return False
        peer, other = self.peers[side], self._other(side)
        return peer.live and not peer.shut and len(other.expected) < MAX_IN_FLIGHT

    @precondition(lambda self: self._can_send("client"))
    @rule(size=sizes)
    @_guarded
    def client_sends(self, size: int) -> None:
        self._send("client", size)

    @precondition(lambda self: self._can_send("server"))
    @rule(size=sizes)
    @_guarded
    def server_sends(self, size: int) -> None:
        self._send("server", size)

    @precondition(
        lambda self: (
            self.running and self.peers["client"].live and not self.peers["client"].shut
        )
    )
    @rule()
    @_guarded
    def client_shuts_write(self) -> None:
        self._shut("client")

    @precondition(
        lambda self: (
            self.running and self.peers["server"].live and not self.peers["server"].shut
        )
    )
    @rule()
    @_guarded
    def server_shuts_write(self) -> None:
        self._shut("server")

    @precondition(
        lambda self: (
            self.running and (self.peers["client"].live or self.peers["server"].live)
        )
    )
    @rule(side=st.sampled_from(["client", "server"]))
    @_guarded
    def a_peer_resets(self, side: Side) -> None:
        # One rule for both sides, so that resets (which end most examples) are
        # not drawn twice as often as the other actions.
        if not self.peers[side].live:
            side = "server" if side == "client" else "client"
        self._reset(side)

    @precondition(
        lambda self: (
            self.relay is not None
            and self.peers["client"].live
            and self.peers["client"].expected
        )
    )
    @rule(size=st.integers(1, 50000))
    @_guarded
    def client_reads(self, size: int) -> None:
        self._read("client", size)

    @precondition(
        lambda self: (
            self.relay is not None
            and self.peers["server"].live
            and self.peers["server"].expected
        )
    )
    @rule(size=st.integers(1, 50000))
    @_guarded
    def server_reads(self, size: int) -> None:
        self._read("server", size)

    def _can_read_end(self, side: Side) -> bool:
        peer = self.peers.get(side)
        return (
            peer is not None
            and peer.live
            and not peer.expected
            and not peer.saw_end
            and (peer.fin_from_relay or self.termination is not None)
        )

    @precondition(lambda self: self._can_read_end("client"))
    @rule()
    @_guarded
    def client_reads_end(self) -> None:
        self._read_end("client")

    @precondition(lambda self: self._can_read_end("server"))
    @rule()
    @_guarded
    def server_reads_end(self) -> None:
        self._read_end("server")

    @precondition(lambda self: self.relay is not None)
    @rule(how=st.sampled_from(["tick", "just_before", "exactly", "past"]))
    @_guarded
    def time_passes(self, how: str) -> None:
        """Jump the relay's clock: a little, or to one second before, exactly at or
        well past the next deadline the model predicts. (Always possible, also
        after the relay ended, so that no state is a dead end.)"""
        self._jump(how)

    @precondition(lambda self: self.running and self.first_eof is not None)
    @rule()
    @_guarded
    def half_closed_time_runs_out(self) -> None:
        """The half-closed state's deadline (a fin timer's, or the idle timer's
        if that comes first), drawn more often than by time_passes alone."""
        self._jump("exactly")

    def _jump(self, how: str) -> None:
        assert self.relay is not None
        if not self.running:
            self.relay.jump(1.0)
            self.now += 1.0
            return
        deadline, cause = self._next_deadline()
        remaining = deadline - self.now
        step = {
            "tick": 1.0,
            "just_before": max(remaining - 1.0, 0.0),
            "exactly": remaining,
            "past": remaining + 1000.0,
        }[how]
        self.relay.jump(step)
        self.now += step
        if self.now >= deadline:
            self._end(cause)

    # -- the invariant -----------------------------------------------------------

    def _observed(self) -> dict[str, int | bool]:
        assert self.relay is not None
        stats = self.relay.stats
        observed: dict[str, int | bool] = {
            "done": self.relay.done.is_set(),
            "bytes_from_client": stats.bytes_from_client,
            "bytes_from_server": stats.bytes_from_server,
        }
        for side, peer in self.peers.items():
            if peer.live:
                # Delivered means in the peer's receive queue: bytes still in the
                # relay's send queue would be lost to an abortive close.
                observed[f"{side}_unread"] = peer.unread()
                observed[f"{side}_got_fin_or_rst"] = (
                    peer.tcp_state() not in _OPEN_STATES
                )
        return observed

    def _expected(self) -> dict[str, tuple[int, int] | bool]:
        """Booleans exactly; counts as an inclusive range."""
        expected: dict[str, tuple[int, int] | bool] = {
            "done": self.termination is not None,
            "bytes_from_client": self.peers["client"].relay_received,
            "bytes_from_server": self.peers["server"].relay_received,
        }
        for side, peer in self.peers.items():
            if peer.live:
                unread = len(peer.expected)
                expected[f"{side}_unread"] = (unread, unread)
                expected[f"{side}_got_fin_or_rst"] = (
                    peer.fin_from_relay or self.termination is not None
                )
        return expected

    def _mismatches(self, observed: dict[str, int | bool]) -> tuple[list[str], bool]:
        """The keys that differ from the model, and whether any of them can never
        turn into what the model expects (flags and counters only ever grow)."""
        wrong, hopeless = [], False
        for key, want in self._expected().items():
            value = observed[key]
            if isinstance(want, bool):
                if value is not want:
                    wrong.append(key)
                    hopeless |= value is True
            elif not want[0] <= value <= want[1]:
                wrong.append(key)
                hopeless |= value > want[1]
        return wrong, hopeless

    @invariant()
    @_guarded
    def relay_matches_model(self) -> None:
        """Wait until the relay settled in the model's state; fail on any other.

        Fails at once on a state the relay can never leave toward the model's,
        after STUCK_AFTER seconds of an unchanged wrong state with the relay idle
        (it is not going to do anything more), and after SETTLE_TIMEOUT anyway.
        """
        if self.relay is None:
            return
        start = time.monotonic()
        stuck_since, last = start, None
        while True:
            self.relay.check_alive()
            observed = self._observed()
            wrong, hopeless = self._mismatches(observed)
            if not wrong:
                # The relay has nothing left to do, and it still agrees.
                self.relay.quiesce()
                observed = self._observed()
                wrong, hopeless = self._mismatches(observed)
                if not wrong:
                    break
            now = time.monotonic()
            if observed != last:
                stuck_since, last = now, observed
            elif now - stuck_since > STUCK_AFTER:
                self.relay.quiesce()
                hopeless |= self._observed() == observed
            message = (
                f"relay state differs from the model in {wrong}: observed "
                f"{observed}, model expects {self._expected()}"
            )
            assert not hopeless, message
            assert now - start < SETTLE_TIMEOUT, message
            time.sleep(0.0005)
        if self.termination is not None:
            assert self.relay.stats.termination is self.termination

    # -- end of an example -------------------------------------------------------

    def _finish(self) -> None:
        """Drive the example to its end and check what every live peer gets."""
        sides: tuple[Side, Side] = ("client", "server")
        for side in sides:
            if self.running:
                peer = self.peers[side]
                if peer.live and not peer.shut:
                    self._shut(side)
                    self.relay_matches_model()
        assert self.termination is not None, "model: relay should have ended"
        event(f"termination: {self.termination.value}")
        self.relay_matches_model()
        for side, peer in self.peers.items():
            if peer.live and not peer.saw_end:
                while peer.expected:
                    self._read(side, len(peer.expected))
                self._read_end(side)
        assert not self._mismatches(self._observed())[0]


_CI = os.environ.get("HYPOTHESIS_PROFILE") == "ci"


def test_relay_half_close_state_machine() -> None:
    run_state_machine_as_test(
        RelayMachine,
        settings=settings(
            max_examples=100 if _CI else 40,
            stateful_step_count=25,
            deadline=None,
            # A step waits for real sockets and a thread: slow by hypothesis'
            # standards, not by ours.
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
