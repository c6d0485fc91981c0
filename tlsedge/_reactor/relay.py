"""Bidirectional byte relay with exact half-close semantics, on the reactor.

Theory of operation
===================

:func:`relay` copies bytes between two already-connected sockets, ``client``
(the peer that connected to us) and ``server`` (the backend we connected to),
until both directions are finished. Each side is a `trio.SocketStream`, an
established `TLSStream` over one (or over a stdlib socket), or
(`DetachedRelays.start`) a connected non-blocking stdlib socket; anything else
is refused with `TypeError` before anything starts. The pair is registered
with the run's reactor (`tlsedge._reactor.loop`), which calls `_Flow.ready` when a
socket is ready; :func:`relay`'s task parks until the end.
`DetachedRelays.start` does the same without a waiting task and calls back at
the end (tcp mode).

Each direction is a tiny state machine::

    OPEN --(EOF received)--> EOF_RECEIVED --(EOF sent on)--> EOF_FORWARDED
      |                               |
      +-- read/write error -----------+--> abort both sides (ERROR)

* A direction reads its next chunk only after the previous chunk was fully
  taken by the destination, so when it sees EOF every byte before it has been
  delivered; the EOF is forwarded right then (``shutdown(SHUT_WR)`` on a
  socket, close_notify on TLS: a TLS 1.3 half-close). The other direction keeps
  flowing. A detached relay whose owner closes both sockets at its end
  (`DetachedRelays.start`'s *closed_at_end*) leaves the second EOF of a plain
  socket to that close instead (no ``shutdown``), and sends the first one at
  the end of the reactor's batch: if the other EOF came in the same batch
  (the usual end of a request), the closes send both.
* The relay returns when both directions are EOF_FORWARDED. Termination is
  ``CLIENT_CLOSED`` if the client's EOF came first, else ``SERVER_CLOSED``.
* **Errors** (``ECONNRESET``, ``EPIPE`` and other :class:`OSError`, a TLS
  error) on either side: the failing side is recorded
  (``CLIENT_ERROR``/``SERVER_ERROR``; a receive error blames the source, a send
  error the destination), :func:`set_abortive_close` is applied to *both*
  sides (so the caller's close sends an RST, like Envoy's AbortReset and
  HAProxy's ``nolinger``), and the relay ends. A socket whose reading is paused
  (backpressure) stays registered for errors, so an RST from it ends the relay
  at once. A side with nothing left to do (its EOF came and nothing is owed to
  it) is no longer watched: an RST from it is seen when the relay next writes
  to it, or a timer ends the relay first.

Timeouts. Reads and writes only store timestamps (the reactor's clock, trio's):
the last byte received from either side, and the last time a blocked
destination took bytes. One reactor timer per relay waits until the earliest
deadline those timestamps allow, re-checks when it fires (activity since then
moves the deadline), and once a deadline really passed records the cause and
ends the relay. The first EOF arms an earlier timer if a fin timer would fire
before the idle timer. The timers, named after their config fields:

* ``idle_timeout``: no byte received from either side for that long, in any state
  (an EOF counts as received).
* Fin timeouts, HAProxy's ``timeout client-fin``/``server-fin`` convention (the name
  is the side we are *waiting for* once the other side has finished). They are
  **inactivity** timers of the half-closed state, as in HAProxy, not deadlines
  counted from the first EOF: a long download after the client's FIN is never cut
  while it flows.

  - after the **client** sends EOF, the connection ends with ``SERVER_FIN_TIMEOUT``
    if the remaining server -> client direction makes no progress for
    ``server_fin_timeout`` seconds;
  - after the **server** sends EOF, likewise ``CLIENT_FIN_TIMEOUT`` after
    ``client_fin_timeout`` seconds without progress client -> server (the client is
    half-closed from our point of view, i.e. in FIN_WAIT).

  *Progress* is a byte received from the remaining direction's source, or its
  destination taking bytes while it was blocked (a slow reader that keeps reading
  keeps the connection; one that stops is attributed to the side we were waiting
  for). Both timers run at once in the half-closed state; the earlier one fires.

A timeout ends the relay normally with the cause in ``stats.termination``, with
both sides set to close with an RST, as after an error: a timeout can cut a
transfer in the middle (a backend that stalls mid-response), and a FIN would let
a client of a close-delimited protocol take the truncated stream for a complete
one. Cancellation from outside (the drain deadline; `DetachedRelays.drain_all`)
records ``DRAINED`` (unless a cause was already recorded).

Buffers and backpressure
========================

A `_Flow` holds two `_Endpoint` (socket, optional TLS engine, bytes owed to
the socket). When a socket is readable the flow makes one non-blocking
``recv_into`` into the thread's *scratch* buffer (``buffer_size``, default
256 KiB), decrypts if the source is TLS (`TLSStream.receive_available`), encrypts
if the destination is TLS (`TLSStream.send_nowait`), and sends at once; only what
the destination does not take is copied into the endpoint's ``out``. While
``out`` holds bytes, the source is not read (its interest drops to errors only)
and the destination is watched for writability; when ``out`` drains, reading
resumes and a pending EOF goes out. So an idle connection holds no buffer
(HAProxy's rule), and a direction holds at most one buffer's worth. Interest
changes (``epoll_ctl``) happen only when backpressure starts or ends; an
endpoint with nothing left to do is unregistered (a level-triggered hang-up
would otherwise wake the reactor for nothing). A TLS source may already hold
records its engine read past what it returned; the flow hands those on before
it waits for the socket.

Measured (``python bench/edge.py --duration 5 --reps 2``, 2026-11-24): TCP
keep-alive at 36,211 requests per proxy CPU-second, 0.67x HAProxy's in the
same run; the profile is then dominated by the kernel's ``send``.
bench/README.md has the history and the TLS figures.

The scratch buffer is per thread because ``recv_into`` releases the GIL: two trio
runs in two threads must not share one.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import math
import socket
import struct
import threading
from collections.abc import Callable
from typing import NamedTuple, TypeAlias

import trio

from tlsedge._core.termination import RelayStats, Termination
from tlsedge._reactor.loop import (
    ERROR,
    HANGUP,
    READABLE,
    WRITABLE,
    Cancellable,
    current_reactor,
)
from tlsedge._tls.stream import TLSStream

LOGGER = logging.getLogger("tlsedge.relay")

__all__ = ["DetachedRelays", "relay", "set_abortive_close"]

# Each thread's shared receive buffers, by size (see "Buffers and backpressure"
# in the module docstring).
_scratch_local = threading.local()

# Most reads of one side per readiness event (a full read means more is
# likely waiting; the bound keeps one busy connection from starving the rest).
_READS_PER_WAKE = 16

# How deep set_abortive_close follows ``transport_stream`` (SSLStream over a
# PrefixedStream over a SocketStream is 3); a bound guards against cycles.
_MAX_TRANSPORT_DEPTH = 8

# struct linger {int l_onoff; int l_linger;}: on, 0 seconds -> close() sends RST.
_LINGER_ABORT = struct.pack("ii", 1, 0)


class _Side(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


_ERROR_OF = {
    _Side.CLIENT: Termination.CLIENT_ERROR,
    _Side.SERVER: Termination.SERVER_ERROR,
}


def set_abortive_close(stream: trio.abc.Stream | socket.socket) -> None:
    """Make the stream's eventual ``aclose()`` send an RST instead of a FIN.

    Sets ``SO_LINGER`` to ``(1, 0)`` on the underlying socket, found as
    :attr:`trio.SocketStream.socket`, following a chain of ``transport_stream``
    attributes through wrapper streams (:class:`trio.SSLStream` and our own).
    Does nothing if no socket is found or it is already closed.

    Args:
        stream: Any stream; typically the client or server side of a relay.
            A stdlib socket (a reactor relay's plain side) gets it directly.
    """
    if isinstance(stream, socket.socket):
        with contextlib.suppress(OSError):
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ABORT)
        return
    current: object = stream
    for _ in range(_MAX_TRANSPORT_DEPTH):
        if isinstance(current, trio.SocketStream):
            # OSError: already closed (EBADF); nothing left to abort.
            with contextlib.suppress(OSError):
                current.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ABORT
                )
            return
        current = getattr(current, "transport_stream", None)
        if current is None:
            return


class _Timeouts(NamedTuple):
    """A relay's timers, in seconds (named after their config fields)."""

    idle: float
    client_fin: float
    server_fin: float

    @classmethod
    @functools.lru_cache(maxsize=64)
    def checked(
        cls, idle: float, client_fin: float, server_fin: float, buffer_size: int
    ) -> _Timeouts:
        """The timeouts, after checking them and *buffer_size*: one tuple
        shared by the relays of a listener (cached), not one per relay.

        Raises:
            ValueError: A timeout is negative or NaN, or *buffer_size* < 1.
        """
        for name, value in (
            ("idle_timeout", idle),
            ("client_fin_timeout", client_fin),
            ("server_fin_timeout", server_fin),
        ):
            if not value >= 0:  # also rejects NaN
                msg = f"{name} must be >= 0, got {value!r}"
                raise ValueError(msg)
        if buffer_size < 1:
            msg = f"buffer_size must be >= 1, got {buffer_size!r}"
            raise ValueError(msg)
        return cls(idle, client_fin, server_fin)


#: A side of a relay: a stream, or a connected non-blocking stdlib socket,
#: driven as it is and left to its owner to close.
_Peer: TypeAlias = trio.abc.Stream | socket.socket


class _Endpoint:
    """One side of a flow on the reactor: its socket, TLS engine, unsent bytes."""

    __slots__ = (
        "fd",
        "hung_up",
        "interest",
        "out",
        "reading",
        "shut_pending",
        "side",
        "sock",
        "tls",
    )

    def __init__(self, side: _Side, sock: socket.socket, tls: TLSStream | None) -> None:
        self.side = side
        self.sock = sock
        self.fd = sock.fileno()
        self.tls = tls
        #: Bytes (records, for TLS) accepted from the other side that this
        #: socket has not taken yet; while there are any, the other side is
        #: not read (backpressure: one buffer per direction). A bytearray
        #: only while it holds bytes: an idle side holds no buffer.
        self.out: bytes | bytearray = b""
        #: Still reading this side (no EOF, error or abort yet).
        self.reading = True
        #: The other side's EOF waits for ``out`` to drain before it is sent.
        self.shut_pending = False
        #: What the reactor watches this socket for; None: not registered.
        #: 0 (registered for errors only) while reading is paused, so that an
        #: RST from a side we are not reading still ends the relay.
        self.interest: int | None = None
        #: The socket reported a hang-up (both directions shut, no error).
        self.hung_up = False


class _Flow:
    """One relay driven by the reactor (see "Buffers and backpressure" above)."""

    __slots__ = (
        "a",
        "armed",
        "b",
        "buffer_size",
        "built",
        "closed_at_end",
        "done",
        "fin_deferred",
        "first_eof",
        "last_activity",
        "last_send",
        "on_done",
        "reactor",
        "relays",
        "scratch",
        "scratch_view",
        "shut_count",
        "started",
        "stats",
        "task",
        "timeouts",
        "timer",
    )

    def __init__(
        self,
        stats: RelayStats,
        timeouts: _Timeouts,
        *,
        ends: _Ends,
        buffer_size: int,
    ) -> None:
        self.reactor = current_reactor()
        self.stats = stats
        self.timeouts = timeouts
        self.last_activity = self.reactor.now()
        # Last time a waiting send made progress (the reader took bytes).
        self.last_send = self.last_activity
        self.first_eof: _Side | None = None
        self.a, self.b, self.built = ends
        self.buffer_size = buffer_size
        self.scratch, self.scratch_view = _scratch(buffer_size)
        #: Who learns that the relay ended: a parked task (`relay`) or a
        #: callback (`DetachedRelays.start`, whose set holds the flow).
        self.task: trio.lowlevel.Task | None = None
        self.on_done: Callable[[], None] | None = None
        self.relays: DetachedRelays | None = None
        self.done = False
        #: `on_done` closes both sockets (`DetachedRelays.start`).
        self.closed_at_end = False
        self.shut_count = 0
        #: The plain socket whose first FIN waits for the end of the
        #: reactor's batch (`_shut`); None once sent or while not deferring.
        self.fin_deferred: _Endpoint | None = None
        #: `start` is done: what happens now happens in a reactor batch.
        self.started = False
        #: The earliest deadline a pending timer of ours will fire at.
        self.armed = math.inf
        #: What the reactor's timer heap holds of this flow (let go at the
        #: end: a flow must not live on until its idle deadline). The flow
        #: is its callback (`__call__`: no bound method kept per flow).
        self.timer = Cancellable(self)

    # -- life cycle --------------------------------------------------------------

    def start(self) -> None:
        """Register both sockets, arm the timer, hand on what TLS buffered."""
        for end in (self.a, self.b):
            end.interest = READABLE
            self.reactor.register(end.fd, READABLE, self)
        self._arm(self.next_deadline()[0])
        for end in (self.a, self.b):
            if end.tls is not None and not self.done:
                # Records the stream's engine read past what it returned
                # (the socket may never be readable again for them).
                self._receive(end, None)
                if not self.done:
                    self._update(end)
                    self._update(self._other(end))
        self.started = True

    def _finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.timer.cancel()
        # Sockets closed by on_done leave the selector with their close.
        drop = self.reactor.forget if self.closed_at_end else self.reactor.unregister
        for end in (self.a, self.b):
            if end.interest is not None:
                drop(end.fd)
                end.interest = None
        # detach(), never close(): the descriptors belong to the streams.
        for raw in self.built:
            raw.detach()
        if self.stats.termination is None:
            self.stats.termination = self.clean_termination()
        if self.task is not None:
            trio.lowlevel.reschedule(self.task)
            self.task = None
        if self.on_done is not None:
            on_done, self.on_done = self.on_done, None
            if self.relays is not None:
                self.relays.ended(self)
            try:
                on_done()
            except Exception:
                LOGGER.exception("relay: the callback at its end failed")

    def drain(self) -> None:
        """Stop now, as ``DRAINED`` (unless a cause was recorded), without
        touching the sockets: their owner closes them."""
        if self.stats.termination is None:
            self.stats.termination = Termination.DRAINED
        self.task = None
        self._finish()

    def fail(self, end: _Endpoint) -> None:
        """A read or write error on *end*: abort both sides."""
        self.abort(_ERROR_OF[end.side])
        self._finish()

    def failed(self, exc: Exception) -> None:
        """A bug in a handler (logged by the reactor): end this relay."""
        self.abort(Termination.INTERNAL_ERROR)
        self._finish()

    def abort(self, cause: Termination) -> None:
        """Record *cause* (unless one was) and make both sides close with an RST."""
        if self.stats.termination is None:
            self.stats.termination = cause
        for end in (self.a, self.b):
            set_abortive_close(end.sock)

    def clean_termination(self) -> Termination:
        """The cause once both directions finished (timeouts record their own)."""
        if self.first_eof is _Side.CLIENT:
            return Termination.CLIENT_CLOSED
        return Termination.SERVER_CLOSED

    # -- timers ------------------------------------------------------------------

    def eof_received(self, source: _Side) -> float | None:
        """Note an EOF; the first one returns the deadline its fin timer sets."""
        now = self.last_activity = self.reactor.now()
        if self.first_eof is not None:
            return None  # second EOF: nothing left to wait for once it is forwarded
        self.first_eof = source
        if source is _Side.CLIENT:
            return now + self.timeouts.server_fin
        return now + self.timeouts.client_fin

    def next_deadline(self) -> tuple[float, Termination]:
        """When the relay times out if nothing happens before, and as what."""
        idle = self.last_activity + self.timeouts.idle
        first_eof = self.first_eof
        if first_eof is None:
            return idle, Termination.IDLE_TIMEOUT
        if first_eof is _Side.CLIENT:
            fin_timeout, cause = (
                self.timeouts.server_fin,
                Termination.SERVER_FIN_TIMEOUT,
            )
        else:
            fin_timeout, cause = (
                self.timeouts.client_fin,
                Termination.CLIENT_FIN_TIMEOUT,
            )
        # Inactivity of the remaining direction: bytes received from its source
        # (last_activity, which the finished source no longer moves after its
        # EOF) or taken by its destination (last_send).
        fin = max(self.last_activity, self.last_send) + fin_timeout
        if fin <= idle:
            return fin, cause
        return idle, Termination.IDLE_TIMEOUT

    def _arm(self, deadline: float) -> None:
        if deadline < self.armed:
            self.armed = deadline
            self.reactor.call_at(deadline, self.timer)

    def __call__(self) -> None:
        """A timer of ours fired: end the relay if a deadline really passed,
        else wait for the next one."""
        if self.done:
            return
        now = self.reactor.now()
        if self.armed <= now:
            self.armed = math.inf  # this was the earliest pending timer
        deadline, cause = self.next_deadline()
        if now >= deadline:
            self.abort(cause)
            self._finish()
        else:
            self._arm(deadline)

    # -- events ------------------------------------------------------------------

    def _other(self, end: _Endpoint) -> _Endpoint:
        return self.b if end is self.a else self.a

    def ready(self, fd: int, events: int) -> None:
        end = self.a if fd == self.a.fd else self.b
        other = self.b if end is self.a else self.a
        acted = False
        if end.out and events & (WRITABLE | ERROR | HANGUP):
            acted = True
            self._flush(end)
            if self.done:
                return
        if end.reading and not other.out and events & (READABLE | ERROR | HANGUP):
            acted = True
            # A full read means more is likely waiting: read on (up to a
            # bound, for fairness) rather than go back to the selector.
            for _ in range(_READS_PER_WAKE):
                if not self._receive(end, end.sock):
                    break
            if self.done:
                return
        if not acted:
            if events & ERROR:
                self.fail(end)  # e.g. an RST while we were not reading this side
                return
            if events & HANGUP:
                # Its FIN waits to be read once reading resumes; until then
                # a level-triggered hang-up would wake us without end.
                end.hung_up = True
        elif self.fin_deferred is not None:
            return  # the interests are set with the FIN (`_forward_fin`)
        elif (
            end.reading
            and other.reading
            and not (end.out or other.out)
            and end.interest == other.interest == READABLE
        ):
            return  # both still just reading (the usual case): nothing changed
        self._update(end)
        self._update(other)

    def _update(self, end: _Endpoint) -> None:
        """Watch *end* for what it is waiting for: unregistered once it has
        nothing left to do (a level-triggered hang-up would wake us for
        nothing), for errors only while its reading is paused."""
        interest: int | None = None
        if end.reading or end.out:
            interest = (READABLE if end.reading and not self._other(end).out else 0) | (
                WRITABLE if end.out else 0
            )
            if interest == 0 and end.hung_up:
                interest = None
        end.interest = self.reactor.watch(end.fd, end.interest, interest, self)

    def _receive(self, end: _Endpoint, sock: socket.socket | None) -> bool:
        """Read *end* once (or only its TLS engine, without *sock*) and pass
        what came on; an EOF starts the other side's shutdown. True if the
        read filled the buffer and everything went on: reading again is
        worth it."""
        other = self._other(end)
        received = 0
        if sock is not None:
            try:
                received = sock.recv_into(self.scratch)
            except BlockingIOError:
                return False
            except OSError:
                self.fail(end)
                return False
        tls = end.tls
        if tls is None:
            if received:
                self._count(end, received)
                self._send(other, self.scratch_view[:received])
            else:
                self._eof(end)
            return received == self.buffer_size and not (self.done or other.out)
        transport_data: memoryview | None = None
        if sock is not None:
            transport_data = self.scratch_view[:received]
        try:
            data, eof = tls.receive_available(transport_data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.fail(end)
            return False
        records = tls.take_transport_data()
        if records:
            self._send_raw(end, records)
            if self.done:
                return False
        if data:
            self._count(end, len(data))
            self._send(other, data)
            if self.done:
                return False
        if eof:
            self._eof(end)
            return False
        return received == self.buffer_size and not (self.done or other.out)

    def _count(self, end: _Endpoint, size: int) -> None:
        self.last_activity = self.reactor.now()
        if end.side is _Side.CLIENT:
            self.stats.bytes_from_client += size
        else:
            self.stats.bytes_from_server += size

    def _send(self, end: _Endpoint, data: bytes | memoryview) -> None:
        """Send bytes from the other side to *end* (encrypted for TLS)."""
        if end.tls is not None:
            try:
                data = end.tls.send_nowait(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.fail(end)
                return
        self._send_raw(end, data)

    def _send_raw(self, end: _Endpoint, data: bytes | memoryview) -> None:
        if end.out:
            end.out += data  # behind bytes the socket has not taken yet
            return
        try:
            sent = end.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.fail(end)
            return
        if sent < len(data):
            # Copied: the scratch buffer is the next read's.
            end.out = bytearray(data[sent:])

    def _flush(self, end: _Endpoint) -> None:
        """*end* is writable: send what it owes; once drained, finish a
        pending shutdown."""
        try:
            sent = end.sock.send(end.out)
        except BlockingIOError:
            return
        except OSError:
            self.fail(end)
            return
        out = end.out
        assert isinstance(out, bytearray)  # bytes only while empty
        del out[:sent]
        # The reader took bytes while we waited: progress for the fin timer.
        self.last_send = self.reactor.now()
        if not out:
            end.out = b""
            if end.shut_pending:
                self._shut(end)

    def _eof(self, end: _Endpoint) -> None:
        """*end* sent its EOF: forward it once everything before it went out."""
        end.reading = False
        fin_deadline = self.eof_received(end.side)
        other = self._other(end)
        if other.tls is not None:
            try:
                self._send_raw(other, other.tls.send_eof_nowait())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.fail(other)
                return
            if self.done:
                return
        if other.out:
            other.shut_pending = True
        else:
            self._shut(other)
        # A FIN put off to the batch's end arms the fin timer there, if the
        # relay did not end first (no timer for it in the heap then).
        if fin_deadline is not None and not self.done and self.fin_deferred is None:
            self._arm(fin_deadline)

    def _shut(self, end: _Endpoint) -> None:
        """The EOF (a FIN, or a close_notify already sent) reached *end*.

        With `closed_at_end` the second one needs no ``shutdown``: the relay
        ends with it, and the owner's ``close`` right after sends the FIN
        (HAProxy's way: a syscall less per connection). Nothing is left
        unread on that socket (its own EOF came first), so the close cannot
        turn into an RST. The first one then waits for the end of the
        reactor's batch (`_forward_fin`; once `started`, this runs in
        ``ready``): when the other side's EOF is in the same batch (the
        usual end of a request: the server's FIN, then the client's), the
        close sends both FINs, without a ``shutdown``, and without the
        ``epoll_ctl`` that would stop watching the finished side.
        """
        end.shut_pending = False
        self.shut_count += 1
        if end.tls is None and not (self.closed_at_end and self.shut_count == 2):
            if self.closed_at_end and self.started:
                self.fin_deferred = end
                self.reactor.defer(self._forward_fin, self)
                return
            try:
                end.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self.fail(end)
                return
        if self.shut_count == 2:
            self._finish()

    def _forward_fin(self) -> None:
        """The end of the batch in which the first EOF came (`_shut`): the
        other side's did not come with it, so send the FIN now, arm the fin
        timer, and watch both sides for what they wait for."""
        end, self.fin_deferred = self.fin_deferred, None
        if self.done or end is None:
            return  # the relay ended in the same batch: the close sends it
        try:
            end.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.fail(end)
            return
        self._arm(self.next_deadline()[0])
        self._update(self.a)
        self._update(self.b)


#: Both endpoints of a reactor relay, and the sockets built for them (to
#: detach at the end).
_Ends = tuple[_Endpoint, _Endpoint, tuple[socket.socket, ...]]


def _reactor_ends(
    client: _Peer,
    server: _Peer,
    sockets: tuple[socket.socket, socket.socket] | None,
) -> _Ends:
    """The pair as reactor endpoints.

    Raises:
        TypeError: A side is not a stdlib socket, a `trio.SocketStream` or an
            established `TLSStream` over one (the sockets built for the
            other side are detached again: nothing is left behind).
    """
    if isinstance(client, socket.socket) and isinstance(server, socket.socket):
        # A plain tcp-mode connection: both sides driven as they are.
        return (
            _Endpoint(_Side.CLIENT, client, None),
            _Endpoint(_Side.SERVER, server, None),
            (),
        )
    given = sockets if sockets is not None else (None, None)
    built: list[socket.socket] = []
    ends: list[_Endpoint] = []
    for stream, side, given_sock in (
        (client, _Side.CLIENT, given[0]),
        (server, _Side.SERVER, given[1]),
    ):
        if isinstance(stream, socket.socket):
            ends.append(_Endpoint(side, stream, None))
            continue
        tls: TLSStream | None = None
        transport: trio.abc.Stream = stream
        if isinstance(stream, TLSStream) and stream.established:
            if stream.transport_socket is not None:
                ends.append(_Endpoint(side, stream.transport_socket, stream))
                continue
            tls, transport = stream, stream.transport_stream
        if not isinstance(transport, trio.SocketStream):
            for raw in built:
                raw.detach()
            raise TypeError(_cannot_drive(side, stream))
        sock = given_sock
        if sock is None:
            sock, made = _stdlib_socket(transport)
            if made:
                built.append(sock)
        ends.append(_Endpoint(side, sock, tls))
    return ends[0], ends[1], tuple(built)


def _cannot_drive(side: _Side, stream: trio.abc.Stream) -> str:
    """The message for a side the reactor cannot drive: what it needs, what came."""
    seen = type(stream).__name__
    if isinstance(stream, TLSStream):
        if stream.established:
            seen = f"a TLSStream over {type(stream.transport_stream).__name__}"
        else:
            seen = "a TLSStream whose handshake is not done"
    return (
        f"relay: the {side.value} side must be a trio.SocketStream, an "
        f"established TLSStream over one, or a connected stdlib socket; got {seen}"
    )


async def _relay_on_reactor(flow: _Flow) -> None:
    """Start *flow* and park this task until it ends; a cancellation from
    outside ends it as ``DRAINED`` (unless a cause was recorded)."""
    flow.start()
    if flow.done:
        await trio.lowlevel.checkpoint()
        return
    flow.task = trio.lowlevel.current_task()

    def abort(_: object) -> trio.lowlevel.Abort:
        flow.drain()
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)


class DetachedRelays:
    """Relays handed to the reactor that no task waits for: a connection's
    owner gives its relay away with `start` and the reactor calls back at
    the end. An idle relayed connection then costs no trio task (about half
    of its memory otherwise). The owner ends the rest with `drain_all`."""

    def __init__(self) -> None:
        self._flows: set[_Flow] = set()
        self._empty = trio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._flows)

    def start(
        self,
        client: _Peer,
        server: _Peer,
        *,
        stats: RelayStats,
        idle_timeout: float,
        client_fin_timeout: float,
        server_fin_timeout: float,
        on_done: Callable[[], None],
        sockets: tuple[socket.socket, socket.socket] | None = None,
        buffer_size: int = 262144,
        closed_at_end: bool = False,
    ) -> None:
        """Start relaying as `relay` would, without waiting for the end.

        *on_done* is called from the reactor's task once the relay ended
        (``stats.termination`` says why); it may be called before this
        returns. A side may be a connected non-blocking stdlib socket (no
        trio objects needed), driven as it is; its owner closes it.

        *closed_at_end*: *on_done* closes both sockets before it returns
        (and no other descriptor refers to them). The relay then leaves
        the last FIN of a clean end to that close, and their removal from
        the reactor's selector too: two syscalls less per connection; and
        when both EOFs come in one batch, the first FIN too (two more).

        Raises:
            ValueError: as `relay`.
            TypeError: as `relay`.
        """
        timeouts = _Timeouts.checked(
            idle_timeout, client_fin_timeout, server_fin_timeout, buffer_size
        )
        ends = _reactor_ends(client, server, sockets)
        flow = _Flow(stats, timeouts, ends=ends, buffer_size=buffer_size)
        flow.on_done = on_done
        flow.relays = self
        flow.closed_at_end = closed_at_end
        if not self._flows:
            self._empty = trio.Event()
        self._flows.add(flow)
        flow.start()

    def ended(self, flow: _Flow) -> None:
        """*flow* ended (called by it, before its *on_done*)."""
        self._flows.discard(flow)
        if not self._flows:
            self._empty.set()

    async def wait_empty(self) -> None:
        """Wait until every relay started here has ended."""
        await self._empty.wait()

    def drain_all(self) -> None:
        """End every relay still running, as ``DRAINED``."""
        for flow in list(self._flows):
            flow.drain()


def _scratch(size: int) -> tuple[bytearray, memoryview]:
    """This thread's shared receive buffer of ``size`` bytes, and a view of it."""
    buffers: dict[int, tuple[bytearray, memoryview]] | None = getattr(
        _scratch_local, "buffers", None
    )
    if buffers is None:
        buffers = _scratch_local.buffers = {}
    scratch = buffers.get(size)
    if scratch is None:
        buffer = bytearray(size)
        scratch = buffers[size] = (buffer, memoryview(buffer))
    return scratch


def _stdlib_socket(stream: trio.SocketStream) -> tuple[socket.socket, bool]:
    """The stdlib socket under *stream*, and whether it was built for the
    caller (who must then ``detach`` it, never close it).

    trio's socket wraps one (``_sock``): using it costs nothing, where
    building another object on the descriptor costs a ``getsockname()``.
    """
    trio_sock = stream.socket
    own = getattr(trio_sock, "_sock", None)
    if type(own) is socket.socket:
        return own, False
    built = socket.socket(
        trio_sock.family, trio_sock.type, trio_sock.proto, fileno=trio_sock.fileno()
    )
    return built, True


async def relay(
    client: trio.abc.Stream,
    server: trio.abc.Stream,
    *,
    stats: RelayStats,
    idle_timeout: float,
    client_fin_timeout: float,
    server_fin_timeout: float,
    buffer_size: int = 262144,
    sockets: tuple[socket.socket, socket.socket] | None = None,
) -> None:
    """Relay bytes both ways between ``client`` and ``server`` until both finish.

    See the module docstring for the exact half-close, timeout and error rules.
    Returns normally for every peer-caused ending (clean close, timeout, RST or
    other error); the cause is in ``stats.termination``. Never closes either
    stream: the caller closes both in its own ``finally`` (use
    :func:`trio.aclose_forcefully` when the cause is an error or timeout; after
    either, both sockets are already set to close with an RST).

    Args:
        client: The stream accepted from the client (TLS or plain).
        server: The stream connected to the backend.
        stats: Updated in place: byte counters while relaying, then the cause.
        idle_timeout: Seconds without a byte from either side before giving up.
        client_fin_timeout: Seconds the client may take to finish after the
            server sent its EOF.
        server_fin_timeout: Seconds the server may take to finish after the
            client sent its EOF.
        buffer_size: Largest chunk read at once, per direction.
        sockets: The stdlib sockets under ``client`` and ``server`` (under
            their `trio.SocketStream`, the transport of a `TLSStream`) when
            the caller made them (saves building one per side, and its
            ``getsockname``). They stay the caller's.

    Raises:
        ValueError: A timeout is negative or NaN, or ``buffer_size`` < 1.
        TypeError: A side is not a `trio.SocketStream` or an established
            `TLSStream` over one (nothing was started).
        trio.Cancelled: Cancelled from outside; ``stats.termination`` is then
            ``DRAINED`` unless a cause had already been recorded.
    """
    timeouts = _Timeouts.checked(
        idle_timeout, client_fin_timeout, server_fin_timeout, buffer_size
    )
    ends = _reactor_ends(client, server, sockets)
    await _relay_on_reactor(_Flow(stats, timeouts, ends=ends, buffer_size=buffer_size))
