"""Message bodies: how each is framed, and a strict chunked decoder (pure).

A body is framed one of four ways (`BodyKind`): none, a Content-Length, chunked,
or (responses only) until the connection closes. `ChunkedDecoder` takes the
bytes of a chunked body as they arrive, checks every framing rule as it goes
(strict chunk-size lines, at most 16 hex digits, CRLF after each chunk's data,
trailer lines like header lines) and hands back the data it carried, the
trailer fields, and where the body ended: the bytes after it are the next
message and must never be taken for part of this one.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from typing import Final

from tlsedge._http.head import (
    CONTROL_RE,
    TOKEN,
    TOKEN_RE,
    HeadRejectedError,
    RequestRejectedError,
)

__all__ = [
    "CHUNKED_BODY",
    "LENGTH_BODY",
    "MAX_CHUNK_LINE",
    "MAX_CHUNK_SIZE_DIGITS",
    "NO_BODY",
    "NO_BODY_STATUSES",
    "UNTIL_CLOSE_BODY",
    "BodyKind",
    "ChunkedDecoder",
    "encode_chunk",
    "encode_field_lines",
    "encode_fields",
    "encode_last_chunk",
]

Header = tuple[bytes, bytes]

#: Statuses whose responses never have a body (RFC 9110 section 6.4.1).
NO_BODY_STATUSES: Final = frozenset({204, 304})
#: A chunk-size line (size and extensions) longer than this is an attack.
MAX_CHUNK_LINE: Final = 4096
#: Chunk sizes beyond 16 hex digits overflow 64-bit parsers (a smuggling vector).
MAX_CHUNK_SIZE_DIGITS: Final = 16

_CHUNK_LINE_RE: Final = re.compile(
    rb"([0-9A-Fa-f]{1,%d})" % MAX_CHUNK_SIZE_DIGITS
    + rb"(?:;"
    + TOKEN
    + rb"(?:=(?:"
    + TOKEN
    + rb'|"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"))?)*'
)


class BodyKind(enum.Enum):
    """How a message's body is delimited."""

    NONE = "none"
    LENGTH = "length"  # Content-Length bytes
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until_close"  # responses without framing: ends at EOF


# The members as module constants (as `tlsedge._pipeline.http.attempt`'s progress): a
# member looked up on its enum class costs about ten times a global's lookup
# (Python 3.11), and every message asks several times.
NO_BODY: Final = BodyKind.NONE
LENGTH_BODY: Final = BodyKind.LENGTH
CHUNKED_BODY: Final = BodyKind.CHUNKED
UNTIL_CLOSE_BODY: Final = BodyKind.UNTIL_CLOSE


def encode_chunk(data: bytes) -> bytes:
    """*data* as one chunk (empty data would end the body: give none)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def encode_fields(first_line: bytes, fields: Sequence[Header]) -> bytes:
    """*first_line* (with its CRLF), the field lines, then the blank line: a
    head (after a start line) or a trailer section (after the last chunk)."""
    lines = [name + b": " + value + b"\r\n" for name, value in fields]
    return b"".join([first_line, *lines, b"\r\n"])


def encode_field_lines(fields: Sequence[Header]) -> bytes:
    """The field lines of *fields* (``name: value`` CRLF each), no blank line."""
    return b"".join([name + b": " + value + b"\r\n" for name, value in fields])


def encode_last_chunk(trailers: list[Header]) -> bytes:
    """The last chunk and the trailer section."""
    if not trailers:
        return b"0\r\n\r\n"
    return encode_fields(b"0\r\n", trailers)


class _State(enum.Enum):
    SIZE = "size"
    DATA = "data"
    DATA_END = "data_end"
    TRAILER = "trailer"
    DONE = "done"


class ChunkedDecoder:
    """Decode and strictly check a chunked body as it streams.

    ``feed`` returns the data the bytes carried (a list of pieces, no chunk
    framing) and raises on the first framing error; once ``done``,
    ``trailers`` holds the trailer fields (values without surrounding
    whitespace) and ``excess`` counts the bytes fed after the end.

    Args:
        max_trailer_bytes: Total size limit of the trailer section.
        max_trailers: Most trailer fields.
        rejected: Builds the error to raise from an HTTP status and a reason
            (default `RequestRejectedError`: 400 for framing, 431 for trailers
            beyond the limits).
    """

    __slots__ = (
        "_line",
        "_max_trailer_bytes",
        "_max_trailers",
        "_rejected",
        "_remaining",
        "_state",
        "_trailer_bytes",
        "excess",
        "trailers",
    )

    def __init__(
        self,
        *,
        max_trailer_bytes: int,
        max_trailers: int,
        rejected: Callable[[int, str], HeadRejectedError] = RequestRejectedError,
    ) -> None:
        self._state = _State.SIZE
        self._line = bytearray()
        self._remaining = 0
        self._max_trailer_bytes = max_trailer_bytes
        self._max_trailers = max_trailers
        self._rejected = rejected
        self._trailer_bytes = 0
        self.trailers: list[Header] = []
        self.excess = 0

    @property
    def done(self) -> bool:
        """True once the last chunk and the trailer section were seen."""
        return self._state is _State.DONE

    def feed(self, data: bytes) -> list[bytes]:
        """Take the next bytes of the body; return the data they carried."""
        out: list[bytes] = []
        pos, end = 0, len(data)
        while pos < end:
            state = self._state
            if state is _State.DONE:
                self.excess += end - pos
                break
            if state is _State.DATA:
                take = min(self._remaining, end - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = _State.DATA_END
                continue
            newline = data.find(b"\n", pos)
            stop = end if newline < 0 else newline + 1
            self._line += data[pos:stop]
            pos = stop
            trailer = state is _State.TRAILER
            if len(self._line) > (
                self._max_trailer_bytes if trailer else MAX_CHUNK_LINE
            ):
                raise self._rejected(
                    431 if trailer else 400, "chunk line or trailer too long"
                )
            if newline < 0:
                break
            line = bytes(self._line)
            self._line.clear()
            if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
                raise self._rejected(400, "bare CR or LF in chunked framing")
            self._line_done(line[:-2])
        return out

    def take(self, buffer: bytearray) -> bytes:
        """Decode what *buffer* holds and empty it, except for the bytes after
        the end of the body (the next message), which stay in it."""
        raw = bytes(buffer)
        buffer.clear()
        data = b"".join(self.feed(raw))
        if self.done and self.excess:
            buffer += raw[len(raw) - self.excess :]
        return data

    def _line_done(self, line: bytes) -> None:
        state = self._state
        if state is _State.SIZE:
            match = _CHUNK_LINE_RE.fullmatch(line)
            if match is None:
                raise self._rejected(400, "malformed chunk size line")
            size = int(match.group(1), 16)
            if size:
                self._remaining = size
                self._state = _State.DATA
            else:
                self._state = _State.TRAILER
        elif state is _State.DATA_END:
            if line:
                raise self._rejected(400, "chunk data longer than its size")
            self._state = _State.SIZE
        elif not line:
            self._state = _State.DONE
        else:
            self._trailer_bytes += len(line) + 2
            if (
                len(self.trailers) >= self._max_trailers
                or self._trailer_bytes > self._max_trailer_bytes
            ):
                raise self._rejected(431, "trailer section too large")
            name, colon, value = line.partition(b":")
            if line[:1] in {b" ", b"\t"} or not colon or not TOKEN_RE.fullmatch(name):
                raise self._rejected(400, "malformed trailer field")
            if CONTROL_RE.search(line):
                raise self._rejected(400, "control character in a trailer")
            self.trailers.append((name, value.strip(b" \t")))
