"""PROXY protocol v2 (binary): strict decoding and encoding.

Layout: 12-byte signature, ver/cmd byte, family byte, u16 length, then
``length`` bytes holding the address block and TLVs. The decoder slices the
header out first (16 + length bytes) and never looks past it, so application
data that arrived in the same read can never be mistaken for TLVs.
"""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv6Address

from proxyproto._crc32c import crc32c
from proxyproto._errors import LocalProtocolError, RemoteProtocolError, quote
from proxyproto._events import (
    TLV,
    UNIX_PATH_LENGTH,
    Command,
    Family,
    HeaderSlots,
    InetAddress,
    InetSlots,
    ProxyHeader,
    TLVType,
    Transport,
    UnixAddress,
    blank_ipv4,
    host_value,
    new_header,
    new_inet6_header,
)
from proxyproto._options import V2_MAX_LENGTH_FIELD, Options
from proxyproto._spec import MAX_ALPN_LENGTH, MAX_UNIQUE_ID_LENGTH
from proxyproto._tlv import TLV_CHECKS, TLV_HEAD

V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_FIXED_LENGTH = 16

# The seven family/transport bytes the spec defines, with the size of their
# address block. Anything else is refused (0x13 once crashed go-proxyproto).
_FAMILY_BYTES: dict[int, tuple[Family, Transport, int]] = {
    0x00: (Family.UNSPEC, Transport.UNSPEC, 0),
    0x11: (Family.INET, Transport.STREAM, 12),  # the block size tells the family
    0x12: (Family.INET, Transport.DGRAM, 12),
    0x21: (Family.INET6, Transport.STREAM, 36),
    0x22: (Family.INET6, Transport.DGRAM, 36),
    0x31: (Family.UNIX, Transport.STREAM, 2 * UNIX_PATH_LENGTH),
    0x32: (Family.UNIX, Transport.DGRAM, 2 * UNIX_PATH_LENGTH),
}
_FAMILY_LIST = " ".join(f"0x{b:02x}" for b in _FAMILY_BYTES)
_BLOCK_SIZE = {(f, t): size for f, t, size in _FAMILY_BYTES.values()}
_CRC32C = int(TLVType.CRC32C)
_UNIQUE_ID = int(TLVType.UNIQUE_ID)
_ALPN = int(TLVType.ALPN)
_INET4 = struct.Struct("!IIHH")
# (ver/cmd, family) byte pairs -> what they mean: one lookup validates both.
_KINDS = {
    bytes((0x20 | command, fam_byte)): (command, family, transport, block)
    for command in Command
    for fam_byte, (family, transport, block) in _FAMILY_BYTES.items()
}
_UNSPEC = (Family.UNSPEC, Transport.UNSPEC)

_INET6 = struct.Struct("!QQQQHH")  # each address as two u64 halves
# The ver/cmd byte, (the family byte skipped,) the length field and the
# address block: bytes 12 to 28 (INET) or 52 (INET6).
_INET4_AT12 = struct.Struct("!BxHIIHH")
_INET6_AT12 = struct.Struct("!BxHQQQQHH")
# The transport of each INET and INET6 family byte; None for the others.
_INET_TRANSPORTS: tuple[Transport | None, ...] = tuple(
    transport if family in (Family.INET, Family.INET6) else None
    for family, transport, _ in (
        _FAMILY_BYTES.get(byte, (Family.UNSPEC, Transport.UNSPEC, 0))
        for byte in range(256)
    )
)
_INET6_PORTS = struct.Struct("!HH")
_U64 = 0xFFFF_FFFF_FFFF_FFFF
_FAMILY_INET = Family.INET
_PROXY = Command.PROXY


def _reject(msg: str, reason: str = "bad_v2") -> RemoteProtocolError:
    return RemoteProtocolError(msg, reason=reason)


def _unix_path(raw: bytes) -> UnixAddress:
    # Regular paths end at the first NUL; abstract ones (leading NUL) can only
    # lose their padding.
    path = raw.rstrip(b"\x00") if raw[:1] == b"\x00" else raw.partition(b"\x00")[0]
    return UnixAddress(path)


