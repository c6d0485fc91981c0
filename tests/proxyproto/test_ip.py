"""An IP address's text and its IPv4-mapped form (`proxyproto._ip`)."""

from __future__ import annotations

import ipaddress
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

import pytest
from hypothesis import example, given, strategies as st

from proxyproto import InetAddress
from proxyproto._ip import ip_text, unmap_address, unmap_network


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("::ffff:192.0.2.66", "::ffff:192.0.2.66"),
        ("::FFFF:C000:0242", "::ffff:192.0.2.66"),
        ("::ffff:0.0.0.0", "::ffff:0.0.0.0"),
        ("192.0.2.66", "192.0.2.66"),
        ("2001:db8::1", "2001:db8::1"),
        ("::1", "::1"),
        ("::", "::"),
        ("::192.0.2.66", "::c000:242"),  # IPv4-compatible (deprecated): hex
        ("64:ff9b::c000:242", "64:ff9b::c000:242"),  # NAT64: not mapped
        ("fe80::1%eth0", "fe80::1%eth0"),
    ],
)
def test_ip_text(text: str, expected: str) -> None:
    assert ip_text(ipaddress.ip_address(text)) == expected


def test_inet_address_text_shows_the_ipv4_address() -> None:
    address = InetAddress.parse("::ffff:192.0.2.66", 40000)
    assert str(address) == "[::ffff:192.0.2.66]:40000"
    assert str(InetAddress.parse("192.0.2.66", 40000)) == "192.0.2.66:40000"


@pytest.mark.parametrize(
    ("network", "forms"),
    [
        ("::ffff:10.0.0.0/104", ["10.0.0.0/8"]),
        ("::ffff:127.0.0.9/128", ["127.0.0.9/32"]),
        ("::ffff:0.0.0.0/96", ["0.0.0.0/0"]),
        ("::/0", ["::/0", "0.0.0.0/0"]),
        ("::/80", ["::/80", "0.0.0.0/0"]),
        ("::fffe:0:0/95", ["::fffe:0:0/95", "0.0.0.0/0"]),
        ("::/81", ["::/81"]),  # stops short of ::ffff:0:0
        ("::fffe:0:0/96", ["::fffe:0:0/96"]),
        ("2001:db8::/32", ["2001:db8::/32"]),
        ("10.0.0.0/8", ["10.0.0.0/8"]),
    ],
)
def test_unmap_network(network: str, forms: list[str]) -> None:
    assert unmap_network(ipaddress.ip_network(network)) == tuple(
        ipaddress.ip_network(form) for form in forms
    )


def test_unmap_address() -> None:
    assert unmap_address(IPv6Address("::ffff:10.0.0.1")) == IPv4Address("10.0.0.1")
    assert unmap_address(IPv4Address("10.0.0.1")) == IPv4Address("10.0.0.1")
    assert unmap_address(IPv6Address("2001:db8::1")) == IPv6Address("2001:db8::1")


addresses_v4 = st.integers(0, 2**32 - 1).map(IPv4Address)
addresses_mapped = st.integers(0, 2**32 - 1).map(
    lambda v: IPv6Address(0xFFFF << 32 | v)
)
addresses_v6 = st.integers(0, 2**128 - 1).map(IPv6Address)
any_address = st.one_of(addresses_v4, addresses_mapped, addresses_v6)
networks = st.one_of(
    st.tuples(addresses_v4, st.integers(0, 32)),
    st.tuples(st.one_of(addresses_mapped, addresses_v6), st.integers(0, 128)),
).map(lambda a: ipaddress.ip_network(f"{a[0]}/{a[1]}", strict=False))


def other_form(
    address: IPv4Address | IPv6Address,
) -> IPv4Address | IPv6Address | None:
    """The same client in the other family, if it has one."""
    if isinstance(address, IPv4Address):
        return IPv6Address(f"::ffff:{address}")
    return address.ipv4_mapped


@given(address=any_address, network=networks)
@example(address=IPv4Address("127.0.0.9"), network=IPv6Network("::ffff:7f00:9/128"))
@example(address=IPv4Address("1.2.3.4"), network=IPv6Network("::/0"))
@example(address=IPv6Address("::ffff:1.2.3.4"), network=IPv4Network("1.2.3.0/24"))
def test_either_form_matches_either_form(
    address: IPv4Address | IPv6Address, network: IPv4Network | IPv6Network
) -> None:
    other = other_form(address)
    expected = address in network or (other is not None and other in network)
    unmapped = unmap_address(address)
    assert any(unmapped in form for form in unmap_network(network)) == expected
