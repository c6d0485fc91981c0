"""HeaderReader: incremental feeding, trailing data, EOF, errors, limits."""

from __future__ import annotations

import os
from typing import Any

import pytest

from proxyproto import (
    NEED_DATA,
    NO_HEADER,
    HeaderReader,
    LocalProtocolError,
    ProxyHeader,
    RemoteProtocolError,
    encode_v2,
    parse,
)

from .vectors import (
    AWS_NLB,
    CLIENT_HELLO,
    SIG,
    V1_INVALID,
    V1_VALID,
    V2_INVALID,
    V2_VALID,
    hx,
)

VALID = [
    *(pytest.param(v.data, id=f"v1-{name}") for name, v in V1_VALID.items()),
    *(pytest.param(v.data, id=f"v2-{name}") for name, v in V2_VALID.items()),
    pytest.param(AWS_NLB, id="aws-nlb"),
]
INVALID = [
    *(pytest.param(d, r, id=f"v1-{name}") for name, (d, r) in V1_INVALID.items()),
    *(pytest.param(d, r, id=f"v2-{name}") for name, (d, r) in V2_INVALID.items()),
]


def read_whole(data: bytes, **options: Any) -> tuple[ProxyHeader, bytes]:
    reader = HeaderReader(**options)
    reader.receive_data(data)
    event = reader.next_event()
    assert isinstance(event, ProxyHeader)
    return event, reader.trailing_data


def read_bytewise(data: bytes, **options: Any) -> tuple[ProxyHeader, int]:
    """Feed one byte at a time; return the header and how many bytes it took."""
    reader = HeaderReader(**options)
    for i in range(len(data)):
        reader.receive_data(data[i : i + 1])
        event = reader.next_event()
        if event is not NEED_DATA:
            assert isinstance(event, ProxyHeader)
            assert reader.trailing_data == b""
            return event, i + 1
    raise AssertionError("no header")


def reason_of(reader: HeaderReader) -> str:
    with pytest.raises(RemoteProtocolError) as exc_info:
        reader.next_event()
    return exc_info.value.reason


# -- h11's tr() pattern ----------------------------------------------------------------


@pytest.mark.parametrize("data", VALID)
def test_whole_bytewise_and_trailing_agree(data: bytes) -> None:
    expected, consumed = parse(data)
    assert consumed == len(data)
    # 1. the whole input at once
    header, trailing = read_whole(data)
    assert header == expected
    assert trailing == b""
    # 2. one byte at a time: the header comes exactly with its last byte
    header, used = read_bytewise(data)
    assert header == expected
    assert used == len(data)
    # 3. with trailing bytes, preserved exactly
    header, trailing = read_whole(data + b"trailing")
    assert header == expected
    assert trailing == b"trailing"


@pytest.mark.parametrize("data", VALID)
def test_client_hello_after_header_is_untouched(data: bytes) -> None:
    header, trailing = read_whole(data + CLIENT_HELLO)
    assert trailing == CLIENT_HELLO
    assert header == parse(data)[0]


@pytest.mark.parametrize("data", VALID)
def test_two_chunks_at_every_split(data: bytes) -> None:
    expected = parse(data)[0]
    stream = data + CLIENT_HELLO
    for cut in range(len(stream) + 1):
        reader = HeaderReader()
        if cut:
            reader.receive_data(stream[:cut])
        event = reader.next_event()
        if cut < len(data):
            assert event is NEED_DATA
            reader.receive_data(stream[cut:])
            assert reader.next_event() == expected
            assert reader.trailing_data == CLIENT_HELLO
        else:
            # The header is complete in the first chunk; what is not yet read
            # stays in the stream, for the adapter to forward after it.
            assert event == expected
            assert reader.trailing_data + stream[cut:] == CLIENT_HELLO


def test_accepts_bytearray_and_memoryview() -> None:
    data = V2_VALID["tcp4"].data + b"x"
    for chunk in (bytearray(data), memoryview(data)):
        reader = HeaderReader()
        reader.receive_data(chunk)
        assert isinstance(reader.next_event(), ProxyHeader)
        assert reader.trailing_data == b"x"
        assert type(reader.trailing_data) is bytes


