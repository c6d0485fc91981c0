"""Validation of TLV values, shared by the parser and the TLV builders.

Text TLVs (AUTHORITY, NETNS, the SSL sub-TLVs) are checked here before anyone
can log or forward them: a header whose text is not the advertised encoding, or
contains control characters, is refused (Envoy's CVE-2024-23324 is what happens
otherwise). Custom (0xE0-0xEF), experimental and future types are opaque: they
are kept raw, in wire order, duplicates included; the cloud vendors' custom
types are checked by their accessors on ``ProxyHeader``.

The dependency goes one way: this module works on bytes and the numbers of
`proxyproto._spec`; `proxyproto._events` (the TLV and header records) calls
`validate_tlv` from its builders and decodes the SSL TLV from `walk_ssl`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from proxyproto._errors import LocalProtocolError, RemoteProtocolError
from proxyproto._spec import (
    MAX_ALPN_LENGTH,
    MAX_AUTHORITY_LENGTH,
    MAX_UNIQUE_ID_LENGTH,
    SSLClient,
    TLVType,
)

ErrorType = type[LocalProtocolError] | type[RemoteProtocolError]

#: The SSL sub-TLVs that carry ASCII text, and the `SSLInfo` field of each.
SSL_TEXT_FIELDS: dict[int, str] = {
    TLVType.SSL_VERSION: "version",
    TLVType.SSL_CIPHER: "cipher",
    TLVType.SSL_SIG_ALG: "sig_alg",
    TLVType.SSL_KEY_ALG: "key_alg",
    TLVType.SSL_GROUP: "group",
    TLVType.SSL_SIG_SCHEME: "sig_scheme",
}
_SSL_TEXT_TYPES = frozenset(int(sub_type) for sub_type in SSL_TEXT_FIELDS)
_SSL_FIXED_LENGTH = 5  # u8 client + u32 verify, packed
#: The type and length of a TLV (or sub-TLV).
TLV_HEAD = struct.Struct("!BH")
_SSL_VERSION = int(TLVType.SSL_VERSION)
_SSL_CN = int(TLVType.SSL_CN)
_CLIENT_SSL = int(SSLClient.SSL)
# Printable ASCII: what str.isprintable() accepts among the ASCII characters.
_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))
_PRINTABLE_ASCII_NO_SPACE = bytes(range(0x21, 0x7F))

# The checks below first try a fast test that accepts only values the full
# check accepts (one bytes.translate call instead of decode + isprintable),
# and fall back to the full check, which says what is wrong, otherwise.


def check_ascii(value: bytes) -> bool:
    """True if *value* is non-empty printable ASCII (what _ascii_text accepts)."""
    return bool(value) and not value.translate(None, _PRINTABLE_ASCII)


def check_utf8(value: bytes) -> bool:
    """True if *value* is non-empty printable UTF-8 (what _utf8_text accepts)."""
    if not value:
        return False
    if not value.translate(None, _PRINTABLE_ASCII):
        return True
    if value.isascii():
        return False  # ASCII with a control character
    try:
        return value.decode("utf-8").isprintable()
    except UnicodeDecodeError:
        return False


def _ascii_text(value: bytes, what: str, error: ErrorType) -> str:
    if not value or not value.isascii():
        raise error(
            f"{what} must be non-empty ASCII, got {value[:32]!r}", reason="bad_tlv"
        )
    text = value.decode("ascii")
    if not text.isprintable():
        raise error(
            f"{what} contains control characters: {value[:32]!r}", reason="bad_tlv"
        )
    return text


def _utf8_text(value: bytes, what: str, error: ErrorType) -> str:
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise error(
            f"{what} is not valid UTF-8: {value[:32]!r}", reason="bad_tlv"
        ) from None
    if not text or not text.isprintable():
        raise error(
            f"{what} must be non-empty printable text, got {value[:32]!r}",
            reason="bad_tlv",
        )
    return text


def _check_alpn(value: bytes, error: ErrorType) -> None:
    if not 1 <= len(value) <= MAX_ALPN_LENGTH:
        raise error(
            f"ALPN TLV must be 1..{MAX_ALPN_LENGTH} bytes (RFC 7301), got {len(value)}",
            reason="bad_tlv",
        )


def _check_authority(value: bytes, error: ErrorType) -> None:
    if len(value) > MAX_AUTHORITY_LENGTH:
        raise error(
            f"AUTHORITY TLV is {len(value)} bytes; a host name has at most "
            f"{MAX_AUTHORITY_LENGTH}",
            reason="bad_tlv",
        )
    if value and not value.translate(None, _PRINTABLE_ASCII_NO_SPACE):
        return
    if " " in _utf8_text(value, "AUTHORITY TLV", error):
        raise error(f"AUTHORITY TLV contains a space: {value[:32]!r}", reason="bad_tlv")


def _check_crc32c(value: bytes, error: ErrorType) -> None:
    if len(value) != 4:
        raise error(f"CRC32C TLV must be 4 bytes, got {len(value)}", reason="bad_tlv")


def _check_unique_id(value: bytes, error: ErrorType) -> None:
    if len(value) > MAX_UNIQUE_ID_LENGTH:
        raise error(
            f"UNIQUE_ID TLV is {len(value)} bytes; the spec allows at most "
            f"{MAX_UNIQUE_ID_LENGTH}",
            reason="bad_tlv",
        )


def _check_netns(value: bytes, error: ErrorType) -> None:
    if not check_ascii(value):
        _ascii_text(value, "NETNS TLV", error)


def _check_ssl(value: bytes, error: ErrorType) -> None:
    # What walk_ssl checks, without building what it returns; on any doubt,
    # walk_ssl runs and raises the precise error.
    end = len(value)
    pos = _SSL_FIXED_LENGTH
    has_version = False
    text_types = _SSL_TEXT_TYPES
    printable = _PRINTABLE_ASCII
    head = TLV_HEAD.unpack_from
    try:
        while pos < end:
            sub_type, length = head(value, pos)  # fewer than 3 bytes: error
            stop = pos + 3 + length
            if stop > end:
                break
            if sub_type in text_types:
                if not length or value[pos + 3 : stop].translate(None, printable):
                    break
                if sub_type == _SSL_VERSION:
                    has_version = True
            elif sub_type == _SSL_CN and not check_utf8(value[pos + 3 : stop]):
                break
            pos = stop
        else:
            if end >= _SSL_FIXED_LENGTH and (has_version or not value[0] & _CLIENT_SSL):
                return
    except struct.error:
        pass
    walk_ssl(value, error)


# The TLV types whose values are checked, by type. Others are opaque.
TLV_CHECKS: dict[int, Callable[[bytes, ErrorType], None]] = {
    TLVType.ALPN: _check_alpn,
    TLVType.AUTHORITY: _check_authority,
    TLVType.CRC32C: _check_crc32c,
    TLVType.UNIQUE_ID: _check_unique_id,
    TLVType.SSL: _check_ssl,
    TLVType.NETNS: _check_netns,
}


def validate_tlv(tlv_type: int, value: bytes, error: ErrorType) -> None:
    """Check one top-level TLV's value against what its type allows.

    Raises:
        LocalProtocolError | RemoteProtocolError: (*error*) the value is invalid.
    """
    check = TLV_CHECKS.get(tlv_type)
    if check is not None:
        check(value, error)


def walk_ssl(value: bytes, error: ErrorType) -> list[tuple[int, bytes, str | None]]:
    """Walk and check the SSL TLV: ``(sub-type, value, text or None)`` each."""
    if len(value) < _SSL_FIXED_LENGTH:
        raise error(
            f"SSL TLV must be at least 5 bytes (client + verify), got {len(value)}",
            reason="bad_tlv",
        )
    subs = []
    has_version = False
    pos, end = _SSL_FIXED_LENGTH, len(value)
    while pos < end:
        if end - pos < 3:
            raise error(
                f"SSL sub-TLV header truncated: {end - pos} bytes left, need 3",
                reason="bad_tlv",
            )
        sub_type = value[pos]
        length = (value[pos + 1] << 8) | value[pos + 2]
        stop = pos + 3 + length
        if stop > end:
            raise error(
                f"SSL sub-TLV 0x{sub_type:02x} of length {length} overruns the SSL "
                f"TLV by {stop - end} bytes",
                reason="bad_tlv",
            )
        sub_value = value[pos + 3 : stop]
        text = None
        name = SSL_TEXT_FIELDS.get(sub_type)
        if name is not None:
            if check_ascii(sub_value):
                text = sub_value.decode("ascii")
            else:
                text = _ascii_text(sub_value, f"SSL {name} sub-TLV", error)
            has_version = has_version or sub_type == _SSL_VERSION
        elif sub_type == _SSL_CN:
            text = _utf8_text(sub_value, "SSL CN sub-TLV", error)
        subs.append((sub_type, sub_value, text))
        pos = stop
    if value[0] & _CLIENT_SSL and not has_version:
        raise error(
            "SSL TLV says the client used TLS but has no VERSION sub-TLV",
            reason="bad_tlv",
        )
    return subs
