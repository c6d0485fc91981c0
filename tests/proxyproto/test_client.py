"""The header plan the PROXY-sending clients share (proxyproto._client)."""

from __future__ import annotations

from ipaddress import IPv6Address

import pytest

from proxyproto import (
    TLV,
    Command,
    InetAddress,
    LocalProtocolError,
    ProxyHeader,
    UnixAddress,
    encode_v2,
    parse,
)
from proxyproto._client import plan_header


def test_a_built_header_names_the_connection_unless_told_otherwise() -> None:
    plan = plan_header(version=1)
    header, _ = parse(plan.wire(("127.0.0.1", 40000), ("127.0.0.1", 80)))
    assert header.version == 1
    assert header.source == InetAddress.parse("127.0.0.1", 40000)
    assert header.destination == InetAddress.parse("127.0.0.1", 80)

    plan = plan_header(source=("203.0.113.7", 5555))
    header, _ = parse(plan.wire(("127.0.0.1", 40000), ("127.0.0.1", 80)))
    assert header.source == InetAddress.parse("203.0.113.7", 5555)
    assert header.destination == InetAddress.parse("127.0.0.1", 80)


def test_ipv6_socket_addresses_and_mixed_families() -> None:
    plan = plan_header(source=("203.0.113.7", 5555))
    header, _ = parse(plan.wire(("::1", 40000, 0, 0), ("::1", 443, 0, 0)))
    # An IPv4 client over an IPv6 connection: sent IPv4-mapped, as HAProxy does.
    assert header.source == InetAddress(IPv6Address("::ffff:203.0.113.7"), 5555)
    assert header.destination == InetAddress(IPv6Address("::1"), 443)


def test_tlvs_crc32c_and_padding() -> None:
    plan = plan_header(tlvs=(TLV.alpn(b"h2"),), crc32c=True, pad_to=128)
    wire = plan.wire(("127.0.0.1", 1), ("127.0.0.1", 2))
    header, consumed = parse(wire)
    assert consumed == len(wire) == 128
    assert header.alpn == b"h2"
    assert header.crc32c is not None


def test_a_given_header_is_sent_as_is() -> None:
    fixed = ProxyHeader.local(tlvs=(TLV.authority("example.com"),))
    plan = plan_header(fixed)
    wire = plan.wire(("127.0.0.1", 1), ("127.0.0.1", 2))
    assert wire == encode_v2(fixed)
    assert parse(wire)[0].command is Command.LOCAL


def test_unix_endpoints_go_in_pairs() -> None:
    plan = plan_header(source=UnixAddress(b"/run/a"), destination=UnixAddress(b"/b"))
    header, _ = parse(plan.wire(("127.0.0.1", 1), ("127.0.0.1", 2)))
    assert header.source == UnixAddress(b"/run/a")
    with pytest.raises(LocalProtocolError, match="needs the other one too"):
        plan_header(source=UnixAddress(b"/run/a"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"version": 1, "tlvs": (TLV.alpn(b"h2"),)}, "v1 headers cannot carry TLVs"),
        ({"version": 1, "pad_to": 64}, "cannot carry a CRC32C or padding"),
        ({"version": 0}, "version must be 1 or 2"),
        ({"destination": ("192.0.2.1", 70000)}, "port"),
        ({"pad_to": 10}, "cannot pad"),
        ({"header": ProxyHeader.local(), "tlvs": (TLV.noop(),)}, "not both"),
    ],
)
def test_contradictions_are_refused_at_once(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(LocalProtocolError, match=message):
        plan_header(**kwargs)  # type: ignore[arg-type]
