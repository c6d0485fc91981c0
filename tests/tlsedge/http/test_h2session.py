"""H2Session (pure): request checks, events, limits, drain; an h2 client in memory."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h2.utilities
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    SettingsFrame,
)
from hypothesis import given, settings, strategies as st

from tlsedge._core.config import Http2Config
from tlsedge._http import h2session
from tlsedge._http.h2session import (
    ConnectionEnded,
    H2Session,
    MalformedRequestError,
    RequestData,
    RequestEnd,
    StreamCancelled,
    StreamMalformed,
    StreamOpened,
    check_request,
)

ErrorCodes = h2.errors.ErrorCodes
Header = tuple[bytes, bytes]
BASE: list[Header] = [
    (b":method", b"GET"),
    (b":scheme", b"https"),
    (b":authority", b"example.com"),
    (b":path", b"/a?b=1"),
]


class Pair:
    """An H2Session and an h2 client talking through memory."""

    def __init__(self, **limits: object) -> None:
        self.session = H2Session(Http2Config(**limits), max_headers=100)  # type: ignore[arg-type]
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.client = h2.connection.H2Connection(config=config)
        self.client.initiate_connection()
        self.now = 0.0
        self.client_events: list[h2.events.Event] = []

    def flush(self) -> list[object]:
        """Client bytes to the session, its answer back; the session's events."""
        events = self.session.receive_data(self.client.data_to_send(), self.now)
        self.client_events += self.client.receive_data(self.session.data_to_send())
        return list(events)

    def request(self, fields: list[Header], *, end_stream: bool = True) -> int:
        sid = self.client.get_next_available_stream_id()
        self.client.send_headers(sid, fields, end_stream=end_stream)
        return sid

    def resets(self) -> dict[int, int]:
        return {
            e.stream_id: e.error_code
            for e in self.client_events
            if isinstance(e, h2.events.StreamReset)
        }

    def goaway(self) -> int | None:
        for event in self.client_events:
            if isinstance(event, h2.events.ConnectionTerminated):
                return int(event.error_code or 0)
        return None


# -- check_request -------------------------------------------------------------------


def test_a_request_becomes_host_first_and_fields() -> None:
    request = check_request(
        [*BASE, (b"user-agent", b"ua"), (b"te", b"trailers"), (b"x", b"1")],
        end_stream=True,
    )
    assert request.method == b"GET"
    assert request.target == b"/a?b=1"
    assert request.host == b"example.com"
    assert request.headers == [
        (b"host", b"example.com"),
        (b"user-agent", b"ua"),
        (b"x", b"1"),
    ]
    assert request.user_agent == b"ua"
    assert request.content_length is None


def test_host_alone_or_agreeing_with_authority() -> None:
    no_authority = [f for f in BASE if f[0] != b":authority"]
    assert check_request(
        [*no_authority, (b"host", b"h.test")], end_stream=True
    ).host == (b"h.test")
    agreeing = check_request([*BASE, (b"host", b"EXAMPLE.com")], end_stream=True)
    assert agreeing.headers[0] == (b"host", b"example.com")


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ([*BASE, (b"connection", b"close")], "connection-specific field 'connection'"),
        ([*BASE, (b"keep-alive", b"1")], "connection-specific field 'keep-alive'"),
        ([*BASE, (b"proxy-connection", b"1")], "connection-specific field"),
        ([*BASE, (b"transfer-encoding", b"chunked")], "connection-specific field"),
        ([*BASE, (b"upgrade", b"websocket")], "connection-specific field 'upgrade'"),
        ([*BASE, (b"te", b"gzip")], "te other than 'trailers'"),
        ([*BASE, (b"host", b"other.test")], "host field and :authority disagree"),
        ([*BASE, (b"host", b"a"), (b"host", b"a")], "more than one host field"),
        ([*BASE, (b"X-Up", b"1")], "is not a lowercase token"),
        ([*BASE, (b"x", b" padded")], "surrounding whitespace"),
        ([*BASE, (b"x", b"a\rb")], "NUL, CR, LF"),
        ([*BASE, (b":protocol", b"websocket")], ":protocol (extended CONNECT"),
        ([*BASE, (b":status", b"200")], "unknown pseudo-header ':status'"),
        ([*BASE, (b":path", b"/again")], "pseudo-header ':path' twice"),
        ([(b"x", b"1"), *BASE], "pseudo-header ':method' after a field"),
        (BASE[1:], "no :method"),
        ([f for f in BASE if f[0] != b":path"], "no :scheme or no :path"),
        ([*BASE[:3], (b":path", b"relative")], "malformed :path 'relative'"),
        ([*BASE[:3], (b":path", b"*")], "malformed :path '*'"),
        ([f for f in BASE if f[0] != b":authority"], "neither :authority nor host"),
        ([*BASE[:2], (b":authority", b"u@h"), BASE[3]], "userinfo in :authority"),
        ([*BASE[:2], (b":authority", b"a b"), BASE[3]], "malformed :authority"),
        ([*BASE, (b"content-length", b"1, 1")], "malformed content-length"),
        ([(b":method", b"CONNECT"), (b":path", b"/")], "CONNECT needs :authority"),
    ],
)
def test_malformed_requests(fields: list[Header], reason: str) -> None:
    with pytest.raises(MalformedRequestError) as info:
        check_request(fields, end_stream=True)
    assert reason in str(info.value)


