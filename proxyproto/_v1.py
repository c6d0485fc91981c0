"""PROXY protocol v1 (text): strict decoding and encoding.

The grammar is exact: ``"PROXY" SP ("TCP4" | "TCP6") SP src SP dst SP sport SP
dport CRLF`` or ``"PROXY UNKNOWN" [anything] CRLF``, at most 107 bytes. Python's
``int()`` and ``ipaddress`` are more forgiving than the spec (signs, ``_``,
surrounding spaces, IPv6 zone ids), so every field is checked byte by byte first.
"""

from __future__ import annotations

import re
import struct
from ipaddress import IPv4Address, IPv6Address
from typing import Literal

from proxyproto._errors import LocalProtocolError, RemoteProtocolError, quote
from proxyproto._events import (
    Command,
    Family,
    HeaderSlots,
    InetAddress,
    InetSlots,
    ProxyHeader,
    Transport,
    blank_ipv4,
    blank_ipv6,
    host_value,
    new_header,
    new_inet,
)
from proxyproto._ip import (
    OCTETS,
    OCTETS_1,
    OCTETS_2,
    OCTETS_3,
    dotted_quad_value,
    ip_text,
    ipv4_value,
    ipv6_text,
    ipv6_value,
)
from proxyproto._options import V1_MAX_LENGTH, Options

V1_PREFIX = b"PROXY "
_UNKNOWN = b"UNKNOWN"
_UNKNOWN_SP = b"UNKNOWN "
_TCP_PROTOCOLS = (b"TCP4", b"TCP6")
# Bytes that may appear in a TCP4/TCP6 line before the CRLF.
_TCP_LINE_BYTES = b"PROXYTCP46 0123456789abcdefABCDEF.:"
_IPV6_BYTES = b"0123456789abcdefABCDEF:."
_MAX_PORT_DIGITS = 5

# Headers and addresses are built without their validating constructors, from
# fields checked here (new_header, new_inet).
_PROXY = Command.PROXY
_INET = Family.INET
_INET6 = Family.INET6
_STREAM = Transport.STREAM

# A TCP4 line in the shape of a valid one, CRLF included: decimal digits,
# single spaces, ports without a leading zero. The destination and its port
# are checked in full (octets 0..255, a port 0..65535, no leading zeros), as
# they are kept as text until read (see PendingInet); the source octets' range
# and leading zeros (OCTETS) and the source port's range are checked on the
# groups.
_OCTET = rb"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# Up to 4 digits first, taken whole (possessive: no backtracking into them
# when a fifth follows), then 5-digit ports up to 65535.
_PORT = rb"(?:[1-9]\d{0,3}+|[1-5]\d{4}|6[0-4]\d{3}|65[0-4]\d\d|655[0-2]\d|6553[0-5]|0)"
_TCP4_HEADER = re.compile(
    rb"PROXY TCP4 (\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3}) "
    rb"(" + rb"\.".join([_OCTET] * 4) + rb") "
    rb"(0|[1-9]\d{0,4}) (" + _PORT + rb")\r\n"
)
_HEX_GROUP = rb"[0-9A-Fa-f]{1,4}"
_DOTTED_QUAD = rb"\.".join([_OCTET] * 4)


def _hex_groups(count: int) -> bytes:
    return rb"(?:%s:){%d}%s" % (_HEX_GROUP, count - 1, _HEX_GROUP) if count else b""


def _ipv6_pattern() -> bytes:
    """What ``IPv6Address`` accepts (as ``ipv6_value`` judges it): eight hex
    groups, or six and a dotted quad; or ``left::right`` for each count of
    groups on the left, with at most 7 in all (6 and a quad): ``::`` stands
    for at least one zero group."""
    forms = [_hex_groups(8), rb"(?:%s:){6}%s" % (_HEX_GROUP, _DOTTED_QUAD)]
    for left in range(8):
        right = 7 - left
        tail = b""
        if right:
            tail = rb"(?:%s(?::%s){0,%d})?" % (_HEX_GROUP, _HEX_GROUP, right - 1)
        if right >= 2:
            quad = rb"(?:%s:){0,%d}%s" % (_HEX_GROUP, right - 2, _DOTTED_QUAD)
            tail = rb"(?:%s|%s)" % (tail, quad)
        forms.append(_hex_groups(left) + b"::" + tail)
    return b"(?:" + b"|".join(forms) + b")"


# A TCP6 line in the shape of a valid one, its destination and destination
# port checked in full (they are kept as text until read, see PendingInet):
# ipv6_value judges the source (what the class admits is its precondition;
# taken whole, possessive: the space after it is not in the class), and the
# line must still end within V1_MAX_LENGTH.
_TCP6_HEADER = re.compile(
    rb"PROXY TCP6 ([0-9A-Fa-f:.]{2,45}+) (" + _ipv6_pattern() + rb") "
    rb"(0|[1-9]\d{0,4}) (" + _PORT + rb")\r\n"
)


