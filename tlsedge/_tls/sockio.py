"""Socket reads and writes that go through trio's scheduler only when they must wait.

``trio.SocketStream`` makes every call a full checkpoint: a read or write that
succeeds at once still yields to the scheduler (``cancel_shielded_checkpoint``),
and each call enters a few context managers. On the hot path of a proxy, where
most writes and many reads succeed at once, that costs more than the work
(../shared/reference/perf-study.md: about 19 µs of CPU per trio wait).
Established connections no longer come here (the reactor drives them); its
user is `TLSStream`'s async API, i.e. what a task still does over TLS:
upstream handshakes, health checks, the 403 answer, and library users.

`receive_some` and `send_all` take any stream; for a `trio.SocketStream` they
call ``read`` and ``write`` on its descriptor directly (non-blocking, as trio
set it), waiting with `trio.lowlevel.wait_readable` / `wait_writable` only
when the kernel says so (other streams: their own methods).
They stay checkpoints for cancellation: each checks the cancel status before
it reads or writes anything (`trio.lowlevel.checkpoint_if_cancelled`, no
yield), as trio's own socket calls do, so a cancellation never loses data
that was read or cuts a write in the middle of its bytes; and one in every
`FAIR_SHARE` operations that did not wait yields anyway (shielded: the
operation is done), so a connection whose peers are always ready cannot
starve the others. Errors are the stream's:
`trio.BrokenResourceError` for a failed socket, `trio.ClosedResourceError`
for a closed one. Nothing else is different; the caller still closes the
stream with its own methods.
"""

from __future__ import annotations

import errno
import os
from typing import Final

import trio

__all__ = ["FAIR_SHARE", "receive_some", "send_all"]

#: Operations that did not wait, across all tasks, between two forced yields.
FAIR_SHARE: Final = 16


class _Budget:
    not_waited = 0


_BUDGET: Final = _Budget()


def _must_yield() -> bool:
    """Count an operation that did not wait; True once per `FAIR_SHARE`."""
    budget = _BUDGET
    budget.not_waited += 1
    if budget.not_waited < FAIR_SHARE:
        return False
    budget.not_waited = 0
    return True


def _closed() -> trio.ClosedResourceError:
    return trio.ClosedResourceError("the socket was closed")


def _fileno(stream: trio.SocketStream) -> int:
    fd = stream.socket.fileno()
    if fd < 0:
        raise _closed()
    return fd


async def receive_some(
    stream: trio.abc.ReceiveStream, max_bytes: int, *, wait_first: bool = False
) -> bytes:
    """``stream.receive_some(max_bytes)``; ``b""`` at EOF.

    *wait_first*: the caller expects nothing to be there yet (the previous
    read drained the socket, or the peer has yet to answer): wait for
    readability before reading, instead of a read that would fail.
    """
    if type(stream) is not trio.SocketStream:
        return bytes(await stream.receive_some(max_bytes))
    fd = _fileno(stream)
    # Cancelled before the read, never after it: the data must not be lost.
    await trio.lowlevel.checkpoint_if_cancelled()
    if not wait_first:
        try:
            data = os.read(fd, max_bytes)
        except BlockingIOError:
            pass
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc
        else:
            if _must_yield():
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data
    while True:
        await trio.lowlevel.wait_readable(fd)
        fd = _fileno(stream)
        try:
            return os.read(fd, max_bytes)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc


async def send_all(stream: trio.abc.SendStream, data: bytes) -> None:
    """``stream.send_all(data)``."""
    if type(stream) is not trio.SocketStream:
        await stream.send_all(data)
        return
    fd = _fileno(stream)
    # Cancelled before anything is written, never after a part of it.
    await trio.lowlevel.checkpoint_if_cancelled()
    view = memoryview(data)
    waited = False
    while view:
        try:
            sent = os.write(fd, view)
        except BlockingIOError:
            waited = True
            await trio.lowlevel.wait_writable(fd)
            fd = _fileno(stream)
            continue
        except OSError as exc:
            if exc.errno == errno.EBADF:
                raise _closed() from exc
            raise trio.BrokenResourceError(f"socket write failed: {exc}") from exc
        view = view[sent:]
    if not waited and _must_yield():
        await trio.lowlevel.cancel_shielded_checkpoint()
