"""The decoders' TLV paths against a full, eager decode.

A decoder checks every TLV when the header is read and keeps the checked
bytes; the records (``ProxyHeader.tlvs``) are made on first access and the
accessors read the bytes (see ``proxyproto._events``). These tests hold that
to the decode it replaced: every TLV walked, checked (the SSL TLV by
``walk_ssl``) and made into a record at once, over generated TLV lists,
malformed ones included: same records, same accessor values, same errors.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import struct
from collections.abc import Callable
from functools import partial
from typing import cast

import pytest
from hypothesis import given, strategies as st

from proxyproto import (
    TLV,
    HeaderReader,
    LocalProtocolError,
    ProxyHeader,
    RemoteProtocolError,
    SSLClient,
    SSLInfo,
    TLVType,
    encode_v2,
    parse,
)
from proxyproto._crc32c import crc32c
from proxyproto._events import _decode_checked_ssl, _decode_ssl
from proxyproto._spec import MAX_UNIQUE_ID_LENGTH
from proxyproto._tlv import SSL_TEXT_FIELDS, validate_tlv, walk_ssl
from proxyproto.strategies import tlv as valid_tlvs

from .test_fast_paths import ssl_values

SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
# The fixed part and address block of each kind of header, without length.
BLOCKS = {
    "inet": (b"\x21\x11", bytes(range(1, 13))),
    "inet6": (b"\x21\x21", bytes(range(1, 37))),
    "local": (b"\x20\x00", b""),
    "unix": (b"\x21\x31", b"/sock".ljust(108, b"\x00") + b"/peer".ljust(108, b"\x00")),
}


# -- the reference: every TLV decoded and checked at once ----------------------


def reference_tlvs(wire: bytes, start: int) -> tuple[TLV, ...]:
    """The TLVs of a whole v2 header *wire* from *start*, decoded eagerly.

    Raises:
        RemoteProtocolError: as the decoders must.
    """
    pos, end = start, len(wire)
    records = []
    crc_at = -1
    while pos < end:
        if end - pos < 3:
            raise RemoteProtocolError(
                f"truncated TLV header at offset {pos}: {end - pos} bytes left, need 3",
                reason="bad_tlv",
            )
        tlv_type, length = struct.unpack_from("!BH", wire, pos)
        stop = pos + 3 + length
        if stop > end:
            raise RemoteProtocolError(
                f"TLV 0x{tlv_type:02x} at offset {pos} has length {length} and "
                f"overruns the header by {stop - end} bytes",
                reason="bad_tlv",
            )
        value = wire[pos + 3 : stop]
        if tlv_type == TLVType.SSL:
            walk_ssl(value, RemoteProtocolError)
        else:
            validate_tlv(tlv_type, value, RemoteProtocolError)
        if tlv_type == TLVType.CRC32C:
            if crc_at >= 0:
                raise RemoteProtocolError("more than one CRC32C TLV", reason="bad_tlv")
            crc_at = pos + 3
        records.append(TLV(tlv_type, value))
        pos = stop
    if crc_at >= 0:
        expected = int.from_bytes(wire[crc_at : crc_at + 4])
        actual = crc32c(wire[:crc_at] + bytes(4) + wire[crc_at + 4 :])
        if actual != expected:
            raise RemoteProtocolError(
                f"CRC32C mismatch: header says 0x{expected:08x}, bytes give "
                f"0x{actual:08x}",
                reason="crc32c_mismatch",
            )
    return tuple(records)


def reference_ssl(value: bytes) -> SSLInfo:
    """The SSL TLV decoded from what walk_ssl returns, by the constructor."""
    subs = walk_ssl(value, RemoteProtocolError)
    fields: dict[str, object] = {}
    for sub_type, sub_value, text in subs:
        if text is not None:
            fields.setdefault(SSL_TEXT_FIELDS.get(sub_type, "cn"), text)
        elif sub_type == TLVType.SSL_CLIENT_CERT:
            fields.setdefault("client_cert", sub_value)
    return SSLInfo(
        client=SSLClient(value[0]),
        verify=int.from_bytes(value[1:5]),
        tlvs=tuple(TLV(sub_type, sub_value) for sub_type, sub_value, _ in subs),
        **fields,  # type: ignore[arg-type]
    )


ACCESSORS = ("alpn", "authority", "unique_id", "crc32c", "netns", "ssl")
CLOUD_ACCESSORS = ("aws_vpce_id", "azure_link_id", "gcp_psc_id")


def _outcome(read: Callable[[], object]) -> tuple[object, ...]:
    try:
        return ("value", read())
    except (RemoteProtocolError, LocalProtocolError) as exc:
        return ("error", type(exc), str(exc), exc.reason)


def reference_reads(records: tuple[TLV, ...], types: set[int]) -> dict[str, object]:
    """What each accessor (and ``tlv()`` of each of *types*) gives for the
    eagerly decoded *records*."""

    def first(tlv_type: int) -> bytes | None:
        return next((t.value for t in records if t.type == tlv_type), None)

    eager = ProxyHeader.local(tlvs=records)
    reads: dict[str, object] = {f"tlv 0x{t:02x}": ("value", first(t)) for t in types}
    authority, netns, crc, ssl = (
        first(TLVType.AUTHORITY),
        first(TLVType.NETNS),
        first(TLVType.CRC32C),
        first(TLVType.SSL),
    )
    reads |= {
        "alpn": ("value", first(TLVType.ALPN)),
        "authority": ("value", authority and authority.decode("utf-8")),
        "unique_id": ("value", first(TLVType.UNIQUE_ID)),
        "crc32c": ("value", crc and int.from_bytes(crc)),
        "netns": ("value", netns and netns.decode("ascii")),
        "ssl": _outcome(lambda: ssl and reference_ssl(ssl)),
    }
    for name in CLOUD_ACCESSORS:
        reads[name] = _outcome(partial(getattr, eager, name))
    return reads


def reads_of(header: ProxyHeader, types: set[int]) -> dict[str, object]:
    reads: dict[str, object] = {
        f"tlv 0x{t:02x}": ("value", header.tlv(t)) for t in types
    }
    for name in ACCESSORS + CLOUD_ACCESSORS:
        reads[name] = _outcome(partial(getattr, header, name))
    return reads


# -- generated TLV lists ---------------------------------------------------------


@st.composite
def tlv_items(draw: st.DrawFn) -> tuple[int, bytes]:
    """One TLV's type and value: valid ones of every kind, values at and past
    their type's limits, SSL TLVs well-formed or broken, any bytes."""
    kind = draw(st.sampled_from(["valid", "ssl", "limits", "any"]))
    if kind == "valid":
        record = draw(valid_tlvs())
        return record.type, record.value
    if kind == "ssl":
        return TLVType.SSL, draw(ssl_values())
    if kind == "limits":
        return draw(
            st.sampled_from(
                [
                    (TLVType.ALPN, b""),
                    (TLVType.ALPN, b"x" * 256),
                    (TLVType.AUTHORITY, "é.example".encode()),
                    (TLVType.AUTHORITY, b"\xff.example"),
                    (TLVType.AUTHORITY, b"a b"),
                    (TLVType.AUTHORITY, b"x" * 256),
                    (TLVType.UNIQUE_ID, b"u" * MAX_UNIQUE_ID_LENGTH),
                    (TLVType.UNIQUE_ID, b"u" * (MAX_UNIQUE_ID_LENGTH + 1)),
                    (TLVType.NOOP, bytes(40)),
                    (TLVType.NETNS, b"ns\x01"),
                    (TLVType.CRC32C, b"\x00\x00\x00"),
                    (TLVType.AWS, b"\x01vpce-0123"),
                    (TLVType.AWS, b"\x01vpce_0123"),
                    (TLVType.AZURE, b"\x01\x00\x00\x00"),
                    (TLVType.GCP, bytes(7)),
                ]
            )
        )
    return draw(st.integers(0, 0xFF)), draw(st.binary(max_size=24))