# -- NEED_DATA, EOF --------------------------------------------------------------------


def test_need_data_before_anything() -> None:
    reader = HeaderReader()
    assert reader.next_event() is NEED_DATA
    assert reader.next_event() is NEED_DATA


@pytest.mark.parametrize("data", VALID)
def test_eof_on_any_proper_prefix_is_an_error(data: bytes) -> None:
    for cut in range(1, len(data), max(1, len(data) // 16)):
        reader = HeaderReader()
        reader.receive_data(data[:cut])
        assert reader.next_event() is NEED_DATA
        reader.receive_data(b"")
        assert reason_of(reader) == "eof"


@pytest.mark.parametrize("versions", [{1}, {2}, {1, 2}])
def test_eof_before_any_byte_is_empty_not_eof(versions: set[int]) -> None:
    # A TCP health check or a port scan: connect, then close without a byte.
    # Not a header cut short, so adapters and metrics can tell it apart.
    reader = HeaderReader(versions=versions)
    assert reader.next_event() is NEED_DATA
    reader.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="without sending a byte") as info:
        reader.next_event()
    assert info.value.reason == "empty"
    assert reason_of(reader) == "empty"  # raised again, unchanged


def test_eof_message_says_how_many_bytes() -> None:
    reader = HeaderReader()
    reader.receive_data(b"PROXY TCP4")
    reader.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="10 bytes"):
        reader.next_event()


def test_complete_header_then_eof_is_fine() -> None:
    reader = HeaderReader()
    reader.receive_data(V1_VALID["tcp4"].data)
    reader.receive_data(b"")
    assert isinstance(reader.next_event(), ProxyHeader)
    assert reader.trailing_data == b""


def test_data_after_eof_is_a_local_error() -> None:
    reader = HeaderReader()
    reader.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        reader.receive_data(b"PROXY")


# -- ERROR and DONE states -------------------------------------------------------------


