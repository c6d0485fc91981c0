"""The link between the supervisor and one worker: a socket pair, messages.

The supervisor of ``edge.workers > 1`` makes a Unix socket pair for each
worker it starts and passes one end as ``--worker FD``; the link lasts as
long as the worker. Each message is one line of JSON, ``{"type": ...}`` and
the fields of one of the dataclasses below (a configuration's text travels as
a JSON string, newlines escaped). Both ends are tlsedge, so a line that is
not a known message is a bug: `LinkError`.

Supervisor to worker: `Start` (first, once), `Prepare` and `Settle` (a
reload's two phases, matched by ``serial``), `Record` (a reload refused
before any worker saw it). Worker to supervisor: `Ready` or `StartFailed`
(once), `Prepared` or `PrepareFailed` (per `Prepare`).
"""

from __future__ import annotations

import dataclasses
import json
import socket
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import trio

from tlsedge._core.reload import ReloadRecord

__all__ = [
    "MAX_MESSAGE",
    "Link",
    "LinkError",
    "Message",
    "PrepareFailed",
    "Prepared",
    "Ready",
    "Record",
    "Settle",
    "Start",
    "StartFailed",
    "decode",
    "encode",
]

#: The longest message line accepted (a configuration file's text fits).
MAX_MESSAGE: Final = 16 * 1024 * 1024


class LinkError(Exception):
    """A line on the link that is not a message (a bug, not bad input)."""


@dataclass(frozen=True, slots=True)
class Start:
    """Supervisor: run this configuration (the running one, not the file's)."""

    #: The configuration file's text as the supervisor loaded it.
    text: str
    #: The process log's format (``--log-format``, else ``edge.log_format``
    #: when the supervisor started).
    log_format: str
    reloads: ReloadRecord


@dataclass(frozen=True, slots=True)
class Prepare:
    """Supervisor: prepare a reload to this text; answer, change nothing yet."""

    serial: int
    text: str


@dataclass(frozen=True, slots=True)
class Settle:
    """Supervisor: commit (or abort) the reload *serial*; the edge's record."""

    serial: int
    commit: bool
    reloads: ReloadRecord


@dataclass(frozen=True, slots=True)
class Record:
    """Supervisor: the edge's reload record changed (a reload was refused)."""

    reloads: ReloadRecord


@dataclass(frozen=True, slots=True)
class Ready:
    """Worker: every listener is bound; serving."""


@dataclass(frozen=True, slots=True)
class StartFailed:
    """Worker: cannot start (then exits); *message* says why."""

    message: str


@dataclass(frozen=True, slots=True)
class Prepared:
    """Worker: reload *serial* is prepared; waiting for `Settle`."""

    serial: int


@dataclass(frozen=True, slots=True)
class Committed:
    """Worker: reload *serial* is committed: new connections get it."""

    serial: int


@dataclass(frozen=True, slots=True)
class PrepareFailed:
    """Worker: reload *serial* cannot be applied; *message* says why."""

    serial: int
    message: str


Message: TypeAlias = (
    Start
    | Prepare
    | Settle
    | Record
    | Ready
    | StartFailed
    | Prepared
    | Committed
    | PrepareFailed
)

_TYPES: Final[dict[str, type[Message]]] = {
    cls.__name__: cls
    for cls in (
        Start,
        Prepare,
        Settle,
        Record,
        Ready,
        StartFailed,
        Prepared,
        Committed,
        PrepareFailed,
    )
}


def encode(message: Message) -> bytes:
    """One message as its line (with the newline)."""
    data: dict[str, Any] = {"type": type(message).__name__}
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        data[field.name] = value.to_json() if isinstance(value, ReloadRecord) else value
    return json.dumps(data, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Message:
    """The message of one line (without its newline).

    Raises:
        LinkError: the line is not a message.
    """
    try:
        data = json.loads(line)
        cls = _TYPES[data.pop("type")]
        if "reloads" in data:
            data["reloads"] = ReloadRecord.from_json(data["reloads"])
        return cls(**data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LinkError(f"not a message: {line[:200]!r}: {exc}") from exc


class Link:
    """One end of a supervisor-worker link, over a connected Unix socket.

    One task may send while another receives; two senders (or two
    receivers) at once are trio's `trio.BusyResourceError`.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self._buffer = bytearray()

    @classmethod
    def from_fd(cls, fd: int) -> Link:
        """The link on descriptor *fd* (a worker's ``--worker FD``)."""
        return cls(socket.socket(fileno=fd))

    async def send(self, message: Message) -> bool:
        """Send *message*; False if the other end is gone."""
        try:
            await self._stream.send_all(encode(message))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    async def receive(self) -> Message | None:
        """The next message; None once the other end is gone.

        Raises:
            LinkError: the other end sent what is not a message.
        """
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > MAX_MESSAGE:
                raise LinkError(f"a message longer than {MAX_MESSAGE} bytes")
            try:
                data = await self._stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                return None
            self._buffer += data
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return decode(line)

    async def aclose(self) -> None:
        """Close this end (the other end's `receive` returns None)."""
        await self._stream.aclose()

    async def __aenter__(self) -> Link:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
