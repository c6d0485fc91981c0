"""RFC 9113 (and RFC 7541 where it bites) case by case, as h2spec's generic,
http2 and hpack groups test a server: raw frames on a real socket to an
Edge, and what the RFC demands back (a connection error: GOAWAY with its
code; a stream error: RST_STREAM with its code, the connection serving on;
or the frames ignored: a request after them gets its 200).

Each case opens its own connection after the handshake (preface, SETTINGS
both ways, both ACKed). Header blocks come from a fresh HPACK encoder each,
so a block the edge refuses leaves no table entry the next one refers to.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import h2.errors
import hpack
import pytest
import trio
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from tests.tlsedge.helpers import access_records, wait_until
from tests.tlsedge.pipeline.http.test_h2 import (
    Setup,
    _connection_tasks,
    _tls_client,
    h2_edge,
)
from tlsedge._http.h2session import PREFACE

ErrorCodes = h2.errors.ErrorCodes
Fields = list[tuple[bytes, bytes]]
_F = TypeVar("_F", bound=Frame)

_GET: Fields = [
    (b":method", b"GET"),
    (b":scheme", b"http"),
    (b":path", b"/echo"),
    (b":authority", b"localhost"),
]
_POST: Fields = [(b":method", b"POST"), *_GET[1:]]
_HOLD: Fields = [*_GET[:2], (b":path", b"/hold"), _GET[3]]

# Frame types, flags and setting codes, for frames written byte by byte.
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE = 0, 1, 2, 3, 4, 5
_PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION, _UNKNOWN = 6, 7, 8, 9, 0x16
_END_STREAM, _END_HEADERS, _PADDED, _WITH_PRIORITY = 0x1, 0x4, 0x8, 0x20
_HEADER_TABLE_SIZE, _ENABLE_PUSH, _INITIAL_WINDOW_SIZE, _MAX_FRAME_SIZE = 1, 2, 4, 5


def raw_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """A frame as bytes, whatever its fields say (hyperframe refuses some)."""
    length = len(payload)
    return struct.pack(">HBBBL", length >> 8, length & 0xFF, kind, flags, stream) + (
        payload
    )


def block(fields: Fields) -> bytes:
    return hpack.Encoder().encode(fields)


def settings(*pairs: tuple[int, int]) -> bytes:
    return raw_frame(_SETTINGS, 0, 0, b"".join(struct.pack(">HL", *p) for p in pairs))


def window_update(stream: int, increment: int) -> bytes:
    return raw_frame(_WINDOW_UPDATE, 0, stream, struct.pack(">L", increment))


def ping(payload: bytes = b"h2spec!!", flags: int = 0, stream: int = 0) -> bytes:
    return raw_frame(_PING, flags, stream, payload)


def headers(
    stream: int,
    fields: Fields = _GET,
    *,
    end_stream: bool = True,
    end_headers: bool = True,
) -> bytes:
    flags = _END_STREAM * end_stream | _END_HEADERS * end_headers
    return raw_frame(_HEADERS, flags, stream, block(fields))


def data(stream: int, payload: bytes, *, end_stream: bool = True) -> bytes:
    return raw_frame(_DATA, _END_STREAM * end_stream, stream, payload)


@dataclass
class FrameClient:
    """Raw HTTP/2 frames both ways: writes bytes, reads frames (`frames`),
    ACKs the edge's SETTINGS and decodes its header blocks (`statuses`)."""

    stream: trio.abc.Stream
    frames: list[Frame] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    closed: bool = False
    _buffer: bytearray = field(default_factory=bytearray)
    decoder: hpack.Decoder = field(default_factory=hpack.Decoder)

    async def handshake(self, *pairs: tuple[int, int]) -> None:
        await self.send(PREFACE + settings(*pairs))
        await self.until(lambda c: c.settings_acked)

    @property
    def settings_acked(self) -> bool:
        return any(
            isinstance(f, SettingsFrame) and "ACK" in f.flags for f in self.frames
        )

    async def send(self, *chunks: bytes) -> None:
        await self.stream.send_all(b"".join(chunks))

    async def read(self) -> None:
        try:
            received = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            received = b""
        if not received:
            self.closed = True
            return
        self._buffer += received
        while len(self._buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self._buffer[:9]))
            if len(self._buffer) < 9 + length:
                break
            frame.parse_body(memoryview(self._buffer[9 : 9 + length]))
            del self._buffer[: 9 + length]
            self.frames.append(frame)
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                with contextlib.suppress(trio.BrokenResourceError):
                    await self.send(SettingsFrame(0, flags=["ACK"]).serialize())
            elif isinstance(frame, HeadersFrame):
                fields = dict(self.decoder.decode(frame.data, raw=True))
                if b":status" in fields:
                    self.statuses[frame.stream_id] = int(fields[b":status"])

    async def until(self, done: Callable[[FrameClient], bool]) -> None:
        """Read until ``done(self)`` holds or the edge closes (10 s at most)."""
        with trio.fail_after(10):
            while not done(self) and not self.closed:
                await self.read()

    def of(self, kind: type[_F], stream: int | None = None) -> list[_F]:
        return [
            f
            for f in self.frames
            if isinstance(f, kind) and (stream is None or f.stream_id == stream)
        ]

    def goaway(self) -> GoAwayFrame | None:
        for frame in self.frames:
            if isinstance(frame, GoAwayFrame):
                return frame
        return None

    def reset(self, stream: int) -> int | None:
        """The code of the edge's RST_STREAM on *stream*, if it sent one."""
        for frame in self.frames:
            if isinstance(frame, RstStreamFrame) and frame.stream_id == stream:
                return int(frame.error_code)
        return None

    def ended(self, stream: int) -> bool:
        return self.reset(stream) is not None or any(
            "END_STREAM" in f.flags
            for f in self.frames
            if isinstance(f, HeadersFrame | DataFrame) and f.stream_id == stream
        )

    def __str__(self) -> str:
        """What the edge sent, for assertion messages."""
        seen = [
            f"{type(f).__name__}({f.stream_id}"
            + (f", {ErrorCodes(f.error_code).name}" if hasattr(f, "error_code") else "")
            + ")"
            for f in self.frames
        ]
        return " ".join(seen) + (" EOF" if self.closed else "")

    def data_sizes(self, stream: int) -> list[int]:
        return [len(f.data) for f in self.of(DataFrame, stream)]


