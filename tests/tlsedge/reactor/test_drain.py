"""The drain signal: it ends registered waits at once, and only those."""

from __future__ import annotations

import trio
import trio.testing

from tlsedge._reactor.drain import Drain


async def test_set_cancels_the_registered_waits_and_wakes_wait() -> None:
    drain = Drain()
    woken = trio.Event()

    async def waiter() -> None:
        await drain.wait()
        woken.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        with trio.CancelScope() as idle, drain.cancels(idle):
            with trio.CancelScope() as busy:  # not registered: runs on
                await trio.testing.wait_all_tasks_blocked()
                drain.set()
                await trio.lowlevel.checkpoint()
            await trio.sleep_forever()
    assert idle.cancelled_caught
    assert not busy.cancelled_caught
    assert drain.is_set()
    assert woken.is_set()


async def test_a_wait_registered_after_the_drain_is_cancelled_at_once() -> None:
    drain = Drain()
    drain.set()
    with trio.CancelScope() as scope, drain.cancels(scope):
        await trio.sleep_forever()
    assert scope.cancelled_caught


async def test_a_wait_that_ended_is_not_cancelled_later() -> None:
    drain = Drain()
    with trio.CancelScope() as scope, drain.cancels(scope):
        await trio.lowlevel.checkpoint()
    drain.set()
    assert not scope.cancel_called
