"""Property tests: round trips, any split, limits, and "only RemoteProtocolError".

Every header the strategies in ``proxyproto.strategies`` can build must survive
``parse(encode(h))``; every way of cutting the bytes into chunks must give the
same result; arbitrary bytes must only ever give NEED_DATA, a header, NO_HEADER
or RemoteProtocolError, the same way whole and byte by byte.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pickle
from collections.abc import Iterable

import google_crc32c
import pytest
from hypothesis import example, given, strategies as st

from proxyproto import (
    NEED_DATA,
    NO_HEADER,
    V2_SIGNATURE,
    HeaderReader,
    LocalProtocolError,
    ProxyHeader,
    RemoteProtocolError,
    TLVType,
    encode,
    encode_v1,
    encode_v2,
    parse,
)
from proxyproto.strategies import (
    InvalidHeader,
    encoded_headers,
    invalid_headers,
    proxy_headers,
)

# Bytes that follow a header: the application's (TLS ClientHello, HTTP, ...).
tails = st.one_of(
    st.sampled_from([b"", b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01"]),
    st.binary(max_size=64),
)


@dataclasses.dataclass(frozen=True)
class Options:
    """One HeaderReader configuration."""

    versions: tuple[int, ...] = (1, 2)
    optional: bool = False
    max_v2_length: int = 4096
    verify_crc32c: bool = True
    accept_unspec_proxy: bool = False
    accept_ipv4_in_tcp6: bool = False

    def reader(self) -> HeaderReader:
        return HeaderReader(
            versions=self.versions,
            optional=self.optional,
            max_v2_length=self.max_v2_length,
            verify_crc32c=self.verify_crc32c,
            accept_unspec_proxy=self.accept_unspec_proxy,
            accept_ipv4_in_tcp6=self.accept_ipv4_in_tcp6,
        )

    def parse(self, data: bytes) -> tuple[ProxyHeader, int]:
        return parse(
            data,
            versions=self.versions,
            max_v2_length=self.max_v2_length,
            verify_crc32c=self.verify_crc32c,
            accept_unspec_proxy=self.accept_unspec_proxy,
            accept_ipv4_in_tcp6=self.accept_ipv4_in_tcp6,
        )


reader_options = st.builds(
    Options,
    versions=st.sampled_from([(1, 2), (1,), (2,)]),
    optional=st.booleans(),
    max_v2_length=st.sampled_from([4096, 0, 12, 300]) | st.integers(0, 0xFFFF),
    verify_crc32c=st.booleans(),
    accept_unspec_proxy=st.booleans(),
    accept_ipv4_in_tcp6=st.booleans(),
)

# An outcome: ("header", header, trailing) | ("no_header", trailing) |
# ("error", reason).
Outcome = tuple[object, ...]


def feed(reader: HeaderReader, chunks: Iterable[bytes]) -> Outcome:
    """Feed non-empty *chunks*, calling next_event() after each, then EOF.

    Only RemoteProtocolError is caught: any other exception fails the test.
    """
    chunks = [c for c in chunks if c]
    try:
        for i, chunk in enumerate(chunks):
            reader.receive_data(chunk)
            event = reader.next_event()
            if event is not NEED_DATA:
                rest = b"".join(chunks[i + 1 :])
                break
        else:
            reader.receive_data(b"")
            event = reader.next_event()
            rest = b""
    except RemoteProtocolError as exc:
        return ("error", exc.reason)
    if event is NO_HEADER:
        return ("no_header", reader.trailing_data + rest)
    assert isinstance(event, ProxyHeader)
    return ("header", event, reader.trailing_data + rest)


def split(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def byte_by_byte(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


# -- round trips ------------------------------------------------------------


@given(proxy_headers(1))
def test_v1_round_trip(header: ProxyHeader) -> None:
    wire = encode_v1(header)
    assert len(wire) <= 107
    assert parse(wire) == (header, len(wire))


@given(proxy_headers(2))
def test_v2_round_trip(header: ProxyHeader) -> None:
    wire = encode_v2(header)
    assert parse(wire) == (header, len(wire))
    # A parsed header re-encodes to the very same bytes.
    assert encode_v2(parse(wire)[0]) == wire


@given(proxy_headers(2, unspec_proxy=True))
def test_v2_unspec_proxy_round_trip_when_accepted(header: ProxyHeader) -> None:
    wire = encode_v2(header)
    assert parse(wire, accept_unspec_proxy=True) == (header, len(wire))


@given(encoded_headers(), st.booleans())
def test_encoded_headers_round_trip(pair: tuple[ProxyHeader, bytes], crc: bool) -> None:
    # Covers the CRC32C and pad_to options and LOCAL with dummy addresses.
    header, wire = pair
    assert parse(wire) == (header, len(wire))
    if header.crc32c is not None:
        at = wire.index(header.tlv(TLVType.CRC32C) or b"")
        zeroed = wire[:at] + bytes(4) + wire[at + 4 :]
        assert google_crc32c.value(zeroed) == header.crc32c
    # Re-encoding what was parsed gives a header that parses back to itself
    # (CRC32C values aside: the encoder recomputes them).
    again = encode(header, crc32c=crc)
    parsed, consumed = parse(again)
    assert consumed == len(again)
    added_crc = crc and header.version == 2 and header.crc32c is None
    assert without_crc_values(parsed) == without_crc_values(header) + (
        [(TLVType.CRC32C, b"")] if added_crc else []
    )
    assert dataclasses.replace(parsed, tlvs=()) == dataclasses.replace(header, tlvs=())


def without_crc_values(header: ProxyHeader) -> list[tuple[int, bytes]]:
    return [(t.type, b"" if t.type == TLVType.CRC32C else t.value) for t in header.tlvs]


# -- any split, trailing data -----------------------------------------------


@given(
    encoded_headers(),
    tails,
    st.lists(st.integers(0, 5000), max_size=8),
    st.booleans(),
)
def test_any_split_gives_same_header_and_trailing_data(
    pair: tuple[ProxyHeader, bytes], tail: bytes, cuts: list[int], optional: bool
) -> None:
    header, wire = pair
    data = wire + tail
    expected = ("header", header, tail)
    assert feed(HeaderReader(optional=optional), split(data, cuts)) == expected
    assert feed(HeaderReader(), [data]) == expected


@given(encoded_headers(), tails)
def test_byte_by_byte_gives_same_header_and_trailing_data(
    pair: tuple[ProxyHeader, bytes], tail: bytes
) -> None:
    header, wire = pair
    assert feed(HeaderReader(), byte_by_byte(wire + tail)) == ("header", header, tail)


@given(encoded_headers(), tails)
def test_bytes_needed_never_reads_past_the_header(
    pair: tuple[ProxyHeader, bytes], tail: bytes
) -> None:
    header, wire = pair
    stream = wire + tail
    reader = HeaderReader()
    pos = 0
    event: object = NEED_DATA
    while event is NEED_DATA:
        wanted = reader.bytes_needed
        assert 1 <= wanted <= len(wire) - pos
        reader.receive_data(stream[pos : pos + wanted])
        pos += wanted
        event = reader.next_event()
    assert event == header
    assert pos == len(wire)
    assert reader.trailing_data == b""
    assert reader.bytes_needed == 0


# -- arbitrary bytes ----------------------------------------------------------


def check_any_input(data: bytes, options: Options) -> None:
    """The fuzz invariant, for one input and one reader configuration."""
    whole = feed(options.reader(), [data])
    assert feed(options.reader(), byte_by_byte(data)) == whole
    try:
        parsed: tuple[object, ...] = options.parse(data)
    except RemoteProtocolError:
        parsed = ()
    if whole[0] == "header":
        _, header, trailing = whole
        assert isinstance(trailing, bytes)
        assert parsed == (header, len(data) - len(trailing))
    elif whole[0] == "error":
        assert parsed == ()


@given(st.binary(max_size=300), reader_options)
@example(b"PROXY TCP4\r\n", Options())
@example(b"PROXY UNKNOWN\x00\n\r\n", Options())
@example(b"PROXY TCP6 2001:db8:\xe0" + b"\xe0" * 100, Options())
def test_arbitrary_bytes_only_raise_remote_protocol_error(
    data: bytes, options: Options
) -> None:
    check_any_input(data, options)


# Inputs that start like a header, so the fuzzing gets past the first byte.
header_like = st.one_of(
    st.tuples(
        st.sampled_from([b"PROXY ", b"PROXY UNKNOWN", b"PROXY TCP"]),
        st.text(
            alphabet="TCP46UNKOW 0123456789abcdefABCDEF:.%+-\r\n\x00", max_size=120
        ).map(lambda s: s.encode()),
    ).map(b"".join),
    st.tuples(st.just(V2_SIGNATURE), st.binary(max_size=300)).map(b"".join),
)


@given(header_like, reader_options)
def test_header_like_bytes_only_raise_remote_protocol_error(
    data: bytes, options: Options
) -> None:
    check_any_input(data, options)


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "truncate", "insert", "delete"]),
        st.integers(0, 5000),
        st.binary(min_size=1, max_size=4),
    ),
    min_size=1,
    max_size=3,
)


def mutate(data: bytes, edits: list[tuple[str, int, bytes]]) -> bytes:
    for op, at, blob in edits:
        i = at % (len(data) + 1)
        if op == "flip" and i < len(data):
            data = data[:i] + bytes([data[i] ^ (blob[0] or 1)]) + data[i + 1 :]
        elif op == "truncate":
            data = data[:i]
        elif op == "insert":
            data = data[:i] + blob + data[i:]
        else:
            data = data[:i] + data[i + len(blob) :]
    return data


@given(encoded_headers(), tails, mutations, reader_options)
def test_mutated_headers_only_raise_remote_protocol_error(
    pair: tuple[ProxyHeader, bytes],
    tail: bytes,
    edits: list[tuple[str, int, bytes]],
    options: Options,
) -> None:
    check_any_input(mutate(pair[1] + tail, edits), options)


@given(st.binary(min_size=1, max_size=200) | header_like, st.binary(max_size=20))
def test_error_is_sticky(data: bytes, more: bytes) -> None:
    reader = HeaderReader()
    reader.receive_data(data)
    reader.receive_data(b"")
    try:
        event = reader.next_event()
    except RemoteProtocolError as exc:
        first = exc
    else:
        assert isinstance(event, ProxyHeader)
        return
    for _ in range(3):
        with pytest.raises(RemoteProtocolError) as info:
            reader.next_event()
        assert info.value.reason == first.reason
    assert reader.bytes_needed == 0
    with pytest.raises(LocalProtocolError):
        _ = reader.trailing_data


@given(st.binary(min_size=1, max_size=50))
def test_error_state_keeps_no_data(data: bytes) -> None:
    reader = HeaderReader()
    reader.receive_data(b"GET / HTTP/1.1\r\n")
    with pytest.raises(RemoteProtocolError):
        reader.next_event()
    reader.receive_data(data)  # ignored: the connection is already refused
    with pytest.raises(RemoteProtocolError, match="not a PROXY header"):
        reader.next_event()


# -- limits -----------------------------------------------------------------


def decided_after(reader: HeaderReader, stream: bytes) -> int:
    """Feed byte by byte; return how many bytes it took to stop NEED_DATA."""
    for i in range(len(stream)):
        reader.receive_data(stream[i : i + 1])
        try:
            if reader.next_event() is not NEED_DATA:
                return i + 1
        except RemoteProtocolError:
            return i + 1
    raise AssertionError(f"still NEED_DATA after {len(stream)} bytes")


v1_alphabet = st.text(alphabet="UNKOWTCP46 0123456789abcdef:.", max_size=200)


@given(st.sampled_from(["", "UNKNOWN ", "TCP6 ", "TCP4 "]), v1_alphabet)
def test_v1_decided_within_107_bytes(start: str, middle: str) -> None:
    # No CRLF anywhere: the reader must give up by byte 107.
    stream = (f"PROXY {start}{middle}" + "f" * 120).encode()
    assert decided_after(HeaderReader(), stream) <= 107


def test_v1_without_crlf_fails_at_byte_107() -> None:
    stream = b"PROXY UNKNOWN " + b"x" * 200
    assert decided_after(HeaderReader(), stream) == 107
    with pytest.raises(RemoteProtocolError) as info:
        parse(stream)
    assert info.value.reason == "v1_too_long"


@given(
    st.integers(0, 600),
    st.sampled_from([0x20, 0x21]),
    st.sampled_from([0x00, 0x11, 0x12, 0x21, 0x22, 0x31, 0x32]),
    st.integers(0, 0xFFFF),
    st.binary(max_size=64),
)
def test_v2_decided_within_16_plus_max_length(
    max_v2_length: int, ver_cmd: int, fam: int, length: int, body: bytes
) -> None:
    fixed = V2_SIGNATURE + bytes((ver_cmd, fam)) + length.to_bytes(2, "big")
    limit = 16 + max_v2_length
    stream = fixed + (body * (limit // max(len(body), 1) + 1) if body else bytes(limit))
    reader = HeaderReader(max_v2_length=max_v2_length, accept_unspec_proxy=True)
    taken = decided_after(reader, stream)
    assert taken <= limit
    if length > max_v2_length:
        assert taken == 16  # the length field alone is enough to refuse


# -- invalid headers ----------------------------------------------------------


@given(invalid_headers())
def test_invalid_headers_are_refused(bad: InvalidHeader) -> None:
    reader = HeaderReader()
    reader.receive_data(bad.data)
    if bad.incomplete:
        assert reader.next_event() is NEED_DATA
        reader.receive_data(b"")
    with pytest.raises(RemoteProtocolError) as whole:
        reader.next_event()
    # Byte by byte: refused too, for the same reason.
    assert feed(HeaderReader(), byte_by_byte(bad.data)) == ("error", whole.value.reason)
    with pytest.raises(RemoteProtocolError):
        parse(bad.data)


# -- lazily built addresses ---------------------------------------------------


@given(encoded_headers())
def test_lazy_addresses_equal_eager_ones(pair: tuple[ProxyHeader, bytes]) -> None:
    header, wire = pair
    lazy, _ = parse(wire)
    untouched, _ = parse(wire)
    # Built by the constructor, with validation, from the lazy values.
    eager = dataclasses.replace(lazy)
    assert eager == lazy == header
    assert untouched == eager  # comparing builds the addresses
    assert lazy.source is lazy.source  # built once
    assert hash(parse(wire)[0]) == hash(header)
    assert repr(parse(wire)[0]) == repr(lazy)
    assert pickle.loads(pickle.dumps(parse(wire)[0])) == header
    assert copy.copy(parse(wire)[0]) == header
    assert copy.deepcopy(parse(wire)[0]) == header
