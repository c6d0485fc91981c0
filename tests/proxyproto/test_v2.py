"""PROXY protocol v2: decoding valid and invalid headers, limits, encoding."""

from __future__ import annotations

from ipaddress import ip_address

import pytest

from proxyproto import (
    NEED_DATA,
    TLV,
    Command,
    Family,
    HeaderReader,
    InetAddress,
    LocalProtocolError,
    ProxyHeader,
    RemoteProtocolError,
    TLVType,
    Transport,
    UnixAddress,
    encode,
    encode_v1,
    encode_v2,
    parse,
)

from .vectors import (
    AWS_NLB,
    AWS_VPCE_ID,
    SIG,
    V2_FAMILY_BYTES,
    V2_INVALID,
    V2_LEN_4097_FIXED,
    V2_VALID,
    V2Valid,
    hx,
)

VALID = [pytest.param(v, id=name) for name, v in V2_VALID.items()]
INVALID = [pytest.param(d, r, id=name) for name, (d, r) in V2_INVALID.items()]
ALLOWED_LIST = "0x00 0x11 0x12 0x21 0x22 0x31 0x32"
BLOCK_SIZE = {0x0: 0, 0x1: 12, 0x2: 36, 0x3: 216}


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


def _address(text: str | bytes | None, port: int) -> InetAddress | UnixAddress | None:
    if text is None:
        return None
    if isinstance(text, bytes):
        return UnixAddress(text)
    return InetAddress(ip_address(text), port)


@pytest.mark.parametrize("vector", VALID)
def test_valid_v2_decodes(vector: V2Valid) -> None:
    header, consumed = parse(vector.data)
    assert consumed == len(vector.data)
    assert header.version == 2
    assert header.command == vector.command
    assert header.family == vector.family
    assert header.transport == vector.transport
    assert header.source == _address(vector.src, vector.sport)
    assert header.destination == _address(vector.dst, vector.dport)
    assert header.tlvs == tuple(TLV(t, v) for t, v in vector.tlvs)


@pytest.mark.parametrize("vector", VALID)
def test_valid_v2_ignores_bytes_after_len(vector: V2Valid) -> None:
    # Bytes after 16+len belong to the application, even if they look like TLVs.
    header, consumed = parse(vector.data + hx("04 0000 05 0001"))
    assert consumed == len(vector.data)
    assert header == parse(vector.data)[0]


@pytest.mark.parametrize(("data", "reason"), INVALID)
def test_invalid_v2_is_refused(data: bytes, reason: str) -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(data)
    assert exc_info.value.reason == reason


@pytest.mark.parametrize(("data", "reason"), INVALID)
def test_invalid_v2_is_refused_byte_by_byte(data: bytes, reason: str) -> None:
    assert bytewise_error(data).reason == reason


@pytest.mark.parametrize(("data", "reason"), INVALID)
def test_invalid_v2_is_refused_by_the_reader(data: bytes, reason: str) -> None:
    reader = HeaderReader()
    reader.receive_data(data + b"trailing")
    with pytest.raises(RemoteProtocolError) as exc_info:
        reader.next_event()
    assert exc_info.value.reason == reason


# -- LOCAL ----------------------------------------------------------------------


def test_local_unspec_len_0() -> None:
    header, consumed = parse(SIG + hx("20 00 0000") + b"GET")
    assert consumed == 16
    assert header == ProxyHeader.local()


def test_local_aws_nlb_health_check_consumes_exactly_28() -> None:
    data = V2_VALID["local-aws-nlb-health-check"].data
    reader = HeaderReader()
    reader.receive_data(data + b"GET / HTTP/1.1\r\n")
    header = reader.next_event()
    assert header == ProxyHeader.local()
    assert isinstance(header, ProxyHeader)
    assert header.source is None
    assert header.destination is None
    assert header.family is Family.UNSPEC
    assert reader.trailing_data == b"GET / HTTP/1.1\r\n"
    assert parse(data)[1] == 28


def test_local_with_tlvs_after_dummy_addresses() -> None:
    data = SIG + hx("20 11 0011  00000000 00000000 0000 0000  01 0002 6832")
    header, consumed = parse(data)
    assert consumed == len(data)
    assert header.command is Command.LOCAL
    assert header.source is None
    assert header.alpn == b"h2"


@pytest.mark.parametrize("fam", [0x13, 0x01, 0x10, 0x20, 0x33, 0x41])
def test_local_with_undefined_family_is_refused(fam: int) -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(SIG + bytes([0x20, fam, 0, 0]))
    assert exc_info.value.reason == "bad_family"


