"""HTTP/2 to a client, server side, sans-IO: the `h2` package plus our rules.

Theory of operation
===================

`H2Session` wraps an `h2.connection.H2Connection` (the framing, HPACK, the
stream states and flow-control arithmetic) and adds what a proxy edge needs
on top, as `tlsedge._http.session.ClientSession` does for HTTP/1.1: each
stream's header block becomes a checked `H2Request` (or a stream error), and
every defence HTTP/2 edges learned the hard way is enforced on the bytes
before h2 sees them. The driver (`tlsedge._pipeline.http.h2`) feeds it bytes
(`receive_data`), reads its events, calls its ``send_*`` methods and writes
`data_to_send`; nothing here does I/O or reads a clock (the driver passes
``now``).

Requests. h2's own inbound header validation is off (it makes every
malformed request a connection error); `check_request` applies RFC 9113
section 8 instead, and a malformed request is a stream error
(``RST_STREAM PROTOCOL_ERROR``, section 8.1.1). The bytes that later go
upstream in an HTTP/1.1 request line or field line are held to the gate's
grammar (`tlsedge._http.head`'s, the one the HTTP/1.1 side is held to; the
gate, `tlsedge._http.gate`, checks it again as it writes the head):
``:method`` a token, ``:path`` visible ASCII, field names tokens (here in
lowercase), values without NUL, CR, LF, other control bytes or surrounding
whitespace. Besides: the pseudo-headers known, once each, before the
fields, ``:method``, ``:scheme`` and ``:path`` present, no connection-specific
field (section 8.2.2: ``connection``, ``keep-alive``, ``proxy-connection``,
``transfer-encoding``, ``upgrade``, and ``te`` other than ``trailers``), no
``:protocol`` (RFC 8441
extended CONNECT is not enabled: we never send
SETTINGS_ENABLE_CONNECT_PROTOCOL). ``:authority`` and ``Host`` are
reconciled as section 8.3.1 says: ``:authority`` wins, a ``Host`` that names
another authority makes the request malformed, and the upstream gets one
``host`` field first. Cookie crumbs come joined into one last field with
``"; "`` (section 8.2.3; h2's own inbound normalisation, which did only this, is
off). More fields than
``max_headers`` get 431, CONNECT (``:method`` and ``:authority`` only) 501,
as in HTTP/1.1. Trailers are held
to the same field rules (and may hold no pseudo-header); a malformed trailer
section resets a stream already being served (`StreamMalformed`, so the
driver closes its upstream connection, which holds half a request).

Two fields of a header block h2 reads itself, whatever its configuration,
and ends the connection over: a ``content-length`` it cannot parse (not
digits, or two that differ), and a ``:status`` of 1xx (it takes the block for
an informational response, which a client may not send). Both make a
request or trailer section malformed, a stream error. So h2 never sees them:
our HPACK decoder (`_Decoder`, installed as h2's ``decoder``) decodes each
header block as h2's own would (the dynamic table stays in step with the
client's, whatever the block holds), then hides them (`_hidden_from_h2`:
such a ``content-length`` is renamed `_MALFORMED_CONTENT_LENGTH`, no token;
such a ``:status`` gets another value), and h2 goes on as with any block.
`check_request` and `_trailer_section` still refuse the block, and the
stream is reset as any malformed one.

Framing facts are checked, not trusted (section 8.1.1): a ``content-length``
must equal the DATA the stream brings, and a stream that breaks it is
malformed: one that ends with its HEADERS although it declared a length,
ends with trailers or DATA short of it, or whose DATA goes beyond it. h2
would make the DATA cases a connection error (``InvalidBodyLengthError``),
so no such frame reaches it: the scanner notes where each DATA frame of the
bytes received lies, its stream and its data's length; when one would break
its stream's count (`_owed`), the bytes before it go to h2 first, the stream
is reset, and h2 then takes the frame as one on a stream we reset (it still
counts against the connection's window, which h2 opens again). Trailers
without END_STREAM (a HEADERS frame on a stream opened before that does not
end it) make the request malformed too (section 8.1; h2: a connection
error): the scanner notes them as well, and the stream is reset the same
way before h2 takes them (it decodes their block: the HPACK state stays in
step). h2 itself checks HPACK, the frame sizes and stream states (connection
errors, GOAWAY); a header block that does not decode is a COMPRESSION_ERROR
(section 4.3: our decoder says so, where h2 would say PROTOCOL_ERROR). A
HEADERS or DATA frame on a stream whose request already ended (half-closed,
section 5.1) is a stream error of type STREAM_CLOSED:
the scanner's HEADERS of such a stream go to h2 as they are, h2 resets the
stream, and a stream still being served is then given up as a malformed one
(`_CLOSED_STREAM_ERROR`).

Limits (``[listeners.http2]``, docs/http2.md). SETTINGS: our HPACK table
(``header_table_size``), ``max_header_list_size`` (h2's HPACK decoder stops a
decompression bomb at it: GOAWAY ENHANCE_YOUR_CALM), the stream window
(``initial_window_size``) and a connection window of
``connection_window_size``; ``max_concurrent_streams`` is advertised in a
SETTINGS frame of ours and enforced here with REFUSED_STREAM (h2 would make
an excess stream a connection error). Floods are counted on the frame headers
of the bytes received (`_FrameScanner`), before h2 parses them, and each ends
the connection with GOAWAY ENHANCE_YOUR_CALM:

* rapid reset (CVE-2023-44487): more than ``max_resets`` RST_STREAM frames
  from the client plus streams we refused, within ``flood_window`` seconds;
* CONTINUATION flood (CVE-2024-27316): a header block (HEADERS and its
  CONTINUATION frames) of more than ``max_header_list_size`` bytes;
* PING and SETTINGS floods: more than ``max_control_frames`` of them within
  ``flood_window`` seconds;
* WINDOW_UPDATE floods: more than ``100 + 2 * (streams + N * DATA frames
  sent)`` of them (N: ``max_window_updates_per_data_frame``), PRIORITY floods:
  more than 100 per stream opened, plus 100;
* empty frames: more than ``max_empty_frames`` frames in a row with an empty
  payload that do not end anything (DATA without END_STREAM, HEADERS or
  CONTINUATION without END_HEADERS).

A preface whose first frame is not a SETTINGS frame ends the connection with
PROTOCOL_ERROR (section 3.4; h2 does not check it). A frame longer than
SETTINGS_MAX_FRAME_SIZE ends the connection at its header, with
FRAME_SIZE_ERROR (section 4.2): h2 would buffer all of it first (up to 16
MiB), and a long HEADERS frame would count as a CONTINUATION flood. So does a
SETTINGS ACK with a payload (section 6.5; h2: PROTOCOL_ERROR).

Flow control. Request DATA is acknowledged (the client's window reopened)
only when the driver says it was written upstream (`acknowledge`), so a slow
upstream slows the client down and at most a window of body per stream is
held. Response DATA goes out only as far as the client's windows allow
(`sendable`).

The client's GOAWAY ends the connection (h2 sends nothing after it): the
frames after it are not read, as h2 would take any of them (a PING, the
RST_STREAM of a stream the client gives up) for a protocol error and answer
GOAWAY PROTOCOL_ERROR.

Drain. `goaway` sends GOAWAY (NO_ERROR) with the last stream accepted; h2 has
no graceful GOAWAY (its own closes the connection for sending), so the frame
is made here. Streams opened after it are refused; those before it finish.
"""

