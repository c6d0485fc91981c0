"""What a PROXY-sending client puts in front of each connection (private).

``proxyproto.httpx``, ``proxyproto.requests`` and ``proxyproto send`` share
one value, a ``HeaderPlan``: either a fixed ``ProxyHeader`` (sent as given on
every connection), or the recipe of a load balancer, whose header describes
the connection it opened: the socket's own address as the source and the
server's as the destination (what ``curl --haproxy-protocol`` sends), each of
which the caller may replace (``source=("203.0.113.7", 5555)``: a client the
test pretends to relay). Pure values, stdlib only, no ``socket`` import: the
caller hands in the connection's addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxyproto._errors import LocalProtocolError
from proxyproto._events import TLV, InetAddress, ProxyHeader, UnixAddress
from proxyproto._v1 import encode_v1
from proxyproto._v2 import encode_v2

__all__ = ["AddressArg", "Endpoint", "HeaderPlan", "plan_header"]

#: An endpoint as callers give it: ``("203.0.113.7", 5555)`` (IPv6 hosts
#: bare, without brackets) or an address object.
AddressArg = InetAddress | UnixAddress | tuple[str, int]
#: A connection's endpoint as ``getsockname()``/``getpeername()`` return it
#: (``(host, port)``, IPv6's 4-tuple, a UNIX path), or an address object.
Endpoint = InetAddress | UnixAddress | tuple[object, ...] | str | bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderPlan:
    """The header each new connection starts with.

    Attributes:
        header: sent as is on every connection (``version`` is the header's
            own); when ``None``, a PROXY header is built per connection from
            ``source`` and ``destination``.
        version: 1 or 2, for built headers.
        source: the client endpoint; ``None`` means the socket's own
            (local) address.
        destination: the server endpoint; ``None`` means the address the
            socket is connected to.
        tlvs: TLVs of a built v2 header.
        crc32c: add a CRC32C TLV (v2).
        pad_to: pad a v2 header with a NOOP TLV to this many bytes.
    """

    header: ProxyHeader | None = None
    version: int = 2
    source: InetAddress | UnixAddress | None = None
    destination: InetAddress | UnixAddress | None = None
    tlvs: tuple[TLV, ...] = ()
    crc32c: bool = False
    pad_to: int | None = None

    def wire(self, local: Endpoint, peer: Endpoint) -> bytes:
        """The header bytes for a connection from *local* to *peer* (socket
        addresses as ``getsockname()`` and ``getpeername()`` return them).

        Raises:
            LocalProtocolError: the header cannot be built or encoded (e.g. a
                UNIX source for a TCP connection's destination).
        """
        header = self.header
        if header is None:
            header = ProxyHeader.from_addresses(
                local if self.source is None else self.source,
                peer if self.destination is None else self.destination,
                version=self.version,
                tlvs=self.tlvs,
            )
        if header.version == 1:
            return encode_v1(header)
        return encode_v2(header, crc32c=self.crc32c, pad_to=self.pad_to)


def _address(value: AddressArg | None) -> InetAddress | UnixAddress | None:
    if value is None or isinstance(value, (InetAddress, UnixAddress)):
        return value
    host, port = value
    return InetAddress.parse(host, port)


def plan_header(
    header: ProxyHeader | None = None,
    *,
    version: int = 2,
    source: AddressArg | None = None,
    destination: AddressArg | None = None,
    tlvs: tuple[TLV, ...] = (),
    crc32c: bool = False,
    pad_to: int | None = None,
) -> HeaderPlan:
    """A ``HeaderPlan`` from the arguments the clients take, checked now (a
    mistake is a ``LocalProtocolError`` here, not on the first request).

    Raises:
        LocalProtocolError: contradictory arguments (a *header* and the
            fields it would replace; TLVs, a CRC32C or padding on v1; an
            unknown version) or an invalid address.
    """
    if header is not None:
        if source is not None or destination is not None or tlvs:
            raise LocalProtocolError(
                "give a header, or source/destination/tlvs to build one: not both"
            )
        plan = HeaderPlan(header=header, crc32c=crc32c, pad_to=pad_to)
        check: tuple[Endpoint, Endpoint] = ("0.0.0.0", 0), ("0.0.0.0", 0)
    else:
        if version not in (1, 2):
            raise LocalProtocolError(f"version must be 1 or 2, got {version!r}")
        plan = HeaderPlan(
            version=version,
            source=_address(source),
            destination=_address(destination),
            tlvs=tuple(tlvs),
            crc32c=crc32c,
            pad_to=pad_to,
        )
        given = [a for a in (plan.source, plan.destination) if a is not None]
        if len(given) == 1 and isinstance(given[0], UnixAddress):
            raise LocalProtocolError(
                "a UNIX source or destination needs the other one too (the "
                "connection's own endpoints are TCP)"
            )
        # TCP stand-ins for the endpoints left to the connection.
        check = ("127.0.0.1", 1), ("127.0.0.1", 2)
    if (version if header is None else header.version) == 1 and (
        crc32c or pad_to is not None
    ):
        raise LocalProtocolError("v1 headers cannot carry a CRC32C or padding")
    plan.wire(*check)
    return plan
