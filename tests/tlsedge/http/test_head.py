"""The strict head parser: unit rules, and h11 as the oracle (differential test).

Every head, valid or mutated, goes to `parse_request_head` and to a fresh
``h11.Connection(h11.SERVER)`` (responses: `parse_response_head` and
``h11.Connection(h11.CLIENT)`` after a GET). Both must give the same verdict,
and when both accept, the same start line, fields and framing. Where we refuse
what h11 accepts, the reason must be one of the deliberate rules listed in
`STRICTER_THAN_H11` (the smuggling defences h11 does not have).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import h11
import pytest
from hypothesis import example, given, strategies as st

from tests.tlsedge.pipeline.http.test_h1 import SMUGGLING_VECTORS
from tlsedge._http.head import (
    RequestHead,
    RequestRejectedError,
    ResponseHead,
    ResponseRejectedError,
    find_head_end,
    parse_request_head,
    parse_response_head,
)

MAX_HEADERS = 100

#: Rules of ours that h11 does not have: h11 accepts these heads, we refuse them.
STRICTER_THAN_H11: frozenset[str] = frozenset(
    {
        # h11 ends lines at a bare LF and keeps a bare CR inside values.
        "bare CR or LF in the request head",
        # h11 allows \x01-\x08, \x0e-\x1f and \x7f in field values.
        "control character in the request head",
        # h11 unfolds obs-fold.
        "obs-fold (header line starts with SP)",
        # h11 takes any HTTP/x.y.
        "only HTTP/1.0 and HTTP/1.1 are served",
        # h11 merges equal repeats and lists ("5, 5"), takes any number of digits.
        "more than one Content-Length",
        "malformed Content-Length",
        # h11 lets Transfer-Encoding win and drops Content-Length.
        "both Content-Length and Transfer-Encoding",
        "Transfer-Encoding in an HTTP/1.0 request",
        # h11 does not look at the Host value.
        "malformed Host",
    }
)
STRICTER_THAN_H11_RESPONSE: frozenset[str] = frozenset(
    {
        "bare CR or LF in the response head",
        "control character in the response head",
        "obs-fold in the response head",
        "more than one Content-Length in the response",
        "malformed Content-Length in the response",
        "both Content-Length and Transfer-Encoding in the response",
        # h11 takes chunked framing from HTTP/1.0 (RFC 9112 section 6.1: faulty).
        "Transfer-Encoding in an HTTP/1.0 response",
        # h11 takes any HTTP/x.y and statuses up to 999.
        "response version HTTP/2.0",
        "response status 600 (expected 100-599)",
        "response status 999 (expected 100-599)",
    }
)


def _h11_request(head: bytes) -> h11.Request | Exception:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
    conn.receive_data(head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        return exc
    assert isinstance(event, h11.Request), event
    return event


def _h11_response(head: bytes) -> h11.Response | h11.InformationalResponse | Exception:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "h")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        return exc
    assert isinstance(event, h11.Response | h11.InformationalResponse), event
    return event


def _framing_of(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """(Content-Length, chunked) as h11's normalised fields declare them."""
    values = dict(headers)
    length = values.get(b"content-length")
    return (None if length is None else int(length)), b"transfer-encoding" in values


def _same_fields(ours: RequestHead | ResponseHead, event: Any) -> None:
    lowered = [
        (name.lower(), value.lower() if name.lower() == b"transfer-encoding" else value)
        for name, value in ours.headers
    ]
    assert lowered == list(event.headers)
    assert ours.version == event.http_version
    assert (ours.content_length, ours.chunked) == _framing_of(list(event.headers))


def _ours_request(head: bytes) -> RequestHead | RequestRejectedError:
    try:
        return parse_request_head(head, max_headers=MAX_HEADERS)
    except RequestRejectedError as exc:
        return exc


def _ours_response(head: bytes) -> ResponseHead | ResponseRejectedError:
    try:
        return parse_response_head(head, max_headers=MAX_HEADERS)
    except ResponseRejectedError as exc:
        return exc