# -- family bytes ---------------------------------------------------------------


def _header_bytes(fam: int, command: int = 0x21) -> bytes:
    size = BLOCK_SIZE[fam >> 4]
    block = V2_VALID["unix-stream"].data[16:] if fam >> 4 == 3 else bytes(range(size))
    return SIG + bytes([command, fam]) + size.to_bytes(2, "big") + block


@pytest.mark.parametrize("fam", V2_FAMILY_BYTES, ids=lambda b: f"0x{b:02x}")
def test_every_defined_family_byte_round_trips(fam: int) -> None:
    data = _header_bytes(fam)
    header, consumed = parse(data, accept_unspec_proxy=True)
    assert consumed == len(data)
    assert header.family == fam >> 4
    assert header.transport == fam & 0xF
    assert encode_v2(header) == data
    assert parse(encode_v2(header), accept_unspec_proxy=True)[0] == header


@pytest.mark.parametrize(
    "fam",
    [b for b in range(256) if b not in V2_FAMILY_BYTES],
    ids=lambda b: f"0x{b:02x}",
)
def test_every_other_family_byte_is_refused(fam: int) -> None:
    data = SIG + bytes([0x21, fam]) + hx("0024") + bytes(36)
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(data)
    assert exc_info.value.reason == "bad_family"
    message = str(exc_info.value)
    assert f"0x{fam:02x}" in message
    assert ALLOWED_LIST in message


@pytest.mark.parametrize("version", [v for v in range(16) if v != 2])
def test_version_nibbles_other_than_2_are_refused(version: int) -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(SIG + bytes([version << 4 | 1, 0x11]) + hx("000c") + bytes(12))
    assert exc_info.value.reason == "bad_version"
    assert f"0x{version:x}" in str(exc_info.value)


@pytest.mark.parametrize("command", range(2, 16))
def test_commands_2_to_15_are_refused(command: int) -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(SIG + bytes([0x20 | command, 0x11]) + hx("000c") + bytes(12))
    assert exc_info.value.reason == "bad_command"


# -- PROXY + UNSPEC ---------------------------------------------------------------


def test_proxy_unspec_refused_by_default() -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(SIG + hx("21 00 0000"))
    assert exc_info.value.reason == "unspec_proxy"
    assert "accept_unspec_proxy" in str(exc_info.value)


def test_proxy_unspec_accepted_with_flag() -> None:
    data = SIG + hx("21 00 0007  05 0004 61626364")
    header, consumed = parse(data, accept_unspec_proxy=True)
    assert consumed == len(data)
    assert header.command is Command.PROXY
    assert header.family is Family.UNSPEC
    assert header.source is None
    assert header.destination is None
    assert header.unique_id == b"abcd"


# -- TLV walk -------------------------------------------------------------------


def test_unknown_custom_experimental_and_future_types_are_kept_raw() -> None:
    header, _ = parse(V2_VALID["duplicate-tlvs"].data)
    assert [t.type for t in header.tlvs] == [0xE0, 0xF0, 0xF0, 0xFF]
    assert header.tlv(0xF0) == b"\x01"  # the first of the duplicates


def test_registered_but_unchecked_types_are_kept() -> None:
    data = SIG + hx("21 11 0011  01020304 05060708 0050 01bb  06 0002 abcd")
    header, _ = parse(data)
    assert header.tlvs == (TLV(0x06, hx("abcd")),)


# -- length limits ----------------------------------------------------------------


def _tcp4_with_length(length: int) -> bytes:
    # INET block then one NOOP TLV filling the rest of len.
    noop = length - 12 - 3
    return (
        SIG
        + bytes([0x21, 0x11])
        + length.to_bytes(2, "big")
        + bytes(12)
        + bytes([0x04])
        + noop.to_bytes(2, "big")
        + bytes(noop)
    )


def test_len_4096_accepted_by_default() -> None:
    header, consumed = parse(_tcp4_with_length(4096))
    assert consumed == 16 + 4096
    assert header.tlv(TLVType.NOOP) == bytes(4096 - 15)


def test_len_4097_refused_as_soon_as_16_bytes_are_in() -> None:
    reader = HeaderReader()
    reader.receive_data(V2_LEN_4097_FIXED[:15])
    assert reader.next_event() is NEED_DATA
    reader.receive_data(V2_LEN_4097_FIXED[15:])
    with pytest.raises(RemoteProtocolError) as exc_info:
        reader.next_event()
    assert exc_info.value.reason == "too_large"
    assert "4097" in str(exc_info.value)
    assert "4096" in str(exc_info.value)