from __future__ import annotations

import contextlib
import operator
import re
import struct
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, NamedTuple

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h2.stream
import hpack
from hyperframe.frame import GoAwayFrame, SettingsFrame

from tlsedge._core.config import Http2Config
from tlsedge._http.head import (
    FIELD_VALUE,
    HOST_RE,
    TOKEN,
    field_error,
    method_error,
    show_bytes,
    target_error,
)

__all__ = [
    "H2_CONFIGURATION",
    "PREFACE",
    "ConnectionEnded",
    "ErrorCodes",
    "H2Request",
    "H2Session",
    "RequestData",
    "RequestEnd",
    "StreamCancelled",
    "StreamMalformed",
    "StreamOpened",
    "WindowOpened",
]

Header = tuple[bytes, bytes]

#: What an HTTP/2 client sends first (RFC 9113 section 3.4).
PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

ErrorCodes = h2.errors.ErrorCodes

#: How every session configures h2 (h2 only reads it): inbound fields are
#: checked by `check_request`; outbound ones are built by the driver
#: (lowercase names, no connection-specific field), so h2's own header
#: checks and normalisation are off.
H2_CONFIGURATION: Final = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_inbound_headers=False,
    normalize_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
)

# Frame types and flags (RFC 9113 section 6).
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS = 0, 1, 2, 3, 4
_PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 6, 7, 8, 9
_END_STREAM, _ACK, _END_HEADERS, _PADDED = 0x1, 0x1, 0x4, 0x8
_FRAME_HEADER: Final = 9
# Our SETTINGS_MAX_FRAME_SIZE: the RFC's initial value, which we keep.
_MAX_FRAME_SIZE: Final = 16384
# A frame header's length (24 bits: 16 + 8), type, flags and stream (with
# the reserved bit: `_STREAM_ID` masks it).
_FRAME_HEADER_UNPACK: Final = struct.Struct(">HBBBL").unpack_from
_STREAM_ID: Final = 0x7FFFFFFF

_PSEUDO: Final = frozenset({b":method", b":scheme", b":path", b":authority"})
_CONNECTION_SPECIFIC: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"upgrade",
    }
)
# A lowercase token (RFC 9110 section 5.6.2; HTTP/2 field names are lowercase).
_NAME: Final = rb"[!#$%&'*+.^_`|~0-9a-z-]+"
_NAME_RE: Final = re.compile(_NAME)
# A request's fields, each name and value joined with NUL, joined with LF: a
# lowercase token and a field-value (`tlsedge._http.head.FIELD_VALUE`), neither
# of which holds NUL or LF, so one NUL per field and one LF fewer than fields
# (counted) leave no byte in doubt.
_FIELD_LINE: Final = _NAME + rb"\x00" + FIELD_VALUE
_FIELD_LINES_RE: Final = re.compile(_FIELD_LINE + rb"(?:\n" + _FIELD_LINE + rb")*")
_TE_ERROR: Final = "te other than 'trailers' (RFC 9113 8.2.2)"
_CONTENT_LENGTH_RE: Final = re.compile(rb"[0-9]{1,18}")
_CONTENT_LENGTH_ERROR: Final = "malformed content-length"
_OPEN_TRAILERS_ERROR: Final = "trailers without END_STREAM (RFC 9113 8.1)"
_CLOSED_STREAM_ERROR: Final = "a frame after the request ended (RFC 9113 5.1)"
#: The fields h2 parses in a request's header block or trailers, whatever
#: its configuration (`_hidden_from_h2`).
_PARSED_BY_H2: Final = frozenset({b"content-length", b":status"})
#: What `_hidden_from_h2` renames a ``content-length`` h2 would refuse to:
#: not a token, so no request or trailer section holding it passes our checks.
_MALFORMED_CONTENT_LENGTH: Final = b"content-length (malformed)"
# RFC 3986 section 3.1.
_SCHEME = rb"[A-Za-z][A-Za-z0-9+.-]*"
_SCHEME_RE: Final = re.compile(_SCHEME)
# A request other than CONNECT whose first four fields are its four
# pseudo-headers, once each (their names' bytes: 7 + 7 + 5 + 10), and all of
# their rules and its fields' grammar in one match: ``:method``, ``:scheme``,
# ``:path`` and ``:authority`` joined with NUL (which none may hold; nor LF):
# a token, a scheme, an origin-form target of visible ASCII, a host
# (`HOST_RE`: no "@") neither empty nor starting with ":"; then each field on
# a line of its own, as in `_FIELD_LINES_RE`. Only a request that fails it is
# checked rule by rule, to say what is wrong.
_PSEUDO_NAMES_SIZE: Final = 29
_COMMON_REQUEST_RE: Final = re.compile(
    TOKEN
    + rb"\x00"
    + _SCHEME
    + rb"\x00/[\x21-\x7e]*\x00(?=[^:\n])"
    + HOST_RE.pattern
    + rb"(?:\n"
    + _FIELD_LINE
    + rb")*"
)


class H2Request(NamedTuple):
    """A checked request head from one stream (a named tuple, as the events
    made per request or body piece: a frozen dataclass sets each field with a
    call, ~2,000 instructions a field).

    ``headers``: the fields for the upstream (``host`` first, no
    pseudo-headers, one ``cookie``); ``end_stream``: the request has no body;
    ``expects_continue``: ``expect: 100-continue``.
    """

    method: bytes
    target: bytes
    scheme: bytes
    host: bytes
    headers: list[Header]
    content_length: int | None
    end_stream: bool
    size: int  # the fields' bytes as decoded (names + values)
    user_agent: bytes | None
    expects_continue: bool = False


