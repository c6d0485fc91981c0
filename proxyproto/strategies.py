"""Hypothesis strategies for PROXY headers: valid ones, and invalid ones that say why.

Use them to fuzz your own PROXY receiver (or a load balancer in front of one). This
module imports Hypothesis; ``import proxyproto`` never loads it.

Valid headers
-------------
``proxy_headers()`` draws ``ProxyHeader`` values of every kind (v1 TCP4/TCP6/
UNKNOWN; v2 PROXY over INET/INET6/UNIX with STREAM or DGRAM, LOCAL) carrying TLVs
of every kind; ``encoded_headers()`` draws ``(header, wire)`` pairs where *wire*
also varies the encoder's options (a CRC32C TLV, NOOP padding, LOCAL headers
with dummy addresses as AWS NLB health checks send) and *header* is exactly what
a strict receiver must decode from *wire*. Every one fits a default receiver's
limits (v2 headers are at most 4096 bytes in total).

Invalid headers
---------------
``invalid_headers()`` draws ``InvalidHeader(data, why, kind, incomplete)``
values: a valid header damaged in one targeted way. ``why`` is a short human
sentence saying what is wrong, ``kind`` a stable slug (one of
``INVALID_KINDS``) and ``incomplete`` says the bytes are a valid header cut
short, which a receiver can only refuse once the peer closes the connection
(send them, then shut down the write side). A strict receiver must refuse all
of them; with default options, ``proxyproto.HeaderReader`` does.

Example: fuzzing your own receiver, here a function ``my_parse(data)`` that
returns ``(host, port)`` pairs or raises ``MyError``::

    from hypothesis import given
    from proxyproto.strategies import encoded_headers, invalid_headers

    @given(encoded_headers(version=2))
    def test_accepts_valid(pair):
        header, wire = pair
        source, _destination = my_parse(wire + b"GET / HTTP/1.1\\r\\n")
        if header.source is not None:
            assert source == (str(header.source.host), header.source.port)

    @given(invalid_headers())
    def test_refuses_invalid(bad):
        with pytest.raises(MyError):
            my_parse(bad.data)  # if it accepts, bad.why says what it missed

The API (names, ``InvalidHeader`` fields, ``INVALID_KINDS`` slugs) is stable:
``proxyproto probe`` reports ``why`` and ``kind`` to its users.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from proxyproto._crc32c import crc32c
from proxyproto._events import (
    TLV,
    Command,
    Family,
    InetAddress,
    ProxyHeader,
    SSLClient,
    SSLInfo,
    TLVType,
    Transport,
    UnixAddress,
)
from proxyproto._extras import missing_extra
from proxyproto._v1 import encode_v1
from proxyproto._v2 import V2_SIGNATURE, encode_v2

try:
    from hypothesis import strategies as st
except ModuleNotFoundError as exc:
    missing_extra(
        exc, feature="proxyproto.strategies", package="hypothesis", extra="probe"
    )

__all__ = [
    "INVALID_KINDS",
    "MAX_ENCODED_V2_LENGTH",
    "InvalidHeader",
    "encoded_headers",
    "host_names",
    "inet_addresses",
    "invalid_headers",
    "ipv4_addresses",
    "ipv6_addresses",
    "ports",
    "proxy_headers",
    "ssl_infos",
    "tlv",
    "tlvs",
    "unix_addresses",
]

#: The largest v2 header (fixed part included) the valid strategies produce, so
#: that a receiver with the common 4 KiB limit accepts all of them.
MAX_ENCODED_V2_LENGTH = 4096

# ---------------------------------------------------------------------------
# Addresses
# ---------------------------------------------------------------------------

#: TCP/UDP ports, 0 included (the spec allows it; Netty once refused it).
ports: st.SearchStrategy[int] = st.integers(0, 0xFFFF)

#: IPv4 hosts: any 32-bit value, with the edge cases drawn often.
ipv4_addresses: st.SearchStrategy[IPv4Address] = st.one_of(
    st.sampled_from(
        [
            IPv4Address(text)
            for text in ("0.0.0.0", "127.0.0.1", "10.0.0.1", "255.255.255.255")
        ]
    ),
    st.integers(0, 0xFFFFFFFF).map(IPv4Address),
)

#: IPv6 hosts: any 128-bit value, plus the forms whose text is special
#: (``::``, ``::1``, IPv4-mapped, link-local, all-ones).
ipv6_addresses: st.SearchStrategy[IPv6Address] = st.one_of(
    st.sampled_from(
        [
            IPv6Address("::"),
            IPv6Address("::1"),
            IPv6Address("::ffff:192.0.2.1"),
            IPv6Address("fe80::1"),
            IPv6Address("2001:db8::8:800:200c:417a"),
            IPv6Address("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"),
        ]
    ),
    st.integers(0, 2**128 - 1).map(IPv6Address),
    # Few non-zero groups: exercises "::" compression at every position.
    st.lists(st.sampled_from([0, 0, 0, 1, 0xFFFF, 0xDB8]), min_size=8, max_size=8).map(
        lambda groups: IPv6Address(":".join(f"{g:x}" for g in groups))
    ),
)

#: ``InetAddress`` endpoints, IPv4 or IPv6.
inet_addresses: st.SearchStrategy[InetAddress] = st.builds(
    InetAddress, st.one_of(ipv4_addresses, ipv6_addresses), ports
)

_UNIX_PATH_LENGTH = 108

#: ``UnixAddress`` paths that survive the v2 address block's NUL padding:
#: regular paths (no NUL byte, at most 108 bytes) and abstract-namespace paths
#: (a leading NUL, never ending in NUL, at most 108 bytes).
unix_addresses: st.SearchStrategy[UnixAddress] = st.one_of(
    st.sampled_from([b"/run/haproxy.sock", b"/tmp/s", b"", b"x" * _UNIX_PATH_LENGTH]),
    st.binary(max_size=_UNIX_PATH_LENGTH).map(lambda p: p.replace(b"\x00", b"/")),
    st.tuples(st.binary(max_size=_UNIX_PATH_LENGTH - 2), st.integers(1, 255)).map(
        lambda t: b"\x00" + t[0] + bytes([t[1]])
    ),
).map(UnixAddress)

# ---------------------------------------------------------------------------
# TLVs
# ---------------------------------------------------------------------------

_PRINTABLE_ASCII = "".join(chr(c) for c in range(0x20, 0x7F))
_ascii_text = st.text(_PRINTABLE_ASCII, min_size=1, max_size=40)

_dns_label = st.from_regex(r"\A[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?\Z")
#: Host names as the AUTHORITY TLV carries them (UTF-8, printable, no space, at
#: most 255 bytes): DNS names, internationalised names, with or without a port.
host_names: st.SearchStrategy[str] = st.one_of(
    st.sampled_from(["example.com", "localhost", "xn--bcher-kva.example", "a"]),
    st.lists(_dns_label, min_size=1, max_size=5).map(".".join),
    st.text(st.characters(categories=("L", "N")), min_size=1, max_size=20).map(
        lambda s: s + ".example"
    ),
    st.tuples(st.lists(_dns_label, min_size=1, max_size=3), ports).map(
        lambda t: ".".join(t[0]) + f":{t[1]}"
    ),
).filter(lambda s: len(s.encode("utf-8")) <= 255)

# A stand-in for a DER client certificate of about 1 KiB (the size that breaks
# the 536-byte assumption); generated once, deterministic.
_FAKE_CERT = b"\x30\x82\x04\x00" + bytes((i * 37 + 11) & 0xFF for i in range(1024))

_SSL_TEXT_SUBTYPES = {
    TLVType.SSL_VERSION: "version",
    TLVType.SSL_CIPHER: "cipher",
    TLVType.SSL_SIG_ALG: "sig_alg",
    TLVType.SSL_KEY_ALG: "key_alg",
    TLVType.SSL_GROUP: "group",
    TLVType.SSL_SIG_SCHEME: "sig_scheme",
}
_SSL_EXAMPLES = {
    "version": ["TLSv1.3", "TLSv1.2"],
    "cipher": ["TLS_AES_128_GCM_SHA256", "ECDHE-RSA-AES128-GCM-SHA256"],
    "sig_alg": ["RSA-SHA256", "ECDSA-SHA384"],
    "key_alg": ["RSA2048", "EC256"],
    "group": ["secp256r1", "X25519"],
    "sig_scheme": ["rsa_pss_rsae_sha256", "ecdsa_secp256r1_sha256"],
}
# Sub-TLV types the spec does not define inside the SSL TLV (kept opaque).
_UNKNOWN_SSL_SUBTYPES = st.integers(0, 0xFF).filter(lambda t: not 0x21 <= t <= 0x28)


@st.composite
def ssl_infos(draw: st.DrawFn) -> SSLInfo:
    """``SSLInfo`` values as a TLS-terminating proxy sends them.

    Any client flags and verify result; every sub-TLV (VERSION, CN, CIPHER,
    SIG_ALG, KEY_ALG, GROUP, SIG_SCHEME, CLIENT_CERT) present or not, in any
    order, plus sometimes an unknown sub-TLV. VERSION is always there when the
    ``SSL`` client flag is set, as the spec requires.
    """
    client = SSLClient(draw(st.integers(0, 0xFF)))
    verify = draw(st.sampled_from([0, 1]) | st.integers(0, 0xFFFFFFFF))
    subs: list[TLV] = []
    fields: dict[str, str | bytes] = {}
    for sub_type, name in _SSL_TEXT_SUBTYPES.items():
        required = sub_type == TLVType.SSL_VERSION and bool(client & SSLClient.SSL)
        if required or draw(st.booleans()):
            text = draw(st.sampled_from(_SSL_EXAMPLES[name]) | _ascii_text)
            fields[name] = text
            subs.append(TLV(sub_type, text.encode("ascii")))
    if draw(st.booleans()):
        cn = draw(st.sampled_from(["client.example.com", "Zoë"]) | host_names)
        fields["cn"] = cn
        subs.append(TLV(TLVType.SSL_CN, cn.encode("utf-8")))
    if draw(st.booleans()):
        cert = draw(st.sampled_from([_FAKE_CERT]) | st.binary(min_size=1, max_size=64))
        fields["client_cert"] = cert
        subs.append(TLV(TLVType.SSL_CLIENT_CERT, cert))
    subs.extend(
        TLV(t, v)
        for t, v in draw(
            st.lists(
                st.tuples(_UNKNOWN_SSL_SUBTYPES, st.binary(max_size=8)), max_size=1
            )
        )
    )
    order = draw(st.permutations(range(len(subs))))
    return SSLInfo(
        client=client,
        verify=verify,
        tlvs=tuple(subs[i] for i in order),
        **fields,  # type: ignore[arg-type]
    )


_REGISTERED_TYPES = frozenset({0x01, 0x02, 0x03, 0x04, 0x05, 0x20, 0x30})
_VENDOR_TYPES = frozenset({TLVType.GCP, TLVType.AWS, TLVType.AZURE})

_vpce_ids = st.one_of(
    st.just("vpce-08d2bf15fac5001c9"),
    st.text(string.ascii_lowercase + string.digits, min_size=17, max_size=17).map(
        lambda s: "vpce-" + s
    ),
    st.text(string.ascii_letters + string.digits + "-", min_size=1, max_size=40),
)


def _opaque(
    types: st.SearchStrategy[int], max_size: int = 32
) -> st.SearchStrategy[TLV]:
    return st.builds(TLV, types, st.binary(max_size=max_size))


# One strategy per TLV kind; ``tlv()`` draws from all of them.
_TLV_KINDS: dict[str, st.SearchStrategy[TLV]] = {
    "alpn": st.one_of(
        st.sampled_from([b"h2", b"http/1.1", b"h3", b"acme-tls/1"]),
        st.binary(min_size=1, max_size=32),
    ).map(TLV.alpn),
    "authority": host_names.map(TLV.authority),
    "noop": _opaque(st.just(TLVType.NOOP)),
    "unique_id": st.one_of(
        st.binary(max_size=32), st.binary(min_size=128, max_size=128)
    ).map(TLV.unique_id),
    "ssl": ssl_infos().map(TLV.ssl),
    "netns": _ascii_text.map(TLV.netns),
    "aws": st.one_of(
        _vpce_ids.map(TLV.aws_vpce_id),
        # Another AWS subtype: opaque (the accessor only reads subtype 0x01).
        st.builds(
            lambda sub, data: TLV(TLVType.AWS, bytes([sub]) + data),
            st.integers(2, 0xFF),
            st.binary(max_size=16),
        ),
    ),
    "azure": st.integers(0, 0xFFFFFFFF).map(TLV.azure_link_id),
    "gcp": st.integers(0, 2**64 - 1).map(TLV.gcp_psc_id),
    "custom": _opaque(st.integers(0xE0, 0xEF).filter(lambda t: t not in _VENDOR_TYPES)),
    "experimental": _opaque(st.integers(0xF0, 0xF7)),
    "future": _opaque(st.integers(0xF8, 0xFF)),
    "unassigned": _opaque(
        st.integers(0x00, 0xDF).filter(lambda t: t not in _REGISTERED_TYPES)
    ),
}


def tlv(*, kinds: Iterable[str] | None = None) -> st.SearchStrategy[TLV]:
    """One valid TLV of any kind except CRC32C (ask the encoder for that).

    Kinds: ``alpn``, ``authority`` (valid host text), ``noop``, ``unique_id``
    (at most 128 bytes), ``ssl`` (see ``ssl_infos()``), ``netns``, ``aws``,
    ``azure``, ``gcp`` (the cloud vendors' custom TLVs, valid for their
    accessors), ``custom`` (other 0xE0-0xEF), ``experimental`` (0xF0-0xF7),
    ``future`` (0xF8-0xFF) and ``unassigned`` (types no one defined).

    Args:
        kinds: draw only these kinds (default: all).
    """
    names = list(_TLV_KINDS) if kinds is None else list(kinds)
    return st.one_of([_TLV_KINDS[name] for name in names])


def tlvs(
    *, min_size: int = 0, max_size: int = 4, kinds: Iterable[str] | None = None
) -> st.SearchStrategy[tuple[TLV, ...]]:
    """Tuples of valid TLVs (see ``tlv()``), duplicates allowed, in any order."""
    return st.lists(tlv(kinds=kinds), min_size=min_size, max_size=max_size).map(tuple)


# ---------------------------------------------------------------------------
# Headers
# ---------------------------------------------------------------------------

_HOSTS: dict[Family, st.SearchStrategy[IPv4Address | IPv6Address]] = {
    Family.INET: ipv4_addresses,
    Family.INET6: ipv6_addresses,
}

# Room kept for a CRC32C TLV (7 bytes) and NOOP padding (at least 3) so any
# valid header can be drawn with either and still fit MAX_ENCODED_V2_LENGTH.
_ENCODER_ROOM = 7 + 3


@st.composite
def proxy_headers(
    draw: st.DrawFn, version: int | None = None, *, unspec_proxy: bool = False
) -> ProxyHeader:
    """Valid ``ProxyHeader`` values of every kind.

    v1: TCP4, TCP6 and UNKNOWN. v2: PROXY with INET, INET6 or UNIX over STREAM
    or DGRAM, and LOCAL; both with ``tlvs()``. Encoded, each fits
    ``MAX_ENCODED_V2_LENGTH`` with room for a CRC32C TLV and padding.

    Args:
        version: 1 or 2 to draw only that version.
        unspec_proxy: also draw v2 PROXY headers with UNSPEC family (no
            addresses). Default receivers refuse them (the spec lets a receiver
            accept or reject them), so they are only drawn on request.
    """
    if version is None:
        version = draw(st.sampled_from([1, 2]))
    if version == 1:
        kind = draw(st.sampled_from(["TCP4", "TCP6", "UNKNOWN"]))
        if kind == "UNKNOWN":
            return ProxyHeader.unknown(version=1)
        hosts = _HOSTS[Family.INET if kind == "TCP4" else Family.INET6]
        return ProxyHeader(
            version=1,
            command=Command.PROXY,
            family=Family.INET if kind == "TCP4" else Family.INET6,
            transport=Transport.STREAM,
            source=InetAddress(draw(hosts), draw(ports)),
            destination=InetAddress(draw(hosts), draw(ports)),
        )
    families = [Family.INET, Family.INET6, Family.UNIX, None]  # None: LOCAL
    if unspec_proxy:
        families.append(Family.UNSPEC)
    family = draw(st.sampled_from(families))
    tlv_tuple = draw(tlvs())
    if family is None:
        header = ProxyHeader.local(tlvs=tlv_tuple)
    elif family is Family.UNSPEC:
        header = dataclasses.replace(ProxyHeader.unknown(version=2), tlvs=tlv_tuple)
    else:
        transport = draw(st.sampled_from([Transport.STREAM, Transport.DGRAM]))
        if family is Family.UNIX:
            source: InetAddress | UnixAddress = draw(unix_addresses)
            destination: InetAddress | UnixAddress = draw(unix_addresses)
        else:
            hosts = _HOSTS[family]
            source = InetAddress(draw(hosts), draw(ports))
            destination = InetAddress(draw(hosts), draw(ports))
        header = ProxyHeader(
            version=2,
            command=Command.PROXY,
            family=family,
            transport=transport,
            source=source,
            destination=destination,
            tlvs=tlv_tuple,
        )
    # Drop trailing TLVs until the header fits (keeps shrinking simple).
    while len(encode_v2(header)) > MAX_ENCODED_V2_LENGTH - _ENCODER_ROOM:
        header = dataclasses.replace(header, tlvs=header.tlvs[:-1])
    return header


_DUMMY_BLOCKS = {0x11: 12, 0x12: 12, 0x21: 36, 0x22: 36, 0x31: 216, 0x32: 216}


def _set_crc(wire: bytes, at: int) -> bytes:
    """Recompute the CRC32C whose 4-byte value starts at *at* in *wire*."""
    zeroed = wire[:at] + b"\x00\x00\x00\x00" + wire[at + 4 :]
    return wire[:at] + crc32c(zeroed).to_bytes(4, "big") + wire[at + 4 :]


@st.composite
def encoded_headers(
    draw: st.DrawFn, version: int | None = None, *, unspec_proxy: bool = False
) -> tuple[ProxyHeader, bytes]:
    """``(header, wire)``: a valid header and its bytes on the wire.

    v2 headers vary what the encoder adds: a CRC32C TLV or not, NOOP padding
    (``encode_v2(..., pad_to=...)``) or not, and LOCAL headers sometimes carry
    a dummy address block as AWS NLB health checks do. *header* is what a
    strict receiver decodes from *wire*, those added TLVs included:
    ``proxyproto.parse(wire) == (header, len(wire))``. Every *wire* is at most
    ``MAX_ENCODED_V2_LENGTH`` bytes.

    Args:
        version: 1 or 2 to draw only that version.
        unspec_proxy: see ``proxy_headers()``.
    """
    header = draw(proxy_headers(version, unspec_proxy=unspec_proxy))
    if header.version == 1:
        return header, encode_v1(header)
    with_crc = draw(st.booleans())
    base = len(encode_v2(header, crc32c=with_crc))
    pad_to = None
    room = MAX_ENCODED_V2_LENGTH - base
    if room >= 3 and draw(st.booleans()):
        pad_to = base + draw(st.sampled_from([0, 3]) | st.integers(3, min(room, 600)))
    wire = encode_v2(header, crc32c=with_crc, pad_to=pad_to)
    # The TLVs the encoder appended: CRC32C first, then the NOOP padding.
    tlv_end = base - 7 if with_crc else base
    extra: list[TLV] = []
    if with_crc:
        extra.append(TLV(TLVType.CRC32C, wire[tlv_end + 3 : tlv_end + 7]))
    if len(wire) > base:
        extra.append(TLV(TLVType.NOOP, bytes(len(wire) - base - 3)))
    if extra:
        header = dataclasses.replace(header, tlvs=header.tlvs + tuple(extra))
    if header.command is Command.LOCAL and draw(st.booleans()):
        # LOCAL with a family byte and dummy addresses (AWS NLB): receivers
        # must skip the block and still read the TLVs after it.
        fam = draw(st.sampled_from(sorted(_DUMMY_BLOCKS)))
        block = draw(
            st.binary(min_size=_DUMMY_BLOCKS[fam], max_size=_DUMMY_BLOCKS[fam])
        )
        if len(wire) + len(block) <= MAX_ENCODED_V2_LENGTH:
            body = block + wire[16:]
            wire = V2_SIGNATURE + bytes((0x20, fam)) + _u16(len(body)) + body
            if with_crc:
                wire = _set_crc(wire, len(block) + tlv_end + 3)
                crc_tlv = TLV(TLVType.CRC32C, wire[len(block) + tlv_end + 3 :][:4])
                header = dataclasses.replace(
                    header,
                    tlvs=tuple(
                        crc_tlv if t.type == TLVType.CRC32C else t for t in header.tlvs
                    ),
                )
    return header, wire


# ---------------------------------------------------------------------------
# Invalid headers
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InvalidHeader:
    """Bytes a strict PROXY receiver must refuse, and why.

    Attributes:
        data: the bytes to send.
        why: a short human sentence saying what is wrong with them.
        kind: a stable slug naming the mutation (one of ``INVALID_KINDS``).
        incomplete: the bytes are a valid header cut short; a receiver can
            only refuse them once the peer closes (or after a timeout).
    """

    data: bytes
    why: str
    kind: str = "other"
    incomplete: bool = False


def _u16(n: int) -> bytes:
    return n.to_bytes(2, "big")


def _v2(ver_cmd: int, fam: int, body: bytes) -> bytes:
    return V2_SIGNATURE + bytes((ver_cmd, fam)) + _u16(len(body)) + body


def _raw_tlv(tlv_type: int, value: bytes) -> bytes:
    return bytes([tlv_type]) + _u16(len(value)) + value


_Draw = Callable[[st.DrawFn], InvalidHeader]
_VALID_FAMILY_BYTES = frozenset({0x00, 0x11, 0x12, 0x21, 0x22, 0x31, 0x32})
# Invalid headers built from a valid one must stay well under the 4 KiB limit,
# so the only thing wrong with them is what their label says.
_MAX_BASE = 2048


def _small_v2_header(draw: st.DrawFn, *, proxy_only: bool = False) -> ProxyHeader:
    header = draw(proxy_headers(2))
    if proxy_only and header.command is Command.LOCAL:
        header = ProxyHeader.from_addresses(
            draw(inet_addresses), draw(inet_addresses), tlvs=header.tlvs
        )
    while len(encode_v2(header)) > _MAX_BASE:
        header = dataclasses.replace(header, tlvs=header.tlvs[:-1])
    return header


def _with_extra_tlv_bytes(header: ProxyHeader, extra: bytes) -> bytes:
    """*header* encoded, with *extra* appended inside its length."""
    wire = encode_v2(header)
    body = wire[16:] + extra
    return wire[:14] + _u16(len(body)) + body


def _bad_family(draw: st.DrawFn) -> InvalidHeader:
    wire = encode_v2(_small_v2_header(draw))
    fam = draw(st.integers(0, 0xFF).filter(lambda b: b not in _VALID_FAMILY_BYTES))
    return InvalidHeader(
        wire[:13] + bytes([fam]) + wire[14:],
        f"v2 family/transport byte 0x{fam:02x} is not one of the seven the spec "
        f"defines",
        "bad_family",
    )


def _bad_version(draw: st.DrawFn) -> InvalidHeader:
    wire = encode_v2(_small_v2_header(draw))
    version = draw(st.integers(0, 15).filter(lambda v: v != 2))
    ver_cmd = (version << 4) | (wire[12] & 0x0F)
    return InvalidHeader(
        wire[:12] + bytes([ver_cmd]) + wire[13:],
        f"v2 version nibble is {version}; receivers must only accept 2",
        "bad_version",
    )


def _bad_command(draw: st.DrawFn) -> InvalidHeader:
    wire = encode_v2(_small_v2_header(draw))
    command = draw(st.integers(2, 15))
    return InvalidHeader(
        wire[:12] + bytes([0x20 | command]) + wire[13:],
        f"v2 command 0x{command:x} is neither LOCAL (0x0) nor PROXY (0x1)",
        "bad_command",
    )


def _short_address_block(draw: st.DrawFn) -> InvalidHeader:
    header = _small_v2_header(draw, proxy_only=True)
    wire = encode_v2(header)
    block = {Family.INET: 12, Family.INET6: 36, Family.UNIX: 216}[header.family]
    length = draw(st.integers(0, block - 1))
    return InvalidHeader(
        wire[:14] + _u16(length) + wire[16 : 16 + length],
        f"v2 PROXY {header.family.name} header says length {length}, shorter than "
        f"its {block}-byte address block",
        "short_address_block",
    )


def _tlv_overrun(draw: st.DrawFn) -> InvalidHeader:
    header = _small_v2_header(draw)
    declared = draw(st.integers(1, 0xFFFF))
    present = draw(st.integers(0, min(declared - 1, 64)))
    tlv_type = draw(st.integers(0, 0xFF))
    extra = (
        bytes([tlv_type])
        + _u16(declared)
        + draw(st.binary(min_size=present, max_size=present))
    )
    return InvalidHeader(
        _with_extra_tlv_bytes(header, extra),
        f"TLV 0x{tlv_type:02x} declares {declared} bytes but only {present} remain "
        f"in the header",
        "tlv_overrun",
    )


def _truncated_tlv_header(draw: st.DrawFn) -> InvalidHeader:
    header = _small_v2_header(draw)
    extra = draw(st.binary(min_size=1, max_size=2))
    return InvalidHeader(
        _with_extra_tlv_bytes(header, extra),
        f"the header ends {len(extra)} byte(s) into a TLV's 3-byte type/length",
        "truncated_tlv_header",
    )


def _crc_mismatch(draw: st.DrawFn) -> InvalidHeader:
    header = _small_v2_header(draw)
    wire = encode_v2(header, crc32c=True)
    # Flip a bit in the CRC value itself or in the address block: the header
    # stays well formed, only the checksum no longer matches.
    block = len(encode_v2(dataclasses.replace(header, tlvs=()))) - 16
    where = draw(st.sampled_from(["crc", "addresses"] if block else ["crc"]))
    at = len(wire) - 4 + draw(st.integers(0, 3))
    if where == "addresses":
        at = 16 + draw(st.integers(0, block - 1))
    flipped = wire[at] ^ (1 << draw(st.integers(0, 7)))
    return InvalidHeader(
        wire[:at] + bytes([flipped]) + wire[at + 1 :],
        f"CRC32C does not match: one bit flipped in the "
        f"{'checksum' if where == 'crc' else 'address block'} (byte {at})",
        "crc32c_mismatch",
    )


def _long_unique_id(draw: st.DrawFn) -> InvalidHeader:
    header = _small_v2_header(draw)
    value = draw(st.binary(min_size=129, max_size=400))
    return InvalidHeader(
        _with_extra_tlv_bytes(header, _raw_tlv(TLVType.UNIQUE_ID, value)),
        f"UNIQUE_ID TLV is {len(value)} bytes; the spec allows at most 128",
        "unique_id_too_long",
    )


_INVALID_UTF8 = [
    b"\xff",
    b"\xc3\x28",
    b"\xe2\x82",
    b"\xed\xa0\x80",
    b"\xf8\x88\x80\x80\x80",
    b"\x80",
]


def _bad_authority(draw: st.DrawFn) -> InvalidHeader:
    header = _small_v2_header(draw)
    host = draw(host_names).encode("utf-8")
    at = draw(st.integers(0, len(host)))
    value = host[:at] + draw(st.sampled_from(_INVALID_UTF8)) + host[at:]
    return InvalidHeader(
        _with_extra_tlv_bytes(header, _raw_tlv(TLVType.AUTHORITY, value)),
        "AUTHORITY TLV is not valid UTF-8",
        "authority_not_utf8",
    )


def _unspec_proxy(draw: st.DrawFn) -> InvalidHeader:
    header = draw(
        proxy_headers(2, unspec_proxy=True).filter(lambda h: h.command is Command.PROXY)
    )
    body = draw(
        st.sampled_from([b"", encode_v2(ProxyHeader.local(tlvs=header.tlvs))[16:]])
    )
    return InvalidHeader(
        _v2(0x21, 0x00, body),
        "v2 PROXY command with UNSPEC family carries no addresses (strict "
        "receivers refuse it)",
        "unspec_proxy",
    )


def _v2_too_long(draw: st.DrawFn) -> InvalidHeader:
    fam = draw(st.sampled_from(sorted(_VALID_FAMILY_BYTES)))
    length = draw(st.integers(4097, 0xFFFF))
    body = draw(st.binary(max_size=64))
    return InvalidHeader(
        V2_SIGNATURE + bytes((0x21, fam)) + _u16(length) + body,
        f"v2 length field is {length}, over the 4096-byte limit receivers apply",
        "v2_too_long",
    )


def _v1_line(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A valid TCP4 or TCP6 line as ``(protocol, [src, dst, sport, dport])``."""
    header = draw(proxy_headers(1).filter(lambda h: h.family is not Family.UNSPEC))
    line = encode_v1(header).decode("ascii")[:-2].split(" ")
    return line[1], line[2:]