@pytest.mark.parametrize(("data", "reason"), INVALID)
def test_error_state_is_sticky(data: bytes, reason: str) -> None:
    reader = HeaderReader()
    reader.receive_data(data)
    with pytest.raises(RemoteProtocolError) as first:
        reader.next_event()
    assert first.value.reason == reason
    for more in (b"", b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n", b"x" * 100_000):
        reader.receive_data(more)  # ignored: the reader already refused
        with pytest.raises(RemoteProtocolError) as again:
            reader.next_event()
        assert again.value is first.value
    with pytest.raises(LocalProtocolError):
        _ = reader.trailing_data
    assert reader.bytes_needed == 0


def test_error_state_after_eof_is_sticky() -> None:
    reader = HeaderReader()
    reader.receive_data(b"PRO")
    reader.receive_data(b"")
    with pytest.raises(RemoteProtocolError) as first:
        reader.next_event()
    with pytest.raises(RemoteProtocolError) as again:
        reader.next_event()
    assert again.value is first.value


def test_receive_data_after_header_is_a_local_error() -> None:
    reader = HeaderReader()
    reader.receive_data(V2_VALID["local-unspec"].data)
    assert isinstance(reader.next_event(), ProxyHeader)
    with pytest.raises(LocalProtocolError, match="trailing_data"):
        reader.receive_data(b"more")
    with pytest.raises(LocalProtocolError):
        reader.receive_data(b"")


def test_next_event_after_header_is_a_local_error() -> None:
    reader = HeaderReader()
    reader.receive_data(V1_VALID["unknown-short"].data)
    assert isinstance(reader.next_event(), ProxyHeader)
    with pytest.raises(LocalProtocolError):
        reader.next_event()


def test_trailing_data_before_header_is_a_local_error() -> None:
    reader = HeaderReader()
    reader.receive_data(b"PROXY ")
    assert reader.next_event() is NEED_DATA
    with pytest.raises(LocalProtocolError):
        _ = reader.trailing_data


# -- early rejection -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        # h11's test_early_detection_of_invalid_request: fail at the first
        # byte that cannot continue a valid header, not at a timeout.
        pytest.param(b"G", "bad_signature", id="GET"),
        pytest.param(b"\x16", "bad_signature", id="client-hello"),
        pytest.param(b"\r\n\r\nX", "bad_signature", id="v2-sig-5th-byte"),
        pytest.param(b"\r\n\r\n\x00\r\nQUIX", "bad_signature", id="v2-sig-11th-byte"),
        pytest.param(b"PROXX", "bad_signature", id="PROXX"),
        pytest.param(b"PROXY\r", "bad_signature", id="PROXY-CR"),
        pytest.param(b"PROXY t", "bad_v1_protocol", id="lowercase-tcp"),
        pytest.param(b"PROXY  ", "bad_v1_protocol", id="double-space"),
        pytest.param(b"PROXY TCP4 1.2.3.4\t", "bad_v1", id="tab"),
        pytest.param(b"PROXY TCP4 1.2.3.4 5.6.7.8 +", "bad_v1", id="plus"),
        pytest.param(b"PROXY TCP6 fe80::1%", "bad_v1", id="zone-id"),
        pytest.param(b"PROXY TCP4 1.2.3.4 5.6.7.8 80 443\n", "bad_v1", id="bare-lf"),
        pytest.param(b"PROXY TCP4 1\r1", "bad_v1", id="lone-cr"),
        pytest.param(b"PROXY UNKNOWN \n", "bad_v1", id="unknown-bare-lf"),
        pytest.param(b"PROXY UNKNOWN \r\r", "bad_v1", id="unknown-cr-cr"),
        pytest.param(b"PROXY UNKNOWN\n", "bad_v1_protocol", id="unknown-glued-lf"),
        pytest.param(b"PROXY UNKNOWN\r\r", "bad_v1_protocol", id="unknown-glued-cr"),
        pytest.param(b"PROXY UNKNOWNx", "bad_v1_protocol", id="unknown-glued"),
        pytest.param(b"PROXY TCP4 \xff", "bad_v1", id="non-ascii"),
        pytest.param(SIG + b"\x11", "bad_version", id="v2-version"),
        pytest.param(SIG + b"\x23", "bad_command", id="v2-command"),
        pytest.param(SIG + b"\x21\x13", "bad_family", id="v2-family"),
        pytest.param(SIG + hx("21 11 1001"), "too_large", id="v2-too-large"),
    ],
)
def test_early_rejection_at_the_first_wrong_byte(data: bytes, reason: str) -> None:
    reader = HeaderReader()
    for i in range(len(data) - 1):
        reader.receive_data(data[i : i + 1])
        assert reader.next_event() is NEED_DATA, data[: i + 1]
    reader.receive_data(data[-1:])
    assert reason_of(reader) == reason


# -- versions --------------------------------------------------------------------------


def test_versions_1_refuses_v2() -> None:
    reader = HeaderReader(versions={1})
    reader.receive_data(V2_VALID["tcp4"].data)
    assert reason_of(reader) == "version_not_allowed"


def test_versions_2_refuses_v1() -> None:
    reader = HeaderReader(versions={2})
    reader.receive_data(V1_VALID["tcp4"].data)
    assert reason_of(reader) == "version_not_allowed"


@pytest.mark.parametrize(
    ("versions", "data", "reason"),
    [
        # "\r" can only start a v2 header: refused at once.
        pytest.param({1}, b"\r", "version_not_allowed", id="v1-only-cr"),
        # "PROXY " is known to be v1 once complete (a shorter prefix could
        # still turn into garbage, and the reason must not depend on splits).
        pytest.param({2}, b"PROXY ", "version_not_allowed", id="v2-only-proxy"),
        pytest.param({2}, b"G", "bad_signature", id="v2-only-garbage"),
        pytest.param({1}, b"G", "bad_signature", id="v1-only-garbage"),
    ],
)
def test_version_refused_early(versions: set[int], data: bytes, reason: str) -> None:
    reader = HeaderReader(versions=versions)
    for i in range(len(data) - 1):
        reader.receive_data(data[i : i + 1])
        assert reader.next_event() is NEED_DATA
    reader.receive_data(data[-1:])
    assert reason_of(reader) == reason


