"""Forwarding-header rewriting (sans-IO)."""

from __future__ import annotations

from ipaddress import ip_network

import pytest
from hypothesis import given, strategies as st

from tlsedge._config import ForwardedConfig
from tlsedge._forwarded import (
    FORWARDING_HEADERS,
    ForwardingContext,
    choose_request_id,
    client_ip_text,
    forwarded_element,
    forwarded_node,
    is_trusted_peer,
    is_valid_request_id,
    new_request_id,
    quote_value,
    rewrite_forwarding_headers,
)

ALL_ON = ForwardedConfig(forwarded=True)
TRUSTED_NET = (ip_network("10.0.0.0/8"), ip_network("fd00::/8"))


def ctx(
    client: tuple[str, int] | None = ("192.0.2.7", 4711),
    *,
    trusted: bool = False,
    tls: bool = False,
    host: bytes | None = b"example.com",
) -> ForwardingContext:
    return ForwardingContext(
        client=client,
        destination=("198.51.100.1", 443 if tls else 80),
        tls=tls,
        trusted=trusted,
        host=host,
    )


SPOOF = [
    (b"Host", b"example.com"),
    (b"X-Forwarded-For", b"1.2.3.4"),
    (b"x-forwarded-for", b"5.6.7.8, 9.9.9.9"),
    (b"X-FORWARDED-PROTO", b"https"),
    (b"X-Forwarded-Port", b"1"),
    (b"X-Forwarded-Host", b"evil.example"),
    (b"X-Real-IP", b"1.2.3.4"),
    (b"Forwarded", b"for=1.2.3.4"),
    (b"Accept", b"*/*"),
]


def test_untrusted_peer_loses_every_client_sent_forwarding_header() -> None:
    out = rewrite_forwarding_headers(SPOOF, ALL_ON, ctx())
    assert out == [
        (b"Host", b"example.com"),
        (b"Accept", b"*/*"),
        (b"X-Forwarded-For", b"192.0.2.7"),
        (b"X-Forwarded-Proto", b"http"),
        (b"X-Forwarded-Port", b"80"),
        (
            b"Forwarded",
            b'for="192.0.2.7:4711";proto=http;host=example.com;by="198.51.100.1:80"',
        ),
    ]


def test_untrusted_spoof_removed_even_with_every_option_off() -> None:
    off = ForwardedConfig(
        x_forwarded_for=False, x_forwarded_proto=False, x_forwarded_port=False
    )
    out = rewrite_forwarding_headers(SPOOF, off, ctx())
    assert out == [(b"Host", b"example.com"), (b"Accept", b"*/*")]


def test_trusted_peer_keeps_chain_and_appends() -> None:
    out = rewrite_forwarding_headers(
        SPOOF, ALL_ON, ctx(("10.1.2.3", 5000), trusted=True)
    )
    assert out == [
        (b"Host", b"example.com"),
        (b"X-FORWARDED-PROTO", b"https"),
        (b"X-Forwarded-Port", b"1"),
        (b"X-Forwarded-Host", b"evil.example"),
        (b"X-Real-IP", b"1.2.3.4"),
        (b"Accept", b"*/*"),
        (b"X-Forwarded-For", b"1.2.3.4, 5.6.7.8, 9.9.9.9, 10.1.2.3"),
        (
            b"Forwarded",
            b'for=1.2.3.4, for="10.1.2.3:5000";proto=http;host=example.com;'
            b'by="198.51.100.1:80"',
        ),
    ]


def test_trusted_peer_without_headers_gets_ours() -> None:
    out = rewrite_forwarding_headers(
        [(b"Host", b"h")],
        ForwardedConfig(),
        ctx(("10.0.0.1", 1), trusted=True, tls=True),
    )
    assert out == [
        (b"Host", b"h"),
        (b"X-Forwarded-For", b"10.0.0.1"),
        (b"X-Forwarded-Proto", b"https"),
        (b"X-Forwarded-Port", b"443"),
    ]


def test_trusted_chain_kept_when_xff_disabled() -> None:
    config = ForwardedConfig(x_forwarded_for=False)
    out = rewrite_forwarding_headers(
        [(b"X-Forwarded-For", b"1.1.1.1")], config, ctx(trusted=True)
    )
    assert (b"X-Forwarded-For", b"1.1.1.1") in out


def test_ipv6_formats() -> None:
    c = ForwardingContext(
        client=("2001:db8::1", 4711),
        destination=("::1", 8443),
        tls=True,
        trusted=False,
        host=b"[::1]:8443",
    )
    out = dict(rewrite_forwarding_headers([], ALL_ON, c))
    assert out[b"X-Forwarded-For"] == b"2001:db8::1"
    assert out[b"X-Forwarded-Port"] == b"8443"
    assert out[b"Forwarded"] == (
        b'for="[2001:db8::1]:4711";proto=https;host="[::1]:8443";by="[::1]:8443"'
    )


