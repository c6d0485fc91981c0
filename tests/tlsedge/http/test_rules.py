"""The proxy's rules on field lines (`tlsedge._http.rules`), against the rules on
split fields they must agree with."""

from __future__ import annotations

from hypothesis import example, given, strategies as st

from tests.tlsedge.http.test_head import mutated, response_heads
from tlsedge._http.body import BodyKind, encode_field_lines
from tlsedge._http.head import (
    ResponseHead,
    ResponseRejectedError,
    parse_response_head,
)
from tlsedge._http.rules import end_to_end_fields, reason_phrase, strip_hop_by_hop
from tlsedge._http.session import ClientSession

# Hop-by-hop names, names a Connection field may name, framing, others; any case.
_NAMES = st.sampled_from(
    [
        b"Connection",
        b"connection",
        b"Keep-Alive",
        b"TE",
        b"Upgrade",
        b"Proxy-Connection",
        b"X-A",
        b"x-a",
        b"Close",
        b"Content-Type",
        b"Host",
        b"Server",
        b"X-Trailing",
    ]
)
# Values as we write them, and with the OWS and emptiness a peer may send.
_AS_WRITTEN = st.sampled_from([b"v", b"a b", b"5", b"a\tb"])
_ANY_VALUES = _AS_WRITTEN | st.sampled_from([b"", b" v", b"v ", b"\tv\t", b"  v"])
_CONNECTION = st.lists(
    st.sampled_from(
        [b"close", b"keep-alive", b"X-A", b"upgrade", b"host", b"content-length"]
    ),
    max_size=3,
).map(b", ".join)


@st.composite
def response_field_lines(draw: st.DrawFn) -> bytes:
    # Half the heads as we write them (the lines are kept), half as they come.
    as_written = draw(st.booleans())
    values = _AS_WRITTEN if as_written else _ANY_VALUES
    fields = draw(st.lists(st.tuples(_NAMES, values), max_size=6))
    if draw(st.booleans()):
        fields.insert(0, (b"Connection", draw(_CONNECTION)))
    if draw(st.booleans()):
        fields.insert(draw(st.integers(0, len(fields))), (b"Content-Length", b"5"))
    separator = b": " if as_written else draw(st.sampled_from([b": ", b":", b":  "]))
    return b"".join(name + separator + value + b"\r\n" for name, value in fields)


@given(response_field_lines(), st.booleans())
def test_end_to_end_fields_are_the_stripped_fields_encoded(
    lines: bytes, keep_upgrade: bool
) -> None:
    head = parse_response_head(
        b"HTTP/1.1 200 OK\r\n" + lines + b"\r\n", max_headers=100
    )
    expected = encode_field_lines(
        strip_hop_by_hop(
            head.headers, keep_upgrade=keep_upgrade, connection=head.connection
        )
    )
    assert end_to_end_fields(head, keep_upgrade=keep_upgrade) == expected


def test_end_to_end_fields_cut_only_hop_by_hop_lines() -> None:
    lines = (
        b"Server: nginx\r\nConnection: keep-alive, X-C\r\nKeep-Alive: timeout=5\r\n"
        b"Content-Length: 6\r\nUpgrade: h2c\r\nX-B: 2\r\n"
    )
    head = parse_response_head(
        b"HTTP/1.1 200 OK\r\n" + lines + b"\r\n", max_headers=100
    )
    assert end_to_end_fields(head, keep_upgrade=False) == (
        b"Server: nginx\r\nContent-Length: 6\r\nX-B: 2\r\n"
    )
    assert end_to_end_fields(head, keep_upgrade=True) == (
        b"Server: nginx\r\nContent-Length: 6\r\nUpgrade: h2c\r\nX-B: 2\r\n"
        b"Connection: upgrade\r\n"
    )
    # A field Connection names goes too; OWS other than one SP is written as
    # we write it (the fields are split).
    spaced = parse_response_head(
        b"HTTP/1.1 200 OK\r\nServer:nginx \r\nX-Empty: \r\nTE: x\r\n"
        b"Connection: x-a\r\nX-A: 1\r\n\r\n",
        max_headers=100,
    )
    assert end_to_end_fields(spaced, keep_upgrade=False) == (
        b"Server: nginx\r\nX-Empty: \r\n"
    )


# -- the spliced response head --------------------------------------------------

# A field line that keeps a head off the spliced path (OWS as we do not write
# it) and changes nothing else: once split and written again, ``X-Pad: v``.
_PAD = b"X-Pad:  v \r\n"


def _parsed(head: bytes) -> ResponseHead | str:
    try:
        return parse_response_head(head, max_headers=100)
    except ResponseRejectedError as exc:
        return exc.reason


def _client_bytes(
    head: ResponseHead, request: bytes, *, spliced: bool, close: bool
) -> bytes:
    """What the driver writes to a client that sent *request* (`_response_head`)."""
    session = ClientSession(max_header_bytes=8192, max_headers=50)
    session.receive_data(request)
    session.next_event()
    body = (
        BodyKind.CHUNKED
        if head.chunked
        else BodyKind.UNTIL_CLOSE
        if head.content_length is None
        else BodyKind.LENGTH
    )
    if spliced:
        assert head.forward is not None
        return session.send_response_head(head.forward, head.status, body, close=close)
    return session.send_response(
        head.status,
        reason_phrase(head.status, head.reason),
        end_to_end_fields(head, keep_upgrade=False),
        body,
        close=close,
    )


@st.composite
def spliceable_heads(draw: st.DrawFn) -> bytes:
    status = draw(st.sampled_from([b"200 OK", b"404 Not Found", b"204 X", b"101 S"]))
    return b"HTTP/1.1 " + status + b"\r\n" + draw(response_field_lines()) + b"\r\n"


@given(
    st.one_of(spliceable_heads(), response_heads(), mutated(response_heads())),
    st.sampled_from(
        [
            b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
            b"HEAD / HTTP/1.1\r\nHost: h\r\n\r\n",
            b"GET / HTTP/1.0\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        ]
    ),
    st.booleans(),
)
@example(
    b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 6\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
    False,
)
def test_spliced_response_head_is_the_parsed_one(
    head: bytes, request: bytes, close: bool
) -> None:
    """A head that takes the spliced path (``forward``) gets the verdict,
    the framing and, to the client, the bytes the written path gives it: the
    same head with a line that keeps it off the spliced path is its oracle."""
    spliced, written = _parsed(head), _parsed(head[:-2] + _PAD + b"\r\n")
    if isinstance(spliced, str) or isinstance(written, str):
        assert spliced == written
        return
    assert written.forward is None
    assert written._replace(field_lines=spliced.field_lines) == (
        spliced._replace(forward=None)
    )
    if spliced.forward is None:
        return
    assert spliced.forward + b"X-Pad: v\r\n" == b"HTTP/1.1 %d %b\r\n%b" % (
        written.status,
        reason_phrase(written.status, written.reason),
        end_to_end_fields(written, keep_upgrade=False),
    )
    assert _client_bytes(spliced, request, spliced=True, close=close) == (
        _client_bytes(spliced, request, spliced=False, close=close)
    )