def test_options_asterisk_and_connect_are_requests() -> None:
    options = [(b":method", b"OPTIONS"), *BASE[1:3], (b":path", b"*")]
    assert check_request(options, end_stream=True).target == b"*"
    connect = check_request(
        [(b":method", b"CONNECT"), (b":authority", b"x.test:443")], end_stream=False
    )
    assert connect.target == b"x.test:443"


# -- the session ---------------------------------------------------------------------


def test_settings_advertise_the_limits_and_no_extended_connect() -> None:
    pair = Pair(max_concurrent_streams=7, initial_window_size=4096)
    pair.flush()
    remote = pair.client.remote_settings
    assert remote.max_concurrent_streams == 7
    assert remote.initial_window_size == 4096
    assert remote.max_header_list_size == 16384
    assert remote.enable_connect_protocol == 0
    assert remote.enable_push == 0


def test_request_body_trailers_and_acknowledgement() -> None:
    pair = Pair()
    pair.flush()
    sid = pair.request([*BASE, (b"content-length", b"5")], end_stream=False)
    pair.client.send_data(sid, b"hello")
    pair.client.send_headers(sid, [(b"x-t", b"1")], end_stream=True)
    opened, data, end = pair.flush()
    assert isinstance(opened, StreamOpened)
    assert opened.request.content_length == 5
    assert not opened.request.end_stream
    assert data == RequestData(sid, b"hello", 5)
    assert end == RequestEnd(sid, [(b"x-t", b"1")])


def test_request_data_is_acknowledged_only_when_used() -> None:
    pair = Pair()
    pair.flush()
    sid = pair.request(BASE, end_stream=False)
    for _ in range(3):
        pair.client.send_data(sid, b"x" * 16000)
    events = pair.flush()
    assert sum(len(e.data) for e in events if isinstance(e, RequestData)) == 48000
    assert pair.client.local_flow_control_window(sid) == 65535 - 48000
    pair.session.acknowledge(sid, 48000)
    pair.flush()
    assert pair.client.local_flow_control_window(sid) == 65535


def test_the_response_respects_the_client_window() -> None:
    pair = Pair()
    pair.client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10})
    pair.flush()
    sid = pair.request(BASE)
    pair.flush()
    session = pair.session
    session.send_headers(sid, 200, [(b"content-type", b"text/plain")], end_stream=False)
    assert session.sendable(sid) == 10
    session.send_data(sid, b"0123456789")
    assert session.sendable(sid) == 0
    pair.flush()
    pair.client.increment_flow_control_window(5, stream_id=sid)
    events = pair.flush()
    assert any(type(e).__name__ == "WindowOpened" for e in events)
    assert session.sendable(sid) == 5
    session.send_end(sid, [(b"x-sum", b"1")])
    pair.flush()
    assert any(isinstance(e, h2.events.TrailersReceived) for e in pair.client_events)
    assert not session.open(sid)


def test_streams_beyond_the_limit_are_refused_and_counted_as_resets() -> None:
    pair = Pair(max_concurrent_streams=2, max_resets=3)
    # Sent before the client knows the limit (it may: RFC 9113 6.5.2).
    sids = [pair.request(BASE) for _ in range(5)]
    events = pair.flush()
    assert [e.stream_id for e in events if isinstance(e, StreamOpened)] == sids[:2]
    assert pair.resets() == dict.fromkeys(sids[2:], ErrorCodes.REFUSED_STREAM)
    pair.client.reset_stream(sids[0], ErrorCodes.CANCEL)  # the fourth reset
    (ended,) = [e for e in pair.flush() if isinstance(e, ConnectionEnded)]
    assert ended.calm
    assert "rapid reset" in ended.reason
    assert pair.goaway() == ErrorCodes.ENHANCE_YOUR_CALM


def test_resets_older_than_the_flood_window_do_not_count() -> None:
    pair = Pair(max_resets=2, flood_window=10.0)
    pair.flush()
    for _ in range(6):
        sid = pair.request(BASE, end_stream=False)
        pair.client.reset_stream(sid, ErrorCodes.CANCEL)
        events = pair.flush()
        assert StreamCancelled(sid, ErrorCodes.CANCEL) in events
        pair.now += 6.0  # two resets per 10 s: never more
    assert pair.goaway() is None


def test_malformed_request_is_a_stream_error_and_the_connection_goes_on() -> None:
    pair = Pair()
    pair.flush()
    bad = pair.request([*BASE, (b"connection", b"close")])
    good = pair.request(BASE)
    events = pair.flush()
    (malformed,) = [e for e in events if isinstance(e, StreamMalformed)]
    assert malformed.stream_id == bad
    assert malformed.method == b"GET"
    assert [e.stream_id for e in events if isinstance(e, StreamOpened)] == [good]
    assert pair.resets() == {bad: ErrorCodes.PROTOCOL_ERROR}


def test_too_many_fields_get_431_and_connect_501() -> None:
    pair = Pair()
    pair.session.max_headers = 3
    pair.flush()
    pair.request([*BASE, *[(b"x-%d" % i, b"v") for i in range(5)]])
    pair.request([(b":method", b"CONNECT"), (b":authority", b"x.test:443")])
    first, second = [e for e in pair.flush() if isinstance(e, StreamOpened)]
    assert first.error == (431, "more than 3 header fields")
    assert second.error == (501, "CONNECT is not supported")


