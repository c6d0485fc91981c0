"""What a connection gives back when it ends: callbacks run in reverse order.

`contextlib.ExitStack` does this too, but wraps every callback in a closure
with a ``__wrapped__`` attribute (a dict per function): about 800 bytes per
callback, 3.2 KiB per relayed connection, which is most of what an idle
connection on the reactor costs. `Cleanup` keeps the callables in a list.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

__all__ = ["Cleanup"]


class Cleanup:
    """Callbacks to run, last added first, when the block (or `close`) ends."""

    __slots__ = ("_callbacks",)

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], object]] = []

    def callback(self, function: Callable[[], object]) -> None:
        """Run *function* at the end (bind arguments with a lambda or partial)."""
        self._callbacks.append(function)

    def pop_all(self) -> Cleanup:
        """A new `Cleanup` that takes over every callback; this one is left empty."""
        taken = Cleanup()
        taken._callbacks, self._callbacks = self._callbacks, []
        return taken

    def close(self) -> None:
        """Run the callbacks, last added first. They all run: the first
        exception one raises is raised once the others ran."""
        callbacks, self._callbacks = self._callbacks, []
        error: BaseException | None = None
        for function in reversed(callbacks):
            try:
                function()
            except BaseException as exc:  # noqa: BLE001 (re-raised below)
                if error is None:
                    error = exc
        if error is not None:
            raise error

    def __enter__(self) -> Cleanup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