def check_request(head: bytes) -> None:
    """Our verdict and parse agree with h11's, but for the listed stricter rules."""
    theirs, ours = _h11_request(head), _ours_request(head)
    if isinstance(ours, RequestRejectedError):
        if not isinstance(theirs, Exception):
            assert ours.reason in STRICTER_THAN_H11, (ours.reason, head)
        return
    assert not isinstance(theirs, Exception), (theirs, head)
    assert (ours.method, ours.target) == (theirs.method, theirs.target)
    _same_fields(ours, theirs)
    assert ours.host == dict(theirs.headers).get(b"host")


def check_response(head: bytes) -> None:
    """The same for a response head (h11 as a client that sent a GET)."""
    theirs, ours = _h11_response(head), _ours_response(head)
    if isinstance(ours, ResponseRejectedError):
        assert ours.status == 502
        if not isinstance(theirs, Exception):
            assert ours.reason in STRICTER_THAN_H11_RESPONSE, (ours.reason, head)
        return
    assert not isinstance(theirs, Exception), (theirs, head)
    assert (ours.status, ours.reason) == (theirs.status_code, theirs.reason)
    _same_fields(ours, theirs)


# -- generators -------------------------------------------------------------------

_TOKEN_CHARS = (
    "!#$%&'*+.^_`|~-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
# Common names (cheap to draw) or any token.
tokens = st.sampled_from(
    [b"Accept", b"User-Agent", b"Cookie", b"x", b"If-None-Match", b"a!#$%&'*+.^_`|~-"]
) | st.text(_TOKEN_CHARS, min_size=1, max_size=12).map(str.encode)
# Names that are no token (h11 refuses them too): SP or HTAB before the colon,
# separators, non-ASCII, a control byte, nothing.
bad_names = st.sampled_from(
    [b"Host ", b"Content-Length\t", b"X Y", b"a\xe9", b"(x)", b"a\x00", b"", b'a"b']
)
# Field-value bytes: visible ASCII, SP, HTAB, obs-text.
values = st.binary(max_size=24).map(
    lambda b: bytes(c if c >= 0x20 and c != 0x7F else 0x41 for c in b)
) | st.sampled_from([b"", b" a ", b"\ta\t", b"a b", b"\xe9t\xe9", b"\xff\x80"])
# ... and (rarely) with a control byte, a bare CR or LF, an obs-fold, a NUL.
bad_values = st.sampled_from(
    [b"a\x01b", b"\x0b", b"a\x7f", b"a\x00b", b"a\rb", b"a\nb", b"a\r\n b", b"\r\n\tb"]
)
# Each: well-formed values or (as often) the malformed ones of the smuggling tests.
hosts = st.sampled_from(
    [b"example.com", b"h:8080", b"[::1]:443", b"127.0.0.1", b"", b"h:", b"h.:0"]
) | (
    st.sampled_from(
        [b"a b", b"u@h", b"a/b", b"h:123456", b"[::1", b"h:1:2", b"a,b", b"h\xe9"]
    )
)
# Boundary lengths (18 digits is the most we take), and what int() would take.
lengths = st.sampled_from(
    [b"0", b"5", b"007", b" 12 ", b"123456789012345678", b"0" * 18, b"9" * 18]
) | (
    st.sampled_from(
        [
            b"5, 5",
            b"+5",
            b"-5",
            b"0x5",
            b"1 0",
            b"9" * 19,
            b"",
            b"1_0",
            b"5;",
            b"\xd9\xa5",
        ]
    )
)
codings = st.sampled_from([b"chunked", b"Chunked", b"CHUNKED"]) | (
    st.sampled_from(
        [
            b"gzip",
            b"gzip, chunked",
            b'"chunked"',
            b"",
            b"chunked, chunked",
            b"chunked,",
            b",chunked",
            b"chunked;q=1",
            b"identity",
            b"chunked\t",
        ]
    )
)
special = st.one_of(
    st.tuples(st.sampled_from([b"Host", b"host", b"HOST"]), hosts),
    st.tuples(st.sampled_from([b"Content-Length", b"content-length"]), lengths),
    st.tuples(st.sampled_from([b"Transfer-Encoding", b"transfer-encoding"]), codings),
    st.tuples(
        st.sampled_from([b"Connection", b"Upgrade"]),
        st.sampled_from([b"close", b"keep-alive", b"Upgrade, close", b"websocket"]),
    ),
)
# Ordinary fields, and a few framing/routing ones (two may clash), in any order.
# (One draw in 32 has a bad name or value.)
field_pairs = st.integers(0, 31).flatmap(
    lambda n: (
        st.tuples(tokens, values)
        if n
        else st.tuples(bad_names, values) | st.tuples(tokens, bad_values)
    )
)
fields = st.tuples(
    st.lists(field_pairs, max_size=4), st.lists(special, max_size=3)
).flatmap(lambda parts: st.permutations(parts[0] + parts[1]))
targets = st.one_of(
    st.text("abcxyz019/?=&%.-_~", max_size=20).map(lambda t: b"/" + t.encode()),
    st.sampled_from(
        [b"*", b"http://h/p?q", b"https://[::1]:8/", b"h:443", b"/a#f", b"/\xe9", b""]
    ),
)
methods = (
    st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"OPTIONS", b"PATCH"]) | tokens
)
# Mostly served versions; HTTP/2.0, 0.9 and 1.2 are accepted by h11, refused by us.
versions = st.sampled_from(
    [b"1.1", b"1.1", b"1.1", b"1.0", b"1.0", b"2.0", b"0.9", b"1.2", b"1.10", b"1"]
)