class StreamOpened(NamedTuple):
    """A new stream with a checked request; *error*: answer it with this
    status and reason instead of forwarding it (431)."""

    stream_id: int
    request: H2Request
    error: tuple[int, str] | None = None


@dataclass(frozen=True, slots=True)
class StreamMalformed:
    """A request we reset with PROTOCOL_ERROR (RFC 9113 section 8.1.1): a new
    stream's, or one being served whose trailers or length were wrong."""

    stream_id: int
    reason: str
    method: bytes | None
    target: bytes | None


class RequestData(NamedTuple):
    """Request body bytes; `H2Session.acknowledge` *flow_length* once used."""

    stream_id: int
    data: bytes
    flow_length: int


class RequestEnd(NamedTuple):
    """The request body ended (with its trailers, if any); not sent for a
    request without a body (`H2Request.end_stream`)."""

    stream_id: int
    trailers: list[Header]


@dataclass(frozen=True, slots=True)
class StreamCancelled:
    """The client reset a stream (or it was refused): stop working on it."""

    stream_id: int
    error_code: int


@dataclass(frozen=True, slots=True)
class WindowOpened:
    """The client opened flow-control windows: blocked senders may go on."""


@dataclass(frozen=True, slots=True)
class ConnectionEnded:
    """No more frames will be read: the client sent GOAWAY, broke the
    protocol, or tripped a defence (*calm*: GOAWAY ENHANCE_YOUR_CALM sent)."""

    reason: str
    by_client: bool = False
    calm: bool = False


Event = (
    StreamOpened
    | StreamMalformed
    | RequestData
    | RequestEnd
    | StreamCancelled
    | WindowOpened
    | ConnectionEnded
)


class _Refused(Exception):
    """Frames refused before h2 sees them: end the connection with GOAWAY
    `code`."""

    code: ErrorCodes


class _Calm(_Refused):
    """A defence tripped: end the connection with ENHANCE_YOUR_CALM."""

    code = ErrorCodes.ENHANCE_YOUR_CALM


class _PrefaceError(_Refused):
    """The preface went on with another frame than a SETTINGS frame (RFC 9113
    section 3.4; h2 does not check it)."""

    code = ErrorCodes.PROTOCOL_ERROR


class _FrameSizeError(_Refused):
    """A frame of a length RFC 9113 refuses (sections 4.2 and 6.5)."""

    code = ErrorCodes.FRAME_SIZE_ERROR


class _FrameScanner:
    """Follows the frame headers of the bytes received (after the preface) and
    keeps the counts the flood defences need (see the module docstring), and
    where the frames `H2Session` checks before h2 takes them lie in the bytes
    scanned (`frames`): each DATA frame completed (the content-length check),
    and each HEADERS frame that neither opens a stream nor ends one (trailers
    without END_STREAM); and where the client's GOAWAY ends (`goaway_end`,
    where the scan stops)."""

    __slots__ = (
        "_data",
        "_empty",
        "_goaway",
        "_header",
        "_limits",
        "_opened",
        "_pad",
        "_priority",
        "_remaining",
        "_settings_due",
        "_skip",
        "_window_updates",
        "block",
        "control",
        "frames",
        "goaway_end",
        "resets",
        "streams",
    )

    def __init__(self, limits: Http2Config) -> None:
        self._limits = limits
        self._skip = len(PREFACE)
        self._settings_due = True  # the preface's SETTINGS frame is to come
        self._header = bytearray()
        self._remaining = 0  # payload bytes of the current frame still to come
        #: The DATA frame in progress: its start in the bytes scanned (0 when
        #: it began in earlier ones), stream, flags and length; None: none.
        self._data: tuple[int, int, int, int] | None = None
        self._pad = 0  # its pad length; -1: padded, the length byte to come
        self.block = -1  # bytes of the header block in progress; -1: none
        self._empty = 0
        self._window_updates = 0
        self._priority = 0
        self.control = 0  # PING and SETTINGS frames in this call to scan
        self.resets = 0  # RST_STREAM frames in this call to scan
        self.streams = 0  # HEADERS frames that may open a stream
        self._opened = 0  # the highest stream a HEADERS frame was on
        self._goaway = False  # the frame in progress is a GOAWAY
        #: Where the client's GOAWAY ended in the bytes scanned (-1: it did not).
        self.goaway_end = -1
        #: The frames to check in this call to scan, in order: DATA frames
        #: completed, as their start, stream, END_STREAM and their data's
        #: length (padding not counted); HEADERS frames on a stream opened
        #: before without END_STREAM, as their start, stream, False and -1.
        self.frames: list[tuple[int, int, bool, int]] = []

    def scan(self, data: bytes, data_frames_sent: int) -> None:
        """Account for *data*'s frames; raise `_Calm` when a limit is passed,
        `_FrameSizeError` at a frame too long, `_PrefaceError` if the first
        frame is not a SETTINGS frame."""
        self.resets = self.control = 0
        if self.frames:
            self.frames = []
        if self._data is not None:
            self._data = (0, *self._data[1:])
        offset = 0
        if self._skip:
            offset = min(self._skip, len(data))
            self._skip -= offset
        end = len(data)
        remaining = self._remaining
        while offset < end:
            if remaining:
                take = min(remaining, end - offset)
                if self._pad < 0:
                    self._pad = data[offset]
                remaining -= take
                offset += take
                if not remaining and self._data is not None:
                    self._data_frame_ends()
                elif not remaining and self._goaway:
                    self.goaway_end = offset
                    break  # (the connection ends at it)
                continue
            start = offset
            if not self._header and end - offset >= _FRAME_HEADER:
                # A whole frame header in this read (the common case).
                high, low, kind, flags, stream = _FRAME_HEADER_UNPACK(data, offset)
                offset += _FRAME_HEADER
            else:
                need = _FRAME_HEADER - len(self._header)
                self._header += data[offset : offset + need]
                offset += min(need, end - offset)
                if len(self._header) < _FRAME_HEADER:
                    break
                high, low, kind, flags, stream = _FRAME_HEADER_UNPACK(self._header)
                self._header = bytearray()
                start = 0
            remaining = high << 8 | low
            self._frame(kind, flags, remaining, data_frames_sent)
            if kind == _DATA:
                self._data = (start, stream & _STREAM_ID, flags, remaining)
                self._pad = -1 if flags & _PADDED else 0
                if not remaining:
                    self._data_frame_ends()
            elif kind == _HEADERS:
                stream &= _STREAM_ID
                if stream > self._opened:
                    self._opened = stream
                elif not flags & _END_STREAM:
                    self.frames.append((start, stream, False, -1))
            elif kind == _GOAWAY:
                self._goaway = True
                if not remaining:
                    self.goaway_end = offset
                    break
        self._remaining = remaining

    def _data_frame_ends(self) -> None:
        """The DATA frame in progress is whole: note it (one whose padding
        exceeds it is left to h2, a connection error)."""
        assert self._data is not None
        start, stream, flags, length = self._data
        self._data = None
        size = length - (self._pad + 1 if flags & _PADDED else 0)
        if size >= 0:
            self.frames.append((start, stream, bool(flags & _END_STREAM), size))

    def _frame(self, kind: int, flags: int, length: int, data_frames_sent: int) -> None:
        if self._settings_due:
            if kind != _SETTINGS or flags & _ACK:
                raise _PrefaceError("a preface without its SETTINGS (RFC 9113 3.4)")
            self._settings_due = False
        if length > _MAX_FRAME_SIZE:
            raise _FrameSizeError(
                f"a frame of {length} bytes, beyond SETTINGS_MAX_FRAME_SIZE "
                f"({_MAX_FRAME_SIZE}, RFC 9113 4.2)"
            )
        limits = self._limits
        if kind in {_HEADERS, _CONTINUATION}:
            if kind == _HEADERS:
                self.streams += 1
                self.block = 0
            elif self.block < 0:
                return  # h2 refuses a stray CONTINUATION
            self.block += length
            if self.block > limits.max_header_list_size:
                raise _Calm(
                    f"header block larger than max_header_list_size "
                    f"({limits.max_header_list_size} bytes): CONTINUATION flood"
                )
            ends = flags & _END_HEADERS
            if ends:
                self.block = -1
            empty = not length and not ends
        elif kind == _DATA:
            empty = not length and not flags & _END_STREAM
        else:
            empty = False
            if kind in {_PING, _SETTINGS}:
                if not flags & _ACK:
                    self.control += 1
                elif kind == _SETTINGS and length:
                    # (h2 would say PROTOCOL_ERROR.)
                    raise _FrameSizeError(
                        f"a SETTINGS ACK with {length} bytes (RFC 9113 6.5)"
                    )
            elif kind == _WINDOW_UPDATE:
                self._window_updates += 1
                allowed = 100 + 2 * (
                    self.streams
                    + limits.max_window_updates_per_data_frame * data_frames_sent
                )
                if self._window_updates > allowed:
                    raise _Calm(
                        f"{self._window_updates} WINDOW_UPDATE frames for "
                        f"{data_frames_sent} DATA frames sent: WINDOW_UPDATE flood"
                    )
            elif kind == _PRIORITY:
                self._priority += 1
                if self._priority > 100 * (self.streams + 1):
                    raise _Calm(
                        f"{self._priority} PRIORITY frames for {self.streams} "
                        "streams: PRIORITY flood"
                    )
            elif kind == _RST_STREAM:
                self.resets += 1
        if empty:
            self._empty += 1
            if self._empty > limits.max_empty_frames:
                raise _Calm(
                    f"more than {limits.max_empty_frames} empty frames in a row"
                )
        elif length:
            self._empty = 0