def test_versions_each_accept_their_own() -> None:
    assert read_whole(V1_VALID["tcp4"].data, versions={1})[0].version == 1
    assert read_whole(V2_VALID["tcp4"].data, versions={2})[0].version == 2
    assert parse(V1_VALID["tcp4"].data, versions=[1])[0].version == 1
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(V1_VALID["tcp4"].data, versions=[2])
    assert exc_info.value.reason == "version_not_allowed"


@pytest.mark.parametrize("versions", [set(), {3}, {1, 2, 3}, {0}])
def test_bad_versions_option_is_a_local_error(versions: set[int]) -> None:
    with pytest.raises(LocalProtocolError):
        HeaderReader(versions=versions)


# -- optional readers ------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http"),
        pytest.param(CLIENT_HELLO, id="client-hello"),
        pytest.param(b"PUT / HTTP/1.1\r\n", id="starts-with-P"),
        pytest.param(b"PROXIMITY", id="PROXI"),
        pytest.param(b"\r\n\r\n\r\n", id="starts-like-v2"),
    ],
)
def test_optional_no_header_keeps_all_bytes(data: bytes) -> None:
    reader = HeaderReader(optional=True)
    reader.receive_data(data)
    assert reader.next_event() is NO_HEADER
    assert reader.trailing_data == data
    with pytest.raises(LocalProtocolError):
        reader.receive_data(b"more")
    with pytest.raises(LocalProtocolError):
        reader.next_event()


@pytest.mark.parametrize(
    "prefix", [b"P", b"PROX", b"PROXY", b"\r", b"\r\n\r\n\x00", SIG[:11]]
)
def test_optional_waits_on_partial_prefixes(prefix: bytes) -> None:
    reader = HeaderReader(optional=True)
    reader.receive_data(prefix)
    assert reader.next_event() is NEED_DATA


@pytest.mark.parametrize(
    "prefix", [b"", b"P", b"PROX", b"PROXY", b"\r", b"\r\n\r\n\x00", SIG[:11]]
)
def test_optional_partial_prefix_at_eof_is_no_header(prefix: bytes) -> None:
    reader = HeaderReader(optional=True)
    reader.receive_data(prefix)
    reader.receive_data(b"")
    assert reader.next_event() is NO_HEADER
    assert reader.trailing_data == prefix


@pytest.mark.parametrize("data", VALID)
def test_optional_still_reads_headers(data: bytes) -> None:
    header, trailing = read_whole(data + b"GET", optional=True)
    assert header == parse(data)[0]
    assert trailing == b"GET"
    assert read_bytewise(data, optional=True)[1] == len(data)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        pytest.param(b"PROXY tcp4 1.2.3.4 5.6.7.8 1 2\r\n", "bad_v1_protocol", id="v1"),
        pytest.param(SIG + b"\x11\x11\x00\x0c" + bytes(12), "bad_version", id="v2"),
        pytest.param(SIG + hx("21 00 0000"), "unspec_proxy", id="v2-unspec"),
    ],
)
def test_optional_still_errors_after_a_full_signature(data: bytes, reason: str) -> None:
    reader = HeaderReader(optional=True)
    reader.receive_data(data)
    assert reason_of(reader) == reason


def test_optional_eof_after_full_signature_is_an_error() -> None:
    reader = HeaderReader(optional=True)
    reader.receive_data(b"PROXY TCP4 ")
    reader.receive_data(b"")
    assert reason_of(reader) == "eof"


# -- bytes_needed ----------------------------------------------------------------------


