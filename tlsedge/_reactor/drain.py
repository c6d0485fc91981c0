"""The edge's drain signal, and the waits it ends at once.

Set once, when the edge drains (SIGTERM, ``Edge.drain()``). Work in flight
reads it (``is_set``) at its next decision point: an HTTP response then
carries ``Connection: close``. A wait that the drain must end at once (an
HTTP connection idle between requests) registers a callback (or its cancel
scope) while it waits, so that no task per connection has to sit waiting for
the signal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

__all__ = ["Drain"]


class Drain:
    """A one-shot drain signal (see the module docstring)."""

    __slots__ = ("_callbacks", "_event", "_set")

    def __init__(self) -> None:
        self._event = trio.Event()
        # The event's flag, kept here too: HTTP reads it twice per request,
        # and this is one Python call where the event's is two.
        self._set = False
        self._callbacks: set[Callable[[], None]] = set()

    def is_set(self) -> bool:
        """True once the edge drains."""
        return self._set

    def set(self) -> None:
        """Drain: wake `wait`, end every registered wait."""
        self._set = True
        self._event.set()
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()

    async def wait(self) -> None:
        """Return once the edge drains."""
        await self._event.wait()

    def call_on_set(self, callback: Callable[[], None]) -> None:
        """Call *callback* once when the edge drains (at once if it did),
        unless `forget` comes first. It must not block."""
        if self._set:
            callback()
        else:
            self._callbacks.add(callback)

    def forget(self, callback: Callable[[], None]) -> None:
        """Undo `call_on_set` (nothing if *callback* was called or never set)."""
        self._callbacks.discard(callback)

    @contextmanager
    def cancels(self, scope: trio.CancelScope) -> Iterator[None]:
        """Within this block, draining cancels *scope* (at once if drained)."""
        cancel = scope.cancel
        self.call_on_set(cancel)
        try:
            yield
        finally:
            self.forget(cancel)