def test_request_id_replaces_client_value() -> None:
    headers = [(b"X-Request-Id", b"spoofed"), (b"x-request-id", b"again")]
    out = rewrite_forwarding_headers(
        headers,
        ForwardedConfig(
            x_forwarded_for=False, x_forwarded_proto=False, x_forwarded_port=False
        ),
        ctx(),
        request_id=(b"X-Request-Id", b"abc"),
    )
    assert out == [(b"X-Request-Id", b"abc")]


def test_choose_request_id() -> None:
    name = b"x-request-id"
    assert choose_request_id([(b"X-Request-Id", b"abc-123")], name, trusted=True) == (
        b"abc-123"
    )
    generated = choose_request_id([(b"X-Request-Id", b"abc-123")], name, trusted=False)
    assert generated != b"abc-123"
    assert len(generated) == 32
    int(generated, 16)
    # Malformed or ambiguous ids from a trusted peer are replaced too.
    assert choose_request_id([(b"X-Request-Id", b"a b")], name, trusted=True) != b"a b"
    two = [(b"X-Request-Id", b"a"), (b"X-Request-Id", b"b")]
    assert choose_request_id(two, name, trusted=True) not in {b"a", b"b"}
    assert new_request_id() != new_request_id()


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (b"0f8fad5b-d9cb-469f-a165-70867728950e", True),
        (b"Root=1-5759e988-bd862e3fe1be46a994272793", True),
        (b"", False),
        (b"a" * 129, False),
        (b"a\r\nX-Evil: 1", False),
        (b"a b", False),
        (b"a\x00", False),
    ],
)
def test_is_valid_request_id(value: bytes, ok: bool) -> None:
    assert is_valid_request_id(value) is ok


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("10.1.2.3", True),
        ("11.0.0.1", False),
        ("::ffff:10.0.0.1", True),
        ("fd00::5", True),
        ("2001:db8::1", False),
        ("not-an-ip", False),
        (None, False),
    ],
)
def test_is_trusted_peer(host: str | None, expected: bool) -> None:
    assert is_trusted_peer(host, TRUSTED_NET) is expected


def test_nothing_is_trusted_without_networks() -> None:
    assert not is_trusted_peer("127.0.0.1", ())


def test_client_ip_text() -> None:
    assert client_ip_text("2001:DB8:0::1") == b"2001:db8::1"
    assert client_ip_text("[::1]") == b"::1"
    assert client_ip_text("::ffff:192.0.2.1") == b"192.0.2.1"
    assert client_ip_text("bogus\r\nX: y") == b"unknown"
    assert client_ip_text(None) == b"unknown"


def test_forwarded_node() -> None:
    assert forwarded_node(("192.0.2.1", 0)) == b"192.0.2.1"
    assert forwarded_node(("192.0.2.1", 80)) == b'"192.0.2.1:80"'
    assert forwarded_node(("2001:db8::1", 0)) == b'"[2001:db8::1]"'
    assert forwarded_node(("2001:db8::1", 4711)) == b'"[2001:db8::1]:4711"'
    assert forwarded_node(None) == b"unknown"
    assert forwarded_node(("x\ny", 1)) == b"unknown"


def test_quote_value() -> None:
    assert quote_value(b"example.com") == b"example.com"
    assert quote_value(b"a:1") == b'"a:1"'
    assert quote_value(b'a"b\\c') == b'"a\\"b\\\\c"'
    for bad in (b"a\rb", b"a\nb", b"a\x00b", b"\x7f"):
        with pytest.raises(ValueError, match="control character"):
            quote_value(bad)


def test_forwarded_element_leaves_out_bad_host() -> None:
    element = forwarded_element(ctx(host=b"a\r\nX-Evil: 1"))
    assert b"host=" not in element
    assert b"\r" not in element
    assert b"\n" not in element
    assert forwarded_element(ctx(client=None, host=None)).startswith(b"for=unknown;")


forwarding_names = st.sampled_from(sorted(FORWARDING_HEADERS)).map(
    lambda name: name.upper() if len(name) % 2 else name
)
values = st.binary(min_size=1, max_size=20).filter(lambda v: b"\n" not in v)


@given(
    st.lists(st.tuples(forwarding_names, values), max_size=8),
    st.booleans(),
    st.booleans(),
)
def test_untrusted_values_never_survive(
    spoof: list[tuple[bytes, bytes]], tls: bool, use_forwarded: bool
) -> None:
    config = ForwardedConfig(forwarded=use_forwarded)
    out = rewrite_forwarding_headers(spoof, config, ctx(tls=tls))
    ours = {
        (b"X-Forwarded-For", b"192.0.2.7"),
        (b"X-Forwarded-Proto", b"https" if tls else b"http"),
        (b"X-Forwarded-Port", b"443" if tls else b"80"),
    }
    assert {h for h in out if h[0] != b"Forwarded"} == ours
    for _, value in out:
        assert b"\r" not in value
        assert b"\n" not in value