def test_continuation_flood_is_cut_at_the_header_list_size() -> None:
    pair = Pair(max_header_list_size=4096)
    pair.flush()
    headers = HeadersFrame(1, flags=["END_STREAM"])
    headers.data = pair.client.encoder.encode(BASE)
    stream = headers.serialize()
    events: list[object] = []
    for _ in range(10):
        continuation = ContinuationFrame(1)
        continuation.data = b"\x00" * 1000
        events += pair.session.receive_data(stream + continuation.serialize(), 0.0)
        stream = b""
    (ended,) = events
    assert isinstance(ended, ConnectionEnded)
    assert "CONTINUATION flood" in ended.reason
    assert pair.session.in_header_block


def test_frames_split_across_reads_are_followed() -> None:
    pair = Pair(max_empty_frames=1)
    pair.flush()
    sid = pair.request(BASE, end_stream=False)
    pair.client.send_data(sid, b"x" * 3000)
    pair.client.send_data(sid, b"", end_stream=True)
    data = pair.client.data_to_send()
    events: list[object] = []
    for index in range(0, len(data), 7):
        events += pair.session.receive_data(data[index : index + 7], 0.0)
    assert sum(len(e.data) for e in events if isinstance(e, RequestData)) == 3000
    assert RequestEnd(sid, []) in events


@pytest.mark.parametrize(
    ("flood", "reason"),
    [
        ("ping", "control frame flood"),
        ("window_update", "WINDOW_UPDATE flood"),
        ("empty", "empty frames in a row"),
        ("priority", "PRIORITY flood"),
    ],
)
def test_floods(flood: str, reason: str) -> None:
    pair = Pair(max_control_frames=10)
    pair.flush()
    sid = pair.request(BASE, end_stream=False)
    pair.flush()
    ended: list[ConnectionEnded] = []
    for index in range(400):
        if flood == "ping":
            pair.client.ping(index.to_bytes(8, "big"))
        elif flood == "window_update":
            pair.client.increment_flow_control_window(1)
        elif flood == "empty":
            pair.client.send_data(sid, b"")
        else:
            pair.client.prioritize(sid, weight=16)
        ended += [e for e in pair.flush() if isinstance(e, ConnectionEnded)]
        if ended:
            break
    assert reason in ended[0].reason
    assert pair.goaway() == ErrorCodes.ENHANCE_YOUR_CALM


def test_goaway_lets_open_streams_finish_and_refuses_new_ones() -> None:
    pair = Pair()
    pair.flush()
    open_sid = pair.request(BASE)
    pair.flush()
    pair.session.goaway()
    pair.session.goaway()  # once
    late = pair.request(BASE)
    assert not [e for e in pair.flush() if isinstance(e, StreamOpened)]
    assert pair.resets() == {late: ErrorCodes.REFUSED_STREAM}
    pair.session.send_headers(open_sid, 204, [], end_stream=True)
    goaway = pair.session.data_to_send()
    assert goaway  # the response after the GOAWAY
    assert pair.session.goaway_sent == open_sid


def test_protocol_errors_end_the_connection() -> None:
    pair = Pair()
    pair.flush()
    # DATA on stream 0 is a connection error in h2's own checks.
    events = pair.session.receive_data(b"\x00\x00\x01\x00\x00\x00\x00\x00\x00x", 0.0)
    (ended,) = events
    assert isinstance(ended, ConnectionEnded)
    assert not ended.calm
    assert pair.session.receive_data(b"more", 0.0) == []


def test_the_clients_goaway_ends_the_connection() -> None:
    pair = Pair()
    pair.flush()
    pair.client.close_connection(ErrorCodes.NO_ERROR)
    (ended,) = pair.flush()
    assert ended == ConnectionEnded("client sent GOAWAY (NO_ERROR)", by_client=True)


@pytest.mark.parametrize("refused", [False, True])
def test_a_stream_the_client_resets_in_the_same_read_is_not_reset_again(
    refused: bool,
) -> None:
    # h2 takes the HEADERS and the RST_STREAM at once: the stream is closed
    # when its request is refused or found malformed (h2 raised
    # StreamClosedError at our RST_STREAM, out of receive_data).
    pair = Pair()
    pair.flush()
    if refused:
        pair.session.goaway()  # (streams after it are refused)
    sid = pair.request([*BASE, (b"X-Upper", b"1")])
    pair.client.reset_stream(sid, ErrorCodes.CANCEL)
    events = pair.flush()
    assert [type(e) for e in events] == ([] if refused else [StreamMalformed])
    assert pair.resets() == {}
    assert not pair.session.ended


@pytest.mark.parametrize("cut", [0, 5, 13])
def test_frames_after_the_clients_goaway_are_not_read(cut: int) -> None:
    # h2 would take the PING after the GOAWAY (in the same read, or with the
    # GOAWAY's end in the next) for a protocol error: GOAWAY PROTOCOL_ERROR.
    pair = Pair()
    pair.flush()
    pair.client.close_connection(ErrorCodes.NO_ERROR)
    sent = (
        pair.client.data_to_send() + PingFrame(0, opaque_data=b"12345678").serialize()
    )
    events = pair.session.receive_data(sent[:cut], 0.0) if cut else []
    events += pair.session.receive_data(sent[cut:], 0.0)
    assert events == [ConnectionEnded("client sent GOAWAY (NO_ERROR)", by_client=True)]
    assert pair.session.data_to_send() == b""