def _join_v1(proto: str, fields: list[str], end: str = "\r\n") -> bytes:
    return ("PROXY " + " ".join([proto, *fields]) + end).encode("utf-8")


def _v1_leading_zero(draw: st.DrawFn) -> InvalidHeader:
    proto, fields = _v1_line(draw)
    if proto == "TCP4" and draw(st.booleans()):
        which = draw(st.integers(0, 1))
        octets = fields[which].split(".")
        i = draw(st.integers(0, 3))
        octets[i] = "0" + octets[i]
        fields[which] = ".".join(octets)
        what = "an IPv4 octet"
    else:
        which = draw(st.integers(2, 3))
        fields[which] = "0" + fields[which]
        what = "a port"
    return InvalidHeader(
        _join_v1(proto, fields),
        f"v1 {what} has a leading zero ({fields[which]})",
        "v1_leading_zero",
    )


def _v1_sign(draw: st.DrawFn) -> InvalidHeader:
    proto, fields = _v1_line(draw)
    which = draw(st.integers(2, 3))
    fields[which] = draw(st.sampled_from("+-")) + fields[which]
    return InvalidHeader(
        _join_v1(proto, fields),
        f"v1 port has a sign ({fields[which]})",
        "v1_sign",
    )


def _v1_double_space(draw: st.DrawFn) -> InvalidHeader:
    proto, fields = _v1_line(draw)
    tokens = ["PROXY", proto, *fields]
    i = draw(st.integers(0, len(tokens) - 2))
    line = " ".join(tokens[: i + 1]) + "  " + " ".join(tokens[i + 1 :]) + "\r\n"
    return InvalidHeader(
        line.encode("ascii"),
        f"v1 fields are separated by two spaces after {tokens[i]!r}",
        "v1_double_space",
    )