_DECODE: Final = hpack.Decoder.decode
_NAME_OF: Final = operator.itemgetter(0)


class _CompressionError(h2.exceptions.ProtocolError):
    """A header block HPACK cannot decode: a connection error of type
    COMPRESSION_ERROR (RFC 9113 section 4.3; h2 reports PROTOCOL_ERROR)."""

    error_code = ErrorCodes.COMPRESSION_ERROR


class _Decoder(hpack.Decoder):
    """HPACK as h2's own decoder, but a header block's fields that h2 would
    end the connection over come out hidden (`_hidden_from_h2`), and a block
    that does not decode is a `_CompressionError`."""

    def decode(self, data: bytes, raw: bool = False) -> Iterable[hpack.HeaderTuple]:
        # (The base method called directly, the names tested in C: a block
        # of 5 fields then costs 3,500 instructions more than h2's decoder;
        # 6,600 with `super()` and a comprehension.)
        try:
            fields = _DECODE(self, data, raw)  # (a list, documented)
        except hpack.OversizedHeaderListError:
            raise  # (h2: ENHANCE_YOUR_CALM, an HPACK bomb)
        except hpack.HPACKDecodingError as exc:
            raise _CompressionError(f"Error decoding header block: {exc}") from exc
        if _PARSED_BY_H2.isdisjoint(map(_NAME_OF, fields)):
            return fields
        return _hidden_from_h2(fields)


def _hidden_from_h2(fields: Iterable[Header]) -> list[hpack.HeaderTuple]:
    """A header block's *fields* with what h2 parses itself, whatever its
    configuration, and ends the connection over, hidden from it; the fields
    stay malformed in our checks (`check_request`, `_trailer_section`), which
    reset the stream instead:

    * ``content-length`` fields h2 cannot parse (one not all ASCII digits:
      empty, a sign, a space...; or two that differ as numbers) are renamed
      `_MALFORMED_CONTENT_LENGTH`;
    * a ``:status`` (no request or trailer section may have one) whose value
      starts with "1" (h2 would take the block for an informational
      response, which a client cannot send) gets a value that does not (it
      is not shown: the field alone is the error).
    """
    fields = list(fields)
    lengths = [value for name, value in fields if name == b"content-length"]
    bad_lengths = bool(lengths) and (
        not all(map(bytes.isdigit, lengths)) or len(set(map(int, lengths))) > 1
    )
    hidden = []
    for name, value in fields:
        if name == b"content-length" and bad_lengths:
            hidden.append(hpack.HeaderTuple(_MALFORMED_CONTENT_LENGTH, value))
        elif name == b":status" and value[:1] == b"1":
            hidden.append(hpack.HeaderTuple(name, b"x" + value))
        else:
            hidden.append(hpack.HeaderTuple(name, value))
    return hidden