def _reject_fixed_part(buf: bytes) -> None:
    # Called when bytes 12-13 are not a known (ver/cmd, family) pair, or not
    # both there yet: say precisely which byte is wrong.
    if len(buf) > 12:
        ver_cmd = buf[12]
        if ver_cmd >> 4 != 2:
            raise _reject(
                f"bad v2 version nibble 0x{ver_cmd >> 4:x} in byte 0x{ver_cmd:02x}; "
                f"expected 0x2",
                reason="bad_version",
            )
        if ver_cmd & 0x0F > 1:
            raise _reject(
                f"bad v2 command 0x{ver_cmd & 0x0F:x}; expected 0x0 (LOCAL) or "
                f"0x1 (PROXY)",
                reason="bad_command",
            )
    if len(buf) > 13:
        raise _reject(
            f"bad v2 family byte 0x{buf[13]:02x}; expected one of {_FAMILY_LIST}",
            reason="bad_family",
        )


def decode_v2(buf: bytes, options: Options) -> tuple[ProxyHeader, int] | None:
    """Decode a v2 header at the start of *buf* (whose first 12 bytes are the
    signature).

    Returns:
        ``(header, bytes consumed)``, or None while the header is incomplete.

    Raises:
        RemoteProtocolError: the bytes are not a valid v2 header.
    """
    size = len(buf)
    if size >= 28:
        # The common case, a PROXY header of the INET or INET6 family with
        # its addresses all there: the family byte chooses, then one unpack
        # reads the ver/cmd byte, the length field and the address block.
        # Anything else (LOCAL, UNIX, short, a length that does not fit)
        # takes the general path below, which says what is wrong.
        family_byte = buf[13]
        transport = _INET_TRANSPORTS[family_byte]
        if transport is not None:
            if family_byte < 0x20:  # INET
                ver_cmd, length, src, dst, sport, dport = _INET4_AT12.unpack_from(
                    buf, 12
                )
                if ver_cmd == 0x21 and 12 <= length <= options.max_v2_length:
                    total = V2_FIXED_LENGTH + length
                    if size < total:
                        return None
                    # new_header inline (see HeaderSlots), the destination
                    # left for first access (see ProxyHeader.destination).
                    host = blank_ipv4()
                    host._ip = src
                    client = InetSlots()
                    client.host = host
                    client.port = sport
                    client.__class__ = InetAddress  # type: ignore[assignment]
                    header = HeaderSlots()
                    header.version = 2
                    header.command = _PROXY
                    header.family = _FAMILY_INET
                    header.transport = transport
                    header.source = client
                    header._destination = (dst, dport)
                    header._tlvs = (
                        check_tlvs(buf, 28, total, options) if total > 28 else ()
                    )
                    header.__class__ = ProxyHeader  # type: ignore[assignment]
                    return header, total  # type: ignore[return-value]
            elif size >= 52:  # INET6
                ver_cmd, length, src_hi, src_lo, dst_hi, dst_lo, sport, dport = (
                    _INET6_AT12.unpack_from(buf, 12)
                )
                if ver_cmd == 0x21 and 36 <= length <= options.max_v2_length:
                    total = V2_FIXED_LENGTH + length
                    if size < total:
                        return None
                    return new_inet6_header(
                        2,
                        transport,
                        (src_hi << 64) | src_lo,
                        sport,
                        (dst_hi << 64) | dst_lo,
                        dport,
                        check_tlvs(buf, 52, total, options) if total > 52 else (),
                    ), total
    kind = _KINDS.get(buf[12:14])
    if kind is None:
        _reject_fixed_part(buf)
        return None
    command, family, transport, block = kind
    if size < V2_FIXED_LENGTH:
        return None
    length = (buf[14] << 8) | buf[15]
    if length > options.max_v2_length:
        raise _reject(
            f"v2 header length {length} exceeds the limit of "
            f"{options.max_v2_length} bytes",
            reason="too_large",
        )
    total = V2_FIXED_LENGTH + length
    if size < total:
        return None
    source: InetAddress | UnixAddress | None = None
    destination: InetAddress | UnixAddress | None = None
    if command is _PROXY:
        if length < block:
            raise _reject(
                f"v2 {family.name} address block needs {block} bytes but the "
                f"header length is {length}",
                reason="truncated_addresses",
            )
        if block:  # UNIX (INET and INET6 took the fast path above)
            source, destination = decode_v2_addresses(buf)
        elif not options.accept_unspec_proxy:
            raise _reject(
                "v2 PROXY command with UNSPEC family (no addresses); refused "
                "unless accept_unspec_proxy=True",
                reason="unspec_proxy",
            )
        tlv_start = V2_FIXED_LENGTH + block
    else:
        # LOCAL: the receiver must ignore the address block and its family but
        # honour the length (AWS NLB health checks send dummy INET addresses).
        family, transport = _UNSPEC
        tlv_start = V2_FIXED_LENGTH + block if length >= block else total
    tlvs: tuple[TLV, ...] | bytes = ()
    if tlv_start < total:
        tlvs = check_tlvs(buf, tlv_start, total, options)
    return new_header(2, command, family, transport, source, destination, tlvs), total


