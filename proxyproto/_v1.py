"""PROXY protocol v1 (text): strict decoding and encoding.

The grammar is exact: ``"PROXY" SP ("TCP4" | "TCP6") SP src SP dst SP sport SP
dport CRLF`` or ``"PROXY UNKNOWN" [anything] CRLF``, at most 107 bytes. Python's
``int()`` and ``ipaddress`` are more forgiving than the spec (signs, ``_``,
surrounding spaces, IPv6 zone ids), so every field is checked byte by byte first.
"""

from __future__ import annotations

import re
from ipaddress import IPv4Address, IPv6Address

from proxyproto._errors import LocalProtocolError, RemoteProtocolError, quote
from proxyproto._events import Command, Family, InetAddress, ProxyHeader, Transport
from proxyproto._options import V1_MAX_LENGTH, Options

V1_PREFIX = b"PROXY "
_UNKNOWN = b"UNKNOWN"
_UNKNOWN_SP = b"UNKNOWN "
_TCP_PROTOCOLS = (b"TCP4", b"TCP6")
# Bytes that may appear in a TCP4/TCP6 line before the CRLF.
_TCP_LINE_BYTES = b"PROXYTCP46 0123456789abcdefABCDEF.:"
_IPV6_BYTES = b"0123456789abcdefABCDEF:."
_MAX_PORT_DIGITS = 5
_set = object.__setattr__

# The exact TCP4 grammar: octets 0-255 and ports 0-65535, decimal digits only,
# no leading zeros, single spaces.
_OCTET = rb"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = rb"(?:" + _OCTET + rb"\.){3}" + _OCTET
_PORT = (
    rb"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}"
    rb"|[1-5][0-9]{4}|[1-9][0-9]{0,3}|0)"
)
_TCP4_LINE = re.compile(
    rb"PROXY TCP4 " + _IPV4 + rb" " + _IPV4 + rb" " + _PORT + rb" " + _PORT
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
    octets = field.split(b".")
    if len(octets) == 4:
        value = 0
        for octet in octets:
            if (
                not octet.isdigit()
                or len(octet) > 3
                or (octet[0] == 0x30 and len(octet) > 1)
            ):
                break
            n = int(octet)
            if n > 255:
                break
            value = (value << 8) | n
        else:
            return IPv4Address(value)
    raise _reject(
        f"v1 TCP4 address must be dotted decimal without leading zeros, "
        f"got {quote(field)}"
    )


def _ipv6(field: bytes, options: Options) -> IPv6Address:
    if options.accept_ipv4_in_tcp6 and b":" not in field:
        return IPv6Address(f"::ffff:{_ipv4(field)}")
    if field and not field.translate(None, _IPV6_BYTES):
        try:
            return IPv6Address(field.decode("ascii"))
        except ValueError:
            pass
    raise _reject(f"v1 TCP6 address is not a valid IPv6 address: {quote(field)}")


def decode_v1(buf: bytes, options: Options) -> tuple[ProxyHeader, int] | None:
    """Decode a v1 header at the start of *buf* (which starts with "PROXY ").

    Returns:
        ``(header, bytes consumed)``, or None if the CRLF has not arrived yet.

    Raises:
        RemoteProtocolError: the bytes are not a valid v1 header.
    """
    end = buf.find(b"\r\n", 0, V1_MAX_LENGTH)
    if end < 0:
        check_v1_prefix(buf[:V1_MAX_LENGTH])
        return None
    line = buf[:end]
    if _TCP4_LINE.fullmatch(line):
        # The common case, validated in one C call; addresses built lazily.
        header = object.__new__(ProxyHeader)
        _set(header, "version", 1)
        _set(header, "command", Command.PROXY)
        _set(header, "family", Family.INET)
        _set(header, "transport", Transport.STREAM)
        _set(header, "tlvs", ())
        _set(header, "_wire", line)
        return header, end + 2
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
        source = InetAddress(_ipv4(parts[2]), _port(parts[4]))
        destination = InetAddress(_ipv4(parts[3]), _port(parts[5]))
        family = Family.INET
    else:
        source = InetAddress(_ipv6(parts[2], options), _port(parts[4]))
        destination = InetAddress(_ipv6(parts[3], options), _port(parts[5]))
        family = Family.INET6
    header = ProxyHeader(
        version=1,
        command=Command.PROXY,
        family=family,
        transport=Transport.STREAM,
        source=source,
        destination=destination,
    )
    return header, end + 2


def decode_v1_addresses(line: bytes) -> tuple[InetAddress, InetAddress]:
    """Build the addresses of a parsed TCP4 line (called on first access)."""
    parts = line.split(b" ")
    return (
        InetAddress(_ipv4(parts[2]), int(parts[4])),
        InetAddress(_ipv4(parts[3]), int(parts[5])),
    )


_UNKNOWN_HEADER = ProxyHeader.unknown(version=1)


def encode_v1(header: ProxyHeader) -> bytes:
    """Serialise a version-1 header.

    Raises:
        LocalProtocolError: the header is not a version-1 header.
    """
    if header.version != 1:
        raise LocalProtocolError(
            f"encode_v1 needs a version-1 header, got version {header.version}"
        )
    src, dst = header.source, header.destination
    if not isinstance(src, InetAddress) or not isinstance(dst, InetAddress):
        return b"PROXY UNKNOWN\r\n"
    proto = "TCP4" if header.family is Family.INET else "TCP6"
    return (
        f"PROXY {proto} {_host_text(src.host)} {_host_text(dst.host)} "
        f"{src.port} {dst.port}\r\n"
    ).encode("ascii")


def _host_text(host: IPv4Address | IPv6Address) -> str:
    # IPv4-mapped addresses in dotted form (as HAProxy writes them), whatever
    # the Python version: str() gives "::ffff:102:304" before 3.13.
    if isinstance(host, IPv6Address) and host.ipv4_mapped is not None:
        return f"::ffff:{host.ipv4_mapped}"
    return str(host)