# -- what the edge must do ----------------------------------------------------------


Steps = Callable[[FrameClient], Awaitable[None]]


async def _served_after(client: FrameClient, stream: int) -> None:
    """The connection goes on: a request on *stream* gets its 200."""
    await client.send(headers(stream))
    await client.until(lambda c: c.ended(stream) or c.goaway() is not None)
    assert client.goaway() is None, str(client)
    assert client.statuses.get(stream) == 200, str(client)


@dataclass(frozen=True)
class Ignored:
    """The frames are ignored: no error, and a request on *next* after them
    is served."""

    next: int = 1

    async def check(self, client: FrameClient) -> None:
        await _served_after(client, self.next)
        assert not client.of(RstStreamFrame)


@dataclass(frozen=True)
class GoawayWith:
    """A connection error: GOAWAY with *code* (RFC 9113 5.4.1), naming
    *last_stream* if given; *or_close*: or the connection closed without one
    (where the RFC lets it be omitted)."""

    code: ErrorCodes
    last_stream: int | None = None
    or_close: bool = False

    async def check(self, client: FrameClient) -> None:
        await client.until(lambda c: c.goaway() is not None)
        goaway = client.goaway()
        if goaway is None and self.or_close:
            assert client.closed, str(client)
            return
        assert goaway is not None, str(client)
        assert ErrorCodes(goaway.error_code) == self.code, str(client)
        if self.last_stream is not None:
            assert goaway.last_stream_id == self.last_stream


@dataclass(frozen=True)
class ResetWith:
    """A stream error: RST_STREAM on *stream* with one of *codes*, the
    connection serving on (a request on *next*, if given, gets its 200). With
    *or_connection*, where the RFC allows either, GOAWAY with one of the
    codes passes too. *once*: frames on the stream after the reset are
    ignored (RFC 9113 5.1, closed), not reset again."""

    codes: tuple[ErrorCodes, ...]
    stream: int = 1
    next: int | None = 3
    or_connection: bool = False
    once: bool = False

    async def check(self, client: FrameClient) -> None:
        await client.until(
            lambda c: c.reset(self.stream) is not None or c.goaway() is not None
        )
        goaway = client.goaway()
        if goaway is not None and self.or_connection:
            assert ErrorCodes(goaway.error_code) in self.codes, str(client)
            return
        code = client.reset(self.stream)
        assert code is not None, str(client)
        assert ErrorCodes(code) in self.codes, str(client)
        if self.next is not None:
            await _served_after(client, self.next)
        if self.once:
            assert len(client.of(RstStreamFrame, self.stream)) == 1, str(client)


@dataclass(frozen=True)
class PingAck:
    """The edge answers the PING *payload* (and no other) with an ACK, and
    serves on; *or_close*: or it closes the connection, sending nothing."""

    payload: bytes = b"h2spec!!"
    or_close: bool = False

    async def check(self, client: FrameClient) -> None:
        await client.until(lambda c: bool(c.of(PingFrame)) or c.goaway() is not None)
        if self.or_close and (client.closed or client.goaway() is not None):
            assert client.goaway() is None, str(client)
            return
        pings = [(set(f.flags), f.opaque_data) for f in client.of(PingFrame)]
        assert pings == [({"ACK"}, self.payload)], str(client)
        assert client.goaway() is None


@dataclass(frozen=True)
class DataSizes:
    """The response on *stream* comes in DATA frames of *sizes* first (flow
    control), as far as the client's window lets it."""

    sizes: tuple[int, ...]
    stream: int = 1

    async def check(self, client: FrameClient) -> None:
        count = len(self.sizes)
        await client.until(lambda c: len(c.data_sizes(self.stream)) >= count)
        assert client.data_sizes(self.stream)[:count] == list(self.sizes)
        assert client.goaway() is None


Expected = Ignored | GoawayWith | ResetWith | PingAck | DataSizes


@dataclass(frozen=True)
class Case:
    section: str
    name: str
    steps: Steps
    expected: Expected
    settings: tuple[tuple[int, int], ...] = ()
    tls: bool = False
    handshake: bool = True
    http2: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.section} {self.name}"


def sends(*chunks: bytes) -> Steps:
    async def steps(client: FrameClient) -> None:
        await client.send(*chunks)

    return steps


def after_response(first: bytes, *then: bytes) -> Steps:
    """Send *first*, wait for stream 1's response to end, then send *then*."""

    async def steps(client: FrameClient) -> None:
        await client.send(first)
        await client.until(lambda c: c.ended(1))
        await client.send(*then)

    return steps


def after_reset(first: bytes, *then: bytes) -> Steps:
    """Send *first*, wait for the edge to reset stream 1, then send *then*."""

    async def steps(client: FrameClient) -> None:
        await client.send(first)
        await client.until(lambda c: c.reset(1) is not None)
        await client.send(*then)

    return steps


def after_data(count: int, *then: bytes) -> Steps:
    """A request on stream 1, then *then* once *count* DATA frames came."""

    async def steps(client: FrameClient) -> None:
        await client.send(headers(1))
        await client.until(lambda c: len(c.data_sizes(1)) >= count)
        await client.send(*then)

    return steps


