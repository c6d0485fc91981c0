"""The upstream exchange, byte by byte (no sockets), and against h11 as the oracle."""

from __future__ import annotations

import h11
import pytest
from hypothesis import example, given, strategies as st

from tests.tlsedge.http.test_head import mutated, response_heads
from tlsedge._http.body import BodyKind
from tlsedge._http.events import (
    NEED_DATA,
    Body,
    EndOfBody,
    Informational,
    Response,
)
from tlsedge._http.exchange import (
    MAX_RESPONSE_HEAD_BYTES,
    UpstreamError,
    UpstreamExchange,
)
from tlsedge._http.gate import MAX_INFORMATIONAL, UpstreamRequest
from tlsedge._http.head import RequestRejectedError
from tlsedge._http.rules import end_to_end_fields, reason_phrase, strip_hop_by_hop
from tlsedge._http.session import ClientSession

Event = Informational | Response | Body | EndOfBody


def sent(method: bytes = b"GET") -> UpstreamExchange:
    """An exchange whose request (no body) went out."""
    exchange = UpstreamExchange(
        UpstreamRequest(method, b"/", [(b"Host", b"h")], BodyKind.NONE)
    )
    exchange.request_head("127.0.0.1:1")
    return exchange


def answered(
    data: bytes, *, method: bytes = b"GET", eof: bool = False
) -> tuple[UpstreamExchange, list[Event]]:
    exchange = sent(method)
    exchange.receive_data(data)
    if eof:
        exchange.receive_data(b"")
    events: list[Event] = []
    while True:
        event = exchange.next_event()
        if event is NEED_DATA:
            return exchange, events
        events.append(event)
        if isinstance(event, EndOfBody):
            return exchange, events


def test_request_serialisation() -> None:
    exchange = UpstreamExchange(
        UpstreamRequest(
            b"POST",
            b"/x",
            [(b"Host", b"h"), (b"Transfer-Encoding", b"chunked")],
            BodyKind.CHUNKED,
        )
    )
    head = exchange.request_head("127.0.0.1:1")
    assert head == b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert not exchange.request_complete
    assert exchange.request_data(b"hello") == b"5\r\nhello\r\n"
    assert exchange.request_end([(b"X-Sum", b"1")]) == b"0\r\nX-Sum: 1\r\n\r\n"
    assert exchange.request_complete


def test_content_length_response_is_reusable() -> None:
    exchange, events = answered(
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\nhello"
    )
    response = events[0]
    assert isinstance(response, Response)
    assert (response.head.status, response.body) == (200, BodyKind.LENGTH)
    assert events[1:] == [Body(b"hello"), EndOfBody([])]
    assert exchange.reusable


def test_chunked_response_with_trailers_split_byte_by_byte() -> None:
    data = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\nT: 1\r\n\r\n"
    )
    exchange = sent()
    events: list[Event] = []
    for byte in data:
        exchange.receive_data(bytes([byte]))
        while (event := exchange.next_event()) is not NEED_DATA:
            events.append(event)
    assert b"".join(e.data for e in events if isinstance(e, Body)) == b"abc"
    assert events[-1] == EndOfBody([(b"T", b"1")])
    assert exchange.reusable


def test_body_until_close_ends_at_eof_and_is_not_reusable() -> None:
    exchange, events = answered(b"HTTP/1.1 200 OK\r\n\r\nall of it", eof=True)
    assert isinstance(events[0], Response)
    assert events[0].body is BodyKind.UNTIL_CLOSE
    assert events[1:] == [Body(b"all of it"), EndOfBody([])]
    assert not exchange.reusable


@pytest.mark.parametrize(
    ("method", "status"), [(b"HEAD", 200), (b"GET", 204), (b"GET", 304)]
)
def test_responses_without_a_body(method: bytes, status: int) -> None:
    exchange, events = answered(
        b"HTTP/1.1 %d X\r\nContent-Length: 10\r\n\r\n" % status, method=method
    )
    assert isinstance(events[0], Response)
    assert events[0].body is BodyKind.NONE
    assert events[1:] == [EndOfBody([])]
    assert exchange.reusable


