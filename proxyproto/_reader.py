"""HeaderReader: the incremental, h11-style PROXY header reader.

Theory of operation
-------------------
The reader has four states. WAITING: bytes accumulate in a buffer; each
``next_event()`` looks at them and either returns NEED_DATA, finishes, or fails.
CLOSED: the peer closed (``receive_data(b"")``) and no more bytes may come; the
next ``next_event()`` finishes or fails, as the bytes it has allow. DONE: a
header (or, for optional readers, NO_HEADER) was returned; the bytes after it
are in ``trailing_data`` and the reader takes no more input. ERROR: the input
was invalid; every later ``next_event()`` raises the same error again.

The first byte decides the version: ``\\r`` can only start the v2 signature and
``P`` only ``PROXY ``. Anything else, or a later byte that cannot continue a
valid header, fails at once (h11's "reject early"): a client that sends
``GET / HTTP/1.1`` is refused after its first byte, not after a timeout. Limits
are checked before buffering beyond them: v1 gives up without a CRLF in 107
bytes, v2 checks the length field as soon as the 16 fixed bytes are in.

The reader never consumes a byte past the header, and ``bytes_needed`` tells a
socket adapter how much it may read without over-reading.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable
from typing import Literal, TypedDict, Unpack

from proxyproto._errors import LocalProtocolError, RemoteProtocolError, quote
from proxyproto._events import (
    NEED_DATA,
    NO_HEADER,
    Command,
    Family,
    HeaderSlots,
    InetAddress,
    InetSlots,
    ProxyHeader,
    Transport,
    _Sentinel,
    blank_ipv4,
    blank_ipv6,
)
from proxyproto._options import (
    DEFAULT_MAX_V2_LENGTH,
    DEFAULT_OPTIONS,
    Options,
)
from proxyproto._v1 import V1_PREFIX, decode_v1
from proxyproto._v2 import (
    V2_FIXED_LENGTH,
    V2_SIGNATURE,
    check_tlvs,
    check_v2_prefix,
    decode_v2,
)

__all__ = ["HeaderReader", "parse"]

# The shortest possible headers: "PROXY UNKNOWN\r\n" and a bare v2 LOCAL.
_V1_MIN_LENGTH = 15


class _State(enum.Enum):
    WAITING = "WAITING"  # for bytes
    CLOSED = "CLOSED"  # the peer closed (EOF) before a verdict: decided next
    DONE = "DONE"
    ERROR = "ERROR"


# The signature, the ver/cmd byte, (the family byte skipped,) the length
# field and the address block of a v2 INET header: its first 28 bytes.
_V2_TCP4 = struct.Struct("!12sBxHIIHH")
# The same for a v2 INET6 header: its first 52 bytes.
_V2_TCP6 = struct.Struct("!12sBxH16s16sHH")
_PROXY = Command.PROXY
_INET = Family.INET
_INET6 = Family.INET6
_from_bytes = int.from_bytes
_STREAM = Transport.STREAM

# Module constants: a global lookup is cheaper than an enum class attribute.
_WAITING = _State.WAITING
_CLOSED = _State.CLOSED
_DONE = _State.DONE
_ERROR = _State.ERROR


def _decode(
    buf: bytes, options: Options, *, optional: bool = False, eof: bool = False
) -> tuple[ProxyHeader, int] | Literal[_Sentinel.NO_HEADER] | None:
    """What the bytes so far are: a header and its length, NO_HEADER (for an
    optional reader), or None while more bytes are needed.

    Raises:
        RemoteProtocolError: the bytes are not a valid header.
    """
    if not buf:
        return NO_HEADER if optional and eof else None
    first = buf[0]
    if first == 0x0D and options.accepts_v2:
        if buf[:12] == V2_SIGNATURE:
            return decode_v2(buf, options)
        if optional and V2_SIGNATURE[: len(buf)] != buf[:12]:
            return NO_HEADER
        check_v2_prefix(buf)
        return NO_HEADER if optional and eof else None
    if first == 0x50 and options.accepts_v1:  # "P"
        if buf[:6] == V1_PREFIX:
            return decode_v1(buf, options) or None  # never False here
        if V1_PREFIX[: len(buf)] != buf[:6]:
            if optional:
                return NO_HEADER
            raise RemoteProtocolError(
                f"bad v1 header: expected 'PROXY ', got {quote(buf[:6])}",
                reason="bad_signature",
            )
        return NO_HEADER if optional and eof else None
    if optional:
        return NO_HEADER
    if first == 0x0D:
        raise RemoteProtocolError(
            "got a PROXY v2 header but only v1 is accepted here",
            reason="version_not_allowed",
        )
    if first == 0x50 and buf[:6] == V1_PREFIX[: len(buf[:6])]:
        if len(buf) < len(V1_PREFIX):
            # Only "PROXY " is a v1 header: until it is all there, the verdict
            # (wrong version or plain garbage) could still go either way, and
            # it must not depend on how the bytes were split.
            return None
        raise RemoteProtocolError(
            "got a PROXY v1 header but only v2 is accepted here",
            reason="version_not_allowed",
        )
    expected = " or ".join(
        {1: "'PROXY ' (v1)", 2: "the v2 signature"}[v] for v in sorted(options.versions)
    )
    raise RemoteProtocolError(
        f"not a PROXY header: expected {expected}, got {quote(buf[:16])}",
        reason="bad_signature",
    )


class ReaderOptions(TypedDict, total=False):
    """The keyword options of ``parse()`` (same as ``HeaderReader``'s)."""

    versions: Iterable[int]
    max_v2_length: int
    verify_crc32c: bool
    accept_unspec_proxy: bool
    accept_ipv4_in_tcp6: bool


class HeaderReaderOptions(ReaderOptions, total=False):
    """The keyword options of ``HeaderReader``: ``parse()``'s and ``optional``."""

    optional: bool


_PARSE_KEYWORDS = frozenset(
    (
        "versions",
        "max_v2_length",
        "verify_crc32c",
        "accept_unspec_proxy",
        "accept_ipv4_in_tcp6",
    )
)
_READER_KEYWORDS = _PARSE_KEYWORDS | {"optional"}
_ALL_VERSIONS = (1, 2)
_MAX_CACHED_OPTIONS = 64
_OPTIONS_CACHE: dict[tuple[frozenset[int], int, bool, bool, bool, bool], Options] = {}


def _make_options(  # noqa: PLR0917 (called with **: keyword defaults cost more)
    versions: Iterable[int] = _ALL_VERSIONS,
    max_v2_length: int = DEFAULT_MAX_V2_LENGTH,
    verify_crc32c: bool = True,
    accept_unspec_proxy: bool = False,
    accept_ipv4_in_tcp6: bool = False,
    optional: bool = False,
) -> Options:
    """The Options of these keyword options (HeaderReader's; parse() takes all
    but *optional*).

    Raises:
        TypeError: not an option (see _check_keywords for the message).
        LocalProtocolError: an option is out of range.
    """
    # A server builds a reader per connection with the same arguments: build
    # (and check) each set of options once. The cache is bounded; invalid
    # options raise and are never cached.
    key = (
        frozenset(versions),
        max_v2_length,
        verify_crc32c,
        accept_unspec_proxy,
        accept_ipv4_in_tcp6,
        optional,
    )
    options = _OPTIONS_CACHE.get(key)
    if options is None:
        options = Options(
            versions=key[0],
            max_v2_length=max_v2_length,
            verify_crc32c=verify_crc32c,
            accept_unspec_proxy=accept_unspec_proxy,
            accept_ipv4_in_tcp6=accept_ipv4_in_tcp6,
            optional=optional,
        )
        if options == DEFAULT_OPTIONS:
            options = DEFAULT_OPTIONS
        if len(_OPTIONS_CACHE) >= _MAX_CACHED_OPTIONS:
            _OPTIONS_CACHE.clear()  # a server uses a handful: start afresh
        _OPTIONS_CACHE[key] = options
    return options


def _check_keywords(
    caller: str, keywords: frozenset[str], given: Iterable[str]
) -> None:
    """Raise the TypeError Python raises for a keyword *caller* does not take.

    Raises:
        TypeError: a keyword of *given* is not in *keywords*.
    """
    for keyword in given:
        if keyword not in keywords:
            raise TypeError(
                f"{caller}() got an unexpected keyword argument {keyword!r}"
            )


class HeaderReader:
    """Reads one PROXY header from a byte stream, sans-IO.

    Args:
        versions: which versions to accept (``{1}``, ``{2}`` or both).
        optional: if True, a connection whose first bytes cannot start a PROXY
            header gives ``NO_HEADER`` instead of an error. This is guessing,
            which the spec forbids on ports that untrusted clients can reach:
            only use it for trusted sources (see ``TrustPolicy`` and
            ``Policy.USE``).
        max_v2_length: the largest v2 length field accepted (0..65535).
        verify_crc32c: check a CRC32C TLV when one is present.
        accept_unspec_proxy: accept a v2 PROXY command with UNSPEC family
            (reported with no addresses) instead of refusing it.
        accept_ipv4_in_tcp6: accept IPv4 addresses in v1 ``TCP6`` lines, as
            some nginx versions emit them (reported as IPv4-mapped IPv6).

    Raises:
        LocalProtocolError: an option is out of range.
    """

    # _error and _trailing are only set (and only read) in the ERROR and DONE
    # states: a reader per connection does not pay for storing them up front.
    __slots__ = ("_buf", "_error", "_options", "_state", "_trailing")
    _error: RemoteProtocolError
    _trailing: bytes

    def __init__(self, **options: Unpack[HeaderReaderOptions]) -> None:
        # The options as ``**``, all kept in one Options: a call without them
        # skips six keyword defaults and a store (a reader is made per
        # connection).
        if options:
            try:
                self._options = _make_options(**options)
            except TypeError:
                _check_keywords("HeaderReader", _READER_KEYWORDS, options)
                raise
        else:
            self._options = DEFAULT_OPTIONS
        self._buf = b""
        self._state = _WAITING

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes received from the peer; ``b""`` means the peer closed.

        Raises:
            LocalProtocolError: the reader has already finished, or data came
                after EOF.
        """
        if self._state is not _WAITING:
            self._refuse_data(data)
        elif not data:
            self._state = _CLOSED
        elif self._buf:
            self._buf += data
        else:
            self._buf = data if type(data) is bytes else bytes(data)

    def _refuse_data(self, data: bytes | bytearray | memoryview) -> None:
        state = self._state
        if state is _DONE:
            raise LocalProtocolError(
                "the header was already read; use trailing_data for what follows"
            )
        if state is _CLOSED and data:
            raise LocalProtocolError("received data after EOF")
        # ERROR: already refused, keep nothing (the buffer stays bounded).

    def next_event(self) -> ProxyHeader | _Sentinel:
        """Parse what has been received so far.

        Returns:
            The ``ProxyHeader``; ``NEED_DATA`` if more bytes are needed; or, for
            optional readers, ``NO_HEADER`` when the stream has no header.

        Raises:
            RemoteProtocolError: the peer's bytes are not a valid header, or the
                peer closed before a complete one (``reason == "eof"``; or
                ``"empty"`` when it closed without sending a byte). Raised
                again on every later call.
            LocalProtocolError: the header was already returned.
        """
        state = self._state
        if state is not _WAITING and state is not _CLOSED:
            if state is _ERROR:
                raise self._error
            raise LocalProtocolError("next_event() called after the header was read")
        buf = self._buf
        options = self._options
        try:
            # The most common header of all, v2 PROXY over TCP/IPv4, whole in
            # one read, is decoded here (and TCP/IPv6 below): a call less
            # than through decode_v2, whose INET path does the same (and says
            # what is wrong when this one does not match). The family byte
            # (0x11, 0x21) picks it; the unpack also reads the signature.
            size = len(buf)
            family_byte = buf[13] if size >= 28 else 0
            if family_byte == 0x11 and options.accepts_v2:
                signature, ver_cmd, length, src, dst, sport, dport = (
                    _V2_TCP4.unpack_from(buf)
                )
                total = V2_FIXED_LENGTH + length
                if (
                    signature == V2_SIGNATURE
                    and ver_cmd == 0x21
                    and 12 <= length <= options.max_v2_length
                    and total <= size
                ):
                    # new_header in line (see HeaderSlots), the destination
                    # left for first access (see ProxyHeader.destination).
                    host = blank_ipv4()
                    host._ip = src
                    client = InetSlots()
                    client.host = host
                    client.port = sport
                    client.__class__ = InetAddress  # type: ignore[assignment]
                    decoded = HeaderSlots()
                    decoded.version = 2
                    decoded.command = _PROXY
                    decoded.family = _INET
                    decoded.transport = _STREAM
                    decoded.source = client
                    decoded._destination = (dst, dport)
                    decoded._tlvs = (
                        check_tlvs(buf, 28, total, options) if total > 28 else ()
                    )
                    decoded.__class__ = ProxyHeader  # type: ignore[assignment]
                    self._trailing = buf[total:] if total < size else b""
                    self._buf = b""
                    self._state = _DONE
                    return decoded  # type: ignore[return-value]
            elif family_byte == 0x21 and size >= 52 and options.accepts_v2:
                # The same for v2 PROXY over TCP/IPv6 (family byte 0x21); the
                # destination kept as its 16 bytes until read.
                (
                    signature,
                    ver_cmd,
                    length,
                    src,
                    dst,
                    sport,
                    dport,
                ) = _V2_TCP6.unpack_from(buf)
                total = V2_FIXED_LENGTH + length
                if (
                    signature == V2_SIGNATURE
                    and ver_cmd == 0x21
                    and 36 <= length <= options.max_v2_length
                    and total <= size
                ):
                    host = blank_ipv6()
                    host._ip = _from_bytes(src)
                    host._scope_id = None
                    client = InetSlots()
                    client.host = host
                    client.port = sport
                    client.__class__ = InetAddress  # type: ignore[assignment]
                    decoded = HeaderSlots()
                    decoded.version = 2
                    decoded.command = _PROXY
                    decoded.family = _INET6
                    decoded.transport = _STREAM
                    decoded.source = client
                    decoded._destination = (dst, dport)
                    decoded._tlvs = (
                        check_tlvs(buf, 52, total, options) if total > 52 else ()
                    )
                    decoded.__class__ = ProxyHeader  # type: ignore[assignment]
                    self._trailing = buf[total:] if total < size else b""
                    self._buf = b""
                    self._state = _DONE
                    return decoded  # type: ignore[return-value]
            # Other complete headers: the first byte picks their decoder.
            # decode_v1 checks "PROXY " itself (False if it is not all
            # there); _decode judges the rest.
            first = buf[0] if size else -1
            result: tuple[ProxyHeader, int] | Literal[False] | None = False
            if first == 0x50:  # "P"
                if options.accepts_v1:
                    result = decode_v1(buf, options)
            elif buf[:12] == V2_SIGNATURE and options.accepts_v2:
                result = decode_v2(buf, options)
            if result is False:
                decided = _decode(
                    buf, options, optional=options.optional, eof=state is _CLOSED
                )
                if decided is NO_HEADER:
                    self._trailing = buf
                    self._buf = b""
                    self._state = _DONE
                    return NO_HEADER
                result = decided
            if result is not None:
                header, consumed = result
                # A header alone in its read is common (load balancers send
                # it as they connect): no slice then.
                self._trailing = buf[consumed:] if consumed < size else b""
                self._buf = b""
                self._state = _DONE
                return header
            if state is _CLOSED:
                if not buf:
                    # What a TCP health check or a port scan does: not a
                    # header cut short, so a reason of its own.
                    raise RemoteProtocolError(
                        "connection closed without sending a byte (no PROXY header)",
                        reason="empty",
                    )
                raise RemoteProtocolError(
                    f"connection closed after {len(buf)} bytes, before a "
                    f"complete PROXY header",
                    reason="eof",
                )
        except RemoteProtocolError as exc:
            self._state = _ERROR
            self._error = exc
            self._buf = b""
            raise
        return NEED_DATA

    @property
    def trailing_data(self) -> bytes:
        """The bytes received after the header, exactly as they arrived.

        Raises:
            LocalProtocolError: the header has not been read yet.
        """
        if self._state is not _DONE:
            raise LocalProtocolError(
                "trailing_data is only known once the header is read"
            )
        return self._trailing

    @property
    def bytes_needed(self) -> int:
        """How many bytes can be read from the socket without reading past the
        header: the exact remainder for v2, at least 1 for v1 (whose end is
        only known when the CRLF arrives; peek or read byte by byte), 0 once
        done.
        """
        if self._state is not _WAITING and self._state is not _CLOSED:
            return 0
        buf = self._buf
        if buf[:1] == b"\r" or (not buf and self._options.versions == {2}):
            if len(buf) < V2_FIXED_LENGTH:
                return V2_FIXED_LENGTH - len(buf)
            return max(1, V2_FIXED_LENGTH + ((buf[14] << 8) | buf[15]) - len(buf))
        if buf and buf[:1] != b"P":
            return 1
        return max(1, _V1_MIN_LENGTH - len(buf))


def parse(
    data: bytes | bytearray | memoryview, **options: Unpack[ReaderOptions]
) -> tuple[ProxyHeader, int]:
    """Parse a complete header at the start of *data* in one call.

    Args:
        data: the bytes received.
        **options: the ``HeaderReader`` options (``versions``, ``max_v2_length``,
            ``verify_crc32c``, ``accept_unspec_proxy``, ``accept_ipv4_in_tcp6``).

    Returns:
        ``(header, consumed)``: the header and its length in bytes; whatever
        follows ``data[consumed:]`` is not part of it.

    Raises:
        RemoteProtocolError: the header is invalid or incomplete
            (``reason == "incomplete"``).
        LocalProtocolError: an option is out of range.
    """
    if options:
        _check_keywords("parse", _PARSE_KEYWORDS, options)
        opts = _make_options(**options)
    else:
        opts = DEFAULT_OPTIONS
    buf = data if type(data) is bytes else bytes(data)
    # Straight to the decoder of a complete header (the reader has its own
    # path for v2 TCP/IPv4 too).
    result: tuple[ProxyHeader, int] | Literal[False, _Sentinel.NO_HEADER] | None
    result = False
    if buf[:12] == V2_SIGNATURE and opts.accepts_v2:
        result = decode_v2(buf, opts)
    elif opts.accepts_v1:
        result = decode_v1(buf, opts)
    if result is False:
        result = _decode(buf, opts)
    if isinstance(result, tuple):
        return result
    raise RemoteProtocolError(
        f"incomplete PROXY header ({len(buf)} bytes)", reason="incomplete"
    )
