"""The supervisor-worker link: messages as lines, over a real socket pair."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.lowlevel

from tlsedge._control.worker_link import (
    MAX_MESSAGE,
    Committed,
    Link,
    LinkError,
    Message,
    Prepare,
    Prepared,
    PrepareFailed,
    Ready,
    Record,
    Settle,
    Start,
    StartFailed,
    decode,
    encode,
)
from tlsedge._core.reload import ReloadRecord, ReloadResult

RECORD = ReloadRecord(loaded=1.0).after(ReloadResult.REFUSED, 2.0, "why\nnot")
TEXT = '[edge]\nworkers = 2\n\n[[listeners]]\nname = "é \\" x"\n'

MESSAGES: list[Message] = [
    Start(TEXT, "json", RECORD),
    Prepare(7, TEXT),
    Settle(7, True, RECORD),
    Settle(8, False, ReloadRecord(loaded=3.0)),
    Record(RECORD),
    Ready(),
    StartFailed("listeners[0].bind: cannot bind"),
    Prepared(7),
    Committed(7),
    PrepareFailed(7, "edge.admin: in use"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_is_one_line_and_decodes_to_itself(message: Message) -> None:
    line = encode(message)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert decode(line[:-1]) == message


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"not json",
        b"[]",
        b'{"no": "type"}',
        b'{"type": "Unknown"}',
        b'{"type": "Prepared"}',
        b'{"type": "Prepared", "serial": 1, "extra": 2}',
        b'{"type": "Record", "reloads": {"loaded": 1}}',
    ],
)
def test_a_line_that_is_not_a_message_is_a_link_error(line: bytes) -> None:
    with pytest.raises(LinkError, match="not a message"):
        decode(line)


def link_pair() -> tuple[Link, Link]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Link(ours), Link.from_fd(theirs.detach())


async def test_messages_cross_in_order_and_eof_is_none() -> None:
    supervisor, worker = link_pair()
    async with supervisor, worker:
        for message in MESSAGES:
            assert await supervisor.send(message)
        for message in MESSAGES:
            assert await worker.receive() == message
        await supervisor.aclose()
        assert await worker.receive() is None
        assert not await worker.send(Ready())  # the other end is gone


async def test_a_message_split_over_many_writes() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker = Link(theirs)
    line = encode(Prepare(1, "x" * 200_000)) + encode(Ready())
    async with worker, trio.open_nursery() as nursery:

        async def write() -> None:
            with ours:
                for start in range(0, len(line), 1000):
                    ours.sendall(line[start : start + 1000])
                    await trio.lowlevel.checkpoint()

        nursery.start_soon(write)
        assert await worker.receive() == Prepare(1, "x" * 200_000)
        assert await worker.receive() == Ready()
        assert await worker.receive() is None


async def test_a_line_without_end_is_refused_past_the_limit() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    worker = Link(theirs)
    async with worker, trio.open_nursery() as nursery:

        async def flood() -> None:
            sock = trio.socket.from_stdlib_socket(ours)
            with sock:
                chunk = b"x" * 65536
                for _ in range(MAX_MESSAGE // len(chunk) + 2):
                    await sock.send(chunk)

        nursery.start_soon(flood)
        with pytest.raises(LinkError, match="longer than"):
            await worker.receive()
        nursery.cancel_scope.cancel()