def _v1_lowercase(draw: st.DrawFn) -> InvalidHeader:
    proto, fields = _v1_line(draw)
    choice = draw(st.sampled_from(["PROXY", "protocol", "UNKNOWN"]))
    if choice == "PROXY":
        data = b"proxy" + _join_v1(proto, fields)[5:]
        word = "PROXY"
    elif choice == "protocol":
        data = _join_v1(proto.lower(), fields)
        word = proto
    else:
        data = b"PROXY unknown\r\n"
        word = "UNKNOWN"
    return InvalidHeader(
        data,
        f"v1 keyword {word} is in lowercase (the grammar is case-sensitive)",
        "v1_lowercase",
    )


def _v1_zone_id(draw: st.DrawFn) -> InvalidHeader:
    which = draw(st.integers(0, 1))
    fields = [str(draw(ipv6_addresses)), str(draw(ipv6_addresses)), "443", "8443"]
    zone = draw(st.sampled_from(["eth0", "1", "lo"]))
    fields[which] = draw(st.sampled_from(["fe80::1", fields[which]])) + "%" + zone
    return InvalidHeader(
        _join_v1("TCP6", fields),
        f"v1 TCP6 address has a zone id ({fields[which]})",
        "v1_zone_id",
    )


def _v1_wrong_family(draw: st.DrawFn) -> InvalidHeader:
    if draw(st.booleans()):
        fields = [str(draw(ipv4_addresses)), str(draw(ipv4_addresses)), "1", "2"]
        return InvalidHeader(
            _join_v1("TCP6", fields),
            "v1 TCP6 line carries IPv4 addresses",
            "v1_ipv4_in_tcp6",
        )
    fields = [str(draw(ipv6_addresses)), str(draw(ipv4_addresses)), "1", "2"]
    if draw(st.booleans()):
        fields[:2] = fields[1::-1]
    return InvalidHeader(
        _join_v1("TCP4", fields),
        "v1 TCP4 line carries an IPv6 address",
        "v1_ipv6_in_tcp4",
    )