# -- framing facts and trailers, checked -------------------------------------------


def _served(pair: Pair, fields: list[Header]) -> int:
    sid = pair.request(fields, end_stream=False)
    (opened,) = pair.flush()
    assert isinstance(opened, StreamOpened)
    return sid


@pytest.mark.parametrize(
    ("trailers", "reason"),
    [
        ([(b"x-sum", b"1\r\n\r\nGET /evil HTTP/1.1")], "trailer field 'x-sum'"),
        ([(b"x-sum\r\nevil", b"1")], "trailer field name"),
        ([(b"X-Sum", b"1")], "is not a lowercase token"),
        ([(b":path", b"/x")], "pseudo-header ':path' in trailers"),
        ([(b"transfer-encoding", b"chunked")], "connection-specific"),
        ([(b"cookie", b"a=1 "), (b"cookie", b"b=2")], "surrounding whitespace"),
        ([(b"x", b" 1")], "surrounding whitespace"),
    ],
)
def test_a_malformed_trailer_section_resets_the_stream_being_served(
    trailers: list[Header], reason: str
) -> None:
    pair = Pair()
    pair.flush()
    sid = _served(pair, BASE)
    pair.client.send_data(sid, b"abc")
    pair.client.send_headers(sid, trailers, end_stream=True)
    events = pair.flush()
    assert [type(e) for e in events] == [RequestData, StreamMalformed]
    malformed = events[1]
    assert isinstance(malformed, StreamMalformed)
    assert reason in malformed.reason
    assert pair.resets() == {sid: ErrorCodes.PROTOCOL_ERROR}
    assert sid not in pair.session.active
    assert pair.goaway() is None


def test_a_length_the_data_does_not_reach_resets_the_stream() -> None:
    pair = Pair()
    pair.flush()
    sid = _served(pair, [*BASE, (b"content-length", b"10")])
    pair.client.send_data(sid, b"abc")
    pair.client.send_headers(sid, [(b"x-sum", b"1")], end_stream=True)
    events = pair.flush()
    assert isinstance(events[-1], StreamMalformed)
    assert "ended 7 bytes short of its content-length" in events[-1].reason
    assert pair.resets() == {sid: ErrorCodes.PROTOCOL_ERROR}


def _frames_split(data: bytes, sizes: list[int]) -> list[bytes]:
    """*data* cut into pieces of *sizes* bytes (the rest last)."""
    pieces = []
    for size in sizes:
        pieces.append(data[:size])
        data = data[size:]
    return [*pieces, data]


@pytest.mark.parametrize("one_read", [True, False])
@pytest.mark.parametrize(
    ("length", "body", "end_stream", "reason"),
    [
        (b"3", [b"abcd"], True, "DATA 1 bytes beyond its content-length"),
        (b"3", [b"ab", b"cd"], False, "DATA 1 bytes beyond its content-length"),
        (b"0", [b"a"], False, "DATA 1 bytes beyond its content-length"),
        (b"10", [b"abc"], True, "the stream ended 7 bytes short of its content"),
        (b"3", [b"ab", b""], True, "the stream ended 1 bytes short of its content"),
    ],
)
def test_data_that_breaks_the_content_length_resets_only_its_stream(
    one_read: bool, length: bytes, body: list[bytes], end_stream: bool, reason: str
) -> None:
    # RFC 9113 8.1.1: a stream error, not the connection's end (h2 would have
    # raised InvalidBodyLengthError, a connection error), whether the DATA
    # comes in the read of its HEADERS or later; the stream beside it goes on.
    pair = Pair()
    pair.flush()
    bad = pair.request([*BASE, (b"content-length", length)], end_stream=False)
    good = pair.request([*BASE, (b"content-length", b"2")], end_stream=False)
    events = [] if one_read else pair.flush()
    for piece in body[:-1]:
        pair.client.send_data(bad, piece)
    pair.client.send_data(bad, body[-1], end_stream=end_stream)
    pair.client.send_data(good, b"ok", end_stream=True)
    events += pair.flush()
    malformed = [e for e in events if isinstance(e, StreamMalformed)]
    assert [m.stream_id for m in malformed] == [bad]
    assert reason in malformed[0].reason
    assert bad not in pair.session.active
    assert events[-2:] == [RequestData(good, b"ok", 2), RequestEnd(good, [])]
    assert pair.resets() == {bad: ErrorCodes.PROTOCOL_ERROR}
    assert pair.goaway() is None
    assert not pair.session.ended