def _head(start: bytes, field_list: list[tuple[bytes, bytes]]) -> bytes:
    return (
        start
        + b"\r\n"
        + b"".join(n + b": " + v + b"\r\n" for n, v in field_list)
        + b"\r\n"
    )


@st.composite
def request_heads(draw: st.DrawFn) -> bytes:
    method, target, version = draw(methods), draw(targets), draw(versions)
    field_list = list(draw(fields))
    if version == b"1.1" and draw(st.integers(0, 4)) > 0:
        field_list.insert(draw(st.integers(0, len(field_list))), (b"Host", b"h"))
    return _head(method + b" " + target + b" HTTP/" + version, field_list)


@st.composite
def response_heads(draw: st.DrawFn) -> bytes:
    status = draw(
        st.sampled_from([100, 200, 204, 301, 304, 404, 500, 599, 600, 999, 99])
    )
    reason = draw(st.sampled_from([b" OK", b" Not Found", b" ", b"", b" a\tb \xe9"]))
    version = draw(st.sampled_from([b"1.1", b"1.0", b"2.0"]))
    field_list = [f for f in draw(fields) if f[0].lower() != b"upgrade"]
    return _head(b"HTTP/" + version + b" %03d" % status + reason, field_list)


@st.composite
def mutated(draw: st.DrawFn, heads: st.SearchStrategy[bytes]) -> bytes:
    """A head with a few bytes inserted or replaced, cut at its first CRLFCRLF."""
    data = bytearray(draw(heads))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data) - 1))
        byte = draw(
            st.sampled_from(
                [b"\r", b"\n", b" ", b"\t", b"\x00", b":", b"\x7f", b"\x80", b"\xff"]
            )
            | st.sampled_from([b"\r\n ", b"\r\n\t", b"\r\n", b"\x0b", b"\x1f"])
        )
        if draw(st.booleans()):
            data[at:at] = byte
        else:
            data[at : at + 1] = byte
    # (A head the edits left without a CRLFCRLF gets one appended, and is cut
    # at the first one then: an edit may have left a CRLF or CR at its end.)
    data += b"\r\n\r\n"
    return bytes(data[: find_head_end(data)])


# -- differential tests -----------------------------------------------------------


