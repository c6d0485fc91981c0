"""The gate (`tlsedge._http.gate`): what it refuses, and the differential
property that HTTP/2 requests reach an upstream exactly as their HTTP/1.1
equivalents do, or not at all (no sockets; h11 and our HTTP/1.1 parser as the
oracles)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import h11
import pytest
from hypothesis import assume, example, given, settings, strategies as st

from tests.tlsedge.http.test_h2session import Pair
from tests.tlsedge.http.test_head import mutated, request_heads
from tlsedge._core.config import ForwardedConfig
from tlsedge._core.forwarded import FORWARDING_HEADERS, ForwardingContext
from tlsedge._http.body import BodyKind, ChunkedDecoder, encode_chunk
from tlsedge._http.events import NEED_DATA, Body, EndOfBody, Request
from tlsedge._http.exchange import UpstreamExchange
from tlsedge._http.gate import UpstreamRequest, from_http1, from_http2
from tlsedge._http.h2session import (
    MalformedRequestError,
    RequestData,
    RequestEnd,
    StreamOpened,
    check_request,
)
from tlsedge._http.head import RequestRejectedError, parse_request_head
from tlsedge._http.rules import HOP_BY_HOP, RequestRewriter
from tlsedge._http.session import ClientClosedMidRequestError, ClientSession

Header = tuple[bytes, bytes]

REWRITER = RequestRewriter(
    forwarded=ForwardedConfig(forwarded=True),
    context=ForwardingContext(
        client=("192.0.2.7", 40000),
        destination=("10.0.0.1", 443),
        tls=True,
        trusted=False,
    ),
    underscores=False,
)
SERVER = "127.0.0.1:8080"


def gated(
    method: bytes = b"GET",
    target: bytes = b"/",
    fields: Sequence[Header] = ((b"Host", b"h"),),
    body: BodyKind = BodyKind.NONE,
) -> UpstreamRequest:
    return UpstreamRequest(method, target, fields, body)


# -- what the gate refuses -----------------------------------------------------------


def test_a_well_formed_request_is_serialised_once() -> None:
    request = gated(
        b"POST", b"/a?b", [(b"Host", b"h"), (b"Content-Length", b"3")], BodyKind.LENGTH
    )
    assert request.data == b"POST /a?b HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\n"
    assert (request.content_length, request.host) == (3, b"h")
    assert request.head_for(SERVER) is request.data


@pytest.mark.parametrize(
    ("method", "target", "fields", "reason"),
    [
        (b"GET\r\nX: 1", b"/", [], "method 'GET\\r\\nX: 1' is not a token"),
        (b"GET /x HTTP/1.1\r\nHost: a\r\n\r\nGET", b"/", [], "is not a token"),
        (b"G T", b"/", [], "is not a token"),
        (b"G\tT", b"/", [], "is not a token"),
        (b"", b"/", [], "is not a token"),
        (b"GET", b"/a b", [], "request target '/a b'"),
        (b"GET", b"/a\tb", [], "control byte, space or non-ASCII"),
        (b"GET", b"/a\x0bb", [], "control byte"),
        (b"GET", b"/a\x7f", [], "control byte"),
        (b"GET", b"/\x80", [], "non-ASCII"),
        (b"GET", b"/\r\nX: y", [], "request target"),
        (b"GET", b"", [], "empty"),
        (b"GET", b"/", [(b"X Y", b"1")], "field name 'X Y' is not a token"),
        (b"GET", b"/", [(b"X:", b"1")], "is not a token"),
        (b"GET", b"/", [(b"", b"1")], "is not a token"),
        (b"GET", b"/", [(b"X", b"a\r\nEvil: 1")], "field 'X': NUL, CR, LF"),
        (b"GET", b"/", [(b"X", b"a\nb")], "NUL, CR, LF"),
        (b"GET", b"/", [(b"X", b"a\rb")], "NUL, CR, LF"),
        (b"GET", b"/", [(b"X", b"a\x00b")], "NUL, CR, LF"),
        (b"GET", b"/", [(b"X", b"a\x01b")], "another control byte"),
        (b"GET", b"/", [(b"X", b"a\x7fb")], "another control byte"),
        (b"GET", b"/", [(b"X", b" a")], "surrounding whitespace"),
        (b"GET", b"/", [(b"X", b"a\t")], "surrounding whitespace"),
    ],
)
def test_bad_bytes_are_refused_with_the_rule_they_break(
    method: bytes, target: bytes, fields: list[Header], reason: str
) -> None:
    with pytest.raises(RequestRejectedError) as info:
        gated(method, target, [(b"Host", b"h"), *fields])
    assert info.value.status == 400
    assert reason in info.value.reason


@pytest.mark.parametrize(
    ("fields", "body", "reason"),
    [
        ([(b"Content-Length", b"5")], BodyKind.NONE, "Content-Length 5 on a request"),
        ([(b"Transfer-Encoding", b"chunked")], BodyKind.NONE, "Transfer-Encoding"),
        ([], BodyKind.LENGTH, "a sized body without its Content-Length"),
        ([(b"Content-Length", b"0")], BodyKind.LENGTH, "without its Content-Length"),
        ([], BodyKind.CHUNKED, "needs Transfer-Encoding: chunked alone"),
        (
            [(b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"5")],
            BodyKind.CHUNKED,
            "chunked alone",
        ),
        ([(b"Transfer-Encoding", b"gzip, chunked")], BodyKind.CHUNKED, "alone"),
        (
            [(b"Content-Length", b"5"), (b"content-length", b"5")],
            BodyKind.LENGTH,
            "more than one",
        ),
        ([(b"Content-Length", b"+5")], BodyKind.LENGTH, "malformed Content-Length"),
        ([(b"host", b"other")], BodyKind.NONE, "more than one Host"),
    ],
)
def test_framing_must_agree_with_the_body(
    fields: list[Header], body: BodyKind, reason: str
) -> None:
    with pytest.raises(RequestRejectedError) as info:
        gated(b"POST", b"/", [(b"Host", b"h"), *fields], body)
    assert reason in info.value.reason


def test_a_zero_content_length_goes_without_a_body() -> None:
    request = gated(b"POST", b"/", [(b"Host", b"h"), (b"Content-Length", b"0")])
    assert request.content_length == 0


def test_no_host_takes_the_servers_address_and_only_a_valid_one() -> None:
    request = gated(b"GET", b"/", [])
    assert request.host is None
    assert (
        request.head_for("[::1]:8080") == b"GET / HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n"
    )
    with pytest.raises(RequestRejectedError):
        request.head_for("a\r\nb:1")


@pytest.mark.parametrize(
    "trailers",
    [
        [(b"X-Sum", b"1\r\n\r\nGET /evil HTTP/1.1")],
        [(b"X-Sum\r\nEvil", b"1")],
        [(b"X-Sum", b"\x00")],
        [(b"X Sum", b"1")],
    ],
)
def test_trailers_that_would_end_the_body_are_refused(trailers: list[Header]) -> None:
    with pytest.raises(RequestRejectedError) as info:
        UpstreamRequest.last_chunk(trailers)
    assert info.value.reason.startswith("trailer ")


def test_trailers_pass_as_a_trailer_section() -> None:
    assert UpstreamRequest.last_chunk([]) == b"0\r\n\r\n"
    assert UpstreamRequest.last_chunk([(b"X-Sum", b"1")]) == b"0\r\nX-Sum: 1\r\n\r\n"


# -- h2c is never asked of an upstream -------------------------------------------------


def _h1(head: bytes) -> UpstreamRequest:
    return from_http1(
        parse_request_head(head, max_headers=100), REWRITER, max_body_size=0
    )


def test_an_h2c_upgrade_goes_upstream_as_a_plain_request() -> None:
    request = _h1(
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
    )
    assert not request.upgrade
    lowered = request.data.lower()
    assert b"upgrade" not in lowered
    assert b"http2-settings" not in lowered


def test_h2c_is_taken_out_of_an_upgrade_that_names_another_protocol() -> None:
    request = _h1(
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: upgrade\r\n"
        b"Upgrade: h2c, websocket\r\n\r\n"
    )
    assert request.upgrade
    assert b"\r\nUpgrade: websocket\r\n" in request.data
    assert b"h2c" not in request.data
    plain = _h1(
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: upgrade\r\n"
        b"Upgrade: websocket\r\n\r\n"
    )
    assert plain.upgrade
    assert b"\r\nUpgrade: websocket\r\n" in plain.data


def test_an_upgrade_in_an_http10_request_is_ignored() -> None:
    # RFC 9110 section 7.8: a server MUST ignore it (it was forwarded, and a
    # 101 relayed).
    request = _h1(
        b"GET / HTTP/1.0\r\nHost: h\r\nConnection: upgrade\r\n"
        b"Upgrade: websocket\r\n\r\n"
    )
    assert not request.upgrade
    assert b"upgrade" not in request.data.lower()


# -- anything the gate lets through is one request, as it was meant -------------------

_PIECES = st.sampled_from(
    [
        b"a",
        b"Z",
        b"0",
        b"-",
        b"/",
        b"?",
        b":",
        b";",
        b",",
        b"=",
        b"*",
        b" ",
        b"\t",
        b"\r",
        b"\n",
        b"\r\n",
        b"\x00",
        b"\x01",
        b"\x0b",
        b"\x7f",
        b"\x80",
        b"\xff",
        b"\r\nX: 1",
        b" HTTP/1.1\r\nHost: e\r\n\r\nGET /",
        b"\r\n0\r\n\r\n",
        b"chunked",
        b"content-length",
    ]
)
#: Bytes that look like what attackers put in a field: pieces and raw bytes.
JUNK = st.lists(_PIECES, max_size=6).map(b"".join) | st.binary(max_size=12)


def _h11_request(data: bytes) -> tuple[h11.Request, bytes, list[Header]]:
    """*data* through h11 as a server: exactly one request, its body, its
    trailers; nothing left over."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    conn.receive_data(b"")
    request = conn.next_event()
    assert isinstance(request, h11.Request), request
    body = b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Data):
            body += event.data
            continue
        assert isinstance(event, h11.EndOfMessage), event
        break
    assert conn.trailing_data == (b"", True)
    return request, body, [(bytes(n), bytes(v)) for n, v in event.headers]