def _v1_out_of_range(draw: st.DrawFn) -> InvalidHeader:
    proto, fields = _v1_line(draw)
    if proto == "TCP4" and draw(st.booleans()):
        which = draw(st.integers(0, 1))
        octets = fields[which].split(".")
        octets[draw(st.integers(0, 3))] = str(draw(st.integers(256, 999)))
        fields[which] = ".".join(octets)
        what = "IPv4 octet"
    else:
        which = draw(st.integers(2, 3))
        fields[which] = str(draw(st.integers(65536, 99999)))
        what = "port"
    return InvalidHeader(
        _join_v1(proto, fields),
        f"v1 {what} is out of range ({fields[which]})",
        "v1_out_of_range",
    )


def _v1_field_count(draw: st.DrawFn) -> InvalidHeader:
    proto, fields = _v1_line(draw)
    if draw(st.booleans()):
        fields = fields[: draw(st.integers(0, 3))]
        why = f"v1 {proto} line has {len(fields)} fields after the protocol, not 4"
    else:
        fields = [*fields, draw(st.sampled_from(["0", "x"]))]
        why = f"v1 {proto} line has an extra field"
    return InvalidHeader(_join_v1(proto, fields), why, "v1_field_count")


def _v1_bad_protocol(draw: st.DrawFn) -> InvalidHeader:
    _, fields = _v1_line(draw)
    proto = draw(
        st.sampled_from(["TCP", "TCP5", "UDP4", "UDP6", "TCP46", "UNIX", "TCP4\t"])
    )
    return InvalidHeader(
        _join_v1(proto, fields),
        f"v1 protocol {proto!r} is not TCP4, TCP6 or UNKNOWN",
        "v1_bad_protocol",
    )


