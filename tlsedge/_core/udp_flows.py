"""UDP flows without I/O: the flow table, idle expiry, PROXY v2 per datagram,
whose fault a failed send is, and the throttle for drop warnings.

A *flow* is the datagrams of one client address (and, behind a trusted load
balancer, of one peer and the client its headers name) to one backend server.
`tlsedge._pipeline.udp` owns the sockets and drives them on the reactor; what it
decides per datagram lives here, as plain functions and records.

Expiry: `FlowTable` keeps its flows in the order of their last datagram
(either way): touching a flow moves it to the end (``OrderedDict.move_to_end``,
O(1)), so the flows that expired are always at the front, and the next one to
expire is the first. Finding the expired flows costs what they are, never a
scan of the table.
"""

from __future__ import annotations

import errno
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final, Generic, Protocol, TypeVar

from proxyproto import (
    TLV,
    Command,
    Family,
    InetAddress,
    Policy,
    ProxyHeader,
    RemoteProtocolError,
    Transport,
    encode_v2,
    parse,
)
from proxyproto._ip import ip_text

__all__ = [
    "MAX_DATAGRAM",
    "DropLog",
    "FlowTable",
    "Unwrapped",
    "dgram_proxy_header",
    "send_drop_reason",
    "unwrap_datagram",
]

#: Receive buffer: the largest UDP payload (65535 - 8 bytes of UDP header;
#: IPv4 datagrams carry at most 65507 bytes, IPv6 jumbograms are not used).
MAX_DATAGRAM: Final = 65535


class _Timed(Protocol):
    last_seen: float


F = TypeVar("F", bound=_Timed)


class FlowTable(Generic[F]):
    """The open flows of one listener, by key, in the order of last use."""

    __slots__ = ("_flows",)

    def __init__(self) -> None:
        self._flows: OrderedDict[Hashable, F] = OrderedDict()

    def __len__(self) -> int:
        return len(self._flows)

    def get(self, key: Hashable) -> F | None:
        return self._flows.get(key)

    def add(self, key: Hashable, flow: F, now: float) -> None:
        """Add a new *flow*, used at *now* (the key must not be in the table)."""
        assert key not in self._flows
        flow.last_seen = now
        self._flows[key] = flow

    def touch(self, key: Hashable, flow: F, now: float) -> None:
        """A datagram of *flow* went either way at *now*."""
        flow.last_seen = now
        self._flows.move_to_end(key)

    def discard(self, key: Hashable, flow: F) -> None:
        """Remove *flow* if it is the one under *key* (a new flow of the same
        client may have taken the key since the old one was expired)."""
        if self._flows.get(key) is flow:
            del self._flows[key]

    def next_expiry(self, idle_timeout: float) -> float | None:
        """When the least recently used flow expires; None when empty."""
        for flow in self._flows.values():
            return flow.last_seen + idle_timeout
        return None

    def pop_expired(self, now: float, idle_timeout: float) -> list[F]:
        """Remove and return the flows idle for *idle_timeout* at *now*."""
        expired: list[F] = []
        flows = self._flows
        while flows:
            key, flow = next(iter(flows.items()))
            if flow.last_seen + idle_timeout > now:
                break
            del flows[key]
            expired.append(flow)
        return expired

    def values(self) -> list[F]:
        return list(self._flows.values())


@dataclass(frozen=True, slots=True)
class Unwrapped:
    """A datagram after the listener's PROXY policy: who sent it, to where,
    and its payload. *drop* names why it is dropped instead (a metrics
    reason), with *detail* for the log."""

    client: tuple[str, int] | None = None
    destination: tuple[str, int] | None = None
    payload: bytes = b""
    drop: str | None = None
    detail: str = ""


_V2_ONLY: Final = frozenset({2})