def test_a_content_length_is_checked_across_reads_and_frame_pieces() -> None:
    # The frames cut anywhere (a frame header in two reads, a padded frame's
    # pad length alone in a read): the data is counted without padding, as h2
    # counts it.
    for cut in range(1, 40):
        pair = Pair()
        pair.flush()
        sid = pair.request([*BASE, (b"content-length", b"6")], end_stream=False)
        pair.client.send_data(sid, b"abc", pad_length=5)
        pair.client.send_data(sid, b"def", end_stream=True, pad_length=2)
        events = []
        for piece in _frames_split(pair.client.data_to_send(), [cut, 1]):
            events += pair.session.receive_data(piece, pair.now)
        assert [e for e in events if not isinstance(e, StreamOpened)] == [
            RequestData(sid, b"abc", 9),
            RequestData(sid, b"def", 6),
            RequestEnd(sid, []),
        ], cut
        pair = Pair()
        pair.flush()
        sid = pair.request([*BASE, (b"content-length", b"5")], end_stream=False)
        pair.client.send_data(sid, b"abc", pad_length=5)
        pair.client.send_data(sid, b"def", end_stream=True, pad_length=2)
        events = []
        for piece in _frames_split(pair.client.data_to_send(), [cut, 1]):
            events += pair.session.receive_data(piece, pair.now)
        assert isinstance(events[-1], StreamMalformed), cut
        assert events[-1].reason == "DATA 1 bytes beyond its content-length"
        assert not pair.session.ended


def test_data_beyond_the_content_length_still_reopens_the_connection_window() -> None:
    # The reset streams' DATA counts against the connection's window (64 KiB
    # here) and is given back (as h2 batches it): twice the window's worth
    # goes through, then a new stream's body.
    pair = Pair(connection_window_size=65535)
    pair.flush()
    for _ in range(8):
        sid = pair.request([*BASE, (b"content-length", b"1")], end_stream=False)
        pair.client.send_data(sid, b"x" * 16000)  # (raises past the window)
        pair.flush()
    assert set(pair.resets().values()) == {ErrorCodes.PROTOCOL_ERROR}
    assert len(pair.resets()) == 8
    sid = pair.request(BASE, end_stream=False)
    pair.client.send_data(sid, b"y" * 16000, end_stream=True)
    events = pair.flush()
    assert RequestData(sid, b"y" * 16000, 16000) in events
    assert not pair.session.ended


_UNPARSABLE_LENGTHS = [[b"abc"], [b"-1"], [b"1 2"], [b""], [b"+5"], [b"5", b"6"]]


@pytest.mark.parametrize("lengths", _UNPARSABLE_LENGTHS)
def test_a_content_length_h2_cannot_parse_resets_only_its_stream(
    lengths: list[bytes],
) -> None:
    # h2 parses content-length as a stream opens, whatever its configuration,
    # and ends the connection over one it cannot parse; RFC 9113 8.1.1 asks a
    # stream error. The bad block's HPACK entries are decoded all the same:
    # the next request names its field by its index in the dynamic table.
    pair = Pair()
    pair.flush()
    beside = pair.request(BASE, end_stream=False)
    marker = (b"x-in-the-bad-block", b"1")
    bad = pair.request(
        [*BASE, marker, *((b"content-length", v) for v in lengths)], end_stream=False
    )
    pair.client.send_data(bad, b"abc", end_stream=True)
    table = pair.client.encoder.header_table
    found = table.search(*marker)
    assert found is not None
    assert found[0] > len(table.STATIC_TABLE)  # (an index in the dynamic table)
    after = pair.request([*BASE, marker])
    pair.client.send_data(beside, b"ok", end_stream=True)
    events = pair.flush()
    assert [e for e in events if isinstance(e, StreamMalformed)] == [
        StreamMalformed(bad, "malformed content-length", b"GET", b"/a?b=1")
    ]
    opened = [e for e in events if isinstance(e, StreamOpened)]
    assert [e.stream_id for e in opened] == [beside, after]
    assert marker in opened[1].request.headers
    assert events[-2:] == [RequestData(beside, b"ok", 2), RequestEnd(beside, [])]
    assert pair.resets() == {bad: ErrorCodes.PROTOCOL_ERROR}
    assert pair.goaway() is None
    assert not pair.session.ended


@pytest.mark.parametrize("lengths", _UNPARSABLE_LENGTHS)
def test_a_content_length_h2_cannot_parse_in_trailers_resets_the_stream(
    lengths: list[bytes],
) -> None:
    pair = Pair()
    pair.flush()
    sid = _served(pair, BASE)
    pair.client.send_data(sid, b"abc")
    pair.client.send_headers(
        sid, [(b"content-length", v) for v in lengths], end_stream=True
    )
    after = pair.request(BASE)
    events = pair.flush()
    assert events[:2] == [
        RequestData(sid, b"abc", 3),
        StreamMalformed(sid, "trailer malformed content-length", None, None),
    ]
    assert [e.stream_id for e in events[2:] if isinstance(e, StreamOpened)] == [after]
    assert pair.resets() == {sid: ErrorCodes.PROTOCOL_ERROR}
    assert pair.goaway() is None


@pytest.mark.parametrize("end_stream", [False, True])
def test_a_1xx_status_in_a_request_or_trailers_resets_only_its_stream(
    end_stream: bool,
) -> None:
    # h2 takes a block with a 1xx :status for an informational response and
    # ends the connection (a client may send none); it is a malformed request.
    pair = Pair()
    pair.flush()
    served = _served(pair, BASE)
    pair.client.send_data(served, b"abc")
    pair.flush()
    status = [(b":status", b"103")]
    encoder = pair.client.encoder
    blocks = _headers_frame(encoder, [*status, *BASE], end_stream=end_stream, sid=3)
    blocks += _headers_frame(encoder, status, end_stream=True, sid=served)
    blocks += _headers_frame(encoder, BASE, end_stream=True, sid=5)
    events = pair.session.receive_data(blocks, pair.now)
    assert events[:2] == [
        StreamMalformed(3, "unknown pseudo-header ':status'", None, None),
        StreamMalformed(
            served,
            "pseudo-header ':status' in trailers (RFC 9113 8.1)",
            None,
            None,
        ),
    ]
    assert [e.stream_id for e in events[2:] if isinstance(e, StreamOpened)] == [5]
    assert not pair.session.ended