def small_table() -> Steps:
    """Two requests read with an HPACK table of 0 bytes: a response that
    indexes a field or refers to one breaks the second's decoding."""

    async def steps(client: FrameClient) -> None:
        client.decoder.header_table_size = 0
        client.decoder.max_allowed_table_size = 0
        await client.send(headers(1), headers(3))
        await client.until(lambda c: c.ended(1) and c.ended(3))

    return steps


def _cancel(stream: int) -> bytes:
    return raw_frame(_RST_STREAM, 0, stream, struct.pack(">L", ErrorCodes.CANCEL))


def fields_of(*extra: tuple[bytes, bytes], base: Fields = _GET) -> Fields:
    return [*base, *extra]


def without(name: bytes) -> Fields:
    return [(n, v) for n, v in _GET if n != name]


_PRIORITY_ON_1 = struct.pack(">LB", 1, 255)  # depends on stream 1, weight 256
_HUFFMAN_EOS = b"\x82\x86\x84\x01\x84\xff\xff\xff\xff"  # :authority, EOS
_UNPADDED_HUFFMAN = b"\x82\x86\x84\x01\x82\x1f\xff"  # 14 bits of padding
_ZERO_PADDED_HUFFMAN = b"\x82\x86\x84\x01\x81\x1c"  # padding not all ones


def _big_block() -> bytes:
    """A request's header block of more than 2^14 bytes (no entry indexed,
    no Huffman coding)."""
    fields = [hpack.NeverIndexedHeaderTuple(b"x-%d" % i, b"x" * 4000) for i in range(5)]
    return hpack.Encoder().encode([*_GET, *fields], huffman=False)


def _indexed(*index: int) -> bytes:
    return b"".join(bytes([0x80 | i]) for i in index)