@given(request_heads())
def test_request_heads_agree_with_h11(head: bytes) -> None:
    check_request(head)


@given(mutated(request_heads()))
@example(b"GET / HTTP/1.1\r\nHost: h\r\nX: a\x01b\r\n\r\n")
def test_mutated_request_heads_agree_with_h11(head: bytes) -> None:
    check_request(head)


@given(response_heads())
def test_response_heads_agree_with_h11(head: bytes) -> None:
    check_response(head)


@given(mutated(response_heads()))
def test_mutated_response_heads_agree_with_h11(head: bytes) -> None:
    check_response(head)


#: Campaign vectors whose head is fine: the chunk scanner refuses their body.
_REFUSED_IN_THE_BODY = frozenset(
    {
        "chunk-0x",
        "chunk-negative",
        "chunk-overflow",
        "chunk-0x-later",
        "chunk-overflow-later",
        "bare-lf-chunk",
        "glued-after-chunk",
        "glued-in-trailer",
    }
)


def _campaign_heads() -> list[Any]:
    """The heads of campaigns/http_clients.py's VECTORS (up to the first CRLFCRLF)."""
    directory = Path(__file__).parents[3] / "campaigns"
    spec = importlib.util.spec_from_file_location(
        "http_clients", directory / "http_clients.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # It imports its sibling `common`: both leave sys.modules afterwards.
    added = {spec.name, "common"} - set(sys.modules)
    sys.path.insert(0, str(directory))
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(directory))
        for name in added:
            sys.modules.pop(name, None)
    heads = []
    for vector in module.VECTORS:
        end = find_head_end(vector.data)
        head = vector.data[:end] if end >= 0 else vector.data + b"\r\n\r\n"
        refused = vector.refused and vector.name not in _REFUSED_IN_THE_BODY
        heads.append(pytest.param(head, refused, id=vector.name))
    return heads


@pytest.mark.parametrize(("head", "refused"), _campaign_heads())
def test_campaign_vectors_agree_with_h11(head: bytes, refused: bool) -> None:
    check_request(head)
    if refused:
        with pytest.raises(RequestRejectedError):
            parse_request_head(head, max_headers=MAX_HEADERS)


@pytest.mark.parametrize(
    "head", [pytest.param(head, id=name) for name, head, _ in SMUGGLING_VECTORS]
)
def test_smuggling_vectors_agree_with_h11(head: bytes) -> None:
    check_request(head)


# -- unit rules -------------------------------------------------------------------


def test_request_head_is_parsed_once_for_the_proxy() -> None:
    head = parse_request_head(
        b"POST /up?x=1 HTTP/1.1\r\nhost: Example.com:8443\r\n"
        b"Content-Length:  12 \r\nConnection: keep-alive, Upgrade\r\n"
        b"Upgrade: websocket\r\nX-Empty:\r\nX-Text: \xe9t\xe9\t\r\n\r\n",
        max_headers=MAX_HEADERS,
    )
    assert (head.method, head.target, head.version) == (b"POST", b"/up?x=1", b"1.1")
    assert head.headers == [
        (b"host", b"Example.com:8443"),
        (b"Content-Length", b"12"),
        (b"Connection", b"keep-alive, Upgrade"),
        (b"Upgrade", b"websocket"),
        (b"X-Empty", b""),
        (b"X-Text", b"\xe9t\xe9"),
    ]
    assert (head.content_length, head.chunked) == (12, False)
    assert head.host == b"Example.com:8443"
    assert head.connection == {b"keep-alive", b"upgrade"}
    assert head.upgrade


def test_request_head_reports_user_agent_and_expect() -> None:
    head = parse_request_head(
        b"PUT / HTTP/1.1\r\nuser-agent:  curl/8 \r\nHost: h\r\nUser-Agent: x\r\n"
        b"Expect: 100-continue\r\nEXPECT: 100-Continue\t\r\n\r\n",
        max_headers=MAX_HEADERS,
    )
    # The first User-Agent, the last Expect (what the session acts on).
    assert (head.user_agent, head.expect) == (b"curl/8", b"100-Continue")
    plain = parse_request_head(b"GET / HTTP/1.0\r\n\r\n", max_headers=1)
    assert (plain.user_agent, plain.expect) == (None, None)


