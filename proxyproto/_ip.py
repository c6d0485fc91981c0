"""IP addresses as clients: one client, one form, one text (private).

An IPv4 client seen through a dual-stack IPv6 socket, or named in a PROXY
header by a dual-stack proxy, is ``::ffff:a.b.c.d``: an IPv4-mapped IPv6
address (RFC 4291 section 2.5.5.2), the same client as ``a.b.c.d``. Whoever
decides by address (`proxyproto.TrustPolicy`, tlsedge's ``allow``/``deny``
and ``trusted_proxies``) brings both sides to one form first: the networks
once, when the rules are built (`unmap_network`), the address at each lookup
(`unmap_address`). The text of an address (`ip_text`) writes the mapped form
as RFC 5952 section 5 recommends, ``::ffff:192.0.2.66``, on every Python
(``str()`` gives ``::ffff:c000:242`` before 3.13), so that the IPv4 address can
be found with grep.

Stdlib only, no I/O.
"""

from __future__ import annotations

import struct
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from operator import attrgetter
from typing import Final

__all__ = [
    "OCTETS",
    "OCTETS_1",
    "OCTETS_2",
    "OCTETS_3",
    "dotted_quad_value",
    "ip_text",
    "ipv4_value",
    "ipv6_text",
    "ipv6_value",
    "network_text",
    "unmap_address",
    "unmap_network",
]

#: Every IPv4-mapped address: ``::ffff:0.0.0.0/96``.
_MAPPED: Final = IPv6Network("::ffff:0:0/96")
_IPV4_BITS: Final = 32
_EVERY_IPV4: Final = IPv4Network("0.0.0.0/0")

#: An address's integer value, read from ipaddress's slot (faster than int()).
_value: Final = attrgetter("_ip")
_HEXTETS: Final = struct.Struct("!8H")
# Runs of zero groups in ":"-wrapped text, longest first (RFC 5952 compresses
# the first longest run of two or more).
_ZERO_RUNS: Final = tuple(":0" * n + ":" for n in range(8, 1, -1))


#: The valid octets of a dotted quad, exactly: decimal 0..255, no sign, no
#: leading zero. One lookup checks and converts.
OCTETS: Final = {str(n).encode("ascii"): n for n in range(256)}
#: OCTETS as the first, second and third octet of an address: an address is
#: the sum of four lookups (no shifts; + is | on these disjoint bits), best
#: added from the last octet up, so that only the last sum leaves CPython's
#: one-digit (30-bit) fast path.
OCTETS_1: Final = {text: n << 24 for text, n in OCTETS.items()}
OCTETS_2: Final = {text: n << 16 for text, n in OCTETS.items()}
OCTETS_3: Final = {text: n << 8 for text, n in OCTETS.items()}


def dotted_quad_value(text: bytes) -> int:
    """The value of *text*, a dotted quad already checked (a v1 TCP4 line's
    regular expression vouches for it): ``b"10.0.0.1"`` -> ``0x0A000001``."""
    a, b, c, d = text.split(b".")
    return OCTETS[d] + OCTETS_3[c] + OCTETS_2[b] + OCTETS_1[a]


def ipv4_value(field: bytes) -> int | None:
    """The value of a strict dotted quad (what ``IPv4Address`` accepts), or
    None."""
    octets = field.split(b".")
    if len(octets) != 4:
        return None
    a, b, c, d = map(OCTETS.get, octets)
    if a is None or b is None or c is None or d is None:
        return None
    return (a << 24) | (b << 16) | (c << 8) | d