CASES = [
    # 3.5 HTTP/2 connection preface
    Case("3.5", "preface and SETTINGS: SETTINGS back", sends(), Ignored()),
    Case(
        "3.5",
        "invalid preface over TLS",
        sends(b"INVALID CONNECTION PREFACE\r\n\r\n"),
        # (RFC 9113 3.4: the GOAWAY may be omitted.)
        GoawayWith(ErrorCodes.PROTOCOL_ERROR, or_close=True),
        tls=True,
    ),
    Case(
        "3.4",
        "preface without SETTINGS",
        sends(PREFACE, ping()),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR, or_close=True),
        handshake=False,
    ),
    # 4.1 Frame format
    Case(
        "4.1",
        "unknown frame type",
        sends(raw_frame(_UNKNOWN, 0, 0, b"x" * 8)),
        Ignored(),
    ),
    Case("4.1", "PING with undefined flags", sends(ping(flags=0x16)), PingAck()),
    Case(
        "4.1",
        "HEADERS and DATA with undefined flags",
        sends(
            raw_frame(_HEADERS, _END_HEADERS | 0xD2, 1, block(_POST)),
            raw_frame(_DATA, _END_STREAM | 0xF6, 1, b"x"),
        ),
        Ignored(next=3),
    ),
    Case(
        "4.1",
        "reserved bit of the stream identifier set",
        sends(raw_frame(_HEADERS, _END_STREAM | _END_HEADERS, 0x80000001, block(_GET))),
        Ignored(next=3),
    ),
    # 4.2 Frame size
    Case(
        "4.2",
        "DATA of 2^14 octets",
        sends(headers(1, _POST, end_stream=False), data(1, b"x" * 16384)),
        Ignored(next=3),
    ),
    Case(
        "4.2",
        "DATA above SETTINGS_MAX_FRAME_SIZE",
        sends(headers(1, _POST, end_stream=False), data(1, b"x" * 16385)),
        ResetWith((ErrorCodes.FRAME_SIZE_ERROR,), or_connection=True),
    ),
    Case(
        "4.2",
        "a frame header above SETTINGS_MAX_FRAME_SIZE, its payload to come",
        sends(headers(1, _POST, end_stream=False), data(1, b"x" * (2**24 - 1))[:1000]),
        GoawayWith(ErrorCodes.FRAME_SIZE_ERROR),
    ),
    Case(
        "4.2",
        "HEADERS above SETTINGS_MAX_FRAME_SIZE",
        sends(
            raw_frame(
                _HEADERS,
                _END_STREAM | _END_HEADERS,
                1,
                _big_block(),
            )
        ),
        GoawayWith(ErrorCodes.FRAME_SIZE_ERROR),
    ),
    # 4.3 Header compression and decompression
    Case(
        "4.3",
        "invalid header block fragment",
        sends(raw_frame(_HEADERS, _END_STREAM | _END_HEADERS, 1, b"\x00\x00\x00\x00")),
        GoawayWith(ErrorCodes.COMPRESSION_ERROR),
    ),
    Case(
        "4.3",
        "PRIORITY inside a header block",
        sends(
            headers(1, end_headers=False),
            raw_frame(_PRIORITY, 0, 1, struct.pack(">LB", 0, 255)),
        ),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "4.3",
        "HEADERS of another stream inside a header block",
        sends(headers(1, end_headers=False), headers(3)),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    # 5.1 Stream states
    Case(
        "5.1",
        "idle: DATA",
        sends(data(1, b"x")),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "5.1",
        "idle: RST_STREAM",
        sends(RstStreamFrame(1, error_code=ErrorCodes.CANCEL).serialize()),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "5.1",
        "idle: WINDOW_UPDATE",
        sends(window_update(1, 100)),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "5.1",
        "idle: CONTINUATION",
        sends(ContinuationFrame(1, block(_GET), flags=["END_HEADERS"]).serialize()),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "5.1",
        "half-closed (remote): DATA",
        sends(headers(1, _HOLD), data(1, b"x")),
        ResetWith((ErrorCodes.STREAM_CLOSED,)),
    ),
    Case(
        "5.1",
        "half-closed (remote): HEADERS",
        sends(headers(1, _HOLD), headers(1, [(b"x-late", b"1")])),
        ResetWith((ErrorCodes.STREAM_CLOSED,)),
    ),
    Case(
        "5.1",
        "half-closed (remote): CONTINUATION",
        sends(
            headers(1, _HOLD),
            ContinuationFrame(
                1, block([(b"x-late", b"1")]), flags=["END_HEADERS"]
            ).serialize(),
        ),
        ResetWith(
            (ErrorCodes.STREAM_CLOSED, ErrorCodes.PROTOCOL_ERROR), or_connection=True
        ),
    ),
    Case(
        "5.1",
        "closed by RST_STREAM: DATA",
        sends(
            headers(1, _POST, end_stream=False),
            RstStreamFrame(1, error_code=ErrorCodes.CANCEL).serialize(),
            data(1, b"x"),
        ),
        ResetWith((ErrorCodes.STREAM_CLOSED,), or_connection=True),
    ),
    Case(
        "5.1",
        "closed by RST_STREAM: HEADERS",
        sends(
            headers(1, _POST, end_stream=False),
            RstStreamFrame(1, error_code=ErrorCodes.CANCEL).serialize(),
            headers(1, [(b"x-late", b"1")]),
        ),
        ResetWith((ErrorCodes.STREAM_CLOSED,), or_connection=True),
    ),
    Case(
        "5.1",
        "closed by RST_STREAM: CONTINUATION",
        sends(
            headers(1, _POST, end_stream=False),
            RstStreamFrame(1, error_code=ErrorCodes.CANCEL).serialize(),
            ContinuationFrame(
                1, block([(b"x-late", b"1")]), flags=["END_HEADERS"]
            ).serialize(),
        ),
        ResetWith(
            (ErrorCodes.STREAM_CLOSED, ErrorCodes.PROTOCOL_ERROR), or_connection=True
        ),
    ),
    pytest.param(
        Case(
            "5.1",
            "closed by the edge's RST_STREAM: DATA ignored",
            sends(
                headers(1, fields_of((b"X-Upper", b"1"), base=_POST), end_stream=False),
                data(1, b"x"),
            ),
            ResetWith((ErrorCodes.PROTOCOL_ERROR,), once=True),
        ),
        marks=pytest.mark.xfail(
            strict=True,
            reason="h2 answers every frame on a stream it reset with RST_STREAM "
            "STREAM_CLOSED (its own state machine; RFC 9113 5.1: MUST ignore)",
        ),
    ),
    Case(
        "5.1",
        "closed by the edge's RST_STREAM: RST_STREAM, WINDOW_UPDATE, PRIORITY",
        after_reset(
            headers(1, fields_of((b"X-Upper", b"1"))),
            RstStreamFrame(1, error_code=ErrorCodes.CANCEL).serialize(),
            window_update(1, 100),
            raw_frame(_PRIORITY, 0, 1, struct.pack(">LB", 0, 15)),
        ),
        ResetWith((ErrorCodes.PROTOCOL_ERROR,), once=True),
    ),
    # 5.4.2 Stream error handling: a stream the client resets in the same
    # write as the frame that makes it a stream error is not reset again
    Case(
        "5.4.2",
        "client's RST_STREAM after malformed HEADERS",
        sends(headers(1, fields_of((b"X-Upper", b"1"))), _cancel(1)),
        Ignored(next=3),
    ),
    Case(
        "5.4.2",
        "client's RST_STREAM after a stream beyond the limit",
        sends(headers(1, _HOLD), headers(3), _cancel(3), ping()),
        PingAck(),
        http2={"max_concurrent_streams": 1},
    ),
    Case(
        "5.4.2",
        "client's RST_STREAM after malformed trailers",
        sends(
            headers(1, _POST, end_stream=False),
            data(1, b"x", end_stream=False),
            headers(1, [(b"X-Upper", b"1")]),
            _cancel(1),
        ),
        Ignored(next=3),
    ),
    Case(
        "5.4.2",
        "client's RST_STREAM after trailers short of the content-length",
        sends(
            headers(
                1, fields_of((b"content-length", b"5"), base=_POST), end_stream=False
            ),
            data(1, b"ab", end_stream=False),
            headers(1, [(b"x-trailer", b"1")]),
            _cancel(1),
        ),
        Ignored(next=3),
    ),
    Case(
        "5.1",
        "closed: DATA",
        after_response(headers(1), data(1, b"x")),
        ResetWith((ErrorCodes.STREAM_CLOSED,), or_connection=True),
    ),
    Case(
        "5.1",
        "closed: HEADERS",
        after_response(headers(1), headers(1)),
        ResetWith((ErrorCodes.STREAM_CLOSED,), or_connection=True),
    ),
    Case(
        "5.1",
        "closed: CONTINUATION",
        after_response(
            headers(1),
            ContinuationFrame(
                1, block([(b"x-late", b"1")]), flags=["END_HEADERS"]
            ).serialize(),
        ),
        ResetWith(
            (ErrorCodes.STREAM_CLOSED, ErrorCodes.PROTOCOL_ERROR), or_connection=True
        ),
    ),
    Case(
        "5.1",
        "half-closed (remote): WINDOW_UPDATE, PRIORITY, RST_STREAM allowed",
        sends(
            headers(1, _HOLD),
            window_update(1, 100),
            raw_frame(_PRIORITY, 0, 1, struct.pack(">LB", 0, 15)),
            RstStreamFrame(1, error_code=ErrorCodes.CANCEL).serialize(),
        ),
        Ignored(next=3),
    ),
    Case(
        "5.1",
        "closed: PRIORITY, WINDOW_UPDATE allowed",
        after_response(
            headers(1),
            raw_frame(_PRIORITY, 0, 1, struct.pack(">LB", 0, 15)),
            window_update(1, 100),
        ),
        Ignored(next=3),
    ),
    Case(
        "5.1",
        "idle: PRIORITY allowed",
        sends(raw_frame(_PRIORITY, 0, 3, struct.pack(">LB", 0, 15))),
        Ignored(next=3),
    ),
    Case(
        "5.1",
        "idle: PRIORITY leaves lower streams idle",
        sends(raw_frame(_PRIORITY, 0, 5, struct.pack(">LB", 0, 15)), headers(1)),
        Ignored(next=3),
    ),
    # 5.1.1 Stream identifiers
    Case(
        "5.1.1",
        "even-numbered stream identifier",
        sends(headers(2)),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "5.1.1",
        "stream identifier below a previous one",
        sends(headers(5), headers(3)),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    # 5.1.2 Stream concurrency
    Case(
        "5.1.2",
        "beyond SETTINGS_MAX_CONCURRENT_STREAMS",
        sends(headers(1, _HOLD), headers(3, _HOLD), headers(5, _HOLD)),
        ResetWith(
            (ErrorCodes.PROTOCOL_ERROR, ErrorCodes.REFUSED_STREAM), stream=5, next=None
        ),
        http2={"max_concurrent_streams": 2},
    ),
    # 5.3.1 Stream dependencies (RFC 7540; a stream error, or per 5.4.1 a
    # connection error)
    Case(
        "5.3.1",
        "HEADERS depending on itself",
        sends(
            raw_frame(
                _HEADERS,
                _END_STREAM | _END_HEADERS | _WITH_PRIORITY,
                1,
                _PRIORITY_ON_1 + block(_GET),
            )
        ),
        ResetWith((ErrorCodes.PROTOCOL_ERROR,), or_connection=True),
    ),
    Case(
        "5.3.1",
        "PRIORITY depending on itself",
        sends(raw_frame(_PRIORITY, 0, 1, _PRIORITY_ON_1)),
        ResetWith((ErrorCodes.PROTOCOL_ERROR,), or_connection=True),
    ),
    # 5.4.1 Connection error handling
    Case(
        "5.4.1",
        "GOAWAY names the last stream processed",
        after_response(headers(1), ping(stream=1)),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR, last_stream=1),
    ),
    # 5.5 Extending HTTP/2
    Case(
        "5.5",
        "unknown SETTINGS identifier",
        sends(settings((0xFF, 1))),
        Ignored(),
    ),
    Case(
        "5.5",
        "unknown frame type on a stream",
        sends(raw_frame(_UNKNOWN, 0xFF, 1, b"x" * 8)),
        Ignored(next=3),
    ),
    Case(
        "5.5",
        "unknown frame type inside a header block",
        sends(headers(1, end_headers=False), raw_frame(_UNKNOWN, 0, 1, b"x" * 8)),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    # 6.1 DATA
    Case(
        "6.1",
        "DATA on stream 0",
        sends(headers(1, _POST, end_stream=False), data(0, b"x")),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.1",
        "DATA with a pad length beyond the frame",
        sends(
            headers(1, _POST, end_stream=False),
            raw_frame(0, _PADDED | _END_STREAM, 1, b"\x06" + b"x" * 5),
        ),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.1",
        "padded DATA",
        sends(
            headers(
                1, fields_of((b"content-length", b"3"), base=_POST), end_stream=False
            ),
            raw_frame(0, _PADDED | _END_STREAM, 1, b"\x04abc" + bytes(4)),
        ),
        Ignored(next=3),
    ),
    # 6.2 HEADERS
    Case(
        "6.2",
        "HEADERS on stream 0",
        sends(headers(0)),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.2",
        "HEADERS with a pad length beyond the frame",
        sends(
            raw_frame(
                _HEADERS, _END_HEADERS | _END_STREAM | _PADDED, 1, b"\xff" + block(_GET)
            )
        ),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.2",
        "padded HEADERS with a priority",
        sends(
            raw_frame(
                _HEADERS,
                _END_HEADERS | _END_STREAM | _PADDED | _WITH_PRIORITY,
                1,
                b"\x03" + struct.pack(">LB", 0, 15) + block(_GET) + bytes(3),
            )
        ),
        Ignored(next=3),
    ),
    # 6.3 PRIORITY
    Case(
        "6.3",
        "PRIORITY on stream 0",
        sends(raw_frame(_PRIORITY, 0, 0, struct.pack(">LB", 1, 15))),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.3",
        "PRIORITY of another length than 5",
        sends(
            headers(1, _HOLD), raw_frame(_PRIORITY, 0, 1, struct.pack(">LBB", 0, 15, 0))
        ),
        ResetWith((ErrorCodes.FRAME_SIZE_ERROR,), or_connection=True),
    ),
    # 6.4 RST_STREAM
    Case(
        "6.4",
        "RST_STREAM on stream 0",
        sends(raw_frame(_RST_STREAM, 0, 0, struct.pack(">L", ErrorCodes.CANCEL))),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.4",
        "RST_STREAM of another length than 4",
        sends(
            headers(1, _HOLD), raw_frame(_RST_STREAM, 0, 1, struct.pack(">LB", 8, 0))
        ),
        GoawayWith(ErrorCodes.FRAME_SIZE_ERROR),
    ),
    # 6.5 SETTINGS
    Case(
        "6.5",
        "SETTINGS ACK with a payload",
        sends(
            raw_frame(_SETTINGS, 0x1, 0, struct.pack(">HL", _INITIAL_WINDOW_SIZE, 1))
        ),
        GoawayWith(ErrorCodes.FRAME_SIZE_ERROR),
    ),
    Case(
        "6.5",
        "SETTINGS on a stream",
        sends(raw_frame(_SETTINGS, 0, 1, struct.pack(">HL", _INITIAL_WINDOW_SIZE, 1))),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.5",
        "SETTINGS of a length not a multiple of 6",
        sends(
            raw_frame(_SETTINGS, 0, 0, struct.pack(">HLB", _INITIAL_WINDOW_SIZE, 1, 0))
        ),
        GoawayWith(ErrorCodes.FRAME_SIZE_ERROR),
    ),
    # 6.5.2 Defined SETTINGS parameters
    Case(
        "6.5.2",
        "SETTINGS_ENABLE_PUSH of 2",
        sends(settings((_ENABLE_PUSH, 2))),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.5.2",
        "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1",
        sends(settings((_INITIAL_WINDOW_SIZE, 2**31))),
        GoawayWith(ErrorCodes.FLOW_CONTROL_ERROR),
    ),
    Case(
        "6.5.2",
        "SETTINGS_MAX_FRAME_SIZE below 2^14",
        sends(settings((_MAX_FRAME_SIZE, 16383))),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.5.2",
        "SETTINGS_MAX_FRAME_SIZE above 2^24-1",
        sends(settings((_MAX_FRAME_SIZE, 2**24))),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.5.2",
        "SETTINGS_HEADER_TABLE_SIZE of 0: responses without the dynamic table",
        small_table(),
        Ignored(next=5),
        settings=((_HEADER_TABLE_SIZE, 0),),
    ),
    Case(
        "6.5.2",
        "SETTINGS_ENABLE_CONNECT_PROTOCOL of 2 (RFC 8441 3)",
        sends(settings((8, 2))),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    # 6.5.3 Settings synchronization
    Case(
        "6.5.3",
        "the last of several values applies",
        sends(
            settings((_INITIAL_WINDOW_SIZE, 100), (_INITIAL_WINDOW_SIZE, 1)), headers(1)
        ),
        DataSizes((1,)),
    ),
    # 6.7 PING
    Case("6.7", "PING gets an ACK", sends(ping()), PingAck()),
    Case(
        "6.7",
        "a PING ACK is not answered",
        sends(ping(b"ackackac", flags=0x1), ping()),
        PingAck(),
    ),
    Case(
        "6.7",
        "PING on a stream",
        sends(ping(stream=1)),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.7",
        "PING of another length than 8",
        sends(ping(b"123456")),
        GoawayWith(ErrorCodes.FRAME_SIZE_ERROR),
    ),
    # 6.8 GOAWAY
    Case(
        "6.8",
        "GOAWAY on a stream",
        sends(raw_frame(_GOAWAY, 0, 1, struct.pack(">LL", 0, 0))),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    # 6.9 WINDOW_UPDATE
    Case(
        "6.9",
        "WINDOW_UPDATE of 0 on the connection",
        sends(window_update(0, 0)),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.9",
        "WINDOW_UPDATE of 0 on a stream",
        sends(headers(1, _HOLD), window_update(1, 0)),
        ResetWith((ErrorCodes.PROTOCOL_ERROR,), or_connection=True),
    ),
    Case(
        "6.9",
        "WINDOW_UPDATE of another length than 4",
        sends(raw_frame(_WINDOW_UPDATE, 0, 0, b"\x00\x00\x01")),
        GoawayWith(ErrorCodes.FRAME_SIZE_ERROR),
    ),
    # 6.9.1 The flow-control window
    Case(
        "6.9.1",
        "SETTINGS_INITIAL_WINDOW_SIZE of 1",
        sends(headers(1)),
        DataSizes((1,)),
        settings=((_INITIAL_WINDOW_SIZE, 1),),
    ),
    Case(
        "6.9.1",
        "connection window beyond 2^31-1",
        sends(window_update(0, 2**31 - 1), window_update(0, 2**31 - 1)),
        GoawayWith(ErrorCodes.FLOW_CONTROL_ERROR),
    ),
    Case(
        "6.9.1",
        "stream window beyond 2^31-1",
        sends(
            headers(1, _HOLD), window_update(1, 2**31 - 1), window_update(1, 2**31 - 1)
        ),
        ResetWith((ErrorCodes.FLOW_CONTROL_ERROR,), or_connection=True),
    ),
    # 6.9.2 Initial flow-control window size
    Case(
        "6.9.2",
        "SETTINGS_INITIAL_WINDOW_SIZE taking a window beyond 2^31-1",
        sends(
            headers(1, _HOLD),
            window_update(1, 2**31 - 1 - 65535),
            settings((_INITIAL_WINDOW_SIZE, 65536)),
        ),
        GoawayWith(ErrorCodes.FLOW_CONTROL_ERROR),
    ),
    Case(
        "6.9.2",
        "SETTINGS_INITIAL_WINDOW_SIZE changed after HEADERS",
        sends(headers(1), settings((_INITIAL_WINDOW_SIZE, 1))),
        DataSizes((1,)),
        settings=((_INITIAL_WINDOW_SIZE, 0),),
    ),
    Case(
        "6.9.2",
        "a window made negative by SETTINGS",
        after_data(1, settings((_INITIAL_WINDOW_SIZE, 2)), window_update(1, 2)),
        DataSizes((3, 1)),
        settings=((_INITIAL_WINDOW_SIZE, 3),),
    ),
    # 6.10 CONTINUATION
    Case(
        "6.10",
        "HEADERS and several CONTINUATION frames",
        sends(
            HeadersFrame(1, block(_GET)[:3], flags=["END_STREAM"]).serialize(),
            ContinuationFrame(1, block(_GET)[3:6]).serialize(),
            ContinuationFrame(1, block(_GET)[6:], flags=["END_HEADERS"]).serialize(),
        ),
        Ignored(next=3),
    ),
    Case(
        "6.10",
        "CONTINUATION followed by another frame",
        sends(
            HeadersFrame(1, block(_POST)[:3]).serialize(),
            ContinuationFrame(1, block(_POST)[3:6]).serialize(),
            data(1, b"x"),
        ),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.10",
        "CONTINUATION on stream 0",
        sends(
            HeadersFrame(1, block(_GET)[:3], flags=["END_STREAM"]).serialize(),
            raw_frame(_CONTINUATION, _END_HEADERS, 0, block(_GET)[3:]),
        ),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.10",
        "CONTINUATION after END_HEADERS",
        sends(
            headers(1, _HOLD),
            ContinuationFrame(
                1, block([(b"x-a", b"1")]), flags=["END_HEADERS"]
            ).serialize(),
        ),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.10",
        "CONTINUATION after a CONTINUATION with END_HEADERS",
        sends(
            HeadersFrame(1, block(_HOLD)[:3], flags=["END_STREAM"]).serialize(),
            ContinuationFrame(1, block(_HOLD)[3:], flags=["END_HEADERS"]).serialize(),
            ContinuationFrame(
                1, block([(b"x-a", b"1")]), flags=["END_HEADERS"]
            ).serialize(),
        ),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.10",
        "CONTINUATION after DATA",
        sends(
            headers(1, _POST, end_stream=False),
            data(1, b"x", end_stream=False),
            ContinuationFrame(
                1, block([(b"x-a", b"1")]), flags=["END_HEADERS"]
            ).serialize(),
        ),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    Case(
        "6.8",
        "GOAWAY, then RST_STREAM in the same write",
        sends(
            headers(1, _HOLD),
            raw_frame(_GOAWAY, 0, 0, struct.pack(">LL", 0, ErrorCodes.NO_ERROR)),
            raw_frame(_RST_STREAM, 0, 1, struct.pack(">L", ErrorCodes.CANCEL)),
            ping(),
        ),
        PingAck(or_close=True),
    ),
    # 7 Error codes
    Case(
        "7",
        "GOAWAY with an unknown error code",
        sends(raw_frame(_GOAWAY, 0, 0, struct.pack(">LL", 0, 0xFF)), ping()),
        PingAck(or_close=True),
    ),
    Case(
        "7",
        "RST_STREAM with an unknown error code",
        sends(
            headers(1, _HOLD),
            raw_frame(_RST_STREAM, 0, 1, struct.pack(">L", 0xFF)),
        ),
        Ignored(next=3),
    ),
    # 8.1 HTTP message framing (requests: a stream error, 8.1.1)
    Case(
        "8.1",
        "trailers without END_STREAM",
        sends(
            headers(1, _POST, end_stream=False),
            headers(1, [(b"x-trailer", b"1")], end_stream=False),
        ),
        ResetWith((ErrorCodes.PROTOCOL_ERROR,)),
    ),
    Case(
        "8.1",
        "content-length other than the DATA",
        sends(
            headers(
                1, fields_of((b"content-length", b"1"), base=_POST), end_stream=False
            ),
            data(1, b"test"),
        ),
        ResetWith((ErrorCodes.PROTOCOL_ERROR,)),
    ),
    Case(
        "8.1",
        "content-length other than the DATA frames together",
        sends(
            headers(
                1, fields_of((b"content-length", b"1"), base=_POST), end_stream=False
            ),
            data(1, b"te", end_stream=False),
            data(1, b"st"),
        ),
        ResetWith((ErrorCodes.PROTOCOL_ERROR,)),
    ),
    Case(
        "8.1",
        "GET, POST with trailers",
        sends(
            headers(1),
            headers(3, _POST, end_stream=False),
            data(3, b"body", end_stream=False),
            headers(3, [(b"x-trailer", b"1")]),
        ),
        Ignored(next=5),
    ),
    # 8.2 HTTP fields
    *[
        Case(
            "8.2",
            name,
            sends(headers(1, fields)),
            ResetWith((ErrorCodes.PROTOCOL_ERROR,)),
        )
        for name, fields in [
            ("uppercase field name", fields_of((b"X-Upper", b"1"))),
            ("field value with a CR LF", fields_of((b"x-a", b"1\r\nx-b: 2"))),
            ("field value with leading space", fields_of((b"x-a", b" 1"))),
            ("connection-specific field", fields_of((b"connection", b"keep-alive"))),
            ("te other than trailers", fields_of((b"te", b"gzip"))),
        ]
    ],
    Case(
        "8.1",
        "pseudo-header in trailers",
        sends(
            headers(1, _POST, end_stream=False),
            data(1, b"x", end_stream=False),
            headers(1, [(b":method", b"GET")]),
        ),
        ResetWith((ErrorCodes.PROTOCOL_ERROR,)),
    ),
    # 8.3 HTTP control data
    *[
        Case(
            "8.3",
            name,
            sends(headers(1, fields)),
            ResetWith((ErrorCodes.PROTOCOL_ERROR,)),
        )
        for name, fields in [
            ("unknown pseudo-header", fields_of((b":foo", b"bar"))),
            ("response pseudo-header in a request", fields_of((b":status", b"200"))),
            ("pseudo-header after a field", [*_GET[:3], (b"x-a", b"1"), _GET[3]]),
            ("empty :path", [*_GET[:2], (b":path", b""), _GET[3]]),
            ("no :method", without(b":method")),
            ("no :scheme", without(b":scheme")),
            ("no :path", without(b":path")),
            ("two :method", [*_GET, (b":method", b"GET")]),
            ("two :scheme", [*_GET, (b":scheme", b"http")]),
            ("two :path", [*_GET, (b":path", b"/")]),
            ("host naming another authority", fields_of((b"host", b"other.test"))),
            ("neither :authority nor host", without(b":authority")),
        ]
    ],
    Case(
        "8.3",
        "host instead of :authority, OPTIONS *",
        sends(
            headers(1, [*without(b":authority"), (b"host", b"localhost")]),
            headers(
                3, [(b":method", b"OPTIONS"), *_GET[1:2], (b":path", b"*"), _GET[3]]
            ),
        ),
        Ignored(next=5),
    ),
    # 8.4 Server push
    Case(
        "8.4",
        "PUSH_PROMISE from a client",
        sends(
            headers(1, _HOLD),
            raw_frame(
                _PUSH_PROMISE, _END_HEADERS, 1, struct.pack(">L", 2) + block(_GET)
            ),
        ),
        GoawayWith(ErrorCodes.PROTOCOL_ERROR),
    ),
    # RFC 7541 HPACK (decoding errors: COMPRESSION_ERROR, RFC 9113 4.3)
    Case(
        "HPACK",
        "literal never indexed, without indexing, huffman, table size update",
        sends(
            raw_frame(
                _HEADERS,
                _END_STREAM | _END_HEADERS,
                1,
                b"\x20"  # table size update to 0 first
                + hpack.Encoder().encode(
                    [*_GET, hpack.NeverIndexedHeaderTuple(b"x-secret", b"1")],
                    huffman=True,
                ),
            )
        ),
        Ignored(next=3),
    ),
    Case(
        "HPACK",
        "two table size updates at the start of a block",
        sends(
            raw_frame(
                _HEADERS,
                _END_STREAM | _END_HEADERS,
                1,
                b"\x20\x3f\xe1\x1f" + block(_GET),  # to 0, then to 4096
            )
        ),
        Ignored(next=3),
    ),
    Case(
        "HPACK",
        "indexed field 0",
        sends(raw_frame(_HEADERS, _END_STREAM | _END_HEADERS, 1, _indexed(0, 2, 6, 4))),
        GoawayWith(ErrorCodes.COMPRESSION_ERROR),
    ),
    Case(
        "HPACK",
        "index beyond the tables",
        sends(
            raw_frame(_HEADERS, _END_STREAM | _END_HEADERS, 1, _indexed(2, 6, 4, 70))
        ),
        GoawayWith(ErrorCodes.COMPRESSION_ERROR),
    ),
    Case(
        "HPACK",
        "table size update beyond SETTINGS_HEADER_TABLE_SIZE",
        sends(
            raw_frame(
                _HEADERS, _END_STREAM | _END_HEADERS, 1, b"\x3f\xe1\x3f" + block(_GET)
            )
        ),
        GoawayWith(ErrorCodes.COMPRESSION_ERROR),
    ),
    Case(
        "HPACK",
        "table size update after a field",
        sends(
            raw_frame(
                _HEADERS,
                _END_STREAM | _END_HEADERS,
                1,
                _indexed(2) + b"\x20" + _indexed(6, 4) + block(_GET[3:]),
            )
        ),
        GoawayWith(ErrorCodes.COMPRESSION_ERROR),
    ),
    Case(
        "HPACK",
        "huffman string with EOS",
        sends(raw_frame(_HEADERS, _END_STREAM | _END_HEADERS, 1, _HUFFMAN_EOS)),
        GoawayWith(ErrorCodes.COMPRESSION_ERROR),
    ),
    Case(
        "HPACK",
        "huffman padding longer than 7 bits",
        sends(raw_frame(_HEADERS, _END_STREAM | _END_HEADERS, 1, _UNPADDED_HUFFMAN)),
        GoawayWith(ErrorCodes.COMPRESSION_ERROR),
    ),
    Case(
        "HPACK",
        "huffman padding not the EOS prefix",
        sends(raw_frame(_HEADERS, _END_STREAM | _END_HEADERS, 1, _ZERO_PADDED_HUFFMAN)),
        GoawayWith(ErrorCodes.COMPRESSION_ERROR),
    ),
]


async def _connect(setup: Setup, case: Case) -> FrameClient:
    if case.tls:
        return FrameClient(await _tls_client(setup, "h2"))
    return FrameClient(await trio.open_tcp_stream("127.0.0.1", setup.plain_port))


@pytest.mark.parametrize("case", CASES, ids=str)
async def test_h2spec_case(
    tmp_path: Path, case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    async with h2_edge(tmp_path, http2=case.http2) as setup:
        client = await _connect(setup, case)
        try:
            if case.handshake and not case.tls:
                await client.handshake(*case.settings)
            await case.steps(client)
            await case.expected.check(client)
        finally:
            await trio.aclose_forcefully(client.stream)
    # Whatever the client sent, the edge's own code did not fail.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_preface_that_ends_during_a_drain_gets_its_first_streams_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An h2c connection accepted before the drain whose preface and first
    request come after it: its first streams are served, as an HTTP/1.1
    connection's first request is then (with ``Connection: close``), and the
    GOAWAY names them (it named none: the request was refused)."""
    caplog.set_level(logging.INFO, logger="tlsedge.access")
    async with h2_edge(tmp_path) as setup:
        client = FrameClient(await trio.open_tcp_stream("127.0.0.1", setup.plain_port))
        try:
            await client.send(PREFACE[:16])
            await wait_until(lambda: _connection_tasks(setup.edge) == 1)  # sniffing
            setup.edge.drain()
            await client.send(PREFACE[16:], settings(), headers(1))
            await client.until(lambda c: False)  # until the edge closes
        finally:
            await trio.aclose_forcefully(client.stream)
    # The drain's GOAWAY, then the one of the close.
    assert [f.last_stream_id for f in client.of(GoAwayFrame)] == [1, 1]
    assert client.statuses[1] == 200
    (line,) = [r for r in access_records(caplog) if r.get("type") == "http"]
    assert (line["target"], line["termination"]) == ("/echo", "ok")
