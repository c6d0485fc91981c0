"""Forwarding-header rewriting (sans-IO), and the trust in ``trusted_proxies``
over a real connection."""

from __future__ import annotations

import ipaddress
import re
from ipaddress import ip_network

import pytest
from hypothesis import example, given, strategies as st

from tests.tlsedge.pipeline.http.test_h1 import echo_and_proxy, get, seen_headers
from tlsedge._core.config import ForwardedConfig
from tlsedge._core.forwarded import (
    FORWARDING_HEADERS,
    ForwardingContext,
    choose_request_id,
    client_ip_text,
    forwarded_element,
    forwarded_node,
    forwarding_key,
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


LOOKALIKES = [
    (b"Host", b"example.com"),
    (b"X_Forwarded_For", b"6.6.6.6"),
    (b"x_forwarded_proto", b"https"),
    (b"X_Forwarded-Port", b"1"),
    (b"X-Forwarded_Host", b"evil.example"),
    (b"X_Real_IP", b"6.6.6.6"),
    (b"X_Request_Id", b"spoofed"),
    (b"Foo_Bar", b"kept"),
]


@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trusted"])
def test_underscore_spellings_of_forwarding_headers_go_from_anyone(
    trusted: bool,
) -> None:
    # CGI/WSGI read X_Forwarded_For as HTTP_X_FORWARDED_FOR: the same key as
    # the real header. No proxy writes that spelling, so nobody's is kept.
    out = rewrite_forwarding_headers(
        LOOKALIKES,
        ForwardedConfig(),
        ctx(("10.1.2.3", 5000), trusted=trusted),
        request_id=(b"X-Request-Id", b"abc"),
    )
    client = b"10.1.2.3"
    assert out == [
        (b"Host", b"example.com"),
        (b"Foo_Bar", b"kept"),
        (b"X-Forwarded-For", client),
        (b"X-Forwarded-Proto", b"http"),
        (b"X-Forwarded-Port", b"80"),
        (b"X-Request-Id", b"abc"),
    ]


def test_forwarding_key() -> None:
    assert forwarding_key(b"X_Forwarded-FOR") == b"x-forwarded-for"
    assert forwarding_key(b"Foo_Bar") == b"foo-bar"


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


@pytest.mark.parametrize(
    ("written", "host", "expected"),
    [
        ("::ffff:10.0.0.0/104", "10.1.2.3", True),
        ("::ffff:10.0.0.0/104", "::ffff:10.1.2.3", True),
        ("::ffff:10.0.0.0/104", "11.0.0.1", False),
        ("10.0.0.0/8", "::ffff:10.1.2.3", True),
        ("::/0", "192.0.2.1", True),  # ::/0 holds the whole mapped range
        ("2001:db8::/32", "192.0.2.1", False),
    ],
)
def test_trusted_proxies_match_in_either_form(
    written: str, host: str, expected: bool
) -> None:
    config = ForwardedConfig(trusted_proxies=(ip_network(written),))
    assert is_trusted_peer(host, config.trusted_proxies) is expected


def test_trusted_proxies_hold_mapped_networks_as_ipv4() -> None:
    config = ForwardedConfig(
        trusted_proxies=tuple(
            map(ip_network, ["::ffff:10.0.0.0/104", "::/0", "0.0.0.0/0"])
        )
    )
    assert config.trusted_proxies == tuple(
        map(ip_network, ["10.0.0.0/8", "::/0", "0.0.0.0/0"])
    )


async def test_a_trusted_proxy_network_in_the_mapped_form_keeps_the_chain() -> None:
    # Over a real connection from 127.0.0.1, through the HTTP proxy.
    forwarded = {"trusted_proxies": ["::ffff:127.0.0.0/104"]}
    async with echo_and_proxy(forwarded=forwarded) as (_, proxy):
        response = await get(
            proxy.address, headers=[("X-Forwarded-For", "203.0.113.9")]
        )
    assert seen_headers(response.json(), "x-forwarded-for") == [
        "203.0.113.9, 127.0.0.1"
    ]


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


# -- properties: any header list, trusted or not ------------------------------------
#
# RFC 7239 section 4 and RFC 9110 section 5.6: a value is a token or a
# quoted-string; a node (section 6) is an IPv4 address, a bracketed IPv6 address,
# "unknown" or an obfuscated name, with an optional port.

TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
VALUE_RE = re.compile(rb"(%s)|(%s)" % (TOKEN, QUOTED))
PAIR = rb"(%s)=(%s|%s)" % (TOKEN, TOKEN, QUOTED)
ELEMENT_RE = re.compile(rb"%s(?:;%s)*" % (PAIR, PAIR))
PAIR_RE = re.compile(PAIR)
OBF = rb"_[A-Za-z0-9._-]+"
NODE_RE = re.compile(
    rb"(?P<name>unknown|%s|\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<v4>[0-9.]+))"
    rb"(?::(?P<port>[0-9]{1,5}|%s))?" % (OBF, OBF)
)
# What h11 never lets through in a field value, and what we must never emit.
CR_LF_NUL = re.compile(rb"[\r\n\x00]")
CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def unquote(value: bytes) -> bytes:
    """Parse an RFC 7239 value (token or quoted-string); fail on anything else."""
    match = VALUE_RE.fullmatch(value)
    assert match is not None, f"not a token or quoted-string: {value!r}"
    if match.group(1) is not None:
        return value
    return re.sub(rb"\\(.)", rb"\1", value[1:-1], flags=re.DOTALL)


def parse_node(value: bytes) -> tuple[bytes, int | None]:
    """An RFC 7239 node -> (nodename as written, port or None)."""
    node = unquote(value)
    match = NODE_RE.fullmatch(node)
    assert match is not None, f"not an RFC 7239 node: {node!r}"
    if match["v4"] is not None:
        assert ipaddress.ip_address(match["v4"].decode()).version == 4
    if match["v6"] is not None:
        assert ipaddress.ip_address(match["v6"].decode()).version == 6
    port = match["port"]
    name = match["name"]
    if match["v6"] is not None:
        name = match["v6"]
    return name, int(port) if port is not None else None


def parse_element(element: bytes) -> dict[bytes, bytes]:
    """One Forwarded element -> {parameter (lower case): unquoted value}."""
    assert ELEMENT_RE.fullmatch(element), f"not a forwarded-element: {element!r}"
    pairs: dict[bytes, bytes] = {}
    for match in PAIR_RE.finditer(element):
        name = match[1].lower()
        assert name not in pairs, f"parameter {name!r} twice in {element!r}"
        pairs[name] = match[2]
    return pairs


def expected_ip(host: str | None) -> str | None:
    """The address a client host should appear as, or None for "unknown":
    canonical text, IPv4-mapped IPv6 as IPv4, no zone id (meaningless off this
    host, and not part of RFC 7239's or X-Forwarded-For's address syntax)."""
    if host is None:
        return None
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return str(address.ipv4_mapped)
    return str(ipaddress.ip_address(address.packed))


def recase(name: bytes, mask: int) -> bytes:
    """*name* with the letters whose bit is set in *mask* in the other case."""
    return bytes(
        c ^ 0x20 if 0x61 <= (c | 0x20) <= 0x7A and mask >> (i % 30) & 1 else c
        for i, c in enumerate(name)
    )


ipv4_text = st.ip_addresses(v=4).map(str)
ipv6_text = st.ip_addresses(v=6).map(str) | st.ip_addresses(v=6).map(
    lambda a: a.exploded.upper()
)
zone = st.text(
    st.characters(codec="ascii", exclude_characters="%"), min_size=1, max_size=6
)
client_hosts = st.one_of(
    ipv4_text,
    ipv6_text,
    st.ip_addresses(v=4).map(lambda a: f"::ffff:{a}"),
    st.builds(lambda a, z: f"{a}%{z}", ipv6_text, zone),
    ipv6_text.map(lambda a: f"[{a}]"),
    st.sampled_from(["unknown", "_hidden", "1.2.3", "300.1.1.1", "example.com"]),
    st.text(max_size=20),
)
endpoints = st.none() | st.tuples(client_hosts, st.integers(0, 65535))
hosts = (
    st.none()
    | st.binary(max_size=30)
    | st.sampled_from(
        [b"example.com", b"example.com:8443", b"[::1]:8443", b'a"b\\c', b"a\r\nX: y"]
    )
)
contexts = st.builds(
    ForwardingContext,
    client=endpoints,
    destination=endpoints,
    tls=st.booleans(),
    trusted=st.booleans(),
    host=hosts,
)
configs = st.builds(
    ForwardedConfig,
    x_forwarded_for=st.booleans(),
    x_forwarded_proto=st.booleans(),
    x_forwarded_port=st.booleans(),
    forwarded=st.booleans(),
)

# Values h11 can deliver: no CR, LF or NUL (nor other controls, for simplicity).
visible = st.binary(max_size=30).map(lambda v: CONTROL.sub(b"", v))
hop_texts = st.one_of(
    ipv4_text,
    ipv6_text,
    st.sampled_from(
        ["unknown", "_hidden", "1.2.3", "[::1]:80", "a b", '"x"', "fe80::1%eth0", ""]
    ),
    st.text(
        st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=","),
        max_size=12,
    ),
)
xff_values = (
    st.builds(
        lambda hops, sep: sep.join(hops).encode(),
        st.lists(hop_texts, max_size=4),
        st.sampled_from([", ", ",", " , ", ",, "]),
    )
    | visible
)
forwarded_values = (
    st.builds(
        forwarded_element,
        st.builds(
            ForwardingContext,
            client=endpoints,
            destination=endpoints,
            tls=st.booleans(),
            trusted=st.just(True),
            host=hosts,
        ),
    )
    | visible
)
other_names = st.sampled_from([b"host", b"accept", b"via", b"x-request-id", b"x-a"])
masks = st.integers(0, 2**30 - 1)