@st.composite
def v2_wires(draw: st.DrawFn) -> tuple[bytes, int]:
    """``(wire, tlv start)``: a v2 header whose TLV part is generated, with
    lengths sometimes off, a CRC32C TLV (right or wrong) sometimes, and the
    TLV part sometimes cut short."""
    ver_fam, block = BLOCKS[draw(st.sampled_from(sorted(BLOCKS)))]
    body = b""
    crc_at = -1
    for tlv_type, value in draw(st.lists(tlv_items(), max_size=5)):
        length = len(value) + draw(st.sampled_from([0, 0, 0, 0, 0, 1, -1]))
        body += bytes([tlv_type]) + max(length, 0).to_bytes(2) + value
    if draw(st.booleans()):
        at = draw(st.integers(0, len(body)))
        crc_at = 16 + len(block) + at + 3
        body = body[:at] + b"\x03\x00\x04" + bytes(4) + body[at:]
    body = body[: len(body) - draw(st.sampled_from([0, 0, 0, 1, 2]))]
    length = len(block) + len(body)
    wire = SIGNATURE + ver_fam + length.to_bytes(2) + block + body
    if crc_at >= 0 and crc_at + 4 <= len(wire) and draw(st.booleans()):
        value = crc32c(wire).to_bytes(4)  # over the zeroed CRC
        wire = wire[:crc_at] + value + wire[crc_at + 4 :]
    return wire, 16 + len(block)