def _read_with_bytes_needed(stream: bytes, **options: Any) -> tuple[object, int, int]:
    """An adapter that reads exactly ``bytes_needed`` bytes per read.

    Returns the event, the bytes taken from the stream, and the number of reads.
    """
    reader = HeaderReader(**options)
    pos = reads = 0
    while True:
        n = reader.bytes_needed
        assert n >= 1
        chunk = stream[pos : pos + n]
        pos += len(chunk)
        reads += 1
        reader.receive_data(chunk)
        event = reader.next_event()
        if event is not NEED_DATA:
            if event is not NO_HEADER:
                assert reader.trailing_data == b""
            assert reader.bytes_needed == 0
            return event, pos, reads


@pytest.mark.parametrize("versions", [{1, 2}, {2}])
@pytest.mark.parametrize(
    "data",
    [
        *(pytest.param(v.data, id=f"v2-{name}") for name, v in V2_VALID.items()),
        pytest.param(AWS_NLB, id="aws-nlb"),
    ],
)
def test_bytes_needed_never_over_reads_v2(data: bytes, versions: set[int]) -> None:
    event, taken, reads = _read_with_bytes_needed(
        data + CLIENT_HELLO, versions=versions
    )
    assert event == parse(data)[0]
    assert taken == len(data)
    # 16 fixed bytes (at most 2 reads), then the rest in one read.
    assert reads <= 3


@pytest.mark.parametrize(
    "data", [pytest.param(v.data, id=name) for name, v in V1_VALID.items()]
)
def test_bytes_needed_never_over_reads_v1(data: bytes) -> None:
    event, taken, reads = _read_with_bytes_needed(data + CLIENT_HELLO, versions={1})
    assert event == parse(data)[0]
    assert taken == len(data)
    # 15 bytes first (the shortest v1 header), then one byte at a time.
    assert reads == 1 + len(data) - 15


def test_bytes_needed_values() -> None:
    reader = HeaderReader()
    assert reader.bytes_needed == 15  # shortest header of either version
    assert HeaderReader(versions={2}).bytes_needed == 16
    reader.receive_data(SIG[:5])
    assert reader.bytes_needed == 11
    reader.receive_data(SIG[5:] + hx("21 11 000c"))
    assert reader.bytes_needed == 12
    reader = HeaderReader()
    reader.receive_data(b"PROXY TCP4 ")
    assert reader.bytes_needed == 4
    reader.receive_data(b"1.2.")
    assert reader.bytes_needed == 1


def test_bytes_needed_with_optional_and_no_header() -> None:
    event, taken, _ = _read_with_bytes_needed(b"GET / HTTP/1.1\r\n\r\n", optional=True)
    assert event is NO_HEADER
    assert taken <= 16


