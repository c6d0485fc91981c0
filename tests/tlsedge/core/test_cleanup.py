"""Cleanup: the connection's callbacks, run last-added first."""

from __future__ import annotations

import pytest

from tlsedge._core.cleanup import Cleanup


def test_callbacks_run_last_added_first_once() -> None:
    ran: list[int] = []
    with Cleanup() as cleanup:
        cleanup.callback(lambda: ran.append(0))
        cleanup.callback(lambda: ran.append(1))
        cleanup.callback(lambda: ran.append(2))
    assert ran == [2, 1, 0]
    cleanup.close()  # nothing left to run
    assert ran == [2, 1, 0]


def test_pop_all_hands_every_callback_over() -> None:
    ran: list[str] = []
    with Cleanup() as cleanup:
        cleanup.callback(lambda: ran.append("first"))
        cleanup.callback(lambda: ran.append("second"))
        taken = cleanup.pop_all()
    assert ran == []  # the original ran nothing
    taken.close()
    assert ran == ["second", "first"]


def test_every_callback_runs_and_the_first_error_is_raised() -> None:
    ran: list[str] = []

    def fails(name: str) -> None:
        ran.append(name)
        raise RuntimeError(name)

    cleanup = Cleanup()
    cleanup.callback(lambda: ran.append("last"))
    cleanup.callback(lambda: fails("second"))
    cleanup.callback(lambda: fails("first"))
    with pytest.raises(RuntimeError, match="first"):
        cleanup.close()
    assert ran == ["first", "second", "last"]
