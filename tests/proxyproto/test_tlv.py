"""TLVs: validation of registered types, typed accessors, builders, SSL."""

from __future__ import annotations

import pytest

from proxyproto import (
    TLV,
    LocalProtocolError,
    ProxyHeader,
    RemoteProtocolError,
    SSLClient,
    SSLInfo,
    TLVType,
    encode_v2,
    parse,
)

from .vectors import AZURE_LINK_ID, AZURE_VALUE, GCP_PSC_ID, GCP_VALUE, SIG, hx

_ADDRESSES = hx("01020304 05060708 0050 01bb")


def wire(*tlvs: tuple[int, bytes]) -> bytes:
    """A v2 PROXY TCP4 header carrying *tlvs*, built by hand."""
    body = _ADDRESSES + b"".join(
        bytes([t]) + len(v).to_bytes(2, "big") + v for t, v in tlvs
    )
    return SIG + hx("21 11") + len(body).to_bytes(2, "big") + body


def parse_tlvs(*tlvs: tuple[int, bytes]) -> ProxyHeader:
    return parse(wire(*tlvs))[0]


def refused(*tlvs: tuple[int, bytes]) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(wire(*tlvs))
    return exc_info.value


def sub(t: int, v: bytes) -> bytes:
    return bytes([t]) + len(v).to_bytes(2, "big") + v


# -- ALPN -------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 2, 255])
def test_alpn_lengths_accepted(length: int) -> None:
    assert parse_tlvs((0x01, b"a" * length)).alpn == b"a" * length


@pytest.mark.parametrize("length", [0, 256])
def test_alpn_lengths_refused(length: int) -> None:
    assert refused((0x01, b"a" * length)).reason == "bad_tlv"


# -- AUTHORITY --------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"example.com", id="ascii"),
        pytest.param("bücher.example".encode(), id="utf8"),
        pytest.param(b"a" * 255, id="255-bytes"),
        pytest.param(b"[::1]:443", id="ipv6-literal"),
    ],
)
def test_authority_accepted(value: bytes) -> None:
    assert parse_tlvs((0x02, value)).authority == value.decode()


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"a" * 256, id="256-bytes"),
        pytest.param(b"ex ample.com", id="space"),
        pytest.param(b"example.com\r\nX-Admin: 1", id="crlf"),
        pytest.param(b"exa\x00mple", id="nul"),
        pytest.param(b"\x7f", id="del"),
        pytest.param(b"", id="empty"),
        # Envoy CVE-2024-23324: invalid UTF-8 must never reach a consumer.
        pytest.param(b"\xc3\x28", id="invalid-utf8"),
        pytest.param(b"\xed\xa0\x80", id="utf8-surrogate"),
        pytest.param(b"\xff\xfe", id="not-utf8"),
    ],
)
def test_authority_refused(value: bytes) -> None:
    assert refused((0x02, value)).reason == "bad_tlv"


# -- CRC32C / UNIQUE_ID / NETNS ------------------------------------------------------


@pytest.mark.parametrize("length", [0, 3, 5, 8])
def test_crc32c_length_must_be_4(length: int) -> None:
    assert refused((0x03, bytes(length))).reason == "bad_tlv"


def test_only_one_crc32c_allowed() -> None:
    error = refused((0x03, bytes(4)), (0x03, bytes(4)))
    assert error.reason == "bad_tlv"
    assert "CRC32C" in str(error)


@pytest.mark.parametrize("length", [0, 1, 128])
def test_unique_id_up_to_128(length: int) -> None:
    assert parse_tlvs((0x05, b"u" * length)).unique_id == b"u" * length


def test_unique_id_129_refused() -> None:
    error = refused((0x05, b"u" * 129))
    assert error.reason == "bad_tlv"
    assert "128" in str(error)


def test_netns_ascii() -> None:
    assert parse_tlvs((0x30, b"blue")).netns == "blue"


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"", id="empty"),
        pytest.param("bl\u00fce".encode(), id="non-ascii"),
        pytest.param(b"bl\x00e", id="nul"),
    ],
)
def test_netns_refused(value: bytes) -> None:
    assert refused((0x30, value)).reason == "bad_tlv"


