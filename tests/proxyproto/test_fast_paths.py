"""The codec's hand-written fast paths against the reference they replace.

``HeaderReader.next_event`` decodes a whole v2 PROXY TCP/IPv4 or TCP/IPv6
header itself (a call less per connection than through ``decode_v2``, which
``parse`` uses; an IPv6 destination kept as its bytes until read): both must
agree on every input, valid or not, and encode alike before the destination
is read.

``decode_v1`` checks a whole TCP4 or TCP6 line with one regular expression,
which vouches for the destination and its port in full (they are kept as text
until read): it must accept exactly the lines the field checks accept, with
the same addresses.

``_v1`` parses and prints addresses without going through ``ipaddress``'s
text routines (written in Python, and slow), and ``_tlv`` checks text with
``bytes.translate`` instead of decode + ``isprintable``. Each must accept
exactly what the reference accepts and give the same value: hypothesis
checks it on random and on mutated valid inputs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from ipaddress import AddressValueError, IPv4Address, IPv6Address
from typing import Any

import pytest
from hypothesis import example, given, strategies as st

from proxyproto import (
    TLV,
    HeaderReader,
    LocalProtocolError,
    ProxyHeader,
    RemoteProtocolError,
    TLVType,
    encode_v1,
    encode_v2,
    parse,
)
from proxyproto._ip import (
    ip_text,
    ipv4_value as _ipv4_int,
    ipv6_text,
    ipv6_value as _ipv6_int,
)
from proxyproto._options import DEFAULT_OPTIONS, V1_MAX_LENGTH
from proxyproto._tlv import (
    _ascii_text,
    _check_authority,
    _check_ssl,
    _utf8_text,
    check_ascii,
    check_utf8,
    walk_ssl,
)
from proxyproto._v1 import _ipv6

_IPV6_ALPHABET = "0123456789abcdefABCDEF:."


def _ipaddress_v6(text: str) -> int | None:
    try:
        return int(IPv6Address(text))
    except AddressValueError:
        return None


def _ipaddress_v4(text: str) -> int | None:
    try:
        return int(IPv4Address(text))
    except AddressValueError:
        return None


ipv6_values = st.one_of(
    st.integers(0, 2**128 - 1),
    # Few non-zero groups: long zero runs, ties between runs, edges.
    st.lists(st.sampled_from([0, 0, 0, 1, 0xFFFF, 0xABC]), min_size=8, max_size=8).map(
        lambda groups: int.from_bytes(b"".join(g.to_bytes(2) for g in groups))
    ),
    st.integers(0, 2**32 - 1).map(lambda v4: 0xFFFF00000000 | v4),
    st.integers(0, 2**32 - 1),
)


@st.composite
def ipv6_texts(draw: st.DrawFn) -> str:
    """Valid IPv6 text in its many spellings, then maybe mangled."""
    value = draw(ipv6_values)
    address = IPv6Address(value)
    groups = [f"{g:x}" for g in address.packed[::2]]
    form = draw(st.sampled_from(["short", "exploded", "v4", "padded", "upper"]))
    if form == "short":
        text = str(address)
    elif form == "exploded":
        text = address.exploded
    elif form == "v4":
        text = ":".join(groups[:6]) + ":" + str(IPv4Address(value & 0xFFFFFFFF))
        if draw(st.booleans()):
            text = str(address).rsplit(":", 2)[0] + ":" + text.rsplit(":", 1)[1]
    elif form == "padded":
        text = ":".join(g.zfill(draw(st.integers(len(g), 5))) for g in groups)
    else:
        text = str(address).upper()
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        char = draw(st.sampled_from(_IPV6_ALPHABET))
        if op == "insert":
            text = text[:i] + char + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + 1 :]
        else:
            text = text[:i] + char + text[i + 1 :]
    return text


@given(st.one_of(ipv6_texts(), st.text(_IPV6_ALPHABET, max_size=48)))
@example("::")
@example(":::")
@example("1:::2")
@example("::1.2.3.4")
@example(":1.2.3.4")
@example("1.2.3.4")
@example("1:2:3:4:5:6:7::")
@example("::1:2:3:4:5:6:7")
@example("1:2:3:4:5:6:7::8")
@example("1:2:3:4:5:6:1.2.3.4")
@example("1:2:3:4:5:6:7:1.2.3.4")
@example("::01.2.3.4")
@example("1.2::3")
@example("00001::")
def test_ipv6_parser_matches_ipaddress(text: str) -> None:
    assert _ipv6_int(text.encode()) == _ipaddress_v6(text)


@given(st.one_of(ipv6_texts(), st.text(_IPV6_ALPHABET, max_size=48)))
def test_ipv6_field_matches_ipaddress(text: str) -> None:
    expected = _ipaddress_v6(text)
    if expected is None:
        try:
            _ipv6(text.encode(), DEFAULT_OPTIONS)
        except RemoteProtocolError:
            return
        raise AssertionError(f"{text!r} accepted")
    host = _ipv6(text.encode(), DEFAULT_OPTIONS)
    assert host == IPv6Address(text)
    assert host.scope_id is None


@given(
    st.one_of(
        st.integers(0, 2**32 - 1).map(lambda v: str(IPv4Address(v))),
        st.text("0123456789.", max_size=20),
        st.lists(st.integers(0, 999).map(str), min_size=3, max_size=5).map(".".join),
        st.lists(st.sampled_from(["0", "00", "01", "255", "256", "1"]), max_size=5).map(
            ".".join
        ),
    )
)
def test_ipv4_parser_matches_ipaddress(text: str) -> None:
    assert _ipv4_int(text.encode()) == _ipaddress_v4(text)


@given(ipv6_values)
@example(0)
@example(1)
@example(0xFFFF_0000_0000)
@example(0xFFFF_0102_0304)
def test_ipv6_printer_matches_ipaddress(value: int) -> None:
    address = IPv6Address(value)
    if address.ipv4_mapped is not None:
        assert ipv6_text(value) == f"::ffff:{address.ipv4_mapped}"
    else:
        assert ipv6_text(value) == str(address)
    assert ip_text(address) == ipv6_text(value)
    assert _ipv6_int(ipv6_text(value).encode()) == value


def _reference_ascii(value: bytes) -> bool:
    try:
        _ascii_text(value, "x", LocalProtocolError)
    except LocalProtocolError:
        return False
    return True


def _reference_utf8(value: bytes) -> bool:
    try:
        _utf8_text(value, "x", LocalProtocolError)
    except LocalProtocolError:
        return False
    return True


texts = st.one_of(
    st.binary(max_size=8),
    st.text(max_size=8).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.text(st.characters(max_codepoint=0x7F), max_size=8).map(str.encode),
)


@given(texts)
def test_ascii_check_matches_reference(value: bytes) -> None:
    assert check_ascii(value) == _reference_ascii(value)


@given(texts)
def test_utf8_check_matches_reference(value: bytes) -> None:
    assert check_utf8(value) == _reference_utf8(value)


def _outcome(
    check: Callable[[bytes, type[LocalProtocolError]], object], value: bytes
) -> str | None:
    try:
        check(value, LocalProtocolError)
    except LocalProtocolError as exc:
        return str(exc)
    return None


sub_values = st.one_of(
    st.sampled_from([b"", b"TLSv1.3", b"a b", b"\x00", b"\x7f", "é".encode()]),
    texts,
)


@st.composite
def ssl_values(draw: st.DrawFn) -> bytes:
    """SSL TLV values: mostly well-formed sub-TLV lists, sometimes broken."""
    out = bytes([draw(st.integers(0, 7))]) + draw(st.binary(min_size=4, max_size=4))
    for _ in range(draw(st.integers(0, 4))):
        sub_type = draw(st.sampled_from([0x21, 0x22, 0x23, 0x25, 0x28, 0x02, 0x99]))
        value = draw(sub_values)
        length = len(value) + draw(st.sampled_from([0, 0, 0, 1, -1]))
        out += bytes([sub_type]) + max(length, 0).to_bytes(2) + value
    cut = draw(st.integers(0, 3))
    return out[: len(out) - cut] if cut else out


@given(st.one_of(ssl_values(), st.binary(max_size=24)))
def test_ssl_check_matches_walk(value: bytes) -> None:
    assert _outcome(_check_ssl, value) == _outcome(walk_ssl, value)


@given(st.one_of(texts, st.binary(min_size=250, max_size=260)))
def test_authority_check_matches_reference(value: bytes) -> None:
    def reference(value: bytes, error: type[LocalProtocolError]) -> None:
        if len(value) > 255:
            raise error(
                f"AUTHORITY TLV is {len(value)} bytes; a host name has at most 255"
            )
        if " " in _utf8_text(value, "AUTHORITY TLV", error):
            raise error(f"AUTHORITY TLV contains a space: {value[:32]!r}")

    assert _outcome(_check_authority, value) == _outcome(reference, value)


@given(ssl_values())
def test_encode_checks_what_the_builders_did_not(value: bytes) -> None:
    # A TLV built with the bare constructor is checked by encode_v2, one from
    # a builder or the parser was checked already and gives the same bytes.
    header = ProxyHeader.from_addresses(
        ("192.0.2.1", 1), ("192.0.2.2", 2), tlvs=(TLV(TLVType.SSL, value),)
    )
    walk = _outcome(walk_ssl, value)
    if walk is not None:
        with pytest.raises(LocalProtocolError, match=re.escape(walk)):
            encode_v2(header)
        return
    wire = encode_v2(header)
    parsed = parse(wire)[0]
    assert encode_v2(parsed) == wire
    assert parsed.ssl is not None
    assert TLV.ssl(parsed.ssl).value == value


def test_two_crc32c_tlvs_reported_before_a_bad_tlv() -> None:
    header = ProxyHeader.local(
        tlvs=(
            TLV(TLVType.ALPN, b""),
            TLV(TLVType.CRC32C, b"\x00" * 4),
            TLV(TLVType.CRC32C, b"\x00" * 4),
        )
    )
    with pytest.raises(LocalProtocolError, match="only one CRC32C"):
        encode_v2(header)
    with pytest.raises(LocalProtocolError, match="ALPN"):
        encode_v2(ProxyHeader.local(tlvs=header.tlvs[:2]))


def _read_whole(data: bytes, max_v2_length: int) -> object:
    reader = HeaderReader(max_v2_length=max_v2_length)
    reader.receive_data(data)
    try:
        event = reader.next_event()
    except RemoteProtocolError as exc:
        return ("error", exc.reason, str(exc))
    if isinstance(event, ProxyHeader):
        return ("header", event, reader.trailing_data)
    return event


def _parse_whole(data: bytes, max_v2_length: int) -> object:
    try:
        header, consumed = parse(data, max_v2_length=max_v2_length)
    except RemoteProtocolError as exc:
        if exc.reason == "incomplete":
            return _read_whole(data, max_v2_length)  # NEED_DATA, as parse says
        return ("error", exc.reason, str(exc))
    return ("header", header, data[consumed:])


_V2_TCP4 = encode_v2(ProxyHeader.from_addresses(("1.2.3.4", 1), ("5.6.7.8", 2)))


_V2_TCP6 = encode_v2(ProxyHeader.from_addresses(("2001:db8::1", 1), ("::1", 2)))


@st.composite
def v2_tcp_inputs(draw: st.DrawFn) -> bytes:
    """A v2 PROXY TCP/IPv4 or TCP/IPv6 header with TLVs and what follows it,
    then maybe a byte of its fixed part or TLVs changed, or cut short."""
    tlvs = draw(
        st.lists(
            st.sampled_from(
                [
                    TLV.alpn(b"h2"),
                    TLV.authority("example.com"),
                    TLV.noop(3),
                    TLV.unique_id(b"x" * 16),
                    TLV(0xE0, b"gcp"),
                ]
            ),
            max_size=3,
        )
    )
    if draw(st.booleans()):
        addresses = ("192.0.2.1", "10.0.0.1")
        fixed = 28
    else:
        addresses = (
            str(IPv6Address(draw(st.integers(0, 2**128 - 1)))),
            str(IPv6Address(draw(st.integers(0, 2**128 - 1)))),
        )
        fixed = 52
    header = ProxyHeader.from_addresses(
        (addresses[0], draw(st.integers(0, 65535))),
        (addresses[1], draw(st.integers(0, 65535))),
        tlvs=tuple(tlvs),
    )
    data = bytearray(encode_v2(header, crc32c=draw(st.booleans())))
    data += draw(st.binary(max_size=4))
    if draw(st.booleans()):
        # Mostly in the bytes the reader's own paths read.
        at = draw(st.one_of(st.integers(0, fixed - 1), st.integers(0, len(data) - 1)))
        data[at] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(data)))
    return bytes(data[:cut]) if draw(st.booleans()) else bytes(data)


@given(v2_tcp_inputs(), st.sampled_from([4096, 12, 11, 30, 36, 35, 54]))
@example(_V2_TCP4, 4096)
@example(_V2_TCP4[:12] + b"\x20" + _V2_TCP4[13:], 4096)  # LOCAL
@example(_V2_TCP4[:12] + b"\x11" + _V2_TCP4[13:], 4096)  # version 1
@example(_V2_TCP4[:11] + b"\x00" + _V2_TCP4[12:], 4096)  # signature
@example(_V2_TCP6, 4096)
@example(_V2_TCP6, 35)
@example(_V2_TCP6[:51], 4096)
@example(_V2_TCP6[:12] + b"\x20" + _V2_TCP6[13:], 4096)  # LOCAL
@example(_V2_TCP6[:12] + b"\x11" + _V2_TCP6[13:], 4096)  # version 1
@example(_V2_TCP6[:11] + b"\x00" + _V2_TCP6[12:], 4096)  # signature
@example(_V2_TCP6[:15] + b"\x23" + _V2_TCP6[16:], 4096)  # length 35
def test_reader_v2_tcp_paths_agree_with_decode_v2(
    data: bytes, max_v2_length: int
) -> None:
    read = _read_whole(data, max_v2_length)
    parsed = _parse_whole(data, max_v2_length)
    if isinstance(read, tuple) and read[0] == "header":
        assert isinstance(parsed, tuple)
        # Encoded before either destination is read (the reader's IPv6 one
        # is still its bytes), then compared.
        assert encode_v2(read[1]) == encode_v2(parsed[1])
    assert read == parsed


# -- v1 TCP4: the regular expression against the field checks -------------------

_OCTET_TEXTS = st.one_of(
    st.integers(0, 255).map(str),
    st.sampled_from(["00", "01", "010", "099", "256", "259", "300", "999", "1000"]),
)
_PORT_TEXTS = st.one_of(
    st.integers(0, 65535).map(str),
    st.sampled_from(["00", "01", "065535", "65536", "65539", "65599", "99999"]),
)


def _quad(octets: list[str]) -> str:
    return ".".join(octets)


def _reference_port(text: str) -> int | None:
    if re.fullmatch(r"0|[1-9][0-9]{0,4}", text) and int(text) <= 0xFFFF:
        return int(text)
    return None


@given(
    st.lists(_OCTET_TEXTS, min_size=4, max_size=4),
    st.lists(_OCTET_TEXTS, min_size=4, max_size=4),
    _PORT_TEXTS,
    _PORT_TEXTS,
    st.binary(max_size=3),
)
@example(["1", "2", "3", "4"], ["255", "255", "255", "255"], "0", "65535", b"")
@example(["1", "2", "3", "4"], ["256", "0", "0", "0"], "1", "2", b"")
@example(["1", "2", "3", "4"], ["10", "0", "0", "01"], "1", "2", b"")
@example(["1", "2", "3", "4"], ["10", "0", "0", "1"], "1", "65536", b"")
@example(["1", "2", "3", "4"], ["10", "0", "0", "1"], "1", "00", b"x")
def test_v1_tcp4_line_agrees_with_the_field_checks(
    src: list[str], dst: list[str], sport: str, dport: str, after: bytes
) -> None:
    line = f"PROXY TCP4 {_quad(src)} {_quad(dst)} {sport} {dport}\r\n".encode()
    fields: list[Any] = [
        _ipv4_int(_quad(src).encode()),
        _ipv4_int(_quad(dst).encode()),
        _reference_port(sport),
        _reference_port(dport),
    ]
    if None in fields:
        with pytest.raises(RemoteProtocolError) as caught:
            parse(line + after)
        assert caught.value.reason == "bad_v1"
        return
    header, consumed = parse(line + after)
    assert consumed == len(line)
    # Encoded before the destination is read (from its text), then read.
    assert encode_v1(header) == line
    assert header == ProxyHeader.from_addresses(
        (str(IPv4Address(fields[0])), fields[2]),
        (str(IPv4Address(fields[1])), fields[3]),
        version=1,
    )


# -- v1 TCP6: the regular expression against the field checks -------------------


@given(ipv6_texts(), ipv6_texts(), _PORT_TEXTS, _PORT_TEXTS, st.binary(max_size=3))
@example("2001:db8::1", "::", "1", "65535", b"")
@example("2001:db8::1", "1:2:3:4:5:6:7::", "1", "0", b"")
@example("2001:db8::1", "::ffff:1.2.3.4", "1", "2", b"")
@example("2001:db8::1", "1:2:3:4:5:6::1.2.3.4", "1", "2", b"")
@example("2001:db8::1", "1:2:3:4:5::6:1.2.3.4", "1", "2", b"")
@example("2001:db8::1", "::1:2:3:4:5:6:1.2.3.4", "1", "2", b"")
@example("2001:db8::1", "1:2:3:4:5:6::7:8", "1", "2", b"")
@example("2001:db8::1", "::1:2:3:4:5:6:7:8", "1", "2", b"")
@example("2001:db8::1", "1:2:3:4:5:6:7:8", "1", "65536", b"")
@example("2001:db8::1", "1:2:3:4:5:6:7:8", "1", "01", b"x")
@example("::1", "ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255", "65535", "1", b"")
def test_v1_tcp6_line_agrees_with_the_field_checks(
    src: str, dst: str, sport: str, dport: str, after: bytes
) -> None:
    line = f"PROXY TCP6 {src} {dst} {sport} {dport}\r\n".encode()
    fields: list[Any] = [
        _ipv6_int(src.encode()),
        _ipv6_int(dst.encode()),
        _reference_port(sport),
        _reference_port(dport),
    ]
    if None in fields or len(line) > V1_MAX_LENGTH:
        with pytest.raises(RemoteProtocolError):
            parse(line + after)
        return
    header, consumed = parse(line + after)
    assert consumed == len(line)
    # Encoded before the destination is read (from its text), then read.
    assert (
        encode_v1(header)
        == (
            f"PROXY TCP6 {ipv6_text(fields[0])} {ipv6_text(fields[1])} "
            f"{fields[2]} {fields[3]}\r\n"
        ).encode()
    )
    assert header == ProxyHeader.from_addresses(
        (str(IPv6Address(fields[0])), fields[2]),
        (str(IPv6Address(fields[1])), fields[3]),
        version=1,
    )
