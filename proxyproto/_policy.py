"""Trust policies: who may send a PROXY header, decided before any byte is read.

The spec says a receiver must be configured to expect the header and must not
guess; it also says to accept it only from known sources. A ``TrustPolicy``
turns CIDR lists into a per-connection ``Policy`` from the peer address (the
load balancer's) and, optionally, the local address the peer connected to
(multi-homed listeners). Adapters and the tlsedge edge share it.

An IPv4 address and its IPv4-mapped IPv6 form (``::ffff:10.0.0.1``, what a
dual-stack socket reports for an IPv4 peer) are one peer: the rules' networks
are brought to the IPv4 form when the policy is built, the addresses at each
decision (`proxyproto._ip`), so either form of a rule matches either form of
an address.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from proxyproto._errors import LocalProtocolError
from proxyproto._ip import unmap_address, unmap_network

__all__ = ["Policy", "TrustPolicy"]

IPNetwork = IPv4Network | IPv6Network
IPAddress = IPv4Address | IPv6Address


class Policy(enum.Enum):
    """What to do with one connection.

    =========  ==========================  ==============================
    policy     header                      client address reported
    =========  ==========================  ==============================
    REQUIRE    must be present and valid   from the header
    IGNORE     must be present and valid   the real peer (TLVs still kept)
    USE        read if present (guesses!)  from the header, else the peer
    SKIP       not read; bytes pass raw    the real peer
    REJECT     not read; close at once     (none)
    =========  ==========================  ==============================

    USE detects the header, which the spec forbids on ports untrusted clients
    can reach; it exists for migrations behind a trusted network and is never
    a default.
    """

    REQUIRE = "require"
    IGNORE = "ignore"
    USE = "use"
    SKIP = "skip"
    REJECT = "reject"


def _network(value: str | IPNetwork | IPAddress) -> IPNetwork:
    if isinstance(value, (IPv4Network, IPv6Network)):
        return value
    try:
        return ipaddress.ip_network(value)
    except ValueError as exc:
        raise LocalProtocolError(f"not a CIDR or address: {value!r} ({exc})") from None


def _address(value: str | IPAddress | tuple[object, ...]) -> IPAddress:
    if isinstance(value, (IPv4Address, IPv6Address)):
        address = value
    else:
        host = value[0] if isinstance(value, tuple) else value
        if not isinstance(host, str):
            raise LocalProtocolError(f"not an IP address: {value!r}")
        address = ipaddress.ip_address(host.partition("%")[0])
    return unmap_address(address)


def _unmapped(networks: tuple[IPNetwork, ...]) -> tuple[IPNetwork, ...]:
    return tuple(form for network in networks for form in unmap_network(network))


def _address_or_none(
    value: str | IPAddress | tuple[object, ...] | None,
) -> IPAddress | None:
    if value is None:
        return None
    try:
        return _address(value)
    except (ValueError, LocalProtocolError):
        return None


#: Most decisions a `TrustPolicy` remembers.
_DECISIONS_KEPT = 4096


def _host(value: str | IPAddress | tuple[object, ...] | None) -> object:
    """What a decision depends on: the host of a socket address tuple (not
    its port), any other address as it is."""
    return value[0] if isinstance(value, tuple) and value else value


@dataclass(frozen=True, slots=True)
class TrustPolicy:
    """Rules mapping peer (and local) addresses to a ``Policy``.

    The first matching rule wins; ``default`` applies when none matches.
    An IPv4 address and its IPv4-mapped IPv6 form (dual-stack sockets) are
    the same peer: each matches the rules written in either form (``rules``
    holds the networks with their mapped ranges as IPv4, see
    `proxyproto._ip.unmap_network`).

    Attributes:
        rules: ``(peer networks, local networks or None for any, policy)``.
        default: the policy for everyone else.
    """

    rules: tuple[
        tuple[tuple[IPNetwork, ...], tuple[IPNetwork, ...] | None, Policy], ...
    ]
    default: Policy = Policy.REJECT
    #: Decisions by (peer host, local host), so that the peers a server sees
    #: again and again (its load balancers) cost a dict lookup, not an
    #: address parse and a network scan; emptied when full.
    _decided: dict[tuple[object, object], Policy] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "rules",
            tuple(
                (
                    _unmapped(peers),
                    None if locals_ is None else _unmapped(locals_),
                    policy,
                )
                for peers, locals_, policy in self.rules
            ),
        )

    @classmethod
    def from_cidrs(
        cls,
        trusted: Iterable[str | IPNetwork | IPAddress],
        *,
        trusted_policy: Policy = Policy.REQUIRE,
        untrusted: Policy = Policy.REJECT,
        local: Iterable[str | IPNetwork | IPAddress] | None = None,
    ) -> TrustPolicy:
        """Peers in *trusted* (connecting to *local*, if given) get
        *trusted_policy*; everyone else gets *untrusted*.

        ``TrustPolicy.from_cidrs(["10.0.0.0/8"])`` is the usual setup behind a
        load balancer: its addresses must send a header, nobody else may
        connect. ``untrusted=Policy.SKIP`` serves other peers directly.

        Raises:
            LocalProtocolError: an entry is not a CIDR or address.
        """
        peers = tuple(_network(n) for n in trusted)
        locals_ = None if local is None else tuple(_network(n) for n in local)
        return cls(rules=((peers, locals_, trusted_policy),), default=untrusted)

    @classmethod
    def everyone(cls, policy: Policy = Policy.REQUIRE) -> TrustPolicy:
        """The same policy for every peer (e.g. a port only the LB can reach)."""
        return cls(rules=(), default=policy)

    def decide(
        self,
        peer: str | IPAddress | tuple[object, ...] | None,
        local: str | IPAddress | tuple[object, ...] | None = None,
    ) -> Policy:
        """The policy for a connection from *peer* to *local*.

        Addresses may be ``ipaddress`` objects, strings, or socket address
        tuples. A peer that is not an IP address (a UNIX socket) matches no
        CIDR rule and gets the default.
        """
        key = (_host(peer), _host(local))
        try:
            return self._decided[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable address: decided, not remembered
            return self._decide(peer, local)
        policy = self._decide(peer, local)
        if len(self._decided) >= _DECISIONS_KEPT:
            self._decided.clear()
        self._decided[key] = policy
        return policy

    def _decide(
        self,
        peer: str | IPAddress | tuple[object, ...] | None,
        local: str | IPAddress | tuple[object, ...] | None,
    ) -> Policy:
        # Parsed separately: a local address that is not an IP (a UNIX
        # listener) only fails the rules that name local networks.
        peer_ip = _address_or_none(peer)
        local_ip = _address_or_none(local)
        if peer_ip is None:
            return self.default
        for peers, locals_, policy in self.rules:
            if not any(peer_ip in net for net in peers):
                continue
            if locals_ is not None and (
                local_ip is None or not any(local_ip in net for net in locals_)
            ):
                continue
            return policy
        return self.default