class H2Session:
    """One HTTP/2 client connection, server side (see the module docstring).

    Args:
        limits: The listener's ``[listeners.http2]`` settings.
        max_headers: Most fields in a request (``[listeners.http] max_headers``;
            more: 431).
    """

    def __init__(self, limits: Http2Config, *, max_headers: int) -> None:
        self.limits = limits
        self.max_headers = max_headers
        settings = h2.settings.SettingCodes
        conn = h2.connection.H2Connection(config=H2_CONFIGURATION)
        conn.decoder = _Decoder()
        # The first SETTINGS holds what applies before the client's ACK too;
        # the window and table sizes apply once ACKed (h2 tracks that).
        conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={settings.MAX_HEADER_LIST_SIZE: limits.max_header_list_size},
        )
        conn.decoder.max_header_list_size = limits.max_header_list_size
        conn.initiate_connection()
        conn.update_settings(
            {
                settings.HEADER_TABLE_SIZE: limits.header_table_size,
                settings.INITIAL_WINDOW_SIZE: limits.initial_window_size,
            }
        )
        # Advertised here, enforced by us (REFUSED_STREAM): in h2's own
        # settings it would make an excess stream a connection error.
        extra = SettingsFrame(0)
        extra.settings[settings.MAX_CONCURRENT_STREAMS] = limits.max_concurrent_streams
        increment = limits.connection_window_size - 65535
        if increment > 0:
            conn.increment_flow_control_window(increment)
        #: Our first frames (h2's SETTINGS, then ours), and a GOAWAY made
        #: here (`goaway`): sent before and after what h2 queued.
        self._first = conn.data_to_send() + extra.serialize()
        self._last = b""
        self.conn = conn
        self._scanner = _FrameScanner(limits)
        self._resets: deque[float] = deque()
        self._control: deque[float] = deque()
        self.active: set[int] = set()  # streams being served
        #: Active streams with a content-length and DATA to come: the DATA
        #: bytes still owed.
        self._owed: dict[int, int] = {}
        self._trailers: dict[int, list[Header]] = {}
        #: The StreamEnded of the last request whose HEADERS ended its stream.
        self._ended_with_headers: h2.events.StreamEnded | None = None
        self.data_frames_sent = 0
        self.goaway_sent: int | None = None  # the last stream id it named
        self.ended = False

    # -- input -------------------------------------------------------------

    @property
    def in_header_block(self) -> bool:
        """A header block was started and not finished (the header timeout)."""
        return self._scanner.block >= 0

    def receive_data(self, data: bytes, now: float) -> list[Event]:
        """Client bytes in, events out (nothing after a `ConnectionEnded`)."""
        if self.ended:
            return []
        scanner = self._scanner
        try:
            scanner.scan(data, self.data_frames_sent)
            # (Only counts that grew can pass a limit.)
            if scanner.resets:
                self._count_resets(scanner.resets, now)
            if scanner.control:
                self._count(
                    self._control,
                    scanner.control,
                    now,
                    most=self.limits.max_control_frames,
                    what="PING and SETTINGS frames",
                    attack="control frame flood",
                )
        except _Refused as exc:
            return [self._refuse(str(exc), exc.code)]
        if scanner.goaway_end >= 0:
            # The client's GOAWAY ends the connection: nothing after it is
            # read (h2 would take a frame after it for a protocol error).
            data = data[: scanner.goaway_end]
        events: list[Event] = []
        if scanner.frames:
            self._receive_checked(data, scanner, now, events)
        else:
            self._receive(data, now, events)
        return events

    def _receive(self, data: bytes, now: float, events: list[Event]) -> None:
        """*data* to h2, its events translated onto *events*."""
        try:
            h2_events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self.ended = True  # h2 has queued its GOAWAY
            events.append(ConnectionEnded(f"HTTP/2 protocol error: {exc}"))
            return
        for event in h2_events:
            if event is self._ended_with_headers:
                continue  # (`H2Request.end_stream` says it)
            self._translate(event, events, now)
            if events and isinstance(events[-1], ConnectionEnded):
                break

    def _receive_checked(
        self, data: bytes, scanner: _FrameScanner, now: float, events: list[Event]
    ) -> None:
        """*data*, which holds frames to check (`_FrameScanner.frames`), to h2
        so that it ends no connection over a malformed request (RFC 9113
        section 8.1.1 asks a stream error): DATA past its stream's
        ``content-length`` or ending the stream short of it, and trailers
        without END_STREAM (section 8.1). Such a frame's stream is reset
        first, and h2 then takes the frame as one on a stream we reset (the
        bytes of DATA count against the connection's window, which h2 opens
        again). The bytes before such a frame, and before a frame of a stream
        not known to be served (its HEADERS may be in *data*), go to h2
        first, so that `active` and `_owed` are up to date when the frame is
        judged."""
        owed = self._owed
        pending: dict[int, int] = {}  # DATA bytes of `owed` streams not fed yet
        fed = 0

        def fed_to(start: int) -> bool:
            """*data* up to *start* fed to h2; False once the connection ended."""
            nonlocal fed
            if start > fed:
                self._receive(data[fed:start], now, events)
                fed = start
                pending.clear()
            return not self.ended

        for start, sid, end_stream, size in scanner.frames:
            if size < 0:  # HEADERS on a stream opened before, not ending it
                if not fed_to(start):
                    return
                if sid in self.active and not self._request_ended(sid):
                    self._malformed_stream(sid, _OPEN_TRAILERS_ERROR, events)
                continue
            if sid not in self.active and not fed_to(start):
                return
            left = owed.get(sid)
            if left is None:
                continue
            left -= pending.get(sid, 0)
            if (size < left and not end_stream) or size == left:
                pending[sid] = pending.get(sid, 0) + size
                continue
            if not fed_to(start):
                return
            if sid not in owed:
                continue  # reset meanwhile
            if size > left:
                reason = f"DATA {size - left} bytes beyond its content-length"
            else:
                reason = (
                    f"the stream ended {left - size} bytes short of its content-length"
                )
            self._malformed_stream(sid, reason, events)
        fed_to(len(data))

    def _count_resets(self, count: int, now: float) -> None:
        self._count(
            self._resets,
            count,
            now,
            most=self.limits.max_resets,
            what="streams reset or refused",
            attack="rapid reset",
        )

    def _count(
        self,
        times: deque[float],
        count: int,
        now: float,
        *,
        most: int,
        what: str,
        attack: str,
    ) -> None:
        """Add *count* events at *now* to *times*; more than *most* within
        ``flood_window`` is a flood."""
        times.extend([now] * count)
        horizon = now - self.limits.flood_window
        while times and times[0] < horizon:
            times.popleft()
        if len(times) > most:
            raise _Calm(
                f"more than {most} {what} within "
                f"{self.limits.flood_window:g} s: {attack}"
            )

    def _refuse(self, reason: str, code: ErrorCodes) -> ConnectionEnded:
        self.ended = True
        self.conn.close_connection(code, additional_data=reason.encode())
        return ConnectionEnded(reason, calm=code is ErrorCodes.ENHANCE_YOUR_CALM)

    def _translate(self, event: h2.events.Event, out: list[Event], now: float) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._request(event, out, now)
        elif isinstance(event, h2.events.StreamEnded):
            sid = event.stream_id
            assert sid is not None
            trailers = self._trailers.pop(sid, [])
            if sid in self.active:
                owed = self._owed.pop(sid, 0)
                if owed:
                    self._malformed_stream(
                        sid,
                        f"the stream ended {owed} bytes short of its content-length",
                        out,
                    )
                else:
                    out.append(RequestEnd(sid, trailers))
        elif isinstance(event, h2.events.DataReceived):
            sid = event.stream_id
            assert sid is not None
            if sid in self.active and event.data:
                if sid in self._owed:
                    self._owed[sid] -= len(event.data)
                out.append(RequestData(sid, event.data, event.flow_controlled_length))
            elif event.flow_controlled_length:
                # Padding, or a refused or answered stream's data: give the
                # window back at once.
                self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
        elif isinstance(event, h2.events.TrailersReceived):
            sid = event.stream_id
            assert sid is not None
            if sid in self.active:
                trailers, error = _trailer_section(event.headers or [])
                if error is None:
                    self._trailers[sid] = trailers
                else:
                    self._malformed_stream(sid, error, out)
        elif isinstance(event, h2.events.StreamReset):
            sid = event.stream_id
            assert sid is not None
            if sid in self.active:
                if event.remote_reset:
                    self.forget(sid)
                    out.append(StreamCancelled(sid, int(event.error_code or 0)))
                else:  # h2 reset it (STREAM_CLOSED): see the module docstring
                    self._given_up(sid, _CLOSED_STREAM_ERROR, out)
        elif isinstance(
            event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)
        ):
            out.append(WindowOpened())
        elif isinstance(event, h2.events.SettingsAcknowledged):
            if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
                # h2 moves the stream windows by the change but decides on a
                # WINDOW_UPDATE only when more data is acknowledged: bytes
                # acknowledged before (short of an update under the old size)
                # would be held back for good if none follows.
                for sid in self.active:
                    with contextlib.suppress(h2.exceptions.StreamClosedError):
                        self.conn.acknowledge_received_data(0, sid)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.ended = True
            out.append(
                ConnectionEnded(
                    f"client sent GOAWAY ({_error_name(event.error_code)})",
                    by_client=True,
                )
            )

    def _request(
        self, event: h2.events.RequestReceived, out: list[Event], now: float
    ) -> None:
        sid = event.stream_id
        assert sid is not None
        self._ended_with_headers = event.stream_ended
        # (name, value) pairs of bytes, as h2 decoded them (``header_encoding=None``).
        fields: list[Header] = event.headers or []
        end_stream = event.stream_ended is not None
        if self.goaway_sent is not None or len(self.active) >= (
            self.limits.max_concurrent_streams
        ):
            self._reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            try:
                self._count_resets(1, now)
            except _Calm as exc:
                out.append(self._refuse(str(exc), exc.code))
            return
        try:
            request = check_request(fields, end_stream=end_stream)
        except MalformedRequestError as exc:
            self._reset_stream(sid, ErrorCodes.PROTOCOL_ERROR)
            out.append(StreamMalformed(sid, str(exc), exc.method, exc.target))
            return
        self.active.add(sid)
        if request.content_length is not None and not end_stream:
            self._owed[sid] = request.content_length
        error = None
        if request.method == b"CONNECT":
            error = (501, "CONNECT is not supported")
        elif len(request.headers) > self.max_headers:
            error = (431, f"more than {self.max_headers} header fields")
        out.append(StreamOpened(sid, request, error))

    def _malformed_stream(self, sid: int, reason: str, out: list[Event]) -> None:
        """A stream being served turned out malformed: reset it and say so."""
        self._reset_stream(sid, ErrorCodes.PROTOCOL_ERROR)
        self._given_up(sid, reason, out)

    def _given_up(self, sid: int, reason: str, out: list[Event]) -> None:
        """A stream being served was reset (by us or by h2) as malformed:
        no longer served, and said so."""
        self.forget(sid)
        self._trailers.pop(sid, None)
        out.append(StreamMalformed(sid, reason, None, None))

    def _reset_stream(self, sid: int, code: ErrorCodes) -> None:
        """RST_STREAM *code* on a stream we judged from h2's events, unless
        the client reset it in the bytes h2 took with them (h2 has closed it:
        its RST_STREAM event comes later)."""
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.conn.reset_stream(sid, code)

    def _request_ended(self, stream_id: int) -> bool:
        """Whether the client ended the stream's request (h2's stream state)."""
        stream = self.conn.streams.get(stream_id)
        return stream is not None and (
            stream.state_machine.state is h2.stream.StreamState.HALF_CLOSED_REMOTE
        )

    def forget(self, stream_id: int) -> None:
        """The stream is no longer served (answered, reset or given up)."""
        self.active.discard(stream_id)
        self._owed.pop(stream_id, None)

    def acknowledge(self, stream_id: int, flow_length: int) -> None:
        """Request body bytes were used: the client may send that much more."""
        if not flow_length or self.ended:
            return
        try:
            self.conn.acknowledge_received_data(flow_length, stream_id)
        except h2.exceptions.StreamClosedError:
            # The stream is gone: the connection's window still grows.
            self.conn.increment_flow_control_window(flow_length)

    # -- output ------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """The bytes to write to the client now."""
        data = self.conn.data_to_send()
        if self._first or self._last:
            data = b"".join((self._first, data, self._last))
            self._first = self._last = b""
        return data

    def open(self, stream_id: int) -> bool:
        """The stream is still ours to answer (not reset, not finished)."""
        return stream_id in self.active and not self.ended

    def sendable(self, stream_id: int) -> int:
        """How many body bytes may go out on the stream now (one DATA frame)."""
        if stream_id not in self.active or self.ended:  # (`open`, inlined)
            return 0
        conn = self.conn
        # h2's windows read directly (`local_flow_control_window` is two calls
        # to read them); an active stream is one h2 has open.
        return min(
            conn.outbound_flow_control_window,
            conn.streams[stream_id].outbound_flow_control_window,
            conn.max_outbound_frame_size,
        )

    def send_headers(
        self, stream_id: int, status: int, headers: list[Header], *, end_stream: bool
    ) -> None:
        """A response head (1xx or final) on an open stream."""
        if stream_id not in self.active or self.ended:  # (`open`, inlined)
            return
        fields = [(b":status", b"%d" % status), *headers]
        try:
            self.conn.send_headers(stream_id, fields, end_stream=end_stream)
        except h2.exceptions.StreamClosedError:
            end_stream = True
        if end_stream:
            self.forget(stream_id)

    def send_data(
        self, stream_id: int, data: bytes, *, end_stream: bool = False
    ) -> None:
        """Body bytes, at most `sendable` of them; *end_stream*: the last
        (the response ends with them, without trailers)."""
        if stream_id in self.active and not self.ended:  # (`open`, inlined)
            try:
                self.conn.send_data(stream_id, data, end_stream=end_stream)
            except h2.exceptions.StreamClosedError:
                self.forget(stream_id)
                return
            self.data_frames_sent += 1
            if end_stream:
                self.forget(stream_id)

    def send_end(self, stream_id: int, trailers: list[Header]) -> None:
        """The end of the response (with trailers when there are any)."""
        if not self.open(stream_id):
            return
        self.forget(stream_id)
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            if trailers:
                self.conn.send_headers(stream_id, trailers, end_stream=True)
            else:
                self.conn.end_stream(stream_id)

    def stop_request(self, stream_id: int) -> None:
        """RST_STREAM NO_ERROR after a complete response: the rest of the
        request is not wanted (RFC 9113 section 8.1)."""
        if self.ended:
            return
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.conn.reset_stream(stream_id, ErrorCodes.NO_ERROR)

    def reset(self, stream_id: int, code: int = ErrorCodes.INTERNAL_ERROR) -> None:
        """Reset a stream we cannot finish (a response cut upstream, a timeout)."""
        if not self.open(stream_id):
            return
        self.forget(stream_id)
        self.conn.reset_stream(stream_id, code)

    def goaway(self) -> None:
        """Graceful GOAWAY (drain): streams up to the last one go on."""
        if self.goaway_sent is not None or self.ended:
            return
        last = self.conn.highest_inbound_stream_id
        self.goaway_sent = last
        frame = GoAwayFrame(0, last_stream_id=last, error_code=ErrorCodes.NO_ERROR)
        self._last += frame.serialize()

    def close(self, code: int = ErrorCodes.NO_ERROR, reason: str = "") -> None:
        """End the connection with GOAWAY (nothing more is sent after it)."""
        self.ended = True
        if self.conn.state_machine.state is h2.connection.ConnectionState.CLOSED:
            return
        self.conn.close_connection(code, additional_data=reason.encode() or None)


