"""The client session, byte by byte (no sockets), and against h11 as the oracle."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, strategies as st

from tlsedge._http.body import BodyKind
from tlsedge._http.events import (
    NEED_DATA,
    Body,
    ConnectionClosed,
    EndOfBody,
    Request,
)
from tlsedge._http.head import RequestRejectedError
from tlsedge._http.session import ClientClosedMidRequestError, ClientSession, Phase

Event = Request | Body | EndOfBody | ConnectionClosed


def new_session(data: bytes = b"", **limits: int) -> ClientSession:
    session = ClientSession(
        max_header_bytes=limits.get("max_header_bytes", 8192),
        max_headers=limits.get("max_headers", 50),
        max_body_size=limits.get("max_body_size", 0),
    )
    if data:
        session.receive_data(data)
    return session


def drain(session: ClientSession) -> list[Event]:
    """Every event the buffered bytes give, up to NEED_DATA or the request's end."""
    events: list[Event] = []
    while True:
        event = session.next_event()
        if event is NEED_DATA:
            return events
        events.append(event)
        if isinstance(event, (EndOfBody, ConnectionClosed)):
            return events


def body_of(events: list[Event]) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, Body))


def test_get_then_pipelined_request_waits_in_the_buffer() -> None:
    session = new_session(
        b"\r\nGET /a HTTP/1.1\r\nHost: h\r\n\r\nGET /b HTTP/1.1\r\nHost: h\r\n\r\n"
    )
    first = drain(session)
    assert isinstance(first[0], Request)
    assert first[0].head.target == b"/a"
    assert first[0].size == len(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n")
    assert first[1:] == [EndOfBody([])]
    # Read, but not answered yet.
    assert (session.request_read, session.keep_alive) == (True, False)
    out = session.send_response(200, b"OK", b"Content-Length: 0\r\n", BodyKind.LENGTH)
    assert out == b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    session.send_end([])
    assert session.keep_alive
    session.start_next_cycle()
    second = drain(session)
    assert isinstance(second[0], Request)
    assert second[0].head.target == b"/b"


def test_content_length_body_split_anywhere() -> None:
    session = new_session(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n01")
    events = drain(session)
    assert isinstance(events[0], Request)
    assert session.phase is Phase.BODY
    assert events[1:] == [Body(b"01")]
    session.receive_data(b"2345")
    assert drain(session) == [Body(b"2345")]
    session.receive_data(b"6789GET")
    assert drain(session) == [Body(b"6789"), EndOfBody([])]
    assert session.trailing_data == b"GET"  # the next request, untouched


def test_chunked_body_is_decoded_with_trailers() -> None:
    session = new_session(
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n1\r\n!\r\n0\r\nX-Sum:  7 \r\n\r\nnext"
    )
    events = drain(session)
    assert body_of(events) == b"hello!"
    assert events[-1] == EndOfBody([(b"X-Sum", b"7")])
    assert session.trailing_data == b"next"


def test_eof_mid_body_and_mid_head() -> None:
    session = new_session(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nab")
    drain(session)
    session.receive_data(b"")
    with pytest.raises(ClientClosedMidRequestError):
        session.next_event()
    partial = new_session(b"GET / HTTP/1.1\r\nHo")
    assert partial.next_event() is NEED_DATA
    assert partial.phase is Phase.HEAD
    partial.receive_data(b"")
    assert partial.next_event() == ConnectionClosed(in_head=True)
    idle = new_session()
    idle.receive_data(b"")
    assert idle.next_event() == ConnectionClosed(in_head=False)


@pytest.mark.parametrize(
    ("data", "status", "reason"),
    [
        (b"\x16\x03\x01\x02\x00", 400, "not an HTTP request"),
        (b"GET / HTTP/1.1\nHost: h\n", 400, "bare CR or LF in the request head"),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 300, 431, "request head larger than 256"),
        (
            b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nz\r\n",
            400,
            "malformed chunk size line",
        ),
        (
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 20\r\n\r\n" + b"x" * 11,
            413,
            "request body larger than 10 bytes",
        ),
    ],
)
def test_refusals_come_as_soon_as_the_bytes_show_them(
    data: bytes, status: int, reason: str
) -> None:
    session = new_session(max_header_bytes=256, max_body_size=10)
    session.receive_data(data)
    with pytest.raises(RequestRejectedError, match=reason) as info:
        drain(session)
    assert info.value.status == status


def test_bare_lf_split_across_reads_is_found() -> None:
    session = new_session(b"GET / HTTP/1.1\r")
    assert session.next_event() is NEED_DATA
    session.receive_data(b"\nHost: h\n")
    with pytest.raises(RequestRejectedError, match="bare CR or LF"):
        session.next_event()


def test_expect_continue_lasts_until_body_or_response() -> None:
    session = new_session(
        b"PUT / HTTP/1.1\r\nHost: h\r\nExpect: 100-Continue\r\n"
        b"Content-Length: 2\r\n\r\n"
    )
    drain(session)
    assert session.expects_continue is True
    assert session.send_informational(100, b"Continue", []) == (
        b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    assert (session.expects_continue,) == (False,)
    old = new_session(
        b"PUT / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    )
    drain(old)
    assert not old.expects_continue  # HTTP/1.0 cannot ask for it


def test_response_framing_for_each_client() -> None:
    # Chunked or close-delimited upstream bodies: chunked to HTTP/1.1 clients.
    v11 = new_session(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    drain(v11)
    head = v11.send_response(200, b"OK", b"", BodyKind.UNTIL_CLOSE)
    assert head == b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert v11.send_data(b"abc") == b"3\r\nabc\r\n"
    assert v11.send_end([(b"T", b"1")]) == b"0\r\nT: 1\r\n\r\n"
    assert v11.keep_alive
    # ... and delimited by our close to HTTP/1.0 ones (no trailers).
    v10 = new_session(b"GET / HTTP/1.0\r\n\r\n")
    drain(v10)
    head = v10.send_response(
        200, b"OK", b"X: 1\r\ntransfer-encoding: chunked\r\nY: 2\r\n", BodyKind.CHUNKED
    )
    assert head == b"HTTP/1.1 200 OK\r\nX: 1\r\nY: 2\r\nConnection: close\r\n\r\n"
    assert v10.send_data(b"abc") == b"abc"
    assert v10.send_end([(b"T", b"1")]) == b""
    assert not v10.keep_alive
    # HEAD answers have no body whatever the fields say.
    head_request = new_session(
        b"HEAD / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    drain(head_request)
    out = head_request.send_response(
        200, b"OK", b"Content-Length: 5\r\n", BodyKind.LENGTH
    )
    assert out == b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\n"
    assert head_request.response_complete
    assert not head_request.keep_alive


def test_responses_without_a_body_carry_no_framing_a_client_could_believe() -> None:
    # An upstream's "Transfer-Encoding: chunked" on a 204 (or on a 1xx, or to
    # an HTTP/1.0 client) went on as it came: a client or an intermediary that
    # took it for a chunked body read the next response as its chunks.
    v11 = new_session(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    drain(v11)
    assert v11.send_informational(
        103,
        b"Early Hints",
        [
            (b"Link", b"</a>"),
            (b"Transfer-Encoding", b"chunked"),
            (b"content-length", b"5"),
        ],
    ) == (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
    out = v11.send_response_head(
        b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\nX: 1\r\n"
        b"content-length: 0\r\n",
        204,
        BodyKind.CHUNKED,
    )
    assert out == b"HTTP/1.1 204 No Content\r\nX: 1\r\n\r\n"
    assert v11.response_complete
    # A 304 keeps them: they describe the representation it stands for.
    v11 = new_session(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    drain(v11)
    head = b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n"
    assert v11.send_response_head(head, 304, BodyKind.CHUNKED) == head + b"\r\n"
    v10 = new_session(b"HEAD / HTTP/1.0\r\n\r\n")
    drain(v10)
    out = v10.send_response(
        200, b"OK", b"Transfer-Encoding: chunked\r\nX: 1\r\n", BodyKind.CHUNKED
    )
    assert out == b"HTTP/1.1 200 OK\r\nX: 1\r\nConnection: close\r\n\r\n"


def test_error_response_to_head_has_no_body() -> None:
    session = new_session(b"HEAD / HTTP/1.1\r\nHost: h\r\n\r\n")
    drain(session)
    out = session.send_error(502, "upstream gone")
    assert out.endswith(b"Connection: close\r\n\r\n")
    assert not session.keep_alive


def test_upgrade_hands_over_the_bytes_after_the_head() -> None:
    session = new_session(
        b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"\r\n\x81\x05hello"
    )
    events = drain(session)
    assert isinstance(events[0], Request)
    assert events[0].head.upgrade
    session.send_informational(101, b"Switching Protocols", [])
    assert session.phase is Phase.SWITCHED
    assert session.trailing_data == b"\x81\x05hello"


# -- h11 as the oracle ----------------------------------------------------------


def h11_requests(
    data: bytes,
) -> list[tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]]]]:
    """(method, target, body, trailers) of each complete request h11 reads."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    out = []
    method = target = body = b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Request):
            method, target, body = event.method, event.target, b""
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            trailers = [(n, v) for n, v in event.headers.raw_items()]
            out.append((method, target, body, trailers))
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
                return out
            conn.send(
                h11.Response(status_code=200, headers=[(b"Content-Length", b"0")])
            )
            conn.send(h11.EndOfMessage())
            conn.start_next_cycle()
        else:
            return out


def ours(
    data: bytes, cuts: list[int]
) -> list[tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]]]]:
    session = new_session()
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    out = []
    current: list[Event] = []
    for piece in pieces:
        if not piece:
            continue  # b"" would mean EOF
        session.receive_data(piece)
        while True:
            event = session.next_event()
            if event is NEED_DATA:
                break
            current.append(event)
            if isinstance(event, EndOfBody):
                request = current[0]
                assert isinstance(request, Request)
                head = request.head
                out.append((head.method, head.target, body_of(current), event.trailers))
                current = []
                session.send_response(
                    200, b"OK", b"Content-Length: 0\r\n", BodyKind.LENGTH
                )
                session.send_end([])
                if not session.keep_alive:
                    return out
                session.start_next_cycle()
    return out


# Valid variations in chunked framing: leading zeros, chunk extensions (token
# or quoted values), trailer fields with OWS or none.
zeros = st.sampled_from([b"", b"", b"0", b"000"])
extensions = st.sampled_from([b"", b"", b";a", b";a=b", b';a="q \\" ;"', b";x=1;y"])
trailers = st.sampled_from(
    [b"", b"X-Check: ok\r\n", b"X-Check:ok \r\nX-B:\t\r\n", b"A: 1\r\nA: 2\r\n"]
)


@st.composite
def request_streams(draw: st.DrawFn) -> bytes:
    out = b""
    for index in range(draw(st.integers(1, 3))):
        body = draw(st.binary(max_size=40))
        method = draw(st.sampled_from([b"GET", b"POST", b"PUT"]))
        head = method + b" /%d HTTP/1.1\r\nHost: example.com\r\n" % index
        if draw(st.booleans()):
            sizes = draw(st.lists(st.integers(1, 9), max_size=4))
            chunks, rest = b"", body
            for size in sizes:
                piece, rest = rest[:size], rest[size:]
                if piece:
                    chunks += b"%s%x%s\r\n%b\r\n" % (
                        draw(zeros),
                        len(piece),
                        draw(extensions),
                        piece,
                    )
            if rest:
                chunks += b"%X\r\n%b\r\n" % (len(rest), rest)
            trailer = draw(trailers)
            coding = draw(st.sampled_from([b"chunked", b"Chunked", b"chunked "]))
            out += (
                head
                + b"Transfer-Encoding: "
                + coding
                + b"\r\n\r\n"
                + chunks
                + draw(zeros)
                + b"0"
                + draw(extensions)
                + b"\r\n"
                + trailer
                + b"\r\n"
            )
        else:
            length = draw(zeros) + b"%d" % len(body)
            out += head + b"Content-Length: %s\r\n\r\n" % length + body
    return out


@given(request_streams(), st.lists(st.integers(0, 400), max_size=5))
def test_request_streams_split_anywhere_agree_with_h11(
    data: bytes, cuts: list[int]
) -> None:
    cuts = sorted({min(c, len(data)) for c in cuts})
    assert ours(data, cuts) == h11_requests(data)


REQUEST_PIECES = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(
        [
            b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n",
            b"PUT / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"5\r\nhello\r\n",
            b"0\r\nX: y\r\n\r\n",
            b"\r\n",
            b"GET / HTTP/1.0\r\n\r\n",
        ]
    ),
)


@given(st.lists(REQUEST_PIECES, max_size=8), st.booleans())
def test_any_bytes_give_events_or_a_refusal(pieces: list[bytes], eof: bool) -> None:
    # Whatever a client sends, the session answers with events, NEED_DATA, a
    # RequestRejectedError or (EOF inside a body) ClientClosedMidRequestError:
    # never another exception, never a loop that does not end.
    session = new_session(max_header_bytes=512, max_headers=8, max_body_size=256)
    feeds = [p for p in pieces if p] + ([b""] if eof else [])
    try:
        for piece in feeds:
            session.receive_data(piece)
            for _ in range(1000):
                event = session.next_event()
                if event is NEED_DATA or isinstance(event, ConnectionClosed):
                    break
                if isinstance(event, EndOfBody):
                    session.send_response(200, b"OK", b"", BodyKind.NONE)
                    session.send_end([])
                    if not session.keep_alive:
                        return
                    session.start_next_cycle()
            else:
                raise AssertionError("next_event never asked for more data")
    except (RequestRejectedError, ClientClosedMidRequestError):
        pass
