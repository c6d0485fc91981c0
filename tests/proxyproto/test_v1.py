"""PROXY protocol v1: decoding every valid and invalid form, and encoding."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address

import pytest

from proxyproto import (
    NEED_DATA,
    Command,
    Family,
    HeaderReader,
    InetAddress,
    LocalProtocolError,
    ProxyHeader,
    RemoteProtocolError,
    Transport,
    encode,
    encode_v1,
    parse,
)

from .vectors import V1_INVALID, V1_LONGEST, V1_VALID, V1Valid

VALID = [pytest.param(v, id=name) for name, v in V1_VALID.items()]
INVALID = [pytest.param(d, r, id=name) for name, (d, r) in V1_INVALID.items()]


def bytewise_error(data: bytes) -> RemoteProtocolError:
    """Feed *data* one byte at a time; return the error (NEED_DATA until then)."""
    reader = HeaderReader()
    for i in range(len(data)):
        reader.receive_data(data[i : i + 1])
        try:
            event = reader.next_event()
        except RemoteProtocolError as exc:
            return exc
        assert event is NEED_DATA
    raise AssertionError(f"{data!r} was not refused")


@pytest.mark.parametrize("vector", VALID)
def test_valid_v1_decodes(vector: V1Valid) -> None:
    header, consumed = parse(vector.data)
    assert consumed == len(vector.data)
    assert header.version == 1
    assert header.command is Command.PROXY
    assert header.tlvs == ()
    if vector.proto is None:
        assert header.family is Family.UNSPEC
        assert header.transport is Transport.UNSPEC
        assert header.source is None
        assert header.destination is None
        return
    assert header.family is (Family.INET if vector.proto == "TCP4" else Family.INET6)
    assert header.transport is Transport.STREAM
    assert header.source == InetAddress(ip_address(vector.src), vector.sport)
    assert header.destination == InetAddress(ip_address(vector.dst), vector.dport)


@pytest.mark.parametrize("vector", VALID)
def test_valid_v1_with_trailing_bytes_consumes_only_the_line(vector: V1Valid) -> None:
    header, consumed = parse(vector.data + b"PROXY TCP4 junk\r\n")
    assert consumed == len(vector.data)
    assert header == parse(vector.data)[0]


@pytest.mark.parametrize(("data", "reason"), INVALID)
def test_invalid_v1_is_refused(data: bytes, reason: str) -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(data)
    assert exc_info.value.reason == reason


@pytest.mark.parametrize(("data", "reason"), INVALID)
def test_invalid_v1_is_refused_byte_by_byte(data: bytes, reason: str) -> None:
    # Fed one byte at a time the line fails at the latest at its last byte
    # (often earlier: see test_reader's early rejection tests), for the same
    # reason as when it arrives whole.
    assert bytewise_error(data).reason == reason


def test_ipv4_in_tcp6_refused_by_default() -> None:
    with pytest.raises(RemoteProtocolError, match="TCP6"):
        parse(b"PROXY TCP6 1.2.3.4 5.6.7.8 80 443\r\n")


def test_ipv4_in_tcp6_accepted_as_mapped_with_flag() -> None:
    header, _ = parse(
        b"PROXY TCP6 1.2.3.4 5.6.7.8 80 443\r\n", accept_ipv4_in_tcp6=True
    )
    assert header.family is Family.INET6
    assert header.source == InetAddress(IPv6Address("::ffff:1.2.3.4"), 80)
    assert header.destination == InetAddress(IPv6Address("::ffff:5.6.7.8"), 443)


def test_ipv4_in_tcp6_flag_still_checks_ipv4_syntax() -> None:
    with pytest.raises(RemoteProtocolError):
        parse(b"PROXY TCP6 01.2.3.4 ::1 80 443\r\n", accept_ipv4_in_tcp6=True)


def test_ipv4_in_tcp6_flag_accepts_mixed_line() -> None:
    header, _ = parse(b"PROXY TCP6 1.2.3.4 ::1 80 443\r\n", accept_ipv4_in_tcp6=True)
    assert header.source == InetAddress(IPv6Address("::ffff:1.2.3.4"), 80)
    assert header.destination == InetAddress(IPv6Address("::1"), 443)


def test_ipv4_in_tcp6_flag_does_not_allow_ipv6_in_tcp4() -> None:
    with pytest.raises(RemoteProtocolError):
        parse(b"PROXY TCP4 ::1 ::2 80 443\r\n", accept_ipv4_in_tcp6=True)


def test_107_byte_line_is_accepted() -> None:
    header, consumed = parse(V1_LONGEST)
    assert consumed == 107
    assert header == ProxyHeader.unknown()


def test_v1_too_long_fails_as_soon_as_107_bytes_without_crlf() -> None:
    data = b"PROXY UNKNOWN " + b"a" * 200
    reader = HeaderReader()
    for i in range(106):
        reader.receive_data(data[i : i + 1])
        assert reader.next_event() is NEED_DATA
    reader.receive_data(data[106:107])
    with pytest.raises(RemoteProtocolError) as exc_info:
        reader.next_event()
    assert exc_info.value.reason == "v1_too_long"


@pytest.mark.parametrize(
    "prefix",
    [
        pytest.param(b"PROXY UNKNOWN ", id="unknown"),
        pytest.param(b"PROXY UNKNOWN ffff:ffff:ffff:ffff:ffff:ffff:ffff:", id="ipv6"),
        pytest.param(b"PROXY TCP6 ", id="tcp6-digits"),
    ],
)
def test_v1_too_long_in_one_chunk_of_107_bytes(prefix: bytes) -> None:
    data = (prefix + b"1" * 107)[:107]
    reader = HeaderReader()
    reader.receive_data(data[:106])
    assert reader.next_event() is NEED_DATA
    reader.receive_data(data[106:])
    with pytest.raises(RemoteProtocolError) as exc_info:
        reader.next_event()
    assert exc_info.value.reason == "v1_too_long"


def test_cr_as_107th_byte_is_too_long() -> None:
    # A CRLF at bytes 107-108 would make a 108-byte line: no need to wait.
    data = b"PROXY UNKNOWN " + b"a" * 92 + b"\r"
    assert len(data) == 107
    reader = HeaderReader()
    reader.receive_data(data)
    with pytest.raises(RemoteProtocolError, match="107"):
        reader.next_event()


def test_unknown_with_anything_is_the_same_header() -> None:
    assert parse(b"PROXY UNKNOWN\r\n")[0] == ProxyHeader.unknown()
    assert parse(b"PROXY UNKNOWN 1.2.3.4 junk \xff\r\n")[0] == ProxyHeader.unknown()


# -- encoding -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param(
            ProxyHeader.from_addresses(
                ("192.168.0.1", 56324), ("10.0.0.1", 443), version=1
            ),
            b"PROXY TCP4 192.168.0.1 10.0.0.1 56324 443\r\n",
            id="tcp4",
        ),
        pytest.param(
            ProxyHeader.from_addresses(
                ("2001:db8::1", 0, 0, 0), ("::1", 65535), version=1
            ),
            b"PROXY TCP6 2001:db8::1 ::1 0 65535\r\n",
            id="tcp6",
        ),
        pytest.param(
            ProxyHeader.from_addresses(("1.2.3.4", 80), ("::1", 443), version=1),
            b"PROXY TCP6 ::ffff:1.2.3.4 ::1 80 443\r\n",
            id="mixed-mapped",
        ),
        pytest.param(ProxyHeader.unknown(), b"PROXY UNKNOWN\r\n", id="unknown"),
    ],
)
def test_encode_v1_exact_bytes(header: ProxyHeader, expected: bytes) -> None:
    assert encode_v1(header) == expected
    assert encode(header) == expected
    assert parse(expected)[0] == header


@pytest.mark.parametrize(
    "name", ["tcp4", "tcp4-port-0", "tcp4-port-65535", "tcp6", "tcp6-longest"]
)
def test_encode_v1_reproduces_canonical_vectors(name: str) -> None:
    data = V1_VALID[name].data
    assert encode_v1(parse(data)[0]) == data


def test_encode_v1_longest_tcp6_line_is_104_bytes() -> None:
    ffff = IPv6Address("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")
    header = ProxyHeader.from_addresses(
        InetAddress(ffff, 65535), InetAddress(ffff, 65535), version=1
    )
    assert len(encode_v1(header)) == 104


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(ProxyHeader.local(), id="v2-local"),
        pytest.param(
            ProxyHeader.from_addresses(("1.2.3.4", 1), ("5.6.7.8", 2)), id="v2-proxy"
        ),
    ],
)
def test_encode_v1_refuses_v2_headers(header: ProxyHeader) -> None:
    with pytest.raises(LocalProtocolError, match="version-1"):
        encode_v1(header)


def test_v1_lazy_tcp4_addresses_are_correct() -> None:
    header, _ = parse(b"PROXY TCP4 10.1.2.3 10.4.5.6 1 65535\r\n")
    assert header.destination == InetAddress(IPv4Address("10.4.5.6"), 65535)
    assert header.source == InetAddress(IPv4Address("10.1.2.3"), 1)