class MalformedRequestError(Exception):
    """A request RFC 9113 section 8.1.1 calls malformed (RST_STREAM PROTOCOL_ERROR)."""

    def __init__(
        self, reason: str, method: bytes | None = None, target: bytes | None = None
    ) -> None:
        super().__init__(reason)
        self.method = method
        self.target = target


def check_request(fields: list[Header], *, end_stream: bool) -> H2Request:
    """Check a request's decoded header block (see the module docstring).

    Raises:
        MalformedRequestError: what is wrong with it.
    """
    pseudo = dict(fields[:4])
    common = _common_request(fields, pseudo)
    if common is None:
        pseudo, size = _pseudo_headers(fields)
        regular = fields[len(pseudo) :]
        # The fields' grammar, all at once (see `_FIELD_LINES_RE`); a field
        # that breaks it is then looked for, to name it.
        lines = b"\n".join(map(b"\x00".join, regular))
        if regular and (
            _FIELD_LINES_RE.fullmatch(lines) is None
            or lines.count(b"\n") != len(regular) - 1
        ):
            raise _malformed(pseudo, _fields_error(regular))
    else:
        size = _PSEUDO_NAMES_SIZE + sum(map(len, common))
        regular = fields[4:]
    headers: list[Header] = []
    hosts: list[bytes] = []
    lengths: list[bytes] = []
    crumbs: list[bytes] = []
    agent: bytes | None = None
    expects_continue = False
    for name, value in regular:
        if name in _CONNECTION_SPECIFIC:
            raise _malformed(pseudo, _connection_specific(name))
        if name == b"cookie":
            crumbs.append(value)  # joined below, as one last field
            continue
        size += len(name) + len(value)
        if name == b"te":
            if value.lower() != b"trailers":
                raise _malformed(pseudo, _TE_ERROR)
            continue  # hop-by-hop (only 'trailers' here): not forwarded
        if name == b"host":
            hosts.append(value)
            continue
        if name == b"content-length":
            lengths.append(value)
        elif name == b"user-agent":
            agent = value
        elif name == b"expect":
            expects_continue = value.lower() == b"100-continue"
        headers.append((name, value))
    if crumbs:
        # RFC 9113 section 8.2.3: cookie crumbs joined into one field.
        cookie = b"; ".join(crumbs)
        error = field_error(b"cookie", cookie)
        if error is not None:
            raise _malformed(pseudo, error)
        size += len(b"cookie") + len(cookie)
        headers.append((b"cookie", cookie))
    if common is None:
        method, scheme, path = _request_line(pseudo)
        authority = pseudo.get(b":authority")
    else:
        method, scheme, path, authority = common
    if len(hosts) > 1:
        raise MalformedRequestError("more than one host field", method, path)
    host = hosts[0] if hosts else None
    if authority is not None:
        if b"@" in authority:
            raise MalformedRequestError("userinfo in :authority", method, path)
        if host is not None and host.lower() != authority.lower():
            raise MalformedRequestError(
                "host field and :authority disagree (RFC 9113 8.3.1)", method, path
            )
        host = authority
    if host is None:
        raise MalformedRequestError("neither :authority nor host", method, path)
    if common is None and (not HOST_RE.fullmatch(host) or host[:1] in {b"", b":"}):
        raise MalformedRequestError("malformed :authority or host", method, path)
    content_length = None
    if lengths:
        if len(lengths) > 1 or not _CONTENT_LENGTH_RE.fullmatch(lengths[0]):
            raise MalformedRequestError(_CONTENT_LENGTH_ERROR, method, path)
        content_length = int(lengths[0])
        if content_length and end_stream:
            raise MalformedRequestError(
                f"content-length {content_length} on a stream its HEADERS ended "
                "(no DATA can follow)",
                method,
                path,
            )
    # (Positionally: keywords cost a named tuple twice as much to make.)
    return H2Request(
        method,
        path,
        scheme,
        host,
        [(b"host", host), *headers],
        content_length,
        end_stream,
        size,
        agent,
        expects_continue,
    )