@pytest.mark.parametrize(
    ("limit", "length", "ok"),
    [
        pytest.param(12, 12, True, id="12-of-12"),
        pytest.param(12, 15, False, id="15-over-12"),
        pytest.param(100, 100, True, id="100-of-100"),
        pytest.param(100, 101, False, id="101-over-100"),
        pytest.param(65535, 65535, True, id="65535-max"),
        pytest.param(4096, 65535, False, id="65535-over-default"),
    ],
)
def test_custom_max_v2_length(limit: int, length: int, ok: bool) -> None:
    data = (
        _tcp4_with_length(length) if length > 12 else SIG + hx("21 11 000c") + bytes(12)
    )
    if ok:
        assert parse(data, max_v2_length=limit)[1] == 16 + length
    else:
        with pytest.raises(RemoteProtocolError) as exc_info:
            parse(data[:16], max_v2_length=limit)
        assert exc_info.value.reason == "too_large"


def test_max_v2_length_applies_to_local_too() -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(SIG + hx("20 00 1001"))
    assert exc_info.value.reason == "too_large"


@pytest.mark.parametrize("limit", [-1, 65536])
def test_max_v2_length_out_of_range_is_a_local_error(limit: int) -> None:
    with pytest.raises(LocalProtocolError):
        HeaderReader(max_v2_length=limit)
    with pytest.raises(LocalProtocolError):
        parse(SIG, max_v2_length=limit)


# -- AWS NLB ----------------------------------------------------------------------


def test_aws_nlb_header() -> None:
    header, consumed = parse(AWS_NLB + b"\x16\x03\x01")
    assert consumed == len(AWS_NLB) == 100
    assert header.source == InetAddress(ip_address("192.0.2.10"), 46052)
    assert header.destination == InetAddress(ip_address("10.0.1.20"), 80)
    assert [t.type for t in header.tlvs] == [
        TLVType.CRC32C,
        TLVType.AWS,
        TLVType.NOOP,
    ]
    assert header.aws_vpce_id == AWS_VPCE_ID
    assert header.crc32c == 0xE2AEBCB3


def test_aws_nlb_header_any_flipped_byte_is_detected() -> None:
    good, _ = parse(AWS_NLB)
    for position in range(len(AWS_NLB)):
        for flip in (0x01, 0x80, 0xFF):
            data = bytearray(AWS_NLB)
            data[position] ^= flip
            try:
                header, consumed = parse(data)
            except RemoteProtocolError:
                continue
            assert (header, consumed) != (good, len(AWS_NLB)), (position, flip)


# -- encoding ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param(
            ProxyHeader.from_addresses(("192.168.0.1", 54321), ("192.168.0.2", 443)),
            V2_VALID["tcp4"].data,
            id="tcp4",
        ),
        pytest.param(
            ProxyHeader.from_addresses(
                ("10.0.0.1", 0), ("10.0.0.2", 65535), transport=Transport.DGRAM
            ),
            V2_VALID["udp4"].data,
            id="udp4",
        ),
        pytest.param(
            ProxyHeader.from_addresses(
                ("2001:db8::1", 4242, 0, 0), ("2001:db8::2", 443)
            ),
            V2_VALID["tcp6"].data,
            id="tcp6",
        ),
        pytest.param(
            ProxyHeader.from_addresses(b"/var/run/src.sock", "/var/run/dst.sock"),
            V2_VALID["unix-stream"].data,
            id="unix",
        ),
        pytest.param(
            ProxyHeader.from_addresses(b"\0abstract-src", b"\0x"),
            V2_VALID["unix-abstract"].data,
            id="unix-abstract",
        ),
        pytest.param(ProxyHeader.local(), SIG + hx("20 00 0000"), id="local"),
        pytest.param(
            ProxyHeader.local(tlvs=(TLV.noop(4), TLV.unique_id(b"id"))),
            V2_VALID["local-tlvs"].data,
            id="local-tlvs",
        ),
        pytest.param(
            ProxyHeader.unknown(version=2), SIG + hx("21 00 0000"), id="unspec"
        ),
        pytest.param(
            ProxyHeader.from_addresses(
                ("127.0.0.1", 50000),
                ("127.0.0.1", 443),
                tlvs=(TLV.alpn(b"h2"), TLV.authority("example.com")),
            ),
            V2_VALID["alpn-authority"].data,
            id="alpn-authority",
        ),
    ],
)
def test_encode_v2_exact_bytes(header: ProxyHeader, expected: bytes) -> None:
    assert encode_v2(header).hex(" ") == expected.hex(" ")
    assert encode(header) == expected