def named(names: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.builds(recase, names, masks)


def underscored(name: bytes, mask: int) -> bytes:
    """*name* with the hyphens whose bit is set in *mask* written ``_``."""
    return bytes(
        0x5F if c == 0x2D and mask >> (i % 30) & 1 else c for i, c in enumerate(name)
    )


def spelled(names: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """*names* in any case, one in four with some ``-`` written ``_`` (the
    look-alikes CGI and WSGI servers take for the real field)."""
    return st.builds(
        lambda name, lower, mask: underscored(name, 0 if lower % 4 else mask),
        named(names),
        masks,
        masks,
    )


def hops(values: list[bytes]) -> list[bytes]:
    """The X-Forwarded-For hops of some field values, in order."""
    return [hop.strip() for v in values for hop in v.split(b",") if hop.strip()]


def values_of(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for n, v in headers if n.lower() == name]


def split_passthrough(
    headers: list[tuple[bytes, bytes]],
    out: list[tuple[bytes, bytes]],
    *,
    trusted: bool,
    rid_name: bytes | None = None,
) -> list[tuple[bytes, bytes]]:
    """Check the fields we do not manage come first, unchanged and in order, and
    return the fields we added after them."""
    managed = {b"x-forwarded-for", b"forwarded"}
    if not trusted:
        managed |= FORWARDING_HEADERS
    lookalikes = set(FORWARDING_HEADERS)
    if rid_name is not None:
        managed.add(rid_name.lower())
        lookalikes.add(forwarding_key(rid_name))
    kept = [
        (n, v)
        for n, v in headers
        if n.lower() not in managed
        and not (b"_" in n and forwarding_key(n) in lookalikes | managed)
    ]
    assert out[: len(kept)] == kept
    return out[len(kept) :]


@given(
    xff=st.lists(st.tuples(named(st.just(b"x-forwarded-for")), xff_values), max_size=5),
    others=st.lists(st.tuples(named(other_names), visible), max_size=3),
    client=endpoints,
    append=st.booleans(),
)
@example(
    xff=[(b"X-Forwarded-For", b"192.0.2.1")],
    others=[],
    client=("fe80::1%a,b", 4711),
    append=True,
).via("a zone id (here with a comma: a fake hop) went into X-Forwarded-For")
def test_trusted_xff_chain_keeps_every_hop_and_ends_with_the_client(
    xff: list[tuple[bytes, bytes]],
    others: list[tuple[bytes, bytes]],
    client: tuple[str, int] | None,
    append: bool,
) -> None:
    headers = [*others[:1], *xff, *others[1:]]
    config = ForwardedConfig(x_forwarded_for=append, x_forwarded_proto=False)
    c = ForwardingContext(client=client, destination=None, tls=False, trusted=True)
    out = rewrite_forwarding_headers(headers, config, c)
    ours = split_passthrough(headers, out, trusted=True)
    chain = values_of(ours, b"x-forwarded-for")
    sent = hops([v for _, v in xff])
    if append:
        (value,) = chain
        me = expected_ip(client[0] if client else None)
        assert hops(chain) == [*sent, (me or "unknown").encode()]
        assert b"%" not in value.rsplit(b",", 1)[-1]
    else:  # kept as it came (in one field), nothing added
        assert len(chain) <= 1
        assert hops(chain) == sent


@given(
    fwd=st.lists(st.tuples(named(st.just(b"forwarded")), forwarded_values), max_size=4),
    context=contexts,
)
def test_trusted_forwarded_chain_is_kept_and_our_element_is_last(
    fwd: list[tuple[bytes, bytes]], context: ForwardingContext
) -> None:
    out = rewrite_forwarding_headers(fwd, ForwardedConfig(forwarded=True), context)
    (value,) = [v for n, v in out if n == b"Forwarded"]
    element = forwarded_element(context)
    chain = [v.strip() for _, v in fwd if v.strip()] if context.trusted else []
    assert value == b", ".join([*chain, element])


@given(context=contexts)
@example(
    context=ForwardingContext(
        client=("fe80::1%eth0", 4711),
        destination=("::%\x1f", 0),
        tls=False,
        trusted=False,
    )
).via("zone ids made an invalid node, or raised ValueError with a control char")
def test_forwarded_element_follows_rfc7239(context: ForwardingContext) -> None:
    element = forwarded_element(context)
    assert not CR_LF_NUL.search(element)
    pairs = parse_element(element)
    assert unquote(pairs[b"proto"]) == (b"https" if context.tls else b"http")
    for parameter, endpoint in ((b"for", context.client), (b"by", context.destination)):
        if parameter == b"by" and endpoint is None:
            assert b"by" not in pairs
            continue
        name, port = parse_node(pairs[parameter])
        ip = expected_ip(endpoint[0] if endpoint else None)
        if ip is None:
            assert (name, port) == (b"unknown", None)
        else:
            assert endpoint is not None
            assert ipaddress.ip_address(name.decode()) == ipaddress.ip_address(ip)
            assert name.decode() == ip  # canonical text
            assert port == (endpoint[1] or None)
    if context.host and not CONTROL.search(context.host):
        assert unquote(pairs[b"host"]) == context.host
    else:
        assert b"host" not in pairs


@given(host=client_hosts, port=st.integers(0, 65535))
@example(host="fe80::1%eth0", port=80).via("zone id inside the brackets")
@example(host="fe80::1%\r", port=80).via("raised ValueError")
def test_forwarded_node_is_an_rfc7239_node(host: str, port: int) -> None:
    node = forwarded_node((host, port))
    name, parsed_port = parse_node(node)
    ip = expected_ip(host)
    assert name.decode() == (ip or "unknown")
    assert parsed_port == (port or None if ip is not None else None)
    assert client_ip_text(host) == (ip or "unknown").encode()


@given(st.binary(max_size=40))
def test_quote_value_output_parses_back(value: bytes) -> None:
    if CONTROL.search(value):
        with pytest.raises(ValueError, match="control character"):
            quote_value(value)
        return
    quoted = quote_value(value)
    assert unquote(quoted) == value
    if re.fullmatch(TOKEN, value):
        assert quoted == value


rid_names = st.sampled_from([b"x-request-id", b"x-amzn-trace-id", b"request-id"])
valid_ids = st.from_regex(rb"[A-Za-z0-9._:+/=-]{1,128}", fullmatch=True)


@given(
    name=named(rid_names),
    values=st.lists(valid_ids | st.binary(max_size=140), max_size=3),
    others=st.lists(st.tuples(named(other_names), st.binary(max_size=20)), max_size=3),
    trusted=st.booleans(),
    masks=st.lists(masks, min_size=3, max_size=3),
)
@example(
    name=b"X-Request-Id",
    values=[b"abc"],
    others=[],
    trusted=True,
    masks=[0, 0, 0],
).via("name given in another case than the field")
def test_choose_request_id_keeps_only_a_trusted_valid_id(
    name: bytes,
    values: list[bytes],
    others: list[tuple[bytes, bytes]],
    trusted: bool,
    masks: list[int],
) -> None:
    fields = [(recase(name, mask), v) for v, mask in zip(values, masks, strict=False)]
    headers = [*others, *fields]
    chosen = choose_request_id(headers, name, trusted=trusted)
    assert is_valid_request_id(chosen)
    assert re.fullmatch(rb"[\x21-\x7e]{1,128}", chosen)
    sent = [v for n, v in headers if n.lower() == name.lower()]
    if trusted and len(sent) == 1 and is_valid_request_id(sent[0]):
        assert chosen == sent[0]
    else:
        assert re.fullmatch(rb"[0-9a-f]{32}", chosen)
        assert chosen not in sent


header_lists = st.lists(
    st.tuples(
        spelled(st.sampled_from(sorted(FORWARDING_HEADERS)) | other_names),
        st.binary(max_size=30),
    ),
    max_size=8,
)


@given(
    headers=header_lists,
    config=configs,
    context=contexts,
    rid=st.none() | st.tuples(named(rid_names), valid_ids),
)
@example(
    headers=[(b"X-Forwarded-For", b"1.2.3.4\r\nX-Evil: 1"), (b"Forwarded", b"\x00")],
    config=ForwardedConfig(forwarded=True),
    context=ctx(("10.1.2.3", 5000), trusted=True),
    rid=None,
).via("a trusted peer's chain was copied with its CR/LF/NUL")
def test_values_we_emit_never_hold_cr_lf_or_nul(
    headers: list[tuple[bytes, bytes]],
    config: ForwardedConfig,
    context: ForwardingContext,
    rid: tuple[bytes, bytes] | None,
) -> None:
    out = rewrite_forwarding_headers(headers, config, context, request_id=rid)
    ours = split_passthrough(
        headers, out, trusted=context.trusted, rid_name=rid[0] if rid else None
    )
    for name, value in ours:
        assert not CR_LF_NUL.search(value), (name, value)
    names = [n.lower() for n, _ in ours]
    assert len(names) == len(set(names))  # each of ours once
    if not context.trusted:
        # From an untrusted peer no forwarding value survives.
        for name, value in ours:
            if name.lower() == b"x-forwarded-for":
                assert (
                    value
                    == (
                        expected_ip(context.client[0] if context.client else None)
                        or "unknown"
                    ).encode()
                )


@given(
    headers=header_lists,
    config=configs,
    context=contexts,
    rid=st.none() | st.tuples(rid_names, valid_ids),
    mask=masks,
    rid_mask=masks,
)
def test_header_name_case_does_not_matter(
    *,
    headers: list[tuple[bytes, bytes]],
    config: ForwardedConfig,
    context: ForwardingContext,
    rid: tuple[bytes, bytes] | None,
    mask: int,
    rid_mask: int,
) -> None:
    lowered = [(n.lower(), v) for n, v in headers]
    recased = [(recase(n, mask + i), v) for i, (n, v) in enumerate(lowered)]
    rid_recased = (recase(rid[0], rid_mask), rid[1]) if rid else None
    plain = rewrite_forwarding_headers(lowered, config, context, request_id=rid)
    odd = rewrite_forwarding_headers(recased, config, context, request_id=rid_recased)
    assert [(n.lower(), v) for n, v in odd] == [(n.lower(), v) for n, v in plain]