def _reject(msg: str, reason: str = "bad_v1") -> RemoteProtocolError:
    return RemoteProtocolError(msg, reason=reason)


def check_v1_prefix(buf: bytes) -> None:
    """Reject a partial v1 line at the earliest byte that cannot be valid.

    The check is conservative: it never refuses a prefix of a valid header, so
    feeding the same bytes in any split gives the same outcome.

    Raises:
        RemoteProtocolError: *buf* cannot be the start of a valid v1 header.
    """
    # Each check judges the bytes as decode_v1 will once the CRLF arrives, so
    # any split of the input gives the same outcome and the same reason: a
    # final CR may be the start of the CRLF (judge the line without it), and
    # the length check comes last so a bad byte is reported as such.
    body = buf[:-1] if buf.endswith(b"\r") else buf
    rest = body[len(V1_PREFIX) :]
    if rest.startswith(_UNKNOWN_SP) or _UNKNOWN.startswith(rest):
        # "PROXY UNKNOWN" may be followed by anything up to the CRLF, but a lone
        # CR or LF is never a terminator.
        if b"\n" in buf or b"\r" in buf[:-1]:
            raise _reject(f"stray CR or LF in a v1 header: {quote(buf)}")
        _check_v1_length(buf)
        return
    token, space, _ = rest.partition(b" ")
    if (space and token not in _TCP_PROTOCOLS) or not any(
        p.startswith(token) for p in _TCP_PROTOCOLS
    ):
        raise _reject(
            f"v1 protocol must be TCP4, TCP6 or UNKNOWN, got {quote(token)}",
            reason="bad_v1_protocol",
        )
    if body.translate(None, _TCP_LINE_BYTES):
        raise _reject(f"invalid byte in a v1 header: {quote(buf)}")
    _check_v1_length(buf)


def _check_v1_length(buf: bytes) -> None:
    if len(buf) >= V1_MAX_LENGTH:
        raise _reject(
            f"no CRLF within the first {V1_MAX_LENGTH} bytes of a v1 header: "
            f"{quote(buf)}",
            reason="v1_too_long",
        )


def _port(field: bytes) -> int:
    if (
        not field.isdigit()
        or len(field) > _MAX_PORT_DIGITS
        or (field[0] == 0x30 and len(field) > 1)
    ):
        raise _reject(
            f"v1 port must be decimal 0..65535 without sign or leading zeros, "
            f"got {quote(field)}"
        )
    port = int(field)
    if port > 0xFFFF:
        raise _reject(f"v1 port out of range: {port}")
    return port


def _ipv4(field: bytes) -> IPv4Address:
    value = ipv4_value(field)
    if value is None:
        raise _reject(
            f"v1 TCP4 address must be dotted decimal without leading zeros, "
            f"got {quote(field)}"
        )
    return IPv4Address(value)


def _ipv6(field: bytes, options: Options) -> IPv6Address:
    if options.accept_ipv4_in_tcp6 and b":" not in field:
        return IPv6Address(0xFFFF00000000 | int(_ipv4(field)))
    if field and not field.translate(None, _IPV6_BYTES):
        value = ipv6_value(field)
        if value is not None:
            return IPv6Address(value)
    raise _reject(f"v1 TCP6 address is not a valid IPv6 address: {quote(field)}")