def test_request_framing_and_defaults() -> None:
    chunked = parse_request_head(
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: Chunked\r\n\r\n",
        max_headers=MAX_HEADERS,
    )
    assert (chunked.content_length, chunked.chunked) == (None, True)
    plain = parse_request_head(b"GET * HTTP/1.0\r\n\r\n", max_headers=MAX_HEADERS)
    assert (plain.content_length, plain.chunked, plain.host) == (None, False, None)
    assert (plain.headers, plain.connection, plain.upgrade) == ([], frozenset(), False)
    assert plain.version == b"1.0"


_H = b"Host: h\r\n"
REQUEST_RULES: list[tuple[bytes, int, str]] = [
    (
        b"GET / HTTP/1.1\r\n" + _H + b"X: a\rb\r\n\r\n",
        400,
        "bare CR or LF in the request head",
    ),
    (b"GET / HTTP/1.1\n" + _H + b"\r\n", 400, "bare CR or LF in the request head"),
    (
        b"GET / HTTP/1.1\r\n" + _H + b"X: \x7f\r\n\r\n",
        400,
        "control character in the request head",
    ),
    (
        b"GET /\x01 HTTP/1.1\r\n" + _H + b"\r\n",
        400,
        "control character in the request head",
    ),
    (b"GET / HTTP/1.1 \r\n" + _H + b"\r\n", 400, "malformed request line"),
    (b"GET /\xe9 HTTP/1.1\r\n" + _H + b"\r\n", 400, "malformed request line"),
    (b"get / http/1.1\r\n" + _H + b"\r\n", 400, "malformed request line"),
    (
        b"GET / HTTP/1.2\r\n" + _H + b"\r\n",
        505,
        "only HTTP/1.0 and HTTP/1.1 are served",
    ),
    (
        b"GET / HTTP/0.9\r\n" + _H + b"X\r\n\r\n",
        505,
        "only HTTP/1.0 and HTTP/1.1 are served",
    ),
    (b"GET / HTTP/1.1\r\n" + _H * 3 + b"X\r\n\r\n", 431, "more than 3 header fields"),
    (
        b"GET / HTTP/1.1\r\n" + _H + b"X: a\r\n\tb\r\n\r\n",
        400,
        "obs-fold (header line starts with SP)",
    ),
    (b"GET / HTTP/1.1\r\n" + _H + b"X a\r\n\r\n", 400, "malformed header field"),
    (b"GET / HTTP/1.1\r\n" + _H + b"X\t: a\r\n\r\n", 400, "malformed header field"),
    (b"GET / HTTP/1.1\r\n" + _H + b": a\r\n\r\n", 400, "malformed header field"),
    # The first line that breaks a rule names it (as check_request_head did).
    (b"GET / HTTP/1.1\r\n" + _H + b"X a\r\n b\r\n\r\n", 400, "malformed header field"),
    (
        b"POST / HTTP/1.1\r\n" + _H + b"Content-Length: 1\r\ncontent-length: 1\r\n\r\n",
        400,
        "more than one Content-Length",
    ),
    (
        b"POST / HTTP/1.1\r\n" + _H + b"Content-Length: \r\n\r\n",
        400,
        "malformed Content-Length",
    ),
    (
        b"POST / HTTP/1.1\r\n" + _H + b"Content-Length: 1234567890123456789\r\n\r\n",
        400,
        "malformed Content-Length",
    ),
    (
        b"POST / HTTP/1.1\r\n"
        + _H
        + b"Transfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n",
        400,
        "both Content-Length and Transfer-Encoding",
    ),
    (
        b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
        400,
        "Transfer-Encoding in an HTTP/1.0 request",
    ),
    (
        b"POST / HTTP/1.1\r\n"
        + _H
        + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
        400,
        "more than one Transfer-Encoding",
    ),
    (
        b"POST / HTTP/1.1\r\n" + _H + b"Transfer-Encoding: chunked, gzip\r\n\r\n",
        501,
        "transfer coding other than chunked",
    ),
    (
        b"POST / HTTP/1.1\r\n" + _H + b"Transfer-Encoding: chunked;q=1\r\n\r\n",
        400,
        "malformed Transfer-Encoding",
    ),
    (b"GET / HTTP/1.1\r\n" + _H + b"host: h\r\n\r\n", 400, "more than one Host"),
    (b"GET / HTTP/1.1\r\n\r\n", 400, "HTTP/1.1 request without Host"),
    (b"GET / HTTP/1.0\r\nHost: h:123456\r\n\r\n", 400, "malformed Host"),
]