def _v1_bare_lf(draw: st.DrawFn) -> InvalidHeader:
    header = draw(proxy_headers(1))
    line = encode_v1(header)[:-2]
    tail = draw(st.sampled_from([b"", b"GET / HTTP/1.1\r\n"]))
    return InvalidHeader(
        line + b"\n" + tail, "v1 line ends with a bare LF instead of CRLF", "v1_bare_lf"
    )


def _v1_lone_cr(draw: st.DrawFn) -> InvalidHeader:
    header = draw(proxy_headers(1))
    line = encode_v1(header)[:-2]
    at = draw(st.integers(6, len(line)))
    return InvalidHeader(
        line[:at] + b"\r" + line[at:] + b"\r\n",
        "v1 line contains a lone CR before its CRLF",
        "v1_lone_cr",
    )


def _v1_no_crlf(draw: st.DrawFn) -> InvalidHeader:
    size = draw(st.integers(107, 160))
    start = draw(st.sampled_from(["PROXY UNKNOWN ", "PROXY TCP6 "]))
    filler = draw(st.sampled_from(["f", ":", " ", "0"]))
    data = (start + filler * size)[:size].encode("ascii")
    return InvalidHeader(
        data,
        f"v1 header has no CRLF within its first 107 bytes ({size} sent)",
        "v1_no_crlf",
    )