@given(JUNK, JUNK, st.lists(st.tuples(JUNK, JUNK), max_size=3), st.booleans())
@example(b"GET\r\nX: 1", b"/", [], False)
@example(b"GET", b"/", [(b"X", b"1\r\nContent-Length: 50")], False)
def test_whatever_passes_the_gate_parses_as_the_same_request(
    method: bytes, target: bytes, fields: list[Header], chunked: bool
) -> None:
    body = BodyKind.CHUNKED if chunked else BodyKind.NONE
    fields = [(b"Host", b"h"), *fields]
    if chunked:
        fields.append((b"Transfer-Encoding", b"chunked"))
    try:
        request = UpstreamRequest(method, target, fields, body)
    except RequestRejectedError:
        return
    head = parse_request_head(request.data, max_headers=100)
    assert (head.method, head.target) == (method, target)
    assert head.headers == fields
    framed = request.data + (b"0\r\n\r\n" if chunked else b"")
    parsed, _, _ = _h11_request(framed)
    assert (parsed.method, parsed.target) == (method, target)
    assert [(n, v) for n, v in parsed.headers] == [(n.lower(), v) for n, v in fields]


# -- the differential property: HTTP/2 becomes what HTTP/1.1 becomes, or nothing ------


@dataclass
class H2Case:
    """An HTTP/2 request: its pseudo-headers, fields, body and trailers."""

    method: bytes = b"POST"
    scheme: bytes = b"https"
    authority: bytes = b"example.test"
    path: bytes = b"/p?q=1"
    fields: list[Header] = field(
        default_factory=lambda: [(b"accept", b"*/*"), (b"x-a", b"1")]
    )
    body: bytes = b""
    trailers: list[Header] = field(default_factory=list)

    @property
    def sized(self) -> bool:
        return any(name == b"content-length" for name, _ in self.fields)