def _common_request(
    fields: list[Header], pseudo: dict[bytes, bytes]
) -> tuple[bytes, bytes, bytes, bytes] | None:
    """The method, scheme, path and authority of a request whose first four
    fields (*pseudo*, as a dict) are its pseudo-headers, one of each, if they
    and its other fields pass their rules (`_COMMON_REQUEST_RE`); else None
    (`check_request` checks it rule by rule)."""
    if pseudo.keys() != _PSEUDO:
        return None
    line = (
        pseudo[b":method"],
        pseudo[b":scheme"],
        pseudo[b":path"],
        pseudo[b":authority"],
    )
    if line[0] == b"CONNECT":
        return None
    regular = fields[4:]
    text = b"\n".join([b"\x00".join(line), *map(b"\x00".join, regular)])
    if _COMMON_REQUEST_RE.fullmatch(text) is None or text.count(b"\n") != len(regular):
        return None
    return line


def _pseudo_headers(fields: list[Header]) -> tuple[dict[bytes, bytes], int]:
    """A request's pseudo-headers, checked as names (known, once each, before
    the fields), and their bytes (names + values).

    Raises:
        MalformedRequestError: what is wrong with them.
    """
    pseudo: dict[bytes, bytes] = {}
    size = 0
    for name, value in fields:
        if name[:1] != b":":
            break
        size += len(name) + len(value)
        if name == b":protocol":
            raise _malformed(
                pseudo, ":protocol (extended CONNECT, RFC 8441) is not enabled"
            )
        if name not in _PSEUDO:
            raise _malformed(pseudo, f"unknown pseudo-header {show_bytes(name)}")
        if name in pseudo:
            raise _malformed(pseudo, f"pseudo-header {show_bytes(name)} twice")
        pseudo[name] = value
    return pseudo, size