# -- parse() ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"PROXY TCP4 1.2.3.4", id="v1-partial"),
        pytest.param(SIG[:7], id="v2-sig-partial"),
        pytest.param(SIG + hx("21 11 000c") + bytes(11), id="v2-one-short"),
        pytest.param(AWS_NLB[:-1], id="aws-nlb-one-short"),
    ],
)
def test_parse_incomplete(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(data)
    assert exc_info.value.reason == "incomplete"


def test_parse_accepts_bytearray_and_memoryview() -> None:
    data = AWS_NLB + b"rest"
    assert parse(bytearray(data))[1] == len(AWS_NLB)
    assert parse(memoryview(data))[1] == len(AWS_NLB)


def test_parse_options() -> None:
    data = SIG + hx("21 00 0000")
    assert parse(data, accept_unspec_proxy=True)[0] == ProxyHeader.unknown(version=2)


# -- error messages --------------------------------------------------------------------

_64K = 64 * 1024


def _huge_inputs() -> list[Any]:
    big_tlv_header = encode_v2(ProxyHeader.local())[:14]
    return [
        pytest.param(b"G" * _64K, {}, id="garbage"),
        pytest.param(os.urandom(_64K), {}, id="random"),
        pytest.param(b"PROXY " + b"A" * _64K, {}, id="v1-letters"),
        pytest.param(b"PROXY TCP4 " + b"1" * _64K, {}, id="v1-digits"),
        pytest.param(b"PROXY UNKNOWN " + b"\xff" * _64K, {}, id="v1-unknown"),
        pytest.param(b"PROXY TCP6 " + b"f" * 90 + b"\r\n", {}, id="v1-long-field"),
        pytest.param(SIG[:11] + b"Z" * _64K, {}, id="v2-bad-sig"),
        pytest.param(
            big_tlv_header + hx("fff8 02fff5") + b"a b" * 21843,
            {"max_v2_length": 65535},
            id="v2-authority",
        ),
        pytest.param(
            big_tlv_header + hx("fff8 30fff5") + b"\xff" * 65525,
            {"max_v2_length": 65535},
            id="v2-netns",
        ),
        pytest.param(
            big_tlv_header + hx("fff8 20fff5 01 00000000 21fff0") + b"\x80" * 65520,
            {"max_v2_length": 65535},
            id="v2-ssl-version",
        ),
        pytest.param(big_tlv_header + hx("ffff") + bytes(100), {}, id="v2-too-large"),
    ]


@pytest.mark.parametrize(("data", "options"), _huge_inputs())
def test_error_messages_are_bounded(data: bytes, options: dict[str, Any]) -> None:
    reader = HeaderReader(**options)
    reader.receive_data(data)
    with pytest.raises(RemoteProtocolError) as exc_info:
        reader.next_event()
    assert len(str(exc_info.value)) <= 300, str(exc_info.value)


@pytest.mark.parametrize(("data", "reason"), INVALID)
def test_every_error_message_is_short_and_has_a_reason(
    data: bytes, reason: str
) -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(data + b"x" * _64K)
    assert exc_info.value.reason == reason
    assert 10 < len(str(exc_info.value)) <= 300


@pytest.mark.parametrize(
    ("data", "expected", "seen"),
    [
        pytest.param(b"GET / HTTP/1.1", "PROXY", "GET", id="bad-signature"),
        pytest.param(SIG + b"\x31\x11", "0x2", "0x3", id="version"),
        pytest.param(
            b"PROXY TCP4 1.2.3.4 5.6.7.8 080 1\r\n", "leading zeros", "080", id="port"
        ),
        pytest.param(SIG + hx("21 11 0004 00000000"), "12", "4", id="short-block"),
    ],
)
def test_error_messages_say_expected_and_seen(
    data: bytes, expected: str, seen: str
) -> None:
    with pytest.raises(RemoteProtocolError) as exc_info:
        parse(data)
    assert expected in str(exc_info.value)
    assert seen in str(exc_info.value)


def test_aws_nlb_accessor_error_is_bounded() -> None:
    from proxyproto import TLV

    header = ProxyHeader.local(tlvs=(TLV(0xEA, b"\x01" + b"_" * 60000),))
    with pytest.raises(RemoteProtocolError) as exc_info:
        _ = header.aws_vpce_id
    assert len(str(exc_info.value)) <= 300


def test_options_are_built_once_per_set_of_arguments() -> None:
    # A server builds a reader per connection: the options are checked once.
    first = HeaderReader(versions={2}, max_v2_length=1024)
    second = HeaderReader(versions=[2], max_v2_length=1024)
    assert first._options is second._options
    assert HeaderReader(versions={1, 2})._options is HeaderReader()._options
    for _ in range(2):  # an invalid set is refused every time, never cached
        with pytest.raises(LocalProtocolError):
            HeaderReader(versions={3})


def test_unknown_options_are_a_type_error() -> None:
    # As for any Python call with a keyword it does not take.
    with pytest.raises(
        TypeError,
        match=r"HeaderReader\(\) got an unexpected keyword argument 'max_length'",
    ):
        HeaderReader(max_length=10)  # type: ignore[call-arg]
    with pytest.raises(
        TypeError, match=r"parse\(\) got an unexpected keyword argument 'strict'"
    ):
        parse(b"PROXY UNKNOWN\r\n", strict=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'optional'"):  # a reader's option only
        parse(b"PROXY UNKNOWN\r\n", optional=True)  # type: ignore[call-arg]
    assert HeaderReader(optional=True)._options is HeaderReader(optional=True)._options