@pytest.mark.parametrize("cut", [0, 5, 9, 12])
def test_trailers_without_end_stream_reset_only_their_stream(cut: int) -> None:
    # RFC 9113 8.1: a malformed request (h2 alone ends the connection). The
    # frames may come in the read of the DATA before them, or cut anywhere.
    pair = Pair()
    pair.flush()
    sid = _served(pair, [*BASE, (b"content-length", b"3")])
    pair.client.send_data(sid, b"abc")
    data = pair.client.data_to_send()
    data += _headers_frame(pair.client.encoder, [(b"x", b"1")], end_stream=False)
    after = _headers_frame(pair.client.encoder, BASE, end_stream=True, sid=3)
    events: list[object] = []
    if cut:
        data, rest = data[: len(data) - cut], data[len(data) - cut :]
        events += pair.session.receive_data(data, pair.now)
        data = rest
    events += pair.session.receive_data(data + after, pair.now)
    pair.client_events += pair.client.receive_data(pair.session.data_to_send())
    assert events[:2] == [
        RequestData(sid, b"abc", 3),
        StreamMalformed(sid, "trailers without END_STREAM (RFC 9113 8.1)", None, None),
    ]
    assert [e.stream_id for e in events[2:] if isinstance(e, StreamOpened)] == [3]
    assert pair.resets() == {sid: ErrorCodes.PROTOCOL_ERROR}
    assert pair.goaway() is None
    # The client's DATA after them is taken as on any stream reset.
    assert pair.session.receive_data(DataFrame(sid, b"more").serialize(), 1.0) == []
    assert not pair.session.ended


@pytest.mark.parametrize("frame", ["headers", "trailers", "data"])
def test_a_frame_after_the_request_ended_resets_its_stream_closed(frame: str) -> None:
    # RFC 9113 5.1: half-closed (remote), a stream error STREAM_CLOSED. The
    # stream was being served: it is given up (h2 alone would reset it and
    # leave it served), and the stream beside it is not touched.
    pair = Pair()
    pair.flush()
    sid = pair.request(BASE, end_stream=True)
    beside = pair.request(BASE, end_stream=True)
    assert len(pair.flush()) == 2
    encoder = pair.client.encoder
    if frame == "data":
        late = bytes(DataFrame(sid, b"late").serialize())
    else:
        late = _headers_frame(encoder, BASE, end_stream=frame == "headers", sid=sid)
    after = _headers_frame(encoder, BASE, end_stream=True, sid=5)
    events = pair.session.receive_data(late + after, pair.now)
    pair.client_events += pair.client.receive_data(pair.session.data_to_send())
    assert events[0] == StreamMalformed(
        sid, "a frame after the request ended (RFC 9113 5.1)", None, None
    )
    assert [e.stream_id for e in events[1:] if isinstance(e, StreamOpened)] == [5]
    assert pair.resets() == {sid: ErrorCodes.STREAM_CLOSED}
    assert pair.goaway() is None
    assert pair.session.active == {beside, 5}


def test_a_content_length_h2_parses_in_trailers_is_a_trailer() -> None:
    # h2 takes a number there (it counts no DATA after trailers), and so do we.
    pair = Pair()
    pair.flush()
    sid = _served(pair, BASE)
    pair.client.send_data(sid, b"abc")
    pair.client.send_headers(sid, [(b"content-length", b"3")], end_stream=True)
    assert pair.flush()[-1] == RequestEnd(sid, [(b"content-length", b"3")])


def test_a_length_with_no_data_to_come_is_malformed() -> None:
    with pytest.raises(MalformedRequestError) as info:
        check_request([*BASE, (b"content-length", b"5")], end_stream=True)
    assert "content-length 5 on a stream its HEADERS ended" in str(info.value)
    request = check_request([*BASE, (b"content-length", b"0")], end_stream=True)
    assert request.content_length == 0