def test_informational_then_final_and_switching() -> None:
    _, events = answered(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    )
    assert isinstance(events[0], Informational)
    assert isinstance(events[1], Response)
    exchange, events = answered(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n\x81\x00"
    )
    assert isinstance(events[0], Informational)
    assert exchange.switched
    assert exchange.trailing_data == b"\x81\x00"
    assert exchange.next_event() is NEED_DATA  # no longer HTTP


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"HTTP/1.1 200 OK\nContent-Length: 0\n\n", "bare LF"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
            "more than one Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n",
            "both Content-Length and Transfer-Encoding",
        ),
        (b"HTTP/1.1 600 Odd\r\n\r\n", "status 600"),
        (b"HTTP/2.0 200 OK\r\n\r\n", "version HTTP/2.0"),
        (b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n", "obs-fold"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "malformed chunk size",
        ),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_RESPONSE_HEAD_BYTES, "larger than"),
    ],
)
def test_responses_that_cannot_be_relayed(data: bytes, reason: str) -> None:
    with pytest.raises(UpstreamError, match=reason) as info:
        answered(data)
    assert not info.value.empty


def test_eof_before_anything_is_empty_and_after_some_bytes_is_not() -> None:
    with pytest.raises(UpstreamError, match="before responding") as info:
        answered(b"", eof=True)
    assert info.value.empty
    with pytest.raises(UpstreamError, match="inside a head") as info:
        answered(b"HTTP/1.1 200", eof=True)
    assert not info.value.empty
    with pytest.raises(UpstreamError, match="mid-response"):
        answered(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab", eof=True)


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nstray",
    ],
    ids=["connection-close", "http-1.0", "stray-bytes"],
)
def test_connections_that_cannot_be_reused(data: bytes) -> None:
    exchange, events = answered(data)
    assert events[-1] == EndOfBody([])
    assert not exchange.reusable


# -- h11 as the oracle ----------------------------------------------------------


