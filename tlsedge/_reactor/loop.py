"""The reactor: one trio task per run drives every established connection.

Theory of operation
===================

trio charges about 19 us of CPU and an ``epoll_ctl`` syscall for every wait on
a socket (``../shared/reference/perf-study.md``). A relayed request makes
several waits, so a task per direction caps the edge near 0.4x HAProxy. The
reactor pays that cost once per *batch* of ready connections instead:

- It owns a readiness selector (``select.epoll`` on Linux, `selectors`'
  default elsewhere) in which connections keep their registrations for their
  whole life; a registration's interest changes only when backpressure starts
  or ends.
- Its task waits on the selector's own descriptor with
  `trio.lowlevel.wait_readable`, then asks the selector for every ready
  descriptor without blocking and calls each one's handler. Handlers never
  await: they make non-blocking ``recv``/``send`` calls and change interest.
  Work that several handler calls of one batch add to (an HTTP/2 connection's
  write of the frames its streams queued) can be put off to the batch's end
  (`Reactor.defer`), and is then done once.
- Timers (idle and fin timeouts) live in one heap that a second task sweeps,
  sleeping until the earliest deadline. A handler only stores timestamps; a
  timer that fires re-checks them and re-arms itself if there was activity
  (so a busy connection never touches the heap). A connection that ends calls
  its timer off (`Cancellable`), which stays in the heap until its deadline;
  so that thousands of short connections a second do not pile up a minute's
  worth of dead entries, the heap is rebuilt without them whenever it has
  doubled since the last rebuild (amortised O(1) per timer).

trio keeps the control plane: accepting, PROXY headers, TLS handshakes,
connecting backends, configuration, health checks and drain run in trio tasks
as before, and hand a connection to the reactor once it is established
(`tlsedge._reactor.relay.relay`).

The reactor of a trio run is made on first use (`current_reactor`) and runs as
a trio *system* task (its timer task a child of it), so library users and
tests that call `relay` need no setup; it ends with the run. A handler that
raises is a bug: it is logged and its ``failed`` method ends that connection
alone.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import select
import selectors
from collections.abc import Callable
from typing import Protocol

import trio

__all__ = [
    "ERROR",
    "HANGUP",
    "READABLE",
    "WRITABLE",
    "Cancellable",
    "Handler",
    "Reactor",
    "current_reactor",
]

LOGGER = logging.getLogger("tlsedge.reactor")

#: Interest bits, the same values for both selector kinds.
READABLE = 1
WRITABLE = 4
#: Error and hang-up bits: reported whatever the interest (epoll's values;
#: the portable selector folds them into READABLE/WRITABLE).
ERROR = 8
HANGUP = 16

#: The timer heap is first rebuilt without its called-off entries at this size.
_COMPACT_AT_LEAST = 1024

#: Most events taken from the selector per wake-up (a larger batch is taken
#: over several loop turns, with a trio checkpoint between them).
_MAX_EVENTS = 512


class Cancellable:
    """A timer callback that can be called off: `Reactor.call_at` keeps what
    it is given until the deadline, and this keeps the real callback (and
    what that holds: a connection's streams, buffers, log record) only until
    `cancel`. A connection that ended long before its idle deadline then
    leaves this small object in the heap, not itself."""

    __slots__ = ("_callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback: Callable[[], None] | None = callback

    def __call__(self) -> None:
        if self._callback is not None:
            self._callback()

    def cancel(self) -> None:
        """Never call the callback (again); drop it."""
        self._callback = None

    @property
    def cancelled(self) -> bool:
        return self._callback is None


class Handler(Protocol):
    """What the reactor calls for a registered descriptor."""

    def ready(self, fd: int, events: int) -> None:
        """*fd* is ready: *events* has `READABLE`, `WRITABLE` and error bits."""

    def failed(self, exc: Exception) -> None:
        """A call to ``ready`` raised *exc* (a bug): end the connection."""


class _Poller(Protocol):
    def register(self, fd: int, events: int) -> None: ...
    def modify(self, fd: int, events: int) -> None: ...
    def unregister(self, fd: int) -> None: ...
    def forget(self, fd: int) -> None: ...
    def poll(self) -> list[tuple[int, int]]: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...


class _Epoll:
    """``select.epoll``, level-triggered; ``poll`` never blocks."""

    def __init__(self) -> None:
        self._epoll = select.epoll()

    def register(self, fd: int, events: int) -> None:
        self._epoll.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        self._epoll.modify(fd, events)

    def unregister(self, fd: int) -> None:
        self._epoll.unregister(fd)

    def forget(self, fd: int) -> None:
        """Nothing to do: closing the descriptor removes it from the epoll."""

    def poll(self) -> list[tuple[int, int]]:
        return self._epoll.poll(0, _MAX_EVENTS)

    def fileno(self) -> int:
        return self._epoll.fileno()

    def close(self) -> None:
        self._epoll.close()


class _PortableSelector:
    """`selectors.DefaultSelector` (kqueue, poll...) behind `_Poller`."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()

    @staticmethod
    def _mask(events: int) -> int:
        return (selectors.EVENT_READ if events & READABLE else 0) | (
            selectors.EVENT_WRITE if events & WRITABLE else 0
        )

    def register(self, fd: int, events: int) -> None:
        self._selector.register(fd, self._mask(events))

    def modify(self, fd: int, events: int) -> None:
        self._selector.modify(fd, self._mask(events))

    def unregister(self, fd: int) -> None:
        self._selector.unregister(fd)

    def forget(self, fd: int) -> None:
        self._selector.unregister(fd)  # its own map would keep the fd

    def poll(self) -> list[tuple[int, int]]:
        return [
            (
                key.fd,
                (READABLE if mask & selectors.EVENT_READ else 0)
                | (WRITABLE if mask & selectors.EVENT_WRITE else 0),
            )
            for key, mask in self._selector.select(0)
        ]

    def fileno(self) -> int:
        return self._selector.fileno()

    def close(self) -> None:
        self._selector.close()


def _make_poller() -> _Poller:
    if hasattr(select, "epoll"):
        return _Epoll()
    return _PortableSelector()


class Reactor:
    """A selector with persistent registrations and a timer heap."""

    def __init__(self) -> None:
        self._poller = _make_poller()
        self._handlers: dict[int, Handler] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._compact_at = _COMPACT_AT_LEAST
        self._deferred: list[tuple[Callable[[], None], Handler]] = []
        self._sequence = itertools.count()
        # The timer task's sleep; its deadline is the earliest timer's.
        self._timer_sleep = trio.CancelScope()
        #: trio's clock (``trio.current_time()`` without the run-context
        #: lookups: handlers read it per chunk).
        self.now: Callable[[], float] = trio.lowlevel.current_clock().current_time

    # -- registrations -------------------------------------------------------

    def register(self, fd: int, events: int, handler: Handler) -> None:
        """Watch *fd* for *events* (`READABLE` | `WRITABLE`) until unregistered."""
        self._poller.register(fd, events)
        self._handlers[fd] = handler

    def watch(
        self, fd: int, current: int | None, wanted: int | None, handler: Handler
    ) -> int | None:
        """Move *fd*'s registration from *current* to *wanted* (None: not
        registered) with the one call that takes; returns *wanted*."""
        if wanted != current:
            if wanted is None:
                self.unregister(fd)
            elif current is None:
                self.register(fd, wanted, handler)
            else:
                self.modify(fd, wanted)
        return wanted

    def modify(self, fd: int, events: int) -> None:
        """Change what a registered *fd* is watched for."""
        self._poller.modify(fd, events)

    def unregister(self, fd: int) -> None:
        """Stop watching *fd*; call before the descriptor is closed."""
        del self._handlers[fd]
        self._poller.unregister(fd)

    def forget(self, fd: int) -> None:
        """Stop watching *fd*, which the caller closes before it returns to
        the reactor (and no duplicate of it stays open): with epoll the close
        removes it from the selector, an ``epoll_ctl`` less than `unregister`.
        """
        del self._handlers[fd]
        self._poller.forget(fd)

    def defer(self, callback: Callable[[], None], handler: Handler) -> None:
        """Call *callback* once the handlers of the current batch of ready
        descriptors have run (it raising is *handler*'s bug: its ``failed``
        is called). Only from a handler's ``ready``: outside a batch, nothing
        would call it before the next one."""
        self._deferred.append((callback, handler))

    def call_at(self, deadline: float, callback: Callable[[], None]) -> None:
        """Call *callback* from the reactor once trio's clock passes
        *deadline*. There is no cancelling: a callback checks whether it is
        still wanted (and a `Cancellable` lets go of what it holds)."""
        timers = self._timers
        heapq.heappush(timers, (deadline, next(self._sequence), callback))
        if len(timers) > self._compact_at:
            self._compact_timers()
        # Only an earlier deadline moves the sleep (setting it costs trio a
        # deadline-heap update even when the value stays).
        if deadline < self._timer_sleep.deadline:  # noqa: PLR1730
            self._timer_sleep.deadline = deadline

    def _compact_timers(self) -> None:
        """Drop the called-off timers from the heap (in place: the timer task
        holds it)."""
        timers = self._timers
        timers[:] = [
            timer
            for timer in timers
            if not (isinstance(timer[2], Cancellable) and timer[2].cancelled)
        ]
        heapq.heapify(timers)
        self._compact_at = max(_COMPACT_AT_LEAST, 2 * len(timers))

    # -- the loops ---------------------------------------------------------------

    async def run(self) -> None:
        """Drive the registered descriptors and the timers until cancelled.

        Two tasks: this one waits for readiness without a deadline (a cancel
        scope per wake-up would cost more than the rest of a wake-up's
        bookkeeping), a second one sleeps until the earliest timer. A new
        timer moves that sleep only when it is the earliest; with one idle
        timeout for all, a new connection's timer never is.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run_timers)
                await self._run_io()
        finally:
            self._poller.close()

    async def _run_io(self) -> None:
        poller = self._poller
        handlers = self._handlers
        selector_fd = poller.fileno()
        wait_readable = trio.lowlevel.wait_readable
        while True:
            await wait_readable(selector_fd)
            while True:
                events = poller.poll()
                for fd, mask in events:
                    handler = handlers.get(fd)
                    if handler is None:
                        # Unregistered by an earlier handler. A forgotten
                        # descriptor its owner failed to close would be
                        # reported again at each poll: drop it for good.
                        with contextlib.suppress(OSError, KeyError, ValueError):
                            poller.unregister(fd)
                        continue
                    try:
                        handler.ready(fd, mask)
                    except Exception as exc:  # a bug: logged, ends that connection
                        LOGGER.exception("reactor: handler failed on fd %d", fd)
                        handler.failed(exc)
                if self._deferred:
                    self._run_deferred()
                # Not kept while waiting: it may have ended (a relay, its
                # streams and buffers).
                handler = None
                if len(events) < _MAX_EVENTS:
                    break
                await trio.lowlevel.checkpoint()

    def _run_deferred(self) -> None:
        while self._deferred:
            deferred, self._deferred = self._deferred, []
            for callback, handler in deferred:
                try:
                    callback()
                except Exception as exc:  # a bug: logged, ends that connection
                    LOGGER.exception("reactor: deferred call failed")
                    handler.failed(exc)

    async def _run_timers(self) -> None:
        timers = self._timers
        while True:
            with trio.CancelScope(
                deadline=timers[0][0] if timers else math.inf
            ) as self._timer_sleep:
                await trio.sleep_forever()
            now = trio.current_time()
            while timers and timers[0][0] <= now:
                _, _, callback = heapq.heappop(timers)
                try:
                    callback()
                except Exception:
                    LOGGER.exception("reactor: timer callback failed")


_REACTOR: trio.lowlevel.RunVar[Reactor] = trio.lowlevel.RunVar("tlsedge_reactor")


def current_reactor() -> Reactor:
    """The reactor of the current trio run, started on first use."""
    try:
        return _REACTOR.get()
    except LookupError:
        pass
    reactor = Reactor()
    _REACTOR.set(reactor)
    trio.lowlevel.spawn_system_task(reactor.run, name="tlsedge reactor")
    return reactor
