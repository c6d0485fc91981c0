"""HeaderReader: the incremental, h11-style PROXY header reader.

Theory of operation
-------------------
The reader has three states. WAITING: bytes accumulate in a buffer; each
``next_event()`` looks at them and either returns NEED_DATA, finishes, or fails.
DONE: a header (or, for optional readers, NO_HEADER) was returned; the bytes
after it are in ``trailing_data`` and the reader takes no more input. ERROR: the
input was invalid; every later ``next_event()`` raises the same error again.

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
from collections.abc import Iterable
from typing import TypedDict, Unpack

from proxyproto._errors import LocalProtocolError, RemoteProtocolError, quote
from proxyproto._events import NEED_DATA, NO_HEADER, ProxyHeader, _Sentinel
from proxyproto._options import (
    DEFAULT_MAX_V2_LENGTH,
    DEFAULT_OPTIONS,
    Options,
)
from proxyproto._v1 import V1_PREFIX, decode_v1
from proxyproto._v2 import V2_FIXED_LENGTH, V2_SIGNATURE, check_v2_prefix, decode_v2

__all__ = ["HeaderReader", "parse"]

# The shortest possible headers: "PROXY UNKNOWN\r\n" and a bare v2 LOCAL.
_V1_MIN_LENGTH = 15


class _State(enum.Enum):
    WAITING = "WAITING"
    DONE = "DONE"
    ERROR = "ERROR"


# Module constants: a global lookup is cheaper than an enum class attribute.
_WAITING = _State.WAITING
_DONE = _State.DONE
_ERROR = _State.ERROR


def _decode(
    buf: bytes, options: Options, *, optional: bool = False, eof: bool = False
) -> tuple[ProxyHeader, int] | _Sentinel:
    if not buf:
        return NO_HEADER if optional and eof else NEED_DATA
    first = buf[0]
    if first == 0x0D and 2 in options.versions:
        if buf[:12] == V2_SIGNATURE:
            return decode_v2(buf, options) or NEED_DATA
        if optional and V2_SIGNATURE[: len(buf)] != buf[:12]:
            return NO_HEADER
        check_v2_prefix(buf)
        return NO_HEADER if optional and eof else NEED_DATA
    if first == 0x50 and 1 in options.versions:  # "P"
        if buf[:6] == V1_PREFIX:
            return decode_v1(buf, options) or NEED_DATA
        if V1_PREFIX[: len(buf)] != buf[:6]:
            if optional:
                return NO_HEADER
            raise RemoteProtocolError(
                f"bad v1 header: expected 'PROXY ', got {quote(buf[:6])}",
                reason="bad_signature",
            )
        return NO_HEADER if optional and eof else NEED_DATA
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
            return NEED_DATA
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


_ALL_VERSIONS = (1, 2)
_DEFAULT_MAX_V2_LENGTH = DEFAULT_MAX_V2_LENGTH  # the default argument's object
_MAX_CACHED_OPTIONS = 64
_OPTIONS_CACHE: dict[tuple[frozenset[int], int, bool, bool, bool], Options] = {}


def _make_options(
    versions: Iterable[int] = _ALL_VERSIONS,
    max_v2_length: int = DEFAULT_MAX_V2_LENGTH,
    verify_crc32c: bool = True,
    accept_unspec_proxy: bool = False,
    accept_ipv4_in_tcp6: bool = False,
) -> Options:
    if (
        versions is _ALL_VERSIONS
        and max_v2_length == DEFAULT_MAX_V2_LENGTH
        and verify_crc32c is True
        and accept_unspec_proxy is False
        and accept_ipv4_in_tcp6 is False
    ):
        return DEFAULT_OPTIONS  # what the code below returns, without building it
    # A server builds a reader per connection with the same arguments: build
    # (and check) each set of options once. The cache is bounded; invalid
    # options raise and are never cached.
    key = (
        frozenset(versions),
        max_v2_length,
        verify_crc32c,
        accept_unspec_proxy,
        accept_ipv4_in_tcp6,
    )
    options = _OPTIONS_CACHE.get(key)
    if options is None:
        options = Options(
            versions=key[0],
            max_v2_length=max_v2_length,
            verify_crc32c=verify_crc32c,
            accept_unspec_proxy=accept_unspec_proxy,
            accept_ipv4_in_tcp6=accept_ipv4_in_tcp6,
        )
        if options == DEFAULT_OPTIONS:
            options = DEFAULT_OPTIONS
        if len(_OPTIONS_CACHE) >= _MAX_CACHED_OPTIONS:
            _OPTIONS_CACHE.clear()  # a server uses a handful: start afresh
        _OPTIONS_CACHE[key] = options
    return options


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

    __slots__ = (
        "_buf",
        "_eof",
        "_error",
        "_optional",
        "_options",
        "_state",
        "_trailing",
    )

    def __init__(
        self,
        *,
        versions: Iterable[int] = _ALL_VERSIONS,
        optional: bool = False,
        max_v2_length: int = DEFAULT_MAX_V2_LENGTH,
        verify_crc32c: bool = True,
        accept_unspec_proxy: bool = False,
        accept_ipv4_in_tcp6: bool = False,
    ) -> None:
        if (
            versions is _ALL_VERSIONS
            and max_v2_length is _DEFAULT_MAX_V2_LENGTH
            and verify_crc32c is True
            and accept_unspec_proxy is False
            and accept_ipv4_in_tcp6 is False
        ):
            # The defaults, as passed when not given (identity is enough here:
            # _make_options finds the same result for equal values).
            self._options = DEFAULT_OPTIONS
        else:
            self._options = _make_options(
                versions,
                max_v2_length,
                verify_crc32c,
                accept_unspec_proxy,
                accept_ipv4_in_tcp6,
            )
        self._optional = optional
        self._buf = b""
        self._eof = False
        self._state = _WAITING
        self._error: RemoteProtocolError | None = None
        self._trailing = b""

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes received from the peer; ``b""`` means the peer closed.

        Raises:
            LocalProtocolError: the reader has already finished, or data came
                after EOF.
        """
        if self._state is not _WAITING:
            if self._state is _DONE:
                raise LocalProtocolError(
                    "the header was already read; use trailing_data for what follows"
                )
            return  # already refused: keep nothing (the buffer stays bounded)
        if not data:
            self._eof = True
        elif self._eof:
            raise LocalProtocolError("received data after EOF")
        elif self._buf:
            self._buf += data
        else:
            self._buf = data if type(data) is bytes else bytes(data)

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
        if self._state is not _WAITING:
            if self._error is not None:
                raise self._error
            raise LocalProtocolError("next_event() called after the header was read")
        buf = self._buf
        options = self._options
        result: tuple[ProxyHeader, int] | _Sentinel
        try:
            # A complete header in one read is the common case: go straight to
            # its decoder (what _decode would do, a call and a few tests less).
            if buf[:12] == V2_SIGNATURE and 2 in options.versions:
                result = decode_v2(buf, options) or NEED_DATA
            elif buf[:6] == V1_PREFIX and 1 in options.versions:
                result = decode_v1(buf, options) or NEED_DATA
            else:
                result = _decode(buf, options, optional=self._optional, eof=self._eof)
            if isinstance(result, tuple):
                header, consumed = result
                self._trailing = buf[consumed:]
                self._buf = b""
                self._state = _DONE
                return header
            if result is NEED_DATA and self._eof:
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
        if result is NO_HEADER:
            self._trailing = buf
            self._buf = b""
            self._state = _DONE
        return result

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
        if self._state is not _WAITING:
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
    opts = _make_options(**options) if options else DEFAULT_OPTIONS
    buf = data if type(data) is bytes else bytes(data)
    # Skip a call in the common cases.
    if buf[:12] == V2_SIGNATURE and 2 in opts.versions:
        result: tuple[ProxyHeader, int] | _Sentinel | None = decode_v2(buf, opts)
    elif buf[:6] == V1_PREFIX and 1 in opts.versions:
        result = decode_v1(buf, opts)
    else:
        result = _decode(buf, opts)
    if type(result) is tuple:
        return result
    raise RemoteProtocolError(
        f"incomplete PROXY header ({len(buf)} bytes)", reason="incomplete"
    )