def unwrap_datagram(
    data: bytes,
    policy: Policy,
    peer: tuple[str, int],
    local: tuple[str, int],
) -> Unwrapped:
    """Apply the trust *policy* decided for *peer* to one datagram.

    A trusted peer (REQUIRE) must start every datagram with a PROXY v2 header
    of a DGRAM transport; its source is the client, its destination where the
    client sent to. An untrusted peer is dropped (REJECT) or served directly
    (SKIP: the datagram is passed on whole, header or not).

    Drop reasons: ``rejected`` (untrusted peer), ``header_error`` (no valid
    v2 header, or not DGRAM), ``health_check`` (a LOCAL header: the load
    balancer's own datagram, which has no client to relay for).
    """
    if policy is Policy.SKIP:
        return Unwrapped(client=peer, destination=local, payload=data)
    if policy is not Policy.REQUIRE:
        return Unwrapped(drop="rejected", detail="peer is not trusted")
    try:
        header, consumed = parse(data, versions=_V2_ONLY)
    except RemoteProtocolError as exc:
        return Unwrapped(drop="header_error", detail=str(exc))
    if header.command is Command.LOCAL or header.family is Family.UNSPEC:
        return Unwrapped(drop="health_check", detail="LOCAL header")
    if header.transport is not Transport.DGRAM:
        return Unwrapped(
            drop="header_error",
            detail=f"header transport is {header.transport.name}, not DGRAM",
        )
    source, destination = header.source, header.destination
    if not isinstance(source, InetAddress) or not isinstance(destination, InetAddress):
        return Unwrapped(drop="header_error", detail="header has no IP addresses")
    return Unwrapped(
        client=(ip_text(source.host), source.port),
        destination=(ip_text(destination.host), destination.port),
        payload=data[consumed:],
    )


def dgram_proxy_header(
    client: tuple[str, int],
    destination: tuple[str, int],
    *,
    unique_id: bytes | None,
    crc32c: bool,
) -> bytes:
    """The PROXY v2 header that starts every datagram of a flow to the server
    (``send_proxy = "v2"``): the client, the address it sent to, DGRAM."""
    tlvs = () if unique_id is None else (TLV.unique_id(unique_id),)
    header = ProxyHeader.from_addresses(
        client, destination, version=2, transport=Transport.DGRAM, tlvs=tlvs
    )
    return encode_v2(header, crc32c=crc32c)


#: Errors of a send to a server that are not the server's: the datagram is
#: dropped for this reason, the flow goes on and the server's health is
#: untouched. Any other error is the server's side (an ICMP error it sent
#: back, no route to it): the flow ends as ``server_error``.
_SEND_DROPS: Final = {
    # Too large to send: the datagram with the PROXY header exceeds the
    # largest UDP payload (65507 bytes over IPv4), or the path MTU with
    # don't-fragment set. The client chose its size.
    errno.EMSGSIZE: "too_large",
    # This host cannot queue it now (interface queue or memory full, as the
    # send buffer can be: BlockingIOError): what a flood of datagrams causes.
    errno.ENOBUFS: "server_busy",
    errno.ENOMEM: "server_busy",
}


def send_drop_reason(error: OSError) -> str | None:
    """The drop reason when a send of a client's datagram to its server
    failed with *error* for a cause that is not the server's (the datagram,
    this host); None when the server's side failed."""
    return _SEND_DROPS.get(error.errno) if error.errno is not None else None


class DropLog:
    """Counts dropped datagrams by reason and says when to log them: at the
    first drop, then at most once per *interval* (a flood must cost a
    counter, not a log line per datagram)."""

    __slots__ = ("_counts", "_interval", "_next")

    def __init__(self, interval: float = 1.0) -> None:
        self._interval = interval
        self._next = float("-inf")
        self._counts: dict[str, int] = {}

    def add(self, reason: str, now: float) -> dict[str, int] | None:
        """Count one drop at *now*; returns the counts to log (and starts a
        new period) when a line is due, else None."""
        counts = self._counts
        counts[reason] = counts.get(reason, 0) + 1
        if now < self._next:
            return None
        self._next = now + self._interval
        self._counts = {}
        return counts