def test_accessors_are_none_without_tlvs() -> None:
    header = parse_tlvs()
    assert header.alpn is None
    assert header.authority is None
    assert header.unique_id is None
    assert header.crc32c is None
    assert header.netns is None
    assert header.ssl is None
    assert header.aws_vpce_id is None
    assert header.azure_link_id is None
    assert header.gcp_psc_id is None
    assert header.tlv(0xE5) is None


# -- SSL ----------------------------------------------------------------------------

# Every sub-TLV 0x21..0x28 with an example value from the spec's table.
SSL_SUBS = [
    (0x21, b"TLSv1.3"),
    (0x22, "éxample.com".encode()),
    (0x23, b"ECDHE-RSA-AES128-GCM-SHA256"),
    (0x24, b"RSA-SHA256"),
    (0x25, b"RSA2048"),
    (0x26, b"secp256r1"),
    (0x27, b"rsa_pss_rsae_sha256"),
    (0x28, hx("3082 0122 3009 0603")),  # the start of some DER
]


def _ssl_value(client: int, verify: int, subs: list[tuple[int, bytes]]) -> bytes:
    return bytes([client]) + verify.to_bytes(4, "big") + b"".join(sub(*s) for s in subs)


def test_ssl_every_sub_tlv() -> None:
    value = _ssl_value(0x07, 0, [*SSL_SUBS, (0x99, b"future")])
    info = parse_tlvs((0x20, value)).ssl
    assert info is not None
    assert info.client == SSLClient.SSL | SSLClient.CERT_CONN | SSLClient.CERT_SESS
    assert info.verify == 0
    assert info.verified
    assert info.version == "TLSv1.3"
    assert info.cn == "éxample.com"
    assert info.cipher == "ECDHE-RSA-AES128-GCM-SHA256"
    assert info.sig_alg == "RSA-SHA256"
    assert info.key_alg == "RSA2048"
    assert info.group == "secp256r1"
    assert info.sig_scheme == "rsa_pss_rsae_sha256"
    assert info.client_cert == hx("3082 0122 3009 0603")
    assert info.tlvs == (*(TLV(t, v) for t, v in SSL_SUBS), TLV(0x99, b"future"))
    assert info.encode() == value


def test_ssl_without_tls_needs_no_version() -> None:
    info = parse_tlvs((0x20, _ssl_value(0x00, 1, []))).ssl
    assert info == SSLInfo()
    assert not info.verified


def test_ssl_verify_nonzero_is_not_verified() -> None:
    info = parse_tlvs((0x20, _ssl_value(0x03, 0x12, [(0x21, b"TLSv1.2")]))).ssl
    assert info is not None
    assert info.verify == 0x12
    assert not info.verified


def test_ssl_verify_zero_without_cert_is_not_verified() -> None:
    info = parse_tlvs((0x20, _ssl_value(0x01, 0, [(0x21, b"TLSv1.2")]))).ssl
    assert info is not None
    assert not info.verified


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"", id="empty"),
        pytest.param(hx("01 000000"), id="4-bytes"),
        pytest.param(_ssl_value(0x01, 0, []), id="client-ssl-no-version"),
        pytest.param(_ssl_value(0x01, 0, [(0x22, b"cn")]), id="cn-but-no-version"),
        pytest.param(
            _ssl_value(0x01, 0, [])[:5] + hx("21 0008") + b"TLSv1.3", id="sub-overrun"
        ),
        pytest.param(_ssl_value(0x00, 0, []) + hx("21"), id="sub-header-1-byte"),
        pytest.param(_ssl_value(0x00, 0, []) + hx("21 00"), id="sub-header-2-bytes"),
        pytest.param(_ssl_value(0x01, 0, [(0x21, b"")]), id="empty-version"),
        pytest.param(
            _ssl_value(0x01, 0, [(0x21, b"TLS\xffv1")]), id="version-not-ascii"
        ),
        pytest.param(_ssl_value(0x01, 0, [(0x21, b"TLSv1.3\n")]), id="version-control"),
        pytest.param(
            _ssl_value(0x01, 0, [(0x21, b"TLSv1.3"), (0x22, b"\xc3\x28")]),
            id="cn-invalid-utf8",
        ),
        pytest.param(
            _ssl_value(0x01, 0, [(0x21, b"TLSv1.3"), (0x23, "é".encode())]),
            id="cipher-non-ascii",
        ),
    ],
)
def test_ssl_malformed_refused(value: bytes) -> None:
    assert refused((0x20, value)).reason == "bad_tlv"