def ipv6_value(text: bytes) -> int | None:
    """The value of *text* if ``IPv6Address`` accepts it, else None.

    The standard library parses IPv6 text in Python, slowly; this is the same
    grammar in fewer steps: eight 1-4 digit hex groups, or fewer around one
    ``::`` that stands for at least one zero group, the last 32 bits possibly
    as a dotted quad. *text* must only contain hex digits, ``:`` and ``.``
    (so no zone id, sign, space or ``0x``). Tested against ``ipaddress`` with
    hypothesis.
    """
    if b"." in text:
        head, colon, last = text.rpartition(b":")
        if not colon or b"." in head:
            return None
        v4 = ipv4_value(last)
        if v4 is None:
            return None
        text = b"%s:%x:%x" % (head, v4 >> 16, v4 & 0xFFFF)
    hi, double_colon, lo = text.partition(b"::")
    if double_colon:
        parts = hi.split(b":") if hi else []
        lo_parts = lo.split(b":") if lo else []
        zeros = 8 - len(parts) - len(lo_parts)
        if zeros < 1:
            return None
        parts += [b"0"] * zeros
        parts += lo_parts
    else:
        parts = text.split(b":")
        if len(parts) != 8:
            return None
    if b"" in parts:
        return None
    # Each group right-aligned in 4 columns, then the padding made zeros: one
    # format call (text has no spaces of its own).
    digits = (_EIGHT_GROUPS % tuple(parts)).replace(b" ", b"0")
    if len(digits) != 32:  # a group longer than 4 digits
        return None
    return int(digits, 16)


_EIGHT_GROUPS = b"%4s" * 8


def unmap_address(
    address: IPv4Address | IPv6Address,
) -> IPv4Address | IPv6Address:
    """*address*, an IPv4-mapped one as the IPv4 address it carries (its scope
    id, if any, dropped with it); any other address as it is."""
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def unmap_network(
    network: IPv4Network | IPv6Network,
) -> tuple[IPv4Network | IPv6Network, ...]:
    """The networks holding the same clients as *network*, its IPv4-mapped
    addresses written as IPv4 (what `unmap_address` gives a lookup).

    ``::ffff:10.0.0.0/104`` -> ``10.0.0.0/8``; an IPv6 network that holds the
    whole mapped range (``::/0``) also holds every IPv4 client:
    ``::/0`` -> ``::/0, 0.0.0.0/0``; any other network as it is.
    """
    if isinstance(network, IPv4Network):
        return (network,)
    if network.prefixlen >= _MAPPED.prefixlen:
        first = int(network.network_address)
        if first >> _IPV4_BITS != 0xFFFF:
            return (network,)
        return (
            IPv4Network((first & 0xFFFF_FFFF, network.prefixlen - _MAPPED.prefixlen)),
        )
    if _MAPPED.network_address in network:
        return (network, _EVERY_IPV4)
    return (network,)


def ipv6_text(value: int) -> str:
    """``str(IPv6Address(value))`` (RFC 5952), computed faster, except that
    IPv4-mapped addresses are written ``::ffff:a.b.c.d`` (section 5)."""
    if value >> _IPV4_BITS == 0xFFFF:
        v4 = (value & 0xFFFFFFFF).to_bytes(4)
        return "::ffff:%d.%d.%d.%d" % tuple(v4)  # noqa: UP031
    # %-formatting: twice as fast as str.format here.
    text = ":%x:%x:%x:%x:%x:%x:%x:%x:" % _HEXTETS.unpack(value.to_bytes(16))  # noqa: UP031
    for run in _ZERO_RUNS:
        if run in text:
            text = text.replace(run, "::", 1)
            break
    if text[1] != ":":
        text = text[1:]
    if text[-2] != ":":
        text = text[:-1]
    return text


def ip_text(address: IPv4Address | IPv6Address) -> str:
    """The text of *address*: RFC 5952 for IPv6, IPv4-mapped addresses as
    ``::ffff:192.0.2.66`` whatever the Python version; a scope id is kept
    (``fe80::1%eth0``)."""
    if isinstance(address, IPv4Address):
        return str(address)
    text = ipv6_text(_value(address))
    if address.scope_id is not None:
        return f"{text}%{address.scope_id}"
    return text


def network_text(network: IPv4Network | IPv6Network) -> str:
    """``address/prefix``, the address as `ip_text` writes it
    (``::ffff:192.0.2.0/120``, not ``::ffff:c000:200/120``)."""
    return f"{ip_text(network.network_address)}/{network.prefixlen}"