@st.composite
def h2_cases(draw: st.DrawFn) -> H2Case:
    """A valid HTTP/2 request with junk in one pseudo-header, field, trailer,
    content-length, cookie crumb or te."""
    case = H2Case(body=draw(st.sampled_from([b"", b"hello"])))
    if draw(st.booleans()):
        case.trailers.append((b"x-sum", b"7"))
    where = draw(
        st.sampled_from(
            [
                "method",
                "scheme",
                "authority",
                "path",
                "name",
                "value",
                "tname",
                "tvalue",
                "length",
                "sized",
                "cookie",
                "te",
                "none",
            ]
        )
    )
    junk = draw(JUNK)
    if where == "method":
        case.method = junk
    elif where == "scheme":
        case.scheme = junk
    elif where == "authority":
        case.authority = junk
    elif where == "path":
        case.path = draw(st.sampled_from([b"", b"/"])) + junk
    elif where == "name":
        case.fields.insert(1, (junk, b"v"))
    elif where == "value":
        case.fields.insert(1, (b"x-junk", junk))
    elif where == "tname":
        case.trailers.append((junk, b"v"))
    elif where == "tvalue":
        case.trailers.append((b"x-junk", junk))
    elif where == "length":
        digits = st.sampled_from([b"0", b"3", b"5", b"6", b"50", b"+5", b"5, 5"])
        case.fields.append((b"content-length", draw(digits | JUNK)))
    elif where == "sized":
        case.fields.append((b"content-length", str(len(case.body)).encode()))
    elif where == "cookie":  # crumbs, joined on their way to HTTP/1.1
        crumbs = draw(
            st.lists(st.sampled_from([b"a=1", b"b=2", b""]) | JUNK, max_size=3)
        )
        case.fields[1:1] = [(b"cookie", crumb) for crumb in [junk, *crumbs]]
    elif where == "te":
        te = draw(st.sampled_from([b"trailers", b"Trailers", b"gzip"]) | JUNK)
        case.fields.append((b"te", te))
    if case.sized:
        case.trailers = []  # a sized body carries no trailers upstream
    return case


