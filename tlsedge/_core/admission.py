"""Who may connect to a listener: its ``allow`` and ``deny`` networks.

Kubernetes' ``loadBalancerSourceRanges`` for tlsedge (docs/configuration.md,
"Client source ranges"). A client is admitted when its address is in an
``allow`` network (or ``allow`` is empty: everyone) and in no ``deny`` network:
deny wins. The address judged is the real client's, as the connection's owner
hands it over (the trusted PROXY header's source, else the TCP peer).

An IPv4 address and its IPv4-mapped IPv6 form (``::ffff:10.0.0.1``, what a
dual-stack proxy names in its PROXY header) are one client, whichever form the
client and the networks are written in: the networks are brought to the IPv4
form when the lists are built (``::ffff:10.0.0.0/104`` holds what
``10.0.0.0/8`` holds, ``::/0`` also every IPv4 client:
`proxyproto._ip.unmap_network`), the client's address at each lookup. The rule
reported is the network as configured.

Lookups cost one bisection, whatever the number of networks: the networks of
one list and family become sorted, disjoint integer ranges (a network inside
another one of the same list is dropped; the outer one is the rule reported).
Pure: no I/O.
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import TypeAlias

from proxyproto._ip import ip_text, network_text, unmap_address, unmap_network

__all__ = ["AccessRules", "Verdict"]

Network: TypeAlias = IPv4Network | IPv6Network


@dataclass(frozen=True, slots=True)
class Verdict:
    """The decision on one client.

    Attributes:
        admitted: The client may go on.
        rule: The network that decided: the ``deny`` network the client is in
            (refused), or the ``allow`` network it is in (admitted). None when
            ``allow`` is empty and nothing denies (admitted), or when the
            client is in no ``allow`` network or has no IP address (refused).
        reason: One line for the logs, naming the client and the rule.
    """

    admitted: bool
    rule: Network | None
    reason: str


class _Ranges:
    """Networks of one family as sorted, disjoint ``[first, last]`` ranges,
    each with the configured network it stands for."""

    __slots__ = ("_firsts", "_lasts", "_networks")

    def __init__(self, networks: Iterable[tuple[Network, Network]]) -> None:
        """*networks*: ``(range, configured network)`` pairs. Of two equal
        ranges, one configured in its own family is the rule reported."""
        ordered = sorted(
            networks,
            key=lambda n: (
                int(n[0].network_address),
                n[0].prefixlen,
                n[0].version != n[1].version,
            ),
        )
        self._firsts: list[int] = []
        self._lasts: list[int] = []
        self._networks: list[Network] = []
        for network, rule in ordered:
            first = int(network.network_address)
            # CIDR networks are nested or disjoint: one that starts inside the
            # previous range lies wholly inside it.
            if self._lasts and first <= self._lasts[-1]:
                continue
            self._firsts.append(first)
            self._lasts.append(int(network.broadcast_address))
            self._networks.append(rule)

    def __bool__(self) -> bool:
        return bool(self._networks)

    def find(self, address: int) -> Network | None:
        """The network holding *address*, if any."""
        index = bisect.bisect_right(self._firsts, address) - 1
        if index >= 0 and address <= self._lasts[index]:
            return self._networks[index]
        return None


class _List:
    """One list (``allow`` or ``deny``), split by family."""

    __slots__ = ("_v4", "_v6")

    def __init__(self, networks: Iterable[Network]) -> None:
        forms = [(form, n) for n in networks for form in unmap_network(n)]
        self._v4 = _Ranges(f for f in forms if isinstance(f[0], IPv4Network))
        self._v6 = _Ranges(f for f in forms if isinstance(f[0], IPv6Network))

    def __bool__(self) -> bool:
        return bool(self._v4) or bool(self._v6)

    def find(self, address: IPv4Address | IPv6Address) -> Network | None:
        """The configured network holding *address* (IPv4-mapped: as IPv4)."""
        if isinstance(address, IPv4Address):
            return self._v4.find(int(address))
        return self._v6.find(int(address))


class AccessRules:
    """A listener's ``allow`` and ``deny`` networks, ready for lookups.

    Args:
        allow: Networks whose clients are admitted; empty admits everyone.
        deny: Networks whose clients are refused, whatever *allow* says.
    """

    __slots__ = ("_allow", "_deny")

    def __init__(self, allow: Iterable[Network], deny: Iterable[Network]) -> None:
        self._allow = _List(allow)
        self._deny = _List(deny)

    def check(self, client: str | None) -> Verdict:
        """Decide on the client at IP address *client* (text, as in a socket
        address; a ``%scope`` suffix is allowed). None, or text that is not an
        IP address (a UNIX socket's path), is in no network."""
        try:
            given = None if client is None else ipaddress.ip_address(client)
        except ValueError:
            given = None
        if given is None:
            if self._allow:
                return Verdict(
                    admitted=False,
                    rule=None,
                    reason="client has no IP address and allow lists networks",
                )
            return Verdict(admitted=True, rule=None, reason="allow is empty")
        address = unmap_address(given)
        denied_by = self._deny.find(address)
        if denied_by is not None:
            return Verdict(
                admitted=False,
                rule=denied_by,
                reason=f"client {ip_text(given)} is in deny {network_text(denied_by)}",
            )
        if not self._allow:
            return Verdict(admitted=True, rule=None, reason="allow is empty")
        allowed_by = self._allow.find(address)
        if allowed_by is None:
            return Verdict(
                admitted=False,
                rule=None,
                reason=f"client {ip_text(given)} is in no allow network",
            )
        return Verdict(
            admitted=True,
            rule=allowed_by,
            reason=f"client {ip_text(given)} is in allow {network_text(allowed_by)}",
        )
