"""TrustPolicy: which peers may (or must) send a PROXY header."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network, IPv6Address, ip_address, ip_network
from typing import Any

import pytest
from hypothesis import given, strategies as st

from proxyproto import LocalProtocolError, Policy, TrustPolicy, _policy

TRUSTED = TrustPolicy.from_cidrs(["10.0.0.0/8", "192.0.2.7", "2001:db8::/32", "::1"])


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        pytest.param("10.1.2.3", Policy.REQUIRE, id="ipv4-in-cidr"),
        pytest.param("11.0.0.1", Policy.REJECT, id="ipv4-outside"),
        pytest.param("192.0.2.7", Policy.REQUIRE, id="single-ipv4"),
        pytest.param("192.0.2.8", Policy.REJECT, id="next-to-single-ipv4"),
        pytest.param("2001:db8:1::5", Policy.REQUIRE, id="ipv6-in-cidr"),
        pytest.param("2001:db9::1", Policy.REJECT, id="ipv6-outside"),
        pytest.param("::1", Policy.REQUIRE, id="single-ipv6"),
        pytest.param("::ffff:10.9.9.9", Policy.REQUIRE, id="mapped-matches-ipv4"),
        pytest.param("::ffff:11.0.0.1", Policy.REJECT, id="mapped-outside"),
        pytest.param(ip_address("10.0.0.1"), Policy.REQUIRE, id="ip-object"),
        pytest.param(("10.0.0.1", 5000), Policy.REQUIRE, id="socket-tuple"),
        pytest.param(
            ("::ffff:10.0.0.1", 5000, 0, 0), Policy.REQUIRE, id="mapped-tuple"
        ),
        pytest.param(
            ("2001:db8::1%eth0", 5000, 0, 3), Policy.REQUIRE, id="scoped-ipv6"
        ),
        pytest.param(("11.0.0.1", 5000), Policy.REJECT, id="socket-tuple-outside"),
        pytest.param(None, Policy.REJECT, id="none"),
        pytest.param("/run/lb.sock", Policy.REJECT, id="unix-path"),
        pytest.param("", Policy.REJECT, id="unnamed-unix"),
        pytest.param(b"\0abstract", Policy.REJECT, id="abstract-unix"),
        pytest.param("not an address", Policy.REJECT, id="garbage"),
    ],
)
def test_from_cidrs_decides_by_peer(peer: Any, expected: Policy) -> None:
    assert TRUSTED.decide(peer) is expected
    assert TRUSTED.decide(peer) is expected  # remembered


def test_remembered_decisions_are_the_decisions_and_stay_bounded() -> None:
    policy = TrustPolicy.from_cidrs(["10.0.0.0/9"], local=["192.0.2.0/24"])
    kept = _policy._DECISIONS_KEPT
    peers = [f"10.{i // 256 % 256}.{i % 256}.1" for i in range(0, kept * 3, 7)]
    for local in ("192.0.2.1", "198.51.100.1"):
        for peer in peers:
            expected = (
                Policy.REQUIRE
                if int(peer.split(".")[1]) < 128 and local == "192.0.2.1"
                else Policy.REJECT
            )
            assert policy.decide((peer, 1), (local, 443)) is expected
            assert policy.decide(peer, local) is expected
            assert len(policy._decided) <= kept
    # Remembering is not part of what a policy is.
    assert policy == TrustPolicy.from_cidrs(["10.0.0.0/9"], local=["192.0.2.0/24"])


def test_from_cidrs_custom_policies() -> None:
    policy = TrustPolicy.from_cidrs(
        ["10.0.0.0/8"], trusted_policy=Policy.USE, untrusted=Policy.SKIP
    )
    assert policy.decide("10.0.0.1") is Policy.USE
    assert policy.decide("8.8.8.8") is Policy.SKIP


def test_from_cidrs_accepts_network_and_address_objects() -> None:
    policy = TrustPolicy.from_cidrs([IPv4Network("10.0.0.0/8"), ip_address("::2")])
    assert policy.decide("10.0.0.1") is Policy.REQUIRE
    assert policy.decide("::2") is Policy.REQUIRE
    assert policy.decide("::3") is Policy.REJECT


def test_local_address_rules() -> None:
    policy = TrustPolicy.from_cidrs(["10.0.0.0/8"], local=["192.168.1.1", "fd00::/8"])
    assert policy.decide("10.0.0.1", "192.168.1.1") is Policy.REQUIRE
    assert policy.decide("10.0.0.1", ("192.168.1.1", 443)) is Policy.REQUIRE
    assert policy.decide("10.0.0.1", "::ffff:192.168.1.1") is Policy.REQUIRE
    assert policy.decide("10.0.0.1", "fd00::1") is Policy.REQUIRE
    assert policy.decide("10.0.0.1", "192.168.1.2") is Policy.REJECT
    assert policy.decide("10.0.0.1") is Policy.REJECT  # local unknown
    assert policy.decide("10.0.0.1", "/run/x.sock") is Policy.REJECT
    assert policy.decide("11.0.0.1", "192.168.1.1") is Policy.REJECT


@pytest.mark.parametrize(
    ("trusted", "peer", "expected"),
    [
        (["::ffff:10.0.0.0/104"], "10.9.9.9", Policy.REQUIRE),
        (["::ffff:10.0.0.0/104"], ("10.9.9.9", 5000), Policy.REQUIRE),
        (["::ffff:10.0.0.0/104"], ("::ffff:10.9.9.9", 5000, 0, 0), Policy.REQUIRE),
        (["::ffff:10.0.0.0/104"], "11.0.0.1", Policy.REJECT),
        (["::ffff:127.0.0.1"], ip_address("127.0.0.1"), Policy.REQUIRE),
        (["10.0.0.0/8"], "::ffff:10.9.9.9", Policy.REQUIRE),
        # an IPv6 network over the whole mapped range holds every IPv4 peer
        (["::/0"], "192.0.2.1", Policy.REQUIRE),
        (["2001:db8::/32"], "192.0.2.1", Policy.REJECT),
    ],
)
def test_a_peer_matches_rules_written_in_either_form(
    trusted: list[str], peer: Any, expected: Policy
) -> None:
    assert TrustPolicy.from_cidrs(trusted).decide(peer) is expected


def test_local_rules_match_in_either_form() -> None:
    policy = TrustPolicy.from_cidrs(["10.0.0.0/8"], local=["::ffff:192.168.1.1"])
    assert policy.decide("10.0.0.1", ("192.168.1.1", 443)) is Policy.REQUIRE
    assert policy.decide("10.0.0.1", "::ffff:192.168.1.1") is Policy.REQUIRE
    assert policy.decide("10.0.0.1", "192.168.1.2") is Policy.REJECT


def test_rules_hold_mapped_networks_as_ipv4() -> None:
    written = tuple(map(ip_network, ["::ffff:10.0.0.0/104", "::/0"]))
    built = TrustPolicy(rules=((written, None, Policy.USE),))
    held = tuple(map(ip_network, ["10.0.0.0/8", "::/0", "0.0.0.0/0"]))
    assert built.rules == ((held, None, Policy.USE),)
    assert built.decide("10.0.0.1") is Policy.USE


def test_unparsable_local_does_not_matter_without_local_rules() -> None:
    assert TRUSTED.decide("10.0.0.1", "") is Policy.REQUIRE
    assert TRUSTED.decide("10.0.0.1", "/run/x.sock") is Policy.REQUIRE
    assert TRUSTED.decide(("10.0.0.1", 1), None) is Policy.REQUIRE


def test_first_matching_rule_wins_then_default() -> None:
    policy = TrustPolicy(
        rules=(
            ((IPv4Network("10.0.0.0/24"),), None, Policy.SKIP),
            ((IPv4Network("10.0.0.0/8"),), None, Policy.REQUIRE),
        ),
        default=Policy.IGNORE,
    )
    assert policy.decide("10.0.0.5") is Policy.SKIP
    assert policy.decide("10.5.0.5") is Policy.REQUIRE
    assert policy.decide("172.16.0.1") is Policy.IGNORE


def test_default_is_reject() -> None:
    assert TrustPolicy(rules=()).decide("10.0.0.1") is Policy.REJECT
    assert TrustPolicy.from_cidrs([]).decide("10.0.0.1") is Policy.REJECT


@pytest.mark.parametrize("policy", list(Policy))
def test_everyone(policy: Policy) -> None:
    everyone = TrustPolicy.everyone(policy)
    assert everyone.decide("10.0.0.1") is policy
    assert everyone.decide("::1", "::1") is policy
    assert everyone.decide(None) is policy
    assert everyone.decide("/run/x.sock") is policy


def test_everyone_defaults_to_require() -> None:
    assert TrustPolicy.everyone().decide("1.2.3.4") is Policy.REQUIRE


@pytest.mark.parametrize(
    "cidr",
    [
        pytest.param("10.0.0.0/33", id="prefix-too-long"),
        pytest.param("10.0.0.1/8", id="host-bits-set"),
        pytest.param("example.com", id="name"),
        pytest.param("", id="empty"),
        pytest.param("2001:db8::/129", id="ipv6-prefix"),
        pytest.param("10.0.0.0/8 ", id="trailing-space"),
    ],
)
def test_bad_cidr_is_a_local_error(cidr: str) -> None:
    with pytest.raises(LocalProtocolError, match="CIDR"):
        TrustPolicy.from_cidrs([cidr])
    with pytest.raises(LocalProtocolError):
        TrustPolicy.from_cidrs(["10.0.0.0/8"], local=[cidr])


def test_policy_values() -> None:
    assert {p.value for p in Policy} == {"require", "ignore", "use", "skip", "reject"}


# -- the rules against a linear scan, written in either form -----------------------

addresses_v4 = st.integers(0, 2**32 - 1).map(IPv4Address)
addresses_v6 = st.integers(0, 2**128 - 1).map(IPv6Address)
addresses_mapped = addresses_v4.map(lambda a: IPv6Address(f"::ffff:{a}"))
addresses = st.one_of(addresses_v4, addresses_v6, addresses_mapped)
networks = st.one_of(
    st.tuples(addresses_v4, st.integers(0, 32)),
    st.tuples(addresses_v6 | addresses_mapped, st.integers(0, 128)),
).map(lambda a: ip_network(f"{a[0]}/{a[1]}", strict=False))
rules = st.lists(
    st.tuples(
        st.lists(networks, max_size=4).map(tuple),
        st.none() | st.lists(networks, max_size=3).map(tuple),
        st.sampled_from(Policy),
    ),
    max_size=4,
).map(tuple)


def _forms(address: IPv4Address | IPv6Address) -> list[IPv4Address | IPv6Address]:
    """*address* and its other form: ``a.b.c.d`` and ``::ffff:a.b.c.d`` are one."""
    if isinstance(address, IPv4Address):
        return [address, IPv6Address(f"::ffff:{address}")]
    return [address] if address.ipv4_mapped is None else [address, address.ipv4_mapped]


def _in(address: IPv4Address | IPv6Address, networks: tuple[Any, ...]) -> bool:
    return any(form in network for form in _forms(address) for network in networks)


def _shapes(address: IPv4Address | IPv6Address, port: int) -> list[Any]:
    """*address* as callers hand it over, in either form: an object, a string,
    a socket address tuple."""
    out: list[Any] = []
    for form in _forms(address):
        four = form.version == 4
        out += [form, str(form), (str(form), port) if four else (str(form), port, 0, 0)]
    return out


# An address, and one way of writing it.
written = st.tuples(addresses, st.integers(0, 65535), st.integers(0, 5)).map(
    lambda a: (a[0], _shapes(a[0], a[1])[a[2] % len(_shapes(a[0], a[1]))])
)


@given(
    rules, st.sampled_from(Policy), st.lists(st.tuples(written, written), max_size=6)
)
def test_decisions_are_the_first_matching_rule_in_a_linear_scan(
    rules: Any, default: Policy, connections: list[Any]
) -> None:
    policy = TrustPolicy(rules=rules, default=default)
    # The networks' own edges, as peers and local addresses, in either form.
    edges = [n[i] for peers, _, _ in rules for n in peers for i in (0, -1)]
    connections += [
        ((edge, str(form)), (edge, str(form)))
        for edge in edges
        for form in _forms(edge)
    ]
    for (peer, peer_written), (local, local_written) in connections:
        expected = next(
            (
                chosen
                for peers, locals_, chosen in rules
                if _in(peer, peers) and (locals_ is None or _in(local, locals_))
            ),
            default,
        )
        assert policy.decide(peer_written, local_written) is expected
        assert policy.decide(peer_written, local_written) is expected  # remembered