def _upstream_bytes(
    request: UpstreamRequest, body: list[bytes], trailers: list[Header]
) -> bytes:
    """What the exchange sends for *request*, its body pieces and its end."""
    exchange = UpstreamExchange(request)
    out = exchange.request_head(SERVER)
    if not exchange.request_complete:
        out += b"".join(exchange.request_data(piece) for piece in body)
        out += exchange.request_end(REWRITER.clean_trailers(trailers))
    return out


def via_http2(case: H2Case) -> bytes | None:
    """What goes upstream for *case* sent over HTTP/2; None: refused."""
    pair = Pair()
    pair.flush()
    pseudo = [
        (b":method", case.method),
        (b":scheme", case.scheme),
        (b":authority", case.authority),
        (b":path", case.path),
    ]
    try:
        sid = pair.request(
            [*pseudo, *case.fields], end_stream=not case.body and not case.trailers
        )
        if case.body:
            pair.client.send_data(sid, case.body, end_stream=not case.trailers)
        if case.trailers:
            pair.client.send_headers(sid, case.trailers, end_stream=True)
    except Exception:  # noqa: BLE001 (h2 will not even encode it)
        assume(False)
    events = pair.flush()
    if not events or not isinstance(events[0], StreamOpened) or events[0].error:
        return None
    pieces = [e.data for e in events if isinstance(e, RequestData)]
    ends = [e for e in events if isinstance(e, RequestEnd)]
    if len(ends) != 1:
        return None  # malformed (reset) mid-stream
    try:
        gated_request = from_http2(events[0].request, REWRITER, max_body_size=0)
        return _upstream_bytes(gated_request, pieces, ends[0].trailers)
    except RequestRejectedError:
        return None