def test_the_exact_length_then_trailers_is_a_request() -> None:
    pair = Pair()
    pair.flush()
    sid = _served(pair, [*BASE, (b"content-length", b"3")])
    pair.client.send_data(sid, b"abc")
    pair.client.send_headers(sid, [(b"x-sum", b"1")], end_stream=True)
    assert pair.flush()[-1] == RequestEnd(sid, [(b"x-sum", b"1")])


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        (b":method", b"GET\r\nX: 1", "is not a token"),
        (b":method", b"GET /x", "is not a token"),
        (b":method", b"G\tT", "is not a token"),
        (b":path", b"/a\tb", "malformed :path"),
        (b":path", b"/a\x0bb", "malformed :path"),
        (b":path", b"/a\x7f", "malformed :path"),
        (b":path", b"/\xc3\xa9", "malformed :path"),
        (b":scheme", b"", "malformed :scheme"),
        (b":scheme", b"ht tp", "malformed :scheme"),
        (b"x", b"a\x01b", "another control byte"),
    ],
)
def test_what_the_http11_side_refuses_is_malformed(
    name: bytes, value: bytes, reason: str
) -> None:
    fields = [(n, value if n == name else v) for n, v in BASE]
    if name not in dict(BASE):
        fields.append((name, value))
    with pytest.raises(MalformedRequestError) as info:
        check_request(fields, end_stream=True)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ([*BASE, (b"x:y", b"1")], "field name 'x:y' is not a lowercase token"),
        ([*BASE, (b"x", b"1\x00y\nz\x002")], "NUL, CR, LF"),
        ([*BASE, (b"x\ny", b"1")], "is not a lowercase token"),
        ([*BASE, (b"", b"1")], "field name '' is not a lowercase token"),
        ([*BASE[:3], (b"host", b"example.com"), BASE[3]], "':path' after a field"),
        ([*BASE[:3], (b"te", b"trailers"), BASE[3]], "':path' after a field"),
        ([*BASE, (b"cookie", b"a=1"), (b"cookie", b"")], "surrounding whitespace"),
    ],
)
def test_the_fields_checked_at_once_name_the_one_that_breaks_a_rule(
    fields: list[Header], reason: str
) -> None:
    with pytest.raises(MalformedRequestError) as info:
        check_request(fields, end_stream=True)
    assert reason in str(info.value)


def test_cookie_crumbs_are_joined_into_one_last_field_in_headers_and_trailers() -> None:
    request = check_request(
        [*BASE, (b"cookie", b"a=1"), (b"x", b"2"), (b"cookie", b"c=3")],
        end_stream=True,
    )
    assert request.headers[1:] == [(b"x", b"2"), (b"cookie", b"a=1; c=3")]
    assert request.size == sum(len(n) + len(v) for n, v in BASE) + len(
        b"x2cookiea=1; c=3"
    )
    pair = Pair()
    pair.flush()
    sid = _served(pair, [*BASE, (b"content-length", b"3")])
    pair.client.send_data(sid, b"abc")
    pair.client.send_headers(
        sid,
        [(b"cookie", b"a=1"), (b"x-sum", b"1"), (b"cookie", b"b=2")],
        end_stream=True,
    )
    assert pair.flush()[-1] == RequestEnd(
        sid, [(b"x-sum", b"1"), (b"cookie", b"a=1; b=2")]
    )


_PSEUDO_VALUES = {
    b":method": [b"GET", b"OPTIONS", b"CONNECT", b"G T", b""],
    b":scheme": [b"https", b"h2+x", b"1x", b"", b"h t"],
    b":path": [b"/", b"/a?b=1", b"*", b"", b"a", b"/\x7f", b"/ x"],
    b":authority": [b"example.com", b"", b":80", b"a@b", b"[::1]:443", b"h\xc3\xa9"],
}


@st.composite
def header_blocks(draw: st.DrawFn) -> list[Header]:
    """The four pseudo-headers in any order, each possibly missing, doubled or
    malformed, then fields that make a request malformed or not."""
    names = draw(st.permutations(list(_PSEUDO_VALUES)))
    names = draw(st.sampled_from([names, names[:3], [*names, names[0]]]))
    pseudo = [
        # (The first value is good: most blocks break one rule at most.)
        (
            name,
            draw(st.sampled_from(_PSEUDO_VALUES[name][:1] * 4 + _PSEUDO_VALUES[name])),
        )
        for name in names
    ]
    extra = st.sampled_from(
        [
            (b"host", b"example.com"),
            (b"host", b"other"),
            (b"user-agent", b"x"),
            (b":protocol", b"websocket"),
            (b":method", b"GET"),
            (b"te", b"gzip"),
        ]
    )
    return pseudo + draw(st.lists(extra, max_size=2))


def _checked(fields: list[Header]) -> object:
    try:
        return check_request(fields, end_stream=True)
    except MalformedRequestError as exc:
        return (str(exc), exc.method, exc.target)


@settings(max_examples=500)
@given(header_blocks())
def test_the_common_pseudo_header_check_is_the_rule_by_rule_one(
    fields: list[Header],
) -> None:
    at_once = _checked(fields)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(h2session, "_common_request", lambda fields, pseudo: None)
        assert _checked(fields) == at_once


# -- h2's own inbound validation, which H2Session switches off -----------------------

_NAMES = st.sampled_from(
    [
        b":method", b":scheme", b":path", b":authority", b":status", b":protocol",
        b":x", b"host", b"te", b"connection", b"keep-alive", b"upgrade",
        b"transfer-encoding", b"proxy-connection", b"content-length", b"cookie",
        b"user-agent", b"x", b"X-Up", b"", b"a b", b"a:b", b"a\x00", b"a\x7f",
        b"\xc3\xa9",
    ]
)  # fmt: skip
_VALUES = st.one_of(
    st.sampled_from(
        [
            b"GET", b"CONNECT", b"OPTIONS", b"http", b"https", b"/", b"/a?b", b"*",
            b"", b"example.com", b"Example.com", b"other.test", b"trailers",
            b"gzip", b"1", b"a=1", b" a", b"a ", b"\ta", b"a\x00b", b"a\rb",
            b"a\nb", b"\x01", b"h:1", b"u@h", b"5", b"05", b"-1", b"+5", b"1 2",
            b"1,1", b"0x5", b"99999999999999999999", b"\xd9\xa1", b"100",
        ]
    ),
    st.binary(max_size=6),
)  # fmt: skip
_FIELD_LISTS = st.lists(st.tuples(_NAMES, _VALUES), max_size=8)