def decode_v1(
    buf: bytes, options: Options
) -> tuple[ProxyHeader, int] | Literal[False] | None:
    """Decode a v1 header at the start of *buf*.

    Returns:
        ``(header, bytes consumed)``; None if the CRLF has not arrived yet;
        False if *buf* does not start with ``PROXY `` (the caller judges it).

    Raises:
        RemoteProtocolError: the bytes are not a valid v1 header.
    """
    match = _TCP4_HEADER.match(buf)
    if match is not None:
        # The common case, shaped by one C call: only range checks and
        # conversions are left. A miss falls through to the field checks,
        # which say what is wrong.
        a, b, c, d, dst_text, sport, dport = match.groups()
        try:  # a KeyError: an octet over 255 or with a leading zero
            src = OCTETS[d] + OCTETS_3[c] + OCTETS_2[b] + OCTETS_1[a]
        except KeyError:
            pass
        else:
            source_port = int(sport)
            if source_port <= 0xFFFF:
                # new_header inline (see HeaderSlots), the destination kept
                # as its text until read (see ProxyHeader.destination).
                host = blank_ipv4()
                host._ip = src
                client = InetSlots()
                client.host = host
                client.port = source_port
                client.__class__ = InetAddress  # type: ignore[assignment]
                header = HeaderSlots()
                header.version = 1
                header.command = _PROXY
                header.family = _INET
                header.transport = _STREAM
                header.source = client
                header._destination = (dst_text, dport)
                header._tlvs = ()
                header.__class__ = ProxyHeader  # type: ignore[assignment]
                return header, match.end()  # type: ignore[return-value]
    else:
        match = _TCP6_HEADER.match(buf)
        if match is not None and match.end() <= V1_MAX_LENGTH:
            src_text, dst_text, sport, dport = match.groups()
            src6 = ipv6_value(src_text)
            if src6 is not None:
                source_port = int(sport)
                if source_port <= 0xFFFF:
                    # new_inet6_header in line, the destination kept as its
                    # text until read (see ProxyHeader.destination).
                    host = blank_ipv6()
                    host._ip = src6
                    host._scope_id = None
                    client = InetSlots()
                    client.host = host
                    client.port = source_port
                    client.__class__ = InetAddress  # type: ignore[assignment]
                    header = HeaderSlots()
                    header.version = 1
                    header.command = _PROXY
                    header.family = _INET6
                    header.transport = _STREAM
                    header.source = client
                    header._destination = (dst_text, dport)
                    header._tlvs = ()
                    header.__class__ = ProxyHeader  # type: ignore[assignment]
                    return header, match.end()  # type: ignore[return-value]
    if buf[:6] != V1_PREFIX:  # the regular expressions above check it too
        return False
    end = buf.find(b"\r\n", 0, V1_MAX_LENGTH)
    if end < 0:
        check_v1_prefix(buf[:V1_MAX_LENGTH])
        return None
    line = buf[:end]
    parts = line.split(b" ")
    proto = parts[1]
    if proto == _UNKNOWN:
        if b"\n" in line or b"\r" in line:
            raise _reject(f"stray CR or LF in a v1 UNKNOWN line: {quote(line)}")
        return _UNKNOWN_HEADER, end + 2
    if proto not in _TCP_PROTOCOLS:
        raise _reject(
            f"v1 protocol must be TCP4, TCP6 or UNKNOWN, got {quote(proto)}",
            reason="bad_v1_protocol",
        )
    if len(parts) != 6:
        raise _reject(
            f"v1 {proto.decode()} line needs 6 single-space-separated fields, got "
            f"{len(parts)}: {quote(line)}"
        )
    # Either a TCP6 line, or a TCP4 line the fast path refused: the field
    # checks below build the addresses or say which field is wrong.
    if proto == b"TCP4":
        source = new_inet(_ipv4(parts[2]), _port(parts[4]))
        destination = new_inet(_ipv4(parts[3]), _port(parts[5]))
        family = _INET
    else:
        source = new_inet(_ipv6(parts[2], options), _port(parts[4]))
        destination = new_inet(_ipv6(parts[3], options), _port(parts[5]))
        family = _INET6
    return new_header(1, _PROXY, family, _STREAM, source, destination, ()), end + 2


_UNKNOWN_HEADER = ProxyHeader.unknown(version=1)


def encode_v1(header: ProxyHeader) -> bytes:
    """Serialise a version-1 header.

    Raises:
        LocalProtocolError: the header is not a version-1 header.
    """
    if header.version != 1:
        raise LocalProtocolError(
            f"encode_v1 needs a version-1 header, got version {header.version} "
            "(build it with ProxyHeader.from_addresses(..., version=1), or "
            "encode() a header in its own version)"
        )
    src = header.source
    dst = header._destination  # a decoded header's unread pair is taken as is
    if isinstance(dst, InetAddress):
        dst_value, dst_port = host_value(dst.host), dst.port
    elif type(dst) is tuple:
        if type(dst[1]) is bytes:  # a decoded line's text (PendingInet)
            text, dst_port = dst[0], int(dst[1])
            if header.family is _INET:
                dst_value = dotted_quad_value(text)
            else:
                dst_value = ipv6_value(text)  # type: ignore[assignment]
        else:
            dst_value, dst_port = dst  # type: ignore[assignment]
    else:
        return b"PROXY UNKNOWN\r\n"
    if not isinstance(src, InetAddress):
        return b"PROXY UNKNOWN\r\n"
    if header.family is _INET:  # both hosts are IPv4 (checked by ProxyHeader)
        both = (host_value(src.host) << 32) | dst_value
        return _TCP4_FORMAT % (
            *_EIGHT_BYTES.unpack(both.to_bytes(8)),
            src.port,
            dst_port,
        )
    return (
        f"PROXY TCP6 {ip_text(src.host)} {ipv6_text(dst_value)} "
        f"{src.port} {dst_port}\r\n"
    ).encode("ascii")


_TCP4_FORMAT = b"PROXY TCP4 %d.%d.%d.%d %d.%d.%d.%d %d %d\r\n"
_EIGHT_BYTES = struct.Struct("8B")
