"""Validation of TLV values, shared by the parser and the TLV builders.

Text TLVs (AUTHORITY, NETNS, the SSL sub-TLVs) are checked here before anyone
can log or forward them: a header whose text is not the advertised encoding, or
contains control characters, is refused (Envoy's CVE-2024-23324 is what happens
otherwise). Custom (0xE0-0xEF), experimental and future types are opaque: they
are kept raw, in wire order, duplicates included; the cloud vendors' custom
types are checked by their accessors on ``ProxyHeader``.
"""

from __future__ import annotations

from collections.abc import Callable

from proxyproto._errors import LocalProtocolError, RemoteProtocolError
from proxyproto._events import (
    MAX_AUTHORITY_LENGTH,
    MAX_UNIQUE_ID_LENGTH,
    TLV,
    SSLClient,
    SSLInfo,
    TLVType,
    slot_setters,
)

ErrorType = type[LocalProtocolError] | type[RemoteProtocolError]

_SSL_TEXT_FIELDS: dict[int, str] = {
    TLVType.SSL_VERSION: "version",
    TLVType.SSL_CIPHER: "cipher",
    TLVType.SSL_SIG_ALG: "sig_alg",
    TLVType.SSL_KEY_ALG: "key_alg",
    TLVType.SSL_GROUP: "group",
    TLVType.SSL_SIG_SCHEME: "sig_scheme",
}
_SSL_FIXED_LENGTH = 5  # u8 client + u32 verify, packed
_SSL_VERSION = int(TLVType.SSL_VERSION)
_SSL_CN = int(TLVType.SSL_CN)
_SSL_CLIENT_CERT = int(TLVType.SSL_CLIENT_CERT)
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
    if not 1 <= len(value) <= 255:
        raise error(
            f"ALPN TLV must be 1..255 bytes (RFC 7301), got {len(value)}",
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
    # What _walk_ssl checks, without building what it returns; on any doubt,
    # _walk_ssl runs and raises the precise error.
    end = len(value)
    pos = _SSL_FIXED_LENGTH
    has_version = False
    text_types = _SSL_TEXT_FIELDS
    printable = _PRINTABLE_ASCII
    while pos < end:
        if end - pos < 3:
            break
        sub_type = value[pos]
        stop = pos + 3 + ((value[pos + 1] << 8) | value[pos + 2])
        if stop > end:
            break
        if sub_type in text_types:
            sub = value[pos + 3 : stop]
            if not sub or sub.translate(None, printable):
                break
            if sub_type == _SSL_VERSION:
                has_version = True
        elif sub_type == _SSL_CN and not check_utf8(value[pos + 3 : stop]):
            break
        pos = stop
    else:
        if end >= _SSL_FIXED_LENGTH and (has_version or not value[0] & _CLIENT_SSL):
            return
    _walk_ssl(value, error)


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


def _walk_ssl(value: bytes, error: ErrorType) -> list[tuple[int, bytes, str | None]]:
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
        name = _SSL_TEXT_FIELDS.get(sub_type)
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


def decode_ssl(value: bytes, error: ErrorType) -> SSLInfo:
    """Decode and validate the SSL TLV's value.

    Raises:
        LocalProtocolError | RemoteProtocolError: (*error*) the value is invalid.
    """
    # Built like the parser builds headers (no constructors: every value is
    # checked by _walk_ssl); the first sub-TLV of each type fills its field.
    fields: dict[str, object] = dict.fromkeys(_SSL_INFO_OPTIONAL)
    tlvs = []
    for sub_type, sub_value, text in _walk_ssl(value, error):
        tlv = _new(TLV)
        _SET_TLV_TYPE(tlv, sub_type)
        _SET_TLV_VALUE(tlv, sub_value)
        _SET_TLV_VALID(tlv, False)  # sub-TLVs are not top-level TLVs
        tlvs.append(tlv)
        if text is not None:
            name = _SSL_TEXT_FIELDS.get(sub_type, "cn")
            if fields[name] is None:
                fields[name] = text
        elif sub_type == _SSL_CLIENT_CERT and fields["client_cert"] is None:
            fields["client_cert"] = sub_value
    client = _CLIENT_FLAGS.get(value[0])
    if client is None:
        client = _CLIENT_FLAGS[value[0]] = SSLClient(value[0])
    fields["client"] = client
    fields["verify"] = int.from_bytes(value[1:5], "big")
    fields["tlvs"] = tuple(tlvs)
    info = _new(SSLInfo)
    for name, field_value in fields.items():
        _SSL_INFO_SETTERS[name](info, field_value)
    return info


_new = object.__new__
_SET_TLV_TYPE, _SET_TLV_VALUE, _SET_TLV_VALID = slot_setters(
    TLV, "type", "value", "_valid"
)
_SSL_INFO_OPTIONAL = (
    "version",
    "cn",
    "cipher",
    "sig_alg",
    "key_alg",
    "group",
    "sig_scheme",
    "client_cert",
)
_SSL_INFO_SETTERS = dict(
    zip(
        (*_SSL_INFO_OPTIONAL, "client", "verify", "tlvs"),
        slot_setters(SSLInfo, *_SSL_INFO_OPTIONAL, "client", "verify", "tlvs"),
        strict=True,
    )
)
# SSLClient(byte) goes through the Enum machinery (~1 us): 256 values at most.
_CLIENT_FLAGS: dict[int, SSLClient] = {}