@st.composite
def _near_requests(draw: st.DrawFn) -> list[Header]:
    """A request much like `BASE` (most lists of `_FIELD_LISTS` break a rule
    at once): pseudo-headers kept, changed or dropped, fields after them, two
    of the lot perhaps swapped."""
    fields = [
        (name, draw(st.one_of(st.just(value), _VALUES)))
        for name, value in BASE
        if draw(st.integers(0, 9))
    ]
    fields += draw(st.lists(st.tuples(_NAMES, _VALUES), max_size=4))
    if len(fields) > 1 and draw(st.booleans()):
        i = draw(st.integers(0, len(fields) - 1))
        j = draw(st.integers(0, len(fields) - 1))
        fields[i], fields[j] = fields[j], fields[i]
    return fields


def _headers_frame(
    encoder: hpack.Encoder, fields: list[Header], *, end_stream: bool, sid: int = 1
) -> bytes:
    """A HEADERS frame with *fields* as they are (h2 would not send them all)."""
    frame = HeadersFrame(sid, encoder.encode(fields), flags=["END_HEADERS"])
    if end_stream:
        frame.flags.add("END_STREAM")
    return bytes(frame.serialize())


def _h2_refuses(
    fields: list[Header], *, end_stream: bool, trailers: bool = False
) -> str | None:
    """Why h2 alone (its inbound validation on, as it comes) would end the
    connection over a request with *fields* (after `BASE` and some DATA, as
    its trailer section, if *trailers*), or None."""
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None)
    )
    server.initiate_connection()
    encoder = hpack.Encoder()
    frames = b""
    if trailers:
        frames = _headers_frame(encoder, BASE, end_stream=False)
        frames += DataFrame(1, b"abc").serialize()
    frames += _headers_frame(encoder, fields, end_stream=end_stream)
    try:
        server.receive_data(h2session.PREFACE + SettingsFrame(0).serialize() + frames)
    except h2.exceptions.ProtocolError as exc:
        return str(exc)
    return None


@settings(max_examples=3000, deadline=None)
@given(fields=st.one_of(_FIELD_LISTS, _near_requests()), end_stream=st.booleans())
def test_every_request_h2s_validation_refuses_check_request_refuses(
    fields: list[Header], end_stream: bool
) -> None:
    # h2's validation is off (`H2Session`), and what h2 reads regardless (a
    # content-length, a 1xx :status) is hidden from it: `check_request`
    # covers every rule h2 alone ends the connection over, as a stream error
    # (RFC 9113 8.1.1 does not ask more). One difference is ours on purpose: a `host`
    # that names the `:authority` in another case is the same authority
    # (host names are case-insensitive); h2 compares the bytes.
    why = _h2_refuses(fields, end_stream=end_stream)
    if why is None:
        return
    hidden: list[Header] = [*h2session._hidden_from_h2(fields)]
    try:
        check_request(hidden, end_stream=end_stream)
    except MalformedRequestError:
        return
    host = dict(fields).get(b"host", b"")
    assert why.startswith("Request header block has mismatched"), why
    assert host.lower() == dict(fields)[b":authority"].lower()


@settings(max_examples=2000, deadline=None)
@given(trailers=_FIELD_LISTS)
def test_every_trailer_section_h2s_validation_refuses_is_refused(
    trailers: list[Header],
) -> None:
    # (As `H2Session` checks them: after `_hidden_from_h2`, as decoded.)
    if _h2_refuses(trailers, end_stream=True, trailers=True) is None:
        return
    hidden: list[Header] = [*h2session._hidden_from_h2(trailers)]
    _, error = h2session._trailer_section(hidden)
    assert error is not None, trailers


@settings(max_examples=1000, deadline=None)
@given(fields=st.one_of(_FIELD_LISTS, _near_requests()), end_stream=st.booleans())
def test_no_request_header_block_ends_the_connection(
    fields: list[Header], end_stream: bool
) -> None:
    # Whatever a request's header block holds, h2 ends no connection over it
    # in `H2Session` (a malformed request is a stream error, RFC 9113 8.1.1):
    # the stream is opened or reset, and the next request is served.
    pair = Pair()
    pair.flush()
    block = _headers_frame(pair.client.encoder, fields, end_stream=end_stream)
    events = pair.session.receive_data(block, 0.0)
    assert not any(isinstance(e, ConnectionEnded) for e in events), events
    after = _headers_frame(pair.client.encoder, BASE, end_stream=True, sid=3)
    (opened,) = pair.session.receive_data(after, 0.0)
    assert isinstance(opened, StreamOpened)


@settings(max_examples=1000, deadline=None)
@given(trailers=_FIELD_LISTS, end_stream=st.booleans())
def test_no_trailer_section_ends_the_connection(
    trailers: list[Header], end_stream: bool
) -> None:
    pair = Pair()
    pair.flush()
    sid = _served(pair, BASE)
    pair.client.send_data(sid, b"abc")
    pair.flush()
    block = _headers_frame(pair.client.encoder, trailers, end_stream=end_stream)
    events = pair.session.receive_data(block, 0.0)
    assert not any(isinstance(e, ConnectionEnded) for e in events), events
    assert not pair.session.ended