@pytest.mark.parametrize(("head", "status", "reason"), REQUEST_RULES)
def test_request_rule(head: bytes, status: int, reason: str) -> None:
    with pytest.raises(RequestRejectedError) as info:
        parse_request_head(head, max_headers=3)
    assert (info.value.status, info.value.reason) == (status, reason)
    check_request(head)


def test_response_head_is_parsed() -> None:
    head = parse_response_head(
        b"HTTP/1.0 404 Not  Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\n",
        max_headers=MAX_HEADERS,
    )
    assert (head.version, head.status, head.reason) == (b"1.0", 404, b"Not  Found")
    assert head.headers == [(b"Content-Length", b"9"), (b"Connection", b"close")]
    assert head.field_lines == b"Content-Length: 9\r\nConnection: close\r\n"
    assert (head.content_length, head.chunked, head.connection) == (
        9,
        False,
        frozenset({b"close"}),
    )
    chunked = parse_response_head(
        b"HTTP/1.1 200\r\nTransfer-Encoding: chunked\r\n\r\n", max_headers=MAX_HEADERS
    )
    assert (chunked.status, chunked.reason, chunked.chunked) == (200, b"", True)
    early = parse_response_head(b"HTTP/1.1 103 Early Hints\r\n\r\n", max_headers=1)
    assert (early.status, early.content_length, early.chunked) == (103, None, False)


RESPONSE_RULES: list[tuple[bytes, str]] = [
    (b"HTTP/1.1 200 OK\n\n", "bare CR or LF in the response head"),
    (b"HTTP/1.1 200 OK\r\nX: \x00\r\n\r\n", "control character in the response head"),
    (b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n", "obs-fold in the response head"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed status line"),
    (b"HTTP/1.1 200 OK\r\nX a\r\n\r\n", "malformed response header field"),
    (
        b"HTTP/1.1 200 OK\r\nX: 1\r\nY: 2\r\nZ: 3\r\n\r\n",
        "more than 2 response header fields",
    ),
    (b"HTTP/2.0 200 OK\r\n\r\n", "response version HTTP/2.0"),
    (b"HTTP/1.1 099 Odd\r\n\r\n", "response status 99 (expected 100-599)"),
    (b"HTTP/1.1 600 Odd\r\n\r\n", "response status 600 (expected 100-599)"),
    (
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
        "more than one Content-Length in the response",
    ),
    (
        b"HTTP/1.1 200 OK\r\nContent-Length: 1,1\r\n\r\n",
        "malformed Content-Length in the response",
    ),
    (
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        "both Content-Length and Transfer-Encoding in the response",
    ),
    (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        "response Transfer-Encoding other than a single 'chunked'",
    ),
]


@pytest.mark.parametrize(("head", "reason"), RESPONSE_RULES)
def test_response_rule(head: bytes, reason: str) -> None:
    with pytest.raises(ResponseRejectedError) as info:
        parse_response_head(head, max_headers=2)
    assert (info.value.status, info.value.reason) == (502, reason)