def h11_body(
    data: bytes, method: bytes = b"GET"
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target="/", headers=[("Host", "h")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    conn.receive_data(b"")
    status, body = 0, b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, body, list(event.headers.raw_items())


# Interim responses before the final one (any number, fields or none).
informational = st.lists(
    st.sampled_from(
        [
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n",
            b"HTTP/1.1 102 \r\n\r\n",
        ]
    ),
    max_size=2,
).map(b"".join)


@st.composite
def responses(draw: st.DrawFn) -> bytes:
    body = draw(st.binary(max_size=60))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    status = draw(st.sampled_from([200, 201, 404, 500, 204, 304]))
    head = draw(informational) + b"HTTP/1.1 %d OK\r\nServer: t\r\n" % status
    if status in {204, 304}:  # no body, whatever the fields say
        length = b"Content-Length: %d\r\n" % len(body) if status == 304 else b""
        return head + draw(st.sampled_from([length, b""])) + b"\r\n"
    if framing == "length":
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    if framing == "close":
        return head + b"\r\n" + body
    chunks, rest = b"", body
    while rest:
        size = draw(st.integers(1, 17))
        piece, rest = rest[:size], rest[size:]
        chunks += b"%x\r\n%b\r\n" % (len(piece), piece)
    trailer = draw(st.sampled_from([b"", b"Etag: x\r\n"]))
    return (
        head
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + chunks
        + b"0\r\n"
        + trailer
        + b"\r\n"
    )


@st.composite
def head_responses(draw: st.DrawFn) -> bytes:
    """Responses to HEAD: framing fields, no body."""
    head = draw(informational) + b"HTTP/1.1 200 OK\r\n"
    framing = draw(
        st.sampled_from(
            [
                b"",
                b"Content-Length: 0\r\n",
                b"Content-Length: 42\r\n",
                b"Transfer-Encoding: chunked\r\n",
            ]
        )
    )
    return head + framing + b"\r\n"


@given(
    st.tuples(st.just(b"GET"), responses())
    | st.tuples(st.just(b"HEAD"), head_responses()),
    st.lists(st.integers(0, 200), max_size=4),
)
def test_response_streams_split_anywhere_agree_with_h11(
    exchanged: tuple[bytes, bytes], cuts: list[int]
) -> None:
    method, data = exchanged
    exchange = sent(method)
    status, body, trailers = 0, b"", []
    bounds = sorted({min(c, len(data)) for c in cuts} | {len(data)})
    start = 0
    pieces = []
    for stop in bounds:
        if stop > start:
            pieces.append(data[start:stop])
        start = stop
    done = False
    for piece in [*pieces, b""]:
        exchange.receive_data(piece)
        while not done and (event := exchange.next_event()) is not NEED_DATA:
            if isinstance(event, Response):
                status = event.head.status
            elif isinstance(event, Body):
                body += event.data
            elif isinstance(event, EndOfBody):
                trailers = event.trailers
                done = True
    assert done
    assert (status, body, trailers) == h11_body(data, method)


RESPONSE_PIECES = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(
        [
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
            b"HTTP/1.0 200 OK\r\n\r\n",
            b"3\r\nabc\r\n",
            b"0\r\n\r\n",
            b"abc",
        ]
    ),
)


@given(st.sampled_from([b"GET", b"HEAD"]), st.lists(RESPONSE_PIECES, max_size=8))
def test_any_bytes_give_events_or_an_upstream_error(
    method: bytes, pieces: list[bytes]
) -> None:
    # Whatever an upstream sends, the exchange answers with events, NEED_DATA
    # or an UpstreamError: never another exception, never a loop that does
    # not end.
    exchange = sent(method)
    try:
        for piece in [*[p for p in pieces if p], b""]:
            exchange.receive_data(piece)
            for _ in range(1000):
                if exchange.next_event() is NEED_DATA:
                    break
            else:
                raise AssertionError("next_event never asked for more data")
    except UpstreamError:
        pass


# -- the request's framing, checked as it goes ---------------------------------------


def sized(length: int) -> UpstreamExchange:
    exchange = UpstreamExchange(
        UpstreamRequest(
            b"POST",
            b"/",
            [(b"Host", b"h"), (b"Content-Length", str(length).encode())],
            BodyKind.LENGTH,
        )
    )
    exchange.request_head("127.0.0.1:1")
    return exchange


def test_a_sized_body_must_bring_exactly_its_length() -> None:
    exact = sized(5)
    assert exact.request_data(b"hel") == b"hel"
    assert exact.request_data(b"lo") == b"lo"
    assert exact.request_end([]) == b""
    assert exact.request_complete
    longer = sized(5)
    with pytest.raises(RequestRejectedError, match="longer than its Content-Length"):
        longer.request_data(b"hello!")
    assert not longer.request_complete


def test_a_body_that_ends_short_leaves_the_connection_unusable() -> None:
    # An upstream still waiting for 2 bytes would read the next client's
    # request as them: the request stays incomplete, the connection is not
    # reused even after a complete response.
    short = sized(5)
    short.request_data(b"abc")
    with pytest.raises(RequestRejectedError, match="2 bytes short"):
        short.request_end([])
    assert not short.request_complete
    short.receive_data(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert isinstance(short.next_event(), Response)
    assert isinstance(short.next_event(), EndOfBody)
    assert short.response_complete
    assert not short.reusable


def test_trailers_that_would_end_the_chunked_body_are_refused() -> None:
    exchange = UpstreamExchange(
        UpstreamRequest(
            b"POST",
            b"/",
            [(b"Host", b"h"), (b"Transfer-Encoding", b"chunked")],
            BodyKind.CHUNKED,
        )
    )
    exchange.request_head("127.0.0.1:1")
    with pytest.raises(RequestRejectedError, match="trailer field 'X'"):
        exchange.request_end([(b"X", b"1\r\n\r\nGET /evil HTTP/1.1")])
    assert not exchange.request_complete


def test_more_informational_responses_than_the_cap_are_an_upstream_error() -> None:
    hint = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    _, events = answered(hint * MAX_INFORMATIONAL)
    assert len(events) == MAX_INFORMATIONAL
    with pytest.raises(UpstreamError, match="more than 32 informational"):
        answered(hint * (MAX_INFORMATIONAL + 1))


@given(
    st.binary(min_size=1, max_size=40),
    st.integers(0, 40),
    st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n"]),
)
def test_rest_of_body_is_the_body_events_at_once(
    body: bytes, given_bytes: int, stray: bytes
) -> None:
    """Right after the head, a sized body all buffered is taken at once and
    leaves the exchange where its events would; one not all there is left
    to the events."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
    whole = given_bytes >= len(body)
    data = head + (body + stray if whole else body[:given_bytes])
    by_events, events = answered(data)
    exchange = sent()
    exchange.receive_data(data)
    assert isinstance(exchange.next_event(), Response)
    rest = exchange.rest_of_body()
    if not whole:
        assert rest is None
        # The bytes there stay for the events.
        exchange.receive_data(body[given_bytes:])
        assert [exchange.next_event(), exchange.next_event()] == [
            Body(body),
            EndOfBody([]),
        ]
        return
    assert rest == b"".join(e.data for e in events if isinstance(e, Body)) == body
    assert events[-1] == EndOfBody([])
    assert exchange.next_event() is NEED_DATA
    assert (exchange.response_complete, exchange.reusable) == (
        by_events.response_complete,
        by_events.reusable,
    )
    assert exchange.trailing_data == by_events.trailing_data == stray


def test_rest_of_body_only_for_a_sized_body_after_its_head() -> None:
    chunked = sent()
    chunked.receive_data(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    )
    assert chunked.rest_of_body() is None  # no head yet
    assert isinstance(chunked.next_event(), Response)
    assert chunked.rest_of_body() is None
    empty = sent()
    empty.receive_data(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert isinstance(empty.next_event(), Response)
    assert empty.rest_of_body() is None
    assert empty.next_event() == EndOfBody([])


# -- relayed to a client: what it reads is what was relayed ------------------------

_AFTER_HEADS = st.sampled_from(
    [
        b"",
        b"hello",
        b"5\r\nhello\r\n0\r\n\r\n",
        b"3;a=b\r\nabc\r\n0\r\nT: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx",
    ]
) | st.binary(max_size=20)
_CLIENT_REQUESTS = st.sampled_from(
    [
        b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
        b"HEAD / HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET / HTTP/1.0\r\n\r\n",
        b"HEAD / HTTP/1.0\r\n\r\n",
    ]
)
_FRAMING = (b"content-length", b"transfer-encoding")


def relayed(
    request: bytes, upstream: bytes, *, spliced: bool
) -> tuple[bytes, bytes, bool] | None:
    """The bytes a client that sent *request* gets for the upstream's bytes,
    the body data relayed, and whether the connection closes after them, as
    the HTTP/1.1 driver relays them (`tlsedge._pipeline.http.h1`); None when
    the upstream's bytes cannot be relayed or switch protocols."""
    exchange = sent(request.split(b" ")[0])
    session = ClientSession(max_header_bytes=8192, max_headers=50)
    session.receive_data(request)
    session.next_event()
    exchange.receive_data(upstream)
    exchange.receive_data(b"")
    out = data = b""
    try:
        while (event := exchange.next_event()) is not NEED_DATA:
            if isinstance(event, Informational):
                head = event.head
                if head.status == 101:
                    return None
                if b"HTTP/1.0" not in request:
                    out += session.send_informational(
                        head.status,
                        reason_phrase(head.status, head.reason),
                        strip_hop_by_hop(head.headers, keep_upgrade=False),
                    )
            elif isinstance(event, Response):
                head = event.head
                if spliced and head.forward is not None:
                    out += session.send_response_head(
                        head.forward, head.status, event.body
                    )
                else:
                    out += session.send_response(
                        head.status,
                        reason_phrase(head.status, head.reason),
                        end_to_end_fields(head, keep_upgrade=False),
                        event.body,
                    )
            elif isinstance(event, Body):
                data += event.data
                out += session.send_data(event.data)
            else:
                trailers = strip_hop_by_hop(event.trailers, keep_upgrade=False)
                out += session.send_end(trailers)
                return out, data, session.close_after_response
    except UpstreamError:
        return None
    return None


@given(
    st.one_of(response_heads(), mutated(response_heads())),
    _AFTER_HEADS,
    _CLIENT_REQUESTS,
    st.booleans(),
)
@example(
    b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"",
    b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
    True,
).via("a 204's Transfer-Encoding went to the client")
def test_a_client_reads_the_response_that_was_relayed_and_nothing_more(
    head: bytes, after: bytes, request: bytes, spliced: bool
) -> None:
    # h11 as the client: one response, the body relayed, no byte left over (a
    # response an intermediary would read differently), and no framing field
    # where RFC 9112 forbids one (1xx, 204).
    result = relayed(request, head + after, spliced=spliced)
    if result is None:
        return
    out, data, close = result
    method = request.split(b" ")[0]
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target="/", headers=[("Host", "h")]))
    client.send(h11.EndOfMessage())
    client.receive_data(out)
    if close:
        client.receive_data(b"")
    body = b""
    while not isinstance(event := client.next_event(), h11.EndOfMessage):
        if isinstance(event, h11.Data):
            body += event.data
            continue
        assert isinstance(event, h11.InformationalResponse | h11.Response), event
        if event.status_code < 200 or event.status_code == 204:
            assert not [n for n, _ in event.headers if n in _FRAMING], out
    assert body == (b"" if method == b"HEAD" else data)
    assert client.trailing_data == (b"", close)
