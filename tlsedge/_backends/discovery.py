"""DNS service discovery: a backend's servers from A/AAAA or SRV records.

A ``[[backends]]`` table with a ``discovery`` table instead of ``servers`` gets
its servers from DNS (in Kubernetes: a headless Service, whose name resolves to
the ready pods' addresses). The name is looked up when the backend is built and
then again every ``refresh`` seconds, with dnspython's asynchronous resolver on
its trio backend, so a lookup never blocks the event loop.

What a lookup gives:

- ``type = "A"``: every A and AAAA address of the name, each with the
  configured ``port`` and weight 1. A name with only one family is fine.
- ``type = "SRV"``: the records of the *lowest* priority value only (RFC 2782:
  a client must try the lowest priority first; tlsedge has no failover between
  priority groups, so higher ones are ignored). Each record's target is
  resolved to its addresses, from the answer's additional section when the
  server sent them (CoreDNS does), else by an A/AAAA lookup; the port is the
  record's. SRV weights (0..65535) become server weights (1..256): weight 0
  counts as 1, and when the largest weight is above 256 every weight is scaled
  down in proportion (at least 1). A target of ``"."`` ("no service") is skipped.

What happens with the answer (the pool applies it with ``Balancer.set_servers``):

- servers that stay keep their `Server` object, hence their health state and
  connection counts; new ones are added; removed ones get no new connections
  while their open connections carry on (they *drain*);
- a failed lookup (timeout, SERVFAIL, NXDOMAIN, no resolver configuration)
  keeps the last good list and logs a warning;
- an empty answer (the name exists but has no records) also keeps the last good
  list and logs a warning: an empty list would refuse every connection, which
  is worse than trying servers that may be gone (the health checks and passive
  checks take dead ones out);
- until a first good answer arrives, lookups are retried every second (or every
  ``refresh`` if that is shorter) instead of every ``refresh``.

Each lookup gives up after ``min(refresh, 5)`` seconds.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Final, NoReturn

import dns.asyncbackend
import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.resolver
import trio
from dns.rdtypes.IN.A import A
from dns.rdtypes.IN.AAAA import AAAA
from dns.rdtypes.IN.SRV import SRV

from tlsedge._core.accesslog import format_address
from tlsedge._core.config import MAX_WEIGHT, DiscoveryConfig

__all__ = ["DiscoveryError", "DnsDiscovery", "Found", "scale_srv_weights"]

LOGGER = logging.getLogger("tlsedge.discovery")

#: ``((ip, port), weight)``: one discovered server.
Found = tuple[tuple[str, int], int]

#: Upper bound on one lookup (dnspython's ``lifetime``).
MAX_LOOKUP_TIME: Final = 5.0
#: Retry interval while no good answer has been seen yet.
INITIAL_RETRY: Final = 1.0


class DiscoveryError(Exception):
    """A DNS lookup failed; the message says which name and why."""


def scale_srv_weights(weights: Sequence[int]) -> list[int]:
    """Map SRV weights (0..65535) onto server weights (1..`MAX_WEIGHT`).

    Weight 0 becomes 1; if the largest weight exceeds `MAX_WEIGHT`, every
    weight is scaled by ``MAX_WEIGHT / largest`` (rounded, at least 1).
    """
    largest = max(weights, default=0)
    if largest <= MAX_WEIGHT:
        return [max(1, weight) for weight in weights]
    return [max(1, round(weight * MAX_WEIGHT / largest)) for weight in weights]


def _sort_key(found: Found) -> tuple[int, int, int]:
    (host, port), _ = found
    address = ipaddress.ip_address(host)
    return (address.version, int(address), port)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.rstrip(".")


class DnsDiscovery:
    """Looks up one backend's ``discovery`` name and remembers the last good list.

    Args:
        config: The backend's ``discovery`` table.
        backend: The backend's name, for log lines.
    """

    def __init__(self, config: DiscoveryConfig, backend: str) -> None:
        """Prepare the lookups; the resolver is built on first use."""
        self.config = config
        self.backend = backend
        #: The last good answer (sorted), or None before the first one.
        self.last: list[Found] | None = None
        self._resolver: dns.asyncresolver.Resolver | None = None
        self._dns_backend = dns.asyncbackend.get_backend("trio")

    @property
    def interval(self) -> float:
        """Seconds until the next lookup: shorter until a good answer came."""
        if self.last is None:
            return min(self.config.refresh, INITIAL_RETRY)
        return self.config.refresh

    def _get_resolver(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            nameserver = self.config.nameserver
            try:
                if nameserver is None:
                    resolver = dns.asyncresolver.Resolver()  # /etc/resolv.conf
                else:
                    resolver = dns.asyncresolver.Resolver(configure=False)
                    resolver.nameservers = [
                        dns.nameserver.Do53Nameserver(nameserver.host, nameserver.port)
                    ]
            except (dns.exception.DNSException, OSError) as exc:
                raise DiscoveryError(
                    f"no DNS resolver configuration: {_describe(exc)}"
                ) from exc
            lifetime = min(self.config.refresh, MAX_LOOKUP_TIME)
            resolver.lifetime = lifetime
            resolver.timeout = lifetime
            self._resolver = resolver
        return self._resolver

    async def _query(
        self, name: str | dns.name.Name, rdtype: str, *, search: bool
    ) -> dns.resolver.Answer | None:
        """One query; None for "the name has no records of this type"."""
        resolver = self._get_resolver()
        try:
            return await resolver.resolve(
                name, rdtype, search=search, backend=self._dns_backend
            )
        except dns.resolver.NoAnswer:
            return None
        except dns.resolver.NXDOMAIN as exc:
            raise DiscoveryError(f"{name} {rdtype}: no such name") from exc
        except (dns.exception.DNSException, OSError) as exc:
            raise DiscoveryError(f"{name} {rdtype}: {_describe(exc)}") from exc

    async def _addresses(self, name: str | dns.name.Name, *, search: bool) -> list[str]:
        """The A and AAAA addresses of *name* (either family may be missing)."""
        addresses: list[str] = []
        for rdtype in ("A", "AAAA"):
            answer = await self._query(name, rdtype, search=search)
            if answer is not None:
                addresses.extend(_addresses_of(answer))
        return addresses

    async def lookup(self) -> list[Found]:
        """Resolve the name once: the servers found, sorted (maybe none).

        Raises:
            DiscoveryError: the lookup failed.
        """
        config = self.config
        found: dict[tuple[str, int], int] = {}
        if config.type == "A":
            assert config.port is not None  # the config loader ensures it
            for host in await self._addresses(config.name, search=True):
                found.setdefault((host, config.port), 1)
        else:
            for address, weight in await self._lookup_srv():
                found[address] = max(weight, found.get(address, 0))
        return sorted(found.items(), key=_sort_key)

    async def _lookup_srv(self) -> list[Found]:
        answer = await self._query(self.config.name, "SRV", search=True)
        if answer is None:
            return []
        records = [
            rdata
            for rdata in answer
            if isinstance(rdata, SRV) and rdata.target != dns.name.root
        ]
        if not records:
            return []
        lowest = min(record.priority for record in records)
        group = [record for record in records if record.priority == lowest]
        weights = scale_srv_weights([record.weight for record in group])
        additional: dict[dns.name.Name, list[str]] = {}
        for rrset in answer.response.additional:
            additional.setdefault(rrset.name, []).extend(_addresses_of(rrset))
        result: list[Found] = []
        for record, weight in zip(group, weights, strict=True):
            if record.port == 0:
                continue
            hosts = additional.get(record.target) or await self._addresses(
                record.target, search=False
            )
            result.extend(((host, record.port), weight) for host in hosts)
        return result

    async def refresh(self) -> list[Found] | None:
        """Look up once and apply the policy of the module docstring.

        Returns:
            The new list when it is good and differs from the last one; None to
            keep the current servers (unchanged, failed or empty answer).
        """
        name = self.config.name
        try:
            found = await self.lookup()
        except DiscoveryError as exc:
            kept = (
                f"keeping the last {len(self.last)} servers"
                if self.last is not None
                else "no servers yet"
            )
            LOGGER.warning(
                "backend %s: DNS lookup failed (%s); %s", self.backend, exc, kept
            )
            return None
        if not found:
            kept = (
                f"keeping the last {len(self.last)} servers"
                if self.last is not None
                else "no servers yet"
            )
            LOGGER.warning(
                "backend %s: DNS name %s has no %s records; %s",
                self.backend,
                name,
                "A/AAAA" if self.config.type == "A" else "usable SRV",
                kept,
            )
            return None
        if found == self.last:
            return None
        previous = dict(self.last or [])
        now = dict(found)
        added = [f"+{format_address(a)}" for a in now if a not in previous]
        removed = [f"-{format_address(a)}" for a in previous if a not in now]
        changed = [
            f"{format_address(a)} weight {previous[a]}->{w}"
            for a, w in now.items()
            if a in previous and previous[a] != w
        ]
        LOGGER.info(
            "backend %s: DNS %s now gives %d servers (%s)",
            self.backend,
            name,
            len(found),
            ", ".join(added + removed + changed),
        )
        self.last = found
        return found

    async def run(
        self,
        apply: Callable[[list[Found]], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> NoReturn:
        """Refresh forever, calling *apply* with each new good list.

        The first lookup happens after `interval` (the pool resolved once
        already when it was built).
        """
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            found = await self.refresh()
            if found is not None:
                apply(found)


def _addresses_of(rdatas: Iterable[object]) -> list[str]:
    """The addresses of the A and AAAA records among *rdatas*."""
    return [str(r.address) for r in rdatas if isinstance(r, A | AAAA)]