def via_http1(case: H2Case) -> bytes | None:
    """What goes upstream for the same request sent over HTTP/1.1."""
    chunked = not case.sized and bool(case.body or case.trailers)
    # HTTP/2 cookie crumbs are one field to HTTP/1.1 (RFC 9113 8.2.3), last.
    fields = [f for f in case.fields if f[0] != b"cookie"]
    cookies = [value for name, value in case.fields if name == b"cookie"]
    if cookies:
        fields.append((b"cookie", b"; ".join(cookies)))
    lines = [
        case.method + b" " + case.path + b" HTTP/1.1",
        b"host: " + case.authority,
        *[name + b": " + value for name, value in fields],
        *([b"transfer-encoding: chunked"] if chunked else []),
    ]
    data = b"\r\n".join(lines) + b"\r\n\r\n"
    if chunked:
        data += (encode_chunk(case.body) if case.body else b"") + b"0\r\n"
        data += b"".join(n + b": " + v + b"\r\n" for n, v in case.trailers) + b"\r\n"
    else:
        data += case.body
    session = ClientSession(max_header_bytes=65536, max_headers=100)
    session.receive_data(data)
    try:
        first = session.next_event()
        assert isinstance(first, Request)
        gated_request = from_http1(first.head, REWRITER, max_body_size=0)
        pieces: list[bytes] = []
        while True:
            event = session.next_event()
            if isinstance(event, Body):
                pieces.append(event.data)
                continue
            if event is NEED_DATA:
                return None  # a Content-Length the body does not reach
            assert isinstance(event, EndOfBody), event
            return _upstream_bytes(gated_request, pieces, event.trailers)
    except RequestRejectedError:
        return None


@settings(max_examples=1500)
@given(h2_cases())
@example(H2Case(method=b"GET\r\nX: 1", path=b"/"))
@example(H2Case(fields=[(b"content-length", b"5")]))
@example(H2Case(body=b"abc", trailers=[(b"x-sum", b"1\r\n\r\nGET /x HTTP/1.1")]))
def test_http2_goes_upstream_as_its_http11_equivalent_or_not_at_all(
    case: H2Case,
) -> None:
    over_http2 = via_http2(case)
    if over_http2 is None:
        return  # refused: a reset or an error answer, nothing upstream
    assert via_http1(case) == over_http2
    # ... and it is one request, meaning what the client sent.
    end = over_http2.index(b"\r\n\r\n") + 4
    head = parse_request_head(over_http2[:end], max_headers=200)
    assert (head.method, head.target) == (case.method, case.path)
    parsed, body, trailers = _h11_request(over_http2)
    assert parsed.method == case.method
    assert body == case.body
    sent = list(parsed.headers)
    for name, value in case.fields:
        # What the rules drop from everyone: hop-by-hop fields, forwarding
        # fields from an untrusted client, names with "_"
        # (underscores_in_headers is off); cookie crumbs arrive joined.
        dropped = (
            name in HOP_BY_HOP
            or name in FORWARDING_HEADERS
            or b"_" in name
            or name == b"cookie"
        )
        if not dropped:
            assert (name, value) in sent
    if b"\r\ntransfer-encoding: chunked\r\n" in over_http2[:end]:
        assert trailers == REWRITER.clean_trailers(case.trailers)
        decoder = ChunkedDecoder(max_trailer_bytes=65536, max_trailers=100)
        assert b"".join(decoder.feed(over_http2[end:])) == body
        assert decoder.done
        assert decoder.excess == 0


# -- the spliced head is the split-and-written one --------------------------------