def test_encode_v2_reproduces_aws_nlb_header() -> None:
    header, _ = parse(AWS_NLB)
    assert encode_v2(header) == AWS_NLB


@pytest.mark.parametrize("size", [28, 31, 32, 100, 536, 65551])
def test_encode_v2_pad_to_exact_size(size: int) -> None:
    header = ProxyHeader.from_addresses(("1.2.3.4", 1), ("5.6.7.8", 2))
    data = encode_v2(header, pad_to=size)
    assert len(data) == size
    assert int.from_bytes(data[14:16], "big") == size - 16
    decoded, _ = parse(data, max_v2_length=65535)
    assert decoded.source == header.source
    if size > 28:
        assert decoded.tlvs == (TLV(TLVType.NOOP, bytes(size - 31)),)


def test_encode_v2_padding_of_3_is_an_empty_noop() -> None:
    header = ProxyHeader.from_addresses(("1.2.3.4", 1), ("5.6.7.8", 2))
    assert encode_v2(header, pad_to=31)[28:] == hx("04 0000")


def test_encode_v2_pad_to_with_crc() -> None:
    header = ProxyHeader.from_addresses(("1.2.3.4", 1), ("5.6.7.8", 2))
    data = encode_v2(header, crc32c=True, pad_to=64)
    assert len(data) == 64
    decoded, _ = parse(data)
    assert [t.type for t in decoded.tlvs] == [TLVType.CRC32C, TLVType.NOOP]


@pytest.mark.parametrize("size", [29, 30, 27, 0])
def test_encode_v2_impossible_pad_to_is_refused(size: int) -> None:
    header = ProxyHeader.from_addresses(("1.2.3.4", 1), ("5.6.7.8", 2))
    with pytest.raises(LocalProtocolError, match="pad"):
        encode_v2(header, pad_to=size)


def test_encode_v2_pad_to_beyond_the_length_field_is_refused() -> None:
    with pytest.raises(LocalProtocolError, match="65535"):
        encode_v2(ProxyHeader.local(), pad_to=65552)


def test_encode_v2_refuses_v1_headers() -> None:
    with pytest.raises(LocalProtocolError, match="version-2"):
        encode_v2(ProxyHeader.unknown())


def test_encode_v1_refuses_v2_headers() -> None:
    with pytest.raises(LocalProtocolError):
        encode_v1(ProxyHeader.local())


def test_encode_v2_refuses_more_than_65535_bytes_of_tlvs() -> None:
    big = TLV(0xE0, bytes(40000))
    header = ProxyHeader.local(tlvs=(big, big))
    with pytest.raises(LocalProtocolError, match="65535"):
        encode_v2(header)


def test_encode_v2_accepts_exactly_65535_bytes() -> None:
    header = ProxyHeader.local(tlvs=(TLV(0xE0, bytes(65532)),))
    data = encode_v2(header)
    assert len(data) == 16 + 65535
    assert parse(data, max_v2_length=65535)[0] == header


def test_encode_v2_refuses_two_crc32c_tlvs() -> None:
    crc = TLV(TLVType.CRC32C, bytes(4))
    with pytest.raises(LocalProtocolError, match="CRC32C"):
        encode_v2(ProxyHeader.local(tlvs=(crc, crc)))


@pytest.mark.parametrize(
    "tlv",
    [
        pytest.param(TLV(TLVType.ALPN, b""), id="empty-alpn"),
        pytest.param(TLV(TLVType.AUTHORITY, b"\xff"), id="authority-not-utf8"),
        pytest.param(TLV(TLVType.CRC32C, b"\0\0"), id="crc-2-bytes"),
        pytest.param(TLV(TLVType.UNIQUE_ID, bytes(129)), id="unique-id-129"),
        pytest.param(TLV(TLVType.SSL, b"\x01\0\0\0\0"), id="ssl-no-version"),
        pytest.param(TLV(TLVType.NETNS, b""), id="empty-netns"),
    ],
)
def test_encode_v2_refuses_invalid_registered_tlvs(tlv: TLV) -> None:
    with pytest.raises(LocalProtocolError):
        encode_v2(ProxyHeader.local(tlvs=(tlv,)))


def test_encode_v2_emits_len_equal_to_bytes_written() -> None:
    # Envoy CVE-2026-47692: len must be exactly what follows.
    tlvs = (TLV(0xE1, b"x" * 10), TLV.noop(0), TLV(0xF7, b""))
    data = encode_v2(ProxyHeader.from_addresses(("::1", 1), ("::2", 2), tlvs=tlvs))
    assert int.from_bytes(data[14:16], "big") == len(data) - 16