def test_ssl_info_builder_round_trips() -> None:
    info = SSLInfo(
        client=SSLClient.SSL | SSLClient.CERT_CONN,
        verify=0,
        version="TLSv1.3",
        cn="client.example",
        cipher="TLS_AES_128_GCM_SHA256",
        group="x25519",
        client_cert=b"\x30\x82",
    )
    header = ProxyHeader.from_addresses(
        ("1.2.3.4", 1), ("5.6.7.8", 2), tlvs=(TLV.ssl(info),)
    )
    decoded = parse(encode_v2(header))[0].ssl
    assert decoded == info
    assert decoded.verified


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"client": SSLClient.SSL}, id="ssl-no-version"),
        pytest.param({"version": "TLSv1.3", "cn": "a\nb"}, id="cn-control"),
        pytest.param({"version": ""}, id="empty-version"),
        pytest.param({"version": "TLSv1.3é"}, id="version-non-ascii"),
        pytest.param({"cipher": "AES\u0000"}, id="cipher-nul"),
    ],
)
def test_tlv_ssl_builder_refuses_invalid(kwargs: dict[str, object]) -> None:
    with pytest.raises(LocalProtocolError):
        TLV.ssl(SSLInfo(**kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"client": 256}, id="client-256"),
        pytest.param({"verify": -1}, id="verify-negative"),
        pytest.param({"verify": 2**32}, id="verify-2**32"),
    ],
)
def test_ssl_info_out_of_range_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(LocalProtocolError):
        SSLInfo(**kwargs)  # type: ignore[arg-type]


# -- cloud vendors ---------------------------------------------------------------


def test_aws_vpce_id() -> None:
    header = parse_tlvs((0xEA, b"\x01vpce-08d2bf15fac5001c9"))
    assert header.aws_vpce_id == "vpce-08d2bf15fac5001c9"


def test_aws_other_subtype_is_not_a_vpce_id() -> None:
    assert parse_tlvs((0xEA, b"\x02whatever")).aws_vpce_id is None


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"\x01", id="empty"),
        pytest.param(b"\x01vpce_123", id="underscore"),
        pytest.param(b"\x01vpce 123", id="space"),
        pytest.param(b"\x01vpce-\xc3\xa9", id="non-ascii"),
        pytest.param(b"\x01vpce-1\n", id="newline"),
    ],
)
def test_aws_vpce_id_malformed(value: bytes) -> None:
    header = parse_tlvs((0xEA, value))  # custom types are opaque to the parser
    with pytest.raises(RemoteProtocolError):
        _ = header.aws_vpce_id


def test_azure_link_id_spec_vector() -> None:
    assert parse_tlvs((0xEE, AZURE_VALUE)).azure_link_id == AZURE_LINK_ID == 0x210045C1


def test_azure_other_subtype_is_not_a_link_id() -> None:
    assert parse_tlvs((0xEE, b"\x02\x00")).azure_link_id is None


@pytest.mark.parametrize("value", [b"\x01", b"\x01\x00\x00\x00", b"\x01" + bytes(5)])
def test_azure_link_id_malformed(value: bytes) -> None:
    header = parse_tlvs((0xEE, value))
    with pytest.raises(RemoteProtocolError):
        _ = header.azure_link_id


def test_gcp_psc_id_spec_vector() -> None:
    assert parse_tlvs((0xE0, GCP_VALUE)).gcp_psc_id == GCP_PSC_ID


@pytest.mark.parametrize("length", [0, 7, 9])
def test_gcp_psc_id_malformed(length: int) -> None:
    header = parse_tlvs((0xE0, bytes(length)))
    with pytest.raises(RemoteProtocolError):
        _ = header.gcp_psc_id


