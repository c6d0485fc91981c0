"""Who may connect to a listener: its ``allow`` and ``deny`` networks.

Kubernetes' ``loadBalancerSourceRanges`` for tlsedge (docs/configuration.md,
"Client source ranges"). A client is admitted when its address is in an
``allow`` network (or ``allow`` is empty: everyone) and in no ``deny`` network:
deny wins. The address judged is the real client's, as the connection's owner
hands it over (the trusted PROXY header's source, else the TCP peer); an
IPv4-mapped IPv6 address (``::ffff:10.0.0.1``) is judged as the IPv4 address
it carries, and as itself against IPv6 networks.

Lookups cost one bisection per family, whatever the number of networks: the
networks of one list and family become sorted, disjoint integer ranges (a
network inside another one of the same list is dropped; the outer one is the
rule reported). Pure: no I/O.
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import TypeAlias

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
    """Networks of one family as sorted, disjoint ``[first, last]`` ranges."""

    __slots__ = ("_firsts", "_lasts", "_networks")

    def __init__(self, networks: Iterable[Network]) -> None:
        ordered = sorted(networks, key=lambda n: (int(n.network_address), n.prefixlen))
        self._firsts: list[int] = []
        self._lasts: list[int] = []
        self._networks: list[Network] = []
        for network in ordered:
            first = int(network.network_address)
            # CIDR networks are nested or disjoint: one that starts inside the
            # previous range lies wholly inside it.
            if self._lasts and first <= self._lasts[-1]:
                continue
            self._firsts.append(first)
            self._lasts.append(int(network.broadcast_address))
            self._networks.append(network)

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
        networks = tuple(networks)
        self._v4 = _Ranges(n for n in networks if isinstance(n, IPv4Network))
        self._v6 = _Ranges(n for n in networks if isinstance(n, IPv6Network))

    def __bool__(self) -> bool:
        return bool(self._v4) or bool(self._v6)

    def find(self, address: IPv4Address | IPv6Address) -> Network | None:
        if isinstance(address, IPv4Address):
            return self._v4.find(int(address))
        mapped = address.ipv4_mapped
        if mapped is not None:
            found = self._v4.find(int(mapped))
            if found is not None:
                return found
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
            address = None if client is None else ipaddress.ip_address(client)
        except ValueError:
            address = None
        if address is None:
            if self._allow:
                return Verdict(
                    admitted=False,
                    rule=None,
                    reason="client has no IP address and allow lists networks",
                )
            return Verdict(admitted=True, rule=None, reason="allow is empty")
        denied_by = self._deny.find(address)
        if denied_by is not None:
            return Verdict(
                admitted=False,
                rule=denied_by,
                reason=f"client {address} is in deny {denied_by}",
            )
        if not self._allow:
            return Verdict(admitted=True, rule=None, reason="allow is empty")
        allowed_by = self._allow.find(address)
        if allowed_by is None:
            return Verdict(
                admitted=False,
                rule=None,
                reason=f"client {address} is in no allow network",
            )
        return Verdict(
            admitted=True,
            rule=allowed_by,
            reason=f"client {address} is in allow {allowed_by}",
        )