def _v1_too_long(draw: st.DrawFn) -> InvalidHeader:
    size = draw(st.integers(108, 200))
    data = (b"PROXY UNKNOWN " + b"x" * size)[: size - 2] + b"\r\n"
    return InvalidHeader(
        data,
        f"v1 line is {size} bytes including CRLF; the maximum is 107",
        "v1_too_long",
    )


def _truncated(draw: st.DrawFn) -> InvalidHeader:
    header, wire = draw(encoded_headers())
    cut = draw(st.integers(1, len(wire) - 1))
    return InvalidHeader(
        wire[:cut],
        f"a valid v{header.version} header cut after {cut} of its {len(wire)} bytes, "
        f"then the connection closes",
        "truncated",
        incomplete=True,
    )


_MUTATIONS: dict[str, _Draw] = {
    "bad_family": _bad_family,
    "bad_version": _bad_version,
    "bad_command": _bad_command,
    "short_address_block": _short_address_block,
    "tlv_overrun": _tlv_overrun,
    "truncated_tlv_header": _truncated_tlv_header,
    "crc32c_mismatch": _crc_mismatch,
    "unique_id_too_long": _long_unique_id,
    "authority_not_utf8": _bad_authority,
    "unspec_proxy": _unspec_proxy,
    "v2_too_long": _v2_too_long,
    "v1_leading_zero": _v1_leading_zero,
    "v1_sign": _v1_sign,
    "v1_double_space": _v1_double_space,
    "v1_lowercase": _v1_lowercase,
    "v1_zone_id": _v1_zone_id,
    "v1_wrong_family": _v1_wrong_family,
    "v1_out_of_range": _v1_out_of_range,
    "v1_field_count": _v1_field_count,
    "v1_bad_protocol": _v1_bad_protocol,
    "v1_bare_lf": _v1_bare_lf,
    "v1_lone_cr": _v1_lone_cr,
    "v1_no_crlf": _v1_no_crlf,
    "v1_too_long": _v1_too_long,
    "truncated": _truncated,
}