def decode_v2_addresses(
    wire: bytes,
) -> tuple[InetAddress, InetAddress] | tuple[UnixAddress, UnixAddress]:
    """Build the address objects of a v2 header from its validated fixed part
    and address block (*wire* starts with the signature)."""
    fam = wire[13] >> 4
    if fam == Family.INET:
        src, dst, sport, dport = _INET4.unpack_from(wire, 16)
        return InetAddress(IPv4Address(src), sport), InetAddress(
            IPv4Address(dst), dport
        )
    if fam == Family.INET6:
        sport, dport = _INET6_PORTS.unpack_from(wire, 48)
        return (
            InetAddress(IPv6Address(wire[16:32]), sport),
            InetAddress(IPv6Address(wire[32:48]), dport),
        )
    return _unix_path(wire[16:124]), _unix_path(wire[124:232])


def check_tlvs(buf: bytes, pos: int, end: int, options: Options) -> bytes:
    """Check the TLVs in ``buf[pos:end]`` (the header's end) and return those
    bytes, as a decoded ProxyHeader keeps them (see ProxyHeader.tlvs).

    Raises:
        RemoteProtocolError: a TLV is truncated, overruns the header, or has
            a value its type does not allow; the CRC32C does not match.
    """
    start = pos
    crc_at = -1
    checks = TLV_CHECKS
    head = TLV_HEAD.unpack_from
    while pos < end:
        if end - pos < 3:
            raise _reject(
                f"truncated TLV header at offset {pos}: {end - pos} bytes left, need 3",
                reason="bad_tlv",
            )
        tlv_type, length = head(buf, pos)
        stop = pos + 3 + length
        if stop > end:
            raise _reject(
                f"TLV 0x{tlv_type:02x} at offset {pos} has length {length} and "
                f"overruns the header by {stop - end} bytes",
                reason="bad_tlv",
            )
        check = checks.get(tlv_type)
        if check is not None:
            # The checks of a length alone are made here, without a call (the
            # check says what is wrong).
            if tlv_type == _UNIQUE_ID:
                if length > MAX_UNIQUE_ID_LENGTH:
                    check(buf[pos + 3 : stop], RemoteProtocolError)
            elif tlv_type == _ALPN:
                if not 0 < length <= MAX_ALPN_LENGTH:
                    check(buf[pos + 3 : stop], RemoteProtocolError)
            else:
                check(buf[pos + 3 : stop], RemoteProtocolError)
                if tlv_type == _CRC32C:
                    if crc_at >= 0:
                        raise _reject("more than one CRC32C TLV", reason="bad_tlv")
                    crc_at = pos + 3
        pos = stop
    if crc_at >= 0 and options.verify_crc32c:
        _verify_crc32c(bytes(buf[:end]), crc_at)
    return buf[start:end]


def _verify_crc32c(header: bytes, at: int) -> None:
    expected = int.from_bytes(header[at : at + 4], "big")
    actual = crc32c(header[:at] + b"\x00\x00\x00\x00" + header[at + 4 :])
    if actual != expected:
        raise _reject(
            f"CRC32C mismatch: header says 0x{expected:08x}, bytes give 0x{actual:08x}",
            reason="crc32c_mismatch",
        )


def check_v2_prefix(buf: bytes) -> None:
    """Reject a partial v2 signature at its first wrong byte.

    Raises:
        RemoteProtocolError: *buf* does not start like a v2 signature.
    """
    n = min(len(buf), len(V2_SIGNATURE))
    if buf[:n] != V2_SIGNATURE[:n]:
        raise _reject(
            f"bad v2 signature: expected {V2_SIGNATURE!r}, got {quote(buf[:12])}",
            reason="bad_signature",
        )


