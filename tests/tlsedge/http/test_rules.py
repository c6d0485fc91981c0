"""The proxy's rules on field lines (`tlsedge._http.rules`), against the rules on
split fields they must agree with."""

from __future__ import annotations

from hypothesis import given, strategies as st

from tlsedge._http.body import encode_field_lines
from tlsedge._http.head import parse_response_head
from tlsedge._http.rules import end_to_end_fields, strip_hop_by_hop

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