# -- builders ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tlv", "expected"),
    [
        pytest.param(TLV.alpn(b"h2"), TLV(0x01, b"h2"), id="alpn"),
        pytest.param(
            TLV.authority("bücher.de"), TLV(0x02, "bücher.de".encode()), id="authority"
        ),
        pytest.param(TLV.unique_id(b"x" * 128), TLV(0x05, b"x" * 128), id="unique-id"),
        pytest.param(TLV.netns("blue"), TLV(0x30, b"blue"), id="netns"),
        pytest.param(TLV.noop(3), TLV(0x04, bytes(3)), id="noop"),
        pytest.param(TLV.noop(), TLV(0x04, b""), id="noop-empty"),
        pytest.param(
            TLV.aws_vpce_id("vpce-08d2bf15fac5001c9"),
            TLV(0xEA, b"\x01vpce-08d2bf15fac5001c9"),
            id="aws",
        ),
        pytest.param(
            TLV.azure_link_id(AZURE_LINK_ID), TLV(0xEE, AZURE_VALUE), id="azure"
        ),
        pytest.param(TLV.gcp_psc_id(GCP_PSC_ID), TLV(0xE0, GCP_VALUE), id="gcp"),
    ],
)
def test_builders(tlv: TLV, expected: TLV) -> None:
    assert tlv == expected


def test_builders_round_trip_through_accessors() -> None:
    tlvs = (
        TLV.alpn(b"http/1.1"),
        TLV.authority("example.com"),
        TLV.unique_id(b"\x00\x01"),
        TLV.netns("ns1"),
        TLV.aws_vpce_id("vpce-1"),
        TLV.azure_link_id(7),
        TLV.gcp_psc_id(2**64 - 1),
    )
    header = parse(encode_v2(ProxyHeader.local(tlvs=tlvs)))[0]
    assert header.alpn == b"http/1.1"
    assert header.authority == "example.com"
    assert header.unique_id == b"\x00\x01"
    assert header.netns == "ns1"
    assert header.aws_vpce_id == "vpce-1"
    assert header.azure_link_id == 7
    assert header.gcp_psc_id == 2**64 - 1


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: TLV.alpn(b""), id="alpn-empty"),
        pytest.param(lambda: TLV.alpn(b"a" * 256), id="alpn-256"),
        pytest.param(lambda: TLV.authority(""), id="authority-empty"),
        pytest.param(lambda: TLV.authority("a b"), id="authority-space"),
        pytest.param(lambda: TLV.authority("a\x00b"), id="authority-nul"),
        pytest.param(lambda: TLV.authority("a" * 256), id="authority-256"),
        pytest.param(lambda: TLV.authority("\udcff"), id="authority-surrogate"),
        pytest.param(lambda: TLV.unique_id(bytes(129)), id="unique-id-129"),
        pytest.param(lambda: TLV.netns(""), id="netns-empty"),
        pytest.param(lambda: TLV.netns("bl\u00fce"), id="netns-non-ascii"),
        pytest.param(lambda: TLV.noop(-1), id="noop-negative"),
        pytest.param(lambda: TLV.noop(65536), id="noop-65536"),
        pytest.param(lambda: TLV.aws_vpce_id(""), id="aws-empty"),
        pytest.param(lambda: TLV.aws_vpce_id("vpce_1"), id="aws-underscore"),
        pytest.param(lambda: TLV.aws_vpce_id("vpce-é"), id="aws-non-ascii"),
        pytest.param(lambda: TLV.azure_link_id(-1), id="azure-negative"),
        pytest.param(lambda: TLV.azure_link_id(2**32), id="azure-2**32"),
        pytest.param(lambda: TLV.gcp_psc_id(-1), id="gcp-negative"),
        pytest.param(lambda: TLV.gcp_psc_id(2**64), id="gcp-2**64"),
        pytest.param(lambda: TLV(256, b""), id="type-256"),
        pytest.param(lambda: TLV(-1, b""), id="type-negative"),
        pytest.param(lambda: TLV(True, b""), id="type-bool"),
        pytest.param(lambda: TLV(1, "h2"), id="value-str"),  # type: ignore[arg-type]
        pytest.param(lambda: TLV(0xE0, bytes(65536)), id="value-65536"),
    ],
)
def test_builders_refuse_invalid_values(build: object) -> None:
    assert callable(build)
    with pytest.raises(LocalProtocolError):
        build()


def test_tlv_type_compares_to_int() -> None:
    assert TLV(TLVType.ALPN, b"h2") == TLV(1, b"h2")
    assert hash(TLV(TLVType.ALPN, b"h2")) == hash(TLV(1, b"h2"))