def _read_with(how: str, wire: bytes) -> ProxyHeader:
    if how == "parse":
        header, consumed = parse(wire)
        assert consumed == len(wire)
        return header
    reader = HeaderReader()
    reader.receive_data(wire + b"data")
    event = reader.next_event()
    assert isinstance(event, ProxyHeader)
    assert reader.trailing_data == b"data"
    return event


@pytest.mark.parametrize("how", ["parse", "reader"])
@given(case=v2_wires())
def test_lazy_tlvs_agree_with_the_eager_decode(
    how: str, case: tuple[bytes, int]
) -> None:
    wire, start = case
    expected_records = _outcome(lambda: reference_tlvs(wire, start))
    if expected_records[0] == "error":
        assert _outcome(lambda: _read_with(how, wire)) == expected_records
        return
    records = cast(tuple[TLV, ...], expected_records[1])
    types = {t.type for t in records} | {TLVType.SSL, 0xFF}
    expected = reference_reads(records, types)
    # The accessors before the records are made, and after.
    header = _read_with(how, wire)
    assert reads_of(header, types) == expected
    assert header.tlvs == records
    assert all(t._valid for t in header.tlvs)
    assert reads_of(header, types) == expected
    header = _read_with(how, wire)
    assert header.tlvs == records
    assert reads_of(header, types) == expected


@given(value=ssl_values())
def test_checked_ssl_decode_agrees_with_the_walk(value: bytes) -> None:
    expected = _outcome(lambda: reference_ssl(value))
    if expected[0] == "error":
        assert _outcome(lambda: _decode_ssl(value)) == expected
        return
    for decoded in (_decode_ssl(value), _decode_checked_ssl(value)):
        assert ("value", decoded) == expected
        assert not any(t._valid for t in decoded.tlvs)


def test_a_lazy_header_is_the_header_it_decodes_to() -> None:
    # Types as ints, as the decoders give them (TLVType members repr apart).
    tlvs = (
        TLV(1, b"h2"),
        TLV(2, b"www.example.com"),
        TLV(0xE5, b"\x01\x02"),
        TLV(4, bytes(3)),
    )
    built = ProxyHeader.from_addresses(
        ("192.0.2.1", 1234), ("10.0.0.1", 443), tlvs=tlvs
    )
    wire = encode_v2(built)
    reads: list[Callable[[ProxyHeader], bool]] = [
        lambda h: h == built,
        lambda h: hash(h) == hash(built),
        lambda h: repr(h) == repr(built),
        lambda h: pickle.loads(pickle.dumps(h)) == built,
        lambda h: copy.copy(h) == built,
        lambda h: dataclasses.replace(h) == built,
        lambda h: encode_v2(h) == wire,
    ]
    for read in reads:
        header, _ = parse(wire)
        assert read(header)


def test_the_constructor_refuses_tlv_bytes() -> None:
    with pytest.raises(LocalProtocolError, match="tlvs must be a tuple of TLV"):
        ProxyHeader.local(tlvs=b"\x04\x00\x00")  # type: ignore[arg-type]


def test_a_lazy_ssl_info_is_the_info_it_decodes_to() -> None:
    info = SSLInfo(
        client=SSLClient.SSL | SSLClient.CERT_CONN,
        verify=0,
        version="TLSv1.3",
        cn="client.example.com",
        client_cert=b"\x30\x03\x02\x01\x01",
    )
    header = ProxyHeader.local(tlvs=(TLV.ssl(info),))
    reads: list[Callable[[SSLInfo], bool]] = [
        lambda i: i == info,
        lambda i: hash(i) == hash(info),
        lambda i: pickle.loads(pickle.dumps(i)) == info,
        lambda i: copy.copy(i) == info,
        lambda i: dataclasses.replace(i) == info,
        lambda i: i.encode() == info.encode(),
        lambda i: i.tlvs == info.tlvs,
    ]
    for read in reads:
        decoded, _ = parse(encode_v2(header))
        assert decoded.ssl is not None
        assert read(decoded.ssl)


def test_ssl_info_refuses_tlv_bytes() -> None:
    with pytest.raises(LocalProtocolError, match="tuple of TLV"):
        SSLInfo(tlvs=b"\x21\x00\x01x")  # type: ignore[arg-type]
