"""The edge's drain signal, and the waits it ends at once.

Set once, when the edge drains (SIGTERM, ``Edge.drain()``). Work in flight
reads it (``is_set``) at its next decision point: an HTTP response then
carries ``Connection: close``. A wait that the drain must end at once (an
HTTP connection idle between requests) registers its cancel scope while it
waits, so that no task per connection has to sit waiting for the signal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["Drain"]


class Drain:
    """A one-shot drain signal (see the module docstring)."""

    __slots__ = ("_event", "_scopes")

    def __init__(self) -> None:
        self._event = trio.Event()
        self._scopes: set[trio.CancelScope] = set()

    def is_set(self) -> bool:
        """True once the edge drains."""
        return self._event.is_set()

    def set(self) -> None:
        """Drain: wake `wait`, cancel every registered wait."""
        self._event.set()
        for scope in self._scopes:
            scope.cancel()
        self._scopes.clear()

    async def wait(self) -> None:
        """Return once the edge drains."""
        await self._event.wait()

    @contextmanager
    def cancels(self, scope: trio.CancelScope) -> Iterator[None]:
        """Within this block, draining cancels *scope* (at once if drained)."""
        if self._event.is_set():
            scope.cancel()
            yield
            return
        self._scopes.add(scope)
        try:
            yield
        finally:
            self._scopes.discard(scope)