def _request_line(pseudo: dict[bytes, bytes]) -> tuple[bytes, bytes, bytes]:
    """The method, scheme and target of a request's pseudo-headers, checked
    rule by rule (CONNECT's target: its authority, its scheme empty).

    Raises:
        MalformedRequestError: what is wrong with them.
    """
    method = pseudo.get(b":method")
    path = pseudo.get(b":path")
    scheme = pseudo.get(b":scheme")
    if method is None:
        raise MalformedRequestError("no :method", None, path)
    error = method_error(method)
    if error is not None:
        raise MalformedRequestError(error, method, path)
    if method == b"CONNECT":
        # RFC 9113 8.5: only :method and :authority. Answered 501, as in
        # HTTP/1.1: the proxy tunnels nothing.
        authority = pseudo.get(b":authority")
        if authority is None or scheme is not None or path is not None:
            raise MalformedRequestError(
                "CONNECT needs :authority and no :scheme or :path", method, path
            )
        path = authority
        scheme = b""
    if scheme is None or path is None:
        raise MalformedRequestError("no :scheme or no :path", method, path)
    if method != b"CONNECT" and not _SCHEME_RE.fullmatch(scheme):
        raise MalformedRequestError(
            f"malformed :scheme {show_bytes(scheme)}", method, path
        )
    if method != b"CONNECT" and (
        not path or (path[:1] != b"/" and not (path == b"*" and method == b"OPTIONS"))
    ):
        raise MalformedRequestError(
            f"malformed :path {show_bytes(path)}: expected '/...' (or '*' for OPTIONS)",
            method,
            path,
        )
    error = target_error(path)
    if error is not None:
        raise MalformedRequestError(f"malformed :path: {error}", method, path)
    return method, scheme, path


def _field_error(name: bytes, value: bytes) -> str | None:
    """What makes a field (not a pseudo-header) malformed in HTTP/2, or None:
    the gate's field rules, a lowercase name, no connection-specific field
    (RFC 9113 section 8.2.2; ``te`` only as ``trailers``); a ``content-length``
    h2 would refuse (`_hidden_from_h2`)."""
    if name == _MALFORMED_CONTENT_LENGTH:
        return _CONTENT_LENGTH_ERROR
    if not _NAME_RE.fullmatch(name):
        return f"field name {show_bytes(name)} is not a lowercase token"
    error = field_error(name, value)
    if error is not None:
        return error
    if name in _CONNECTION_SPECIFIC:
        return _connection_specific(name)
    if name == b"te" and value.lower() != b"trailers":
        return _TE_ERROR
    return None


def _fields_error(regular: list[Header]) -> str:
    """What makes the first malformed one of a request's fields (after its
    pseudo-headers) malformed."""
    for name, value in regular:
        if name[:1] == b":":
            return f"pseudo-header {show_bytes(name)} after a field"
        error = _field_error(name, value)
        if error is not None:
            return error
    return "a field that spans lines"


def _connection_specific(name: bytes) -> str:
    return f"connection-specific field {show_bytes(name)} (RFC 9113 8.2.2)"


def _trailer_error(name: bytes, value: bytes) -> str | None:
    """What makes a trailer field malformed, or None."""
    if name[:1] == b":":
        return f"pseudo-header {show_bytes(name)} in trailers (RFC 9113 8.1)"
    error = _field_error(name, value)
    return None if error is None else f"trailer {error}"


def _trailer_section(fields: list[Header]) -> tuple[list[Header], str | None]:
    """A trailer section's fields, cookie crumbs joined, and what makes it
    malformed, or None: a field as it came (a cookie crumb too), or the
    joined cookie."""
    trailers = _cookies_joined(fields)
    checked = fields if trailers is fields else [*fields, trailers[-1]]
    return trailers, next((e for n, v in checked if (e := _trailer_error(n, v))), None)


def _cookies_joined(fields: list[Header]) -> list[Header]:
    """*fields* with their cookie crumbs joined into one last field (RFC 9113
    section 8.2.3)."""
    crumbs = [value for name, value in fields if name == b"cookie"]
    if not crumbs:
        return fields
    return [
        *((name, value) for name, value in fields if name != b"cookie"),
        (b"cookie", b"; ".join(crumbs)),
    ]


def _error_name(code: int | None) -> str:
    """An HTTP/2 error code's name (``NO_ERROR``), or its number if unknown."""
    try:
        return ErrorCodes(code or 0).name
    except ValueError:
        return f"error code {code}"


def _malformed(pseudo: dict[bytes, bytes], reason: str) -> MalformedRequestError:
    """A malformed request, with its method and path when they were seen."""
    return MalformedRequestError(reason, pseudo.get(b":method"), pseudo.get(b":path"))
