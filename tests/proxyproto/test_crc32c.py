"""CRC32C: the RFC vectors, pure vs accelerated, and the v2 CRC32C TLV."""

from __future__ import annotations

import google_crc32c
import pytest
from hypothesis import given, strategies as st

from proxyproto import (
    TLV,
    HeaderReader,
    ProxyHeader,
    RemoteProtocolError,
    TLVType,
    crc32c,
    encode_v2,
    parse,
)
from proxyproto._crc32c import ACCELERATED, crc32c_pure

from .vectors import AWS_NLB, AWS_NLB_CRC, AWS_NLB_CRC_OFFSET, CRC32C_VECTORS, SIG, hx

VECTORS = [pytest.param(d, c, id=name) for name, (d, c) in CRC32C_VECTORS.items()]


@pytest.mark.parametrize(("data", "expected"), VECTORS)
def test_rfc3720_vectors_pure(data: bytes, expected: int) -> None:
    assert crc32c_pure(data) == expected


@pytest.mark.parametrize(("data", "expected"), VECTORS)
def test_rfc3720_vectors_public(data: bytes, expected: int) -> None:
    assert crc32c(data) == expected


@pytest.mark.parametrize(("data", "expected"), VECTORS)
def test_rfc3720_vectors_reference(data: bytes, expected: int) -> None:
    # The reference implementation agrees: the vectors themselves are right.
    assert google_crc32c.value(data) == expected


def test_accelerated_implementation_is_used() -> None:
    # google-crc32c is a test dependency; its C extension must be picked.
    assert ACCELERATED == "google_crc32c"


def test_pure_accepts_bytearray_and_memoryview() -> None:
    data = bytes(range(256)) * 3
    assert crc32c_pure(bytearray(data)) == crc32c_pure(memoryview(data)) == crc32c(data)


@given(st.binary(min_size=0, max_size=2000))
def test_pure_and_accelerated_agree(data: bytes) -> None:
    assert crc32c_pure(data) == google_crc32c.value(data) == crc32c(data)


@pytest.mark.parametrize("length", range(40))
def test_pure_every_tail_length(length: int) -> None:
    # Covers every combination of 8-byte words and 0..7 tail bytes.
    data = bytes((i * 37 + 11) & 0xFF for i in range(length))
    assert crc32c_pure(data) == google_crc32c.value(data)


# -- the CRC32C TLV ------------------------------------------------------------------


def test_aws_nlb_vector_crc_is_right() -> None:
    zeroed = AWS_NLB[:AWS_NLB_CRC_OFFSET] + bytes(4) + AWS_NLB[AWS_NLB_CRC_OFFSET + 4 :]
    assert google_crc32c.value(zeroed) == AWS_NLB_CRC
    assert parse(AWS_NLB)[0].crc32c == AWS_NLB_CRC


def _verify_with_reference(data: bytes) -> None:
    header, consumed = parse(data, verify_crc32c=False)
    assert consumed == len(data)
    # Find the CRC TLV by walking the header ourselves.
    pos = 16 + {0: 0, 1: 12, 2: 36, 3: 216}[data[13] >> 4]
    while data[pos] != TLVType.CRC32C:
        pos += 3 + int.from_bytes(data[pos + 1 : pos + 3], "big")
    at = pos + 3
    zeroed = data[:at] + bytes(4) + data[at + 4 :]
    assert int.from_bytes(data[at : at + 4], "big") == google_crc32c.value(zeroed)
    assert header.crc32c == google_crc32c.value(zeroed)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(ProxyHeader.local(), id="local"),
        pytest.param(
            ProxyHeader.from_addresses(("1.2.3.4", 1), ("5.6.7.8", 2)), id="tcp4"
        ),
        pytest.param(
            ProxyHeader.from_addresses(
                ("::1", 1), ("::2", 2), tlvs=(TLV.alpn(b"h2"), TLV(0xE5, b"\xff" * 100))
            ),
            id="tcp6-tlvs",
        ),
        pytest.param(ProxyHeader.from_addresses("/a", "/b"), id="unix"),
    ],
)
def test_encode_v2_crc32c_verifies_with_reference(header: ProxyHeader) -> None:
    data = encode_v2(header, crc32c=True)
    _verify_with_reference(data)
    decoded, _ = parse(data)
    assert decoded.tlvs[:-1] == header.tlvs
    assert decoded.tlvs[-1].type == TLVType.CRC32C


def test_user_crc_tlv_is_recomputed_in_place() -> None:
    tlvs = (
        TLV(0xE0, b"before"),
        TLV(TLVType.CRC32C, hx("deadbeef")),
        TLV(0xE1, b"after"),
    )
    data = encode_v2(ProxyHeader.local(tlvs=tlvs))
    _verify_with_reference(data)
    decoded, _ = parse(data)
    assert [t.type for t in decoded.tlvs] == [0xE0, TLVType.CRC32C, 0xE1]
    assert decoded.crc32c != 0xDEADBEEF


def test_crc_flag_does_not_add_a_second_crc() -> None:
    data = encode_v2(
        ProxyHeader.local(tlvs=(TLV(TLVType.CRC32C, bytes(4)),)), crc32c=True
    )
    assert len(parse(data)[0].tlvs) == 1


def test_mismatch_is_refused() -> None:
    data = bytearray(AWS_NLB)
    data[-1] ^= 0x01  # in the NOOP padding, covered by the CRC
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(data)
    assert exc_info.value.reason == "crc32c_mismatch"
    assert "0xe2aebcb3" in str(exc_info.value)


def test_mismatch_of_the_crc_itself_is_refused() -> None:
    data = bytearray(AWS_NLB)
    data[AWS_NLB_CRC_OFFSET] ^= 0x10
    reader = HeaderReader()
    reader.receive_data(data)
    with pytest.raises(RemoteProtocolError) as exc_info:
        reader.next_event()
    assert exc_info.value.reason == "crc32c_mismatch"


def test_verify_crc32c_false_skips_the_check() -> None:
    data = bytearray(AWS_NLB)
    data[-1] ^= 0x01
    header, _ = parse(data, verify_crc32c=False)
    assert header.crc32c == AWS_NLB_CRC
    reader = HeaderReader(verify_crc32c=False)
    reader.receive_data(data)
    assert isinstance(reader.next_event(), ProxyHeader)


def test_crc_covers_the_fixed_part() -> None:
    # Turn PROXY into LOCAL: the CRC still catches it.
    data = bytearray(AWS_NLB)
    data[12] = 0x20
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(data)
    assert exc_info.value.reason == "crc32c_mismatch"


def test_crc_in_local_header_is_checked() -> None:
    data = SIG + hx("20 00 0007  03 0004 00000000")
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(data)
    assert exc_info.value.reason == "crc32c_mismatch"
    assert parse(encode_v2(ProxyHeader.local(), crc32c=True))[0].crc32c is not None