_SPLICE_NAMES = st.sampled_from(
    [
        b"Accept",
        b"x-a",
        b"X_A",
        b"Connection",
        b"Keep-Alive",
        b"TE",
        b"Upgrade",
        b"Proxy-Connection",
        b"HTTP2-Settings",
        b"X-Forwarded-For",
        b"x_forwarded_for",
        b"X-Forwarded_Proto",
        b"X-Forwarded-Port",
        b"X-Forwarded-Host",
        b"X-Real-IP",
        b"Forwarded",
        b"X-Request-Id",
        b"x_request_id",
        b"Cookie",
        b"Content-Type",
        b"close",
        b"Trailer",
    ]
)
_SPLICE_VALUES = st.sampled_from(
    [b"1", b"a b", b"close", b"keep-alive", b"x-a, close", b"X_A", b"1.2.3.4", b""]
)


@st.composite
def spliceable_heads(draw: st.DrawFn) -> bytes:
    """Request heads as clients write them (any OWS), the field names the
    proxy acts on among others."""
    fields = draw(st.lists(st.tuples(_SPLICE_NAMES, _SPLICE_VALUES), max_size=8))
    lines = b"".join(
        name
        + draw(st.sampled_from([b": ", b":", b":  ", b":\t"]))
        + value
        + draw(st.sampled_from([b"", b" ", b"\t"]))
        + b"\r\n"
        for name, value in fields
    )
    target = draw(st.sampled_from([b"/", b"/a?b=c", b"*"]))
    method = b"OPTIONS" if target == b"*" else draw(st.sampled_from([b"GET", b"PUT"]))
    version = draw(st.sampled_from([b"1.1", b"1.0"]))
    host = b"Host: h.test\r\n" if version == b"1.1" or draw(st.booleans()) else b""
    return b"%s %s HTTP/%s\r\n%s%s\r\n" % (method, target, version, host, lines)


@given(
    spliceable_heads(),
    st.builds(
        ForwardedConfig,
        x_forwarded_for=st.booleans(),
        x_forwarded_proto=st.booleans(),
        x_forwarded_port=st.booleans(),
        forwarded=st.booleans(),
        request_id=st.sampled_from(["", "X-Request-Id"]),
    ),
    st.booleans(),
)
def test_a_spliced_head_carries_the_fields_the_written_one_does(
    data: bytes, forwarded: ForwardedConfig, underscores: bool
) -> None:
    try:
        head = parse_request_head(data, max_headers=100)
    except RequestRejectedError:
        return
    rewriter = RequestRewriter(
        forwarded=forwarded, context=REWRITER.context, underscores=underscores
    )
    request = from_http1(head, rewriter, max_body_size=0)
    fields, _ = rewriter.head_fields(
        head.headers,
        connection=head.connection,
        upgrade=False,
        authority=None,
        host=head.host,
    )
    sent = parse_request_head(request.head_for(SERVER), max_headers=200)
    rid = forwarded.request_id.encode()
    if request.request_id is not None:  # a fresh id each way: compare the rest
        assert (rid, request.request_id) in sent.headers
    assert [f for f in sent.headers if f[0] != rid] == [
        f for f in fields if f[0] != rid
    ] + ([(b"Host", SERVER.encode())] if head.host is None else [])
    assert (sent.method, sent.target, sent.content_length) == (
        head.method,
        head.target,
        head.content_length,
    )