def _address_block(header: ProxyHeader) -> bytes:
    src = header.source
    dst = header._destination  # a decoded header's unread pair is taken as is
    if isinstance(src, InetAddress):
        # ProxyHeader pairs it with an InetAddress of the same IP version,
        # IPv4 for INET and IPv6 for INET6.
        if isinstance(dst, InetAddress):
            d, dst_port = host_value(dst.host), dst.port
        elif type(dst) is tuple:  # never text: that is v1's (see PendingInet)
            pending, dst_port = dst  # type: ignore[assignment]
            # A value, or (HeaderReader's INET6 path) the address's 16 bytes.
            d = int.from_bytes(pending) if isinstance(pending, bytes) else pending
        else:
            return b""
        s = host_value(src.host)
        if header.family is _FAMILY_INET:
            return _INET4.pack(s, d, src.port, dst_port)
        return _INET6.pack(s >> 64, s & _U64, d >> 64, d & _U64, src.port, dst_port)
    if isinstance(src, UnixAddress) and isinstance(dst, UnixAddress):
        return src.path.ljust(UNIX_PATH_LENGTH, b"\x00") + dst.path.ljust(
            UNIX_PATH_LENGTH, b"\x00"
        )
    return b""


def encode_v2(
    header: ProxyHeader, *, crc32c: bool = False, pad_to: int | None = None
) -> bytes:
    """Serialise a version-2 header.

    A CRC32C TLV already among the header's TLVs is always recomputed, so the
    encoder never emits a wrong checksum.

    Args:
        header: a header with ``version == 2``.
        crc32c: append a CRC32C TLV if the header has none.
        pad_to: pad with a NOOP TLV so the whole header is this many bytes.

    Raises:
        LocalProtocolError: the header is not version 2, has several CRC32C
            TLVs or a registered TLV with an invalid value, is too long for
            the 16-bit length, or cannot be padded to *pad_to* (a NOOP TLV
            takes at least 3 bytes).
    """
    if header.version != 2:
        raise LocalProtocolError(
            f"encode_v2 needs a version-2 header, got version {header.version}"
        )
    # As stored: a built header's tuple without the property's call; a
    # decoded header's TLV bytes made into records by the property.
    stored = header._tlvs
    tlvs: tuple[TLV, ...] = (
        header.tlvs if type(stored) is bytes else stored  # type: ignore[assignment]
    )
    parts = [_address_block(header)]
    crc_at = -1
    offset = V2_FIXED_LENGTH + len(parts[0])
    checks = TLV_CHECKS
    try:
        for tlv in tlvs:
            tlv_type = tlv.type
            value = tlv.value
            check = checks.get(tlv_type)
            if check is not None:
                if not tlv._valid:
                    check(value, LocalProtocolError)
                if tlv_type == _CRC32C:
                    if crc_at >= 0:
                        raise LocalProtocolError(_TWO_CRC32C)
                    crc_at = offset + 3
                    value = _NO_CRC32C
            length = len(value)
            parts.append(bytes((tlv_type, length >> 8, length & 0xFF)))
            parts.append(value)
            offset += 3 + length
    except LocalProtocolError:
        # Same verdict as checking the CRC32C count before anything else.
        if sum(1 for t in tlvs if t.type == _CRC32C) > 1:
            raise LocalProtocolError(_TWO_CRC32C) from None
        raise
    if crc32c and crc_at < 0:
        parts.append(_CRC32C_TLV_HEADER)
        parts.append(_NO_CRC32C)
        crc_at = offset + 3
        offset += 7
    if pad_to is not None:
        padding = pad_to - offset
        if padding != 0:
            if padding < 3:
                raise LocalProtocolError(
                    f"cannot pad a {offset}-byte header to {pad_to} bytes: a NOOP "
                    f"TLV needs at least 3"
                )
            parts.append(
                bytes((TLVType.NOOP, (padding - 3) >> 8, (padding - 3) & 0xFF))
            )
            parts.append(bytes(padding - 3))
            offset = pad_to
    length = offset - V2_FIXED_LENGTH
    if length > V2_MAX_LENGTH_FIELD:
        raise LocalProtocolError(
            f"header body is {length} bytes; the length field holds at most 65535"
        )
    fam_byte = (header.family << 4) | header.transport
    fixed = V2_SIGNATURE + bytes(
        (0x20 | header.command, fam_byte, length >> 8, length & 0xFF)
    )
    wire = fixed + b"".join(parts)
    if crc_at >= 0:
        wire = wire[:crc_at] + crc32c_of(wire).to_bytes(4, "big") + wire[crc_at + 4 :]
    return wire


# encode_v2's keyword argument shadows the function name inside it.
crc32c_of = crc32c
_TWO_CRC32C = "a header can carry only one CRC32C TLV"
_NO_CRC32C = b"\x00\x00\x00\x00"  # the CRC32C value while it is computed
_CRC32C_TLV_HEADER = bytes((_CRC32C, 0, 4))