#: The mutation names ``invalid_headers(kinds=...)`` accepts. An
#: ``InvalidHeader``'s ``kind`` is one of these, except for ``v1_wrong_family``,
#: which labels its examples ``v1_ipv4_in_tcp6`` or ``v1_ipv6_in_tcp4``.
INVALID_KINDS: tuple[str, ...] = tuple(_MUTATIONS)


@st.composite
def invalid_headers(
    draw: st.DrawFn, kinds: Iterable[str] | None = None
) -> InvalidHeader:
    """``InvalidHeader`` values: valid headers damaged in one targeted way.

    v2: a family byte outside the seven, a version nibble other than 2, a
    command other than LOCAL/PROXY, a length shorter than the address block,
    a TLV overrunning the header, a truncated TLV header, a CRC32C mismatch, a
    UNIQUE_ID over 128 bytes, a non-UTF-8 AUTHORITY, PROXY with UNSPEC family,
    a length over 4096. v1: leading zeros, signs, double spaces, lowercase
    keywords, IPv6 zone ids, the wrong address family, out-of-range numbers,
    wrong field counts, unknown protocols, a bare LF or lone CR, no CRLF within
    107 bytes, a line over 107 bytes. Both: a valid header cut short
    (``incomplete=True``).

    Args:
        kinds: draw only these mutations (names from ``INVALID_KINDS``).

    Raises:
        KeyError: an unknown kind was asked for (when drawing).
    """
    names = INVALID_KINDS if kinds is None else tuple(kinds)
    name = draw(st.sampled_from(names))
    return _MUTATIONS[name](draw)