@given(
    st.lists(st.tuples(_SPLICE_NAMES.map(bytes.lower), _SPLICE_VALUES), max_size=8),
    st.tuples(
        st.sampled_from([[], [(b"content-length", b"0")], [(b"content-length", b"7")]]),
        st.booleans(),
    ),
    st.sampled_from([(b"GET", b"/"), (b"POST", b"/a?b=c"), (b"OPTIONS", b"*")]),
    st.builds(
        ForwardedConfig,
        x_forwarded_for=st.booleans(),
        x_forwarded_proto=st.booleans(),
        x_forwarded_port=st.booleans(),
        forwarded=st.booleans(),
        request_id=st.sampled_from(["", "X-Request-Id"]),
    ),
    st.booleans(),
)
def test_a_spliced_http2_head_is_the_written_one(
    fields: list[Header],
    framing: tuple[list[Header], bool],
    request_line: tuple[bytes, bytes],
    forwarded: ForwardedConfig,
    underscores: bool,
) -> None:
    length, end_stream = framing
    method, path = request_line
    pseudo = [
        (b":method", method),
        (b":scheme", b"https"),
        (b":authority", b"h.test"),
        (b":path", path),
    ]
    try:
        request = check_request([*pseudo, *fields, *length], end_stream=end_stream)
    except MalformedRequestError:
        return
    rewriter = RequestRewriter(
        forwarded=forwarded, context=REWRITER.context, underscores=underscores
    )
    spliced = from_http2(request, rewriter, max_body_size=0)
    chunked = (
        [(b"transfer-encoding", b"chunked")] if spliced.body is BodyKind.CHUNKED else []
    )
    written_fields, _ = rewriter.head_fields(
        [*request.headers, *chunked],
        connection=frozenset(),
        upgrade=False,
        authority=None,
        host=request.host,
    )
    rid = forwarded.request_id.encode()
    if spliced.request_id is not None:  # a fresh id each way: the spliced one
        written_fields = [
            (n, spliced.request_id if n == rid else v) for n, v in written_fields
        ]
    written = UpstreamRequest(
        method,
        path,
        written_fields,
        spliced.body,
        request_id=spliced.request_id,
    )
    assert spliced.data == written.data
    assert (spliced.content_length, spliced.host, spliced.upgrade) == (
        written.content_length,
        written.host,
        written.upgrade,
    )


# -- HTTP/1.1: what goes upstream is the request the session read ------------------

_BODIES = st.sampled_from(
    [
        b"",
        b"hello",
        b"5\r\nhello\r\n0\r\n\r\n",
        b"3;a=b\r\nabc\r\n0\r\nT: 1\r\nX_Forwarded_For: 1\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n",
    ]
) | st.binary(max_size=20)


def read_by_the_session(
    data: bytes,
) -> tuple[Request, list[bytes], list[Header]] | None:
    """The first request in *data* (the client then closes), its body pieces
    and trailers, as the session reads them; None: refused or cut short."""
    session = ClientSession(max_header_bytes=65536, max_headers=100)
    session.receive_data(data)
    session.receive_data(b"")
    pieces: list[bytes] = []
    try:
        request = session.next_event()
        if not isinstance(request, Request):
            return None
        while isinstance(event := session.next_event(), Body):
            pieces.append(event.data)
    except (RequestRejectedError, ClientClosedMidRequestError):
        return None
    assert isinstance(event, EndOfBody), event
    return request, pieces, event.trailers


@given(st.one_of(request_heads(), mutated(request_heads())), _BODIES)
@example(
    b"GET / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"3;a=b\r\nabc\r\n0\r\nT: 1\r\nX_Forwarded_For: 1\r\n\r\n",
)
def test_an_http11_request_goes_upstream_as_the_session_read_it(
    head: bytes, body: bytes
) -> None:
    # h11 as the upstream: exactly one request (nothing left over), with the
    # method, the target and the body the session read, and its trailers
    # cleaned: whatever the client's head and body, no second request.
    read = read_by_the_session(head + body)
    if read is None:
        return
    request, pieces, trailers = read
    try:
        upstream = from_http1(request.head, REWRITER, max_body_size=0)
    except RequestRejectedError:
        return
    sent = _upstream_bytes(upstream, pieces, REWRITER.clean_trailers(trailers))
    parsed, data, upstream_trailers = _h11_request(sent)
    assert parsed.method == request.head.method
    assert data == b"".join(pieces)
    if upstream.body is BodyKind.CHUNKED:  # (h11 gives names lowercased)
        cleaned = REWRITER.clean_trailers(trailers)
        assert upstream_trailers == [(n.lower(), v) for n, v in cleaned]
