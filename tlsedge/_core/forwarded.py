"""Forwarding headers: X-Forwarded-*, RFC 7239 ``Forwarded`` and the request id.

Pure functions on h11-style header lists (``(name, value)`` byte pairs, names in
any case, order kept); no I/O. The HTTP proxy (``tlsedge._http``) calls
`rewrite_forwarding_headers` once per request with what it knows about the
connection.

The trust rule (uvicorn's ``forwarded_allow_ips``, nginx's ``set_real_ip_from``):
the *peer* is the real client address after PROXY unwrapping. When the peer is
not in ``[listeners.forwarded] trusted_proxies``, every client-sent
``X-Forwarded-For``, ``X-Forwarded-Proto``, ``X-Forwarded-Port``,
``X-Forwarded-Host``, ``X-Real-IP`` and ``Forwarded`` field is removed (names
compared case-insensitively, every occurrence) before ours are added, so a
client cannot claim to be someone else. A field named like one of these with
``_`` for ``-`` (``X_Forwarded_For``, ``X_Real_IP``; also the request id's
name) is removed from everyone, trusted or not: CGI and WSGI map both spellings
to the same ``HTTP_X_FORWARDED_FOR`` key, and no proxy writes the underscore
form (`forwarding_key`). From a trusted peer the list-valued
headers (``X-Forwarded-For``, ``Forwarded``) keep their chain and get our hop
appended (a field value holding a control character is dropped from the
chain); the single-valued ones (``X-Forwarded-Proto``/``-Port``) are kept as
the trusted proxy set them, and only added when absent.

Formats, as HAProxy and nginx write them: ``X-Forwarded-For`` carries the bare
address (IPv6 without brackets, no port, no zone id). ``Forwarded`` (RFC 7239 section 4)
carries nodes with ports, IPv6 in brackets, and quotes every value that is not
a token: ``for="[2001:db8::1]:4711";proto=https;host=example.com;by="192.0.2.1:443"``.

Nothing a peer sent can inject a header: values we emit are built from parsed
IP addresses, ports and validated host names; `quote_value` refuses control
characters (CR, LF, NUL, ...) and h11 refuses them again when it serialises.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from tlsedge._core.config import ForwardedConfig, Network

__all__ = [
    "FORWARDING_HEADERS",
    "ForwardingContext",
    "choose_request_id",
    "client_ip_text",
    "forwarded_element",
    "forwarded_node",
    "forwarding_key",
    "is_trusted_peer",
    "is_valid_request_id",
    "new_request_id",
    "quote_value",
    "rewrite_forwarding_headers",
]

Header = tuple[bytes, bytes]

#: Client-sent fields removed from untrusted peers (lower case).
FORWARDING_HEADERS: Final = frozenset(
    {
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-port",
        b"x-forwarded-host",
        b"x-real-ip",
        b"forwarded",
    }
)

#: Random bytes in a generated request id: 128 bits, as a UUID4 (hex: 32 chars).
REQUEST_ID_BYTES: Final = 16
#: Longest request id kept from a trusted proxy. AWS X-Amzn-Trace-Id values are
#: ~40 characters, W3C traceparent 55; 128 leaves room without letting a peer
#: fill the access log.
MAX_REQUEST_ID_LENGTH: Final = 128

# RFC 9110 token characters.
_TOKEN_RE: Final = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# What a kept request id may contain: UUIDs, hex, base64(url), trace ids.
_REQUEST_ID_RE: Final = re.compile(rb"[A-Za-z0-9._:+/=-]{1,%d}" % MAX_REQUEST_ID_LENGTH)
# Control characters (HTAB excepted) may never appear in a value we emit.
_CONTROL_RE: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")

_XFF: Final = b"x-forwarded-for"
_XFP: Final = b"x-forwarded-proto"
_XFPORT: Final = b"x-forwarded-port"
_FORWARDED: Final = b"forwarded"


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardingContext:
    """What the edge knows about one request's connection.

    Attributes:
        client: The real client ``(ip, port)`` after PROXY unwrapping, or None.
        destination: The address the client connected to, or None.
        tls: True when the listener terminated TLS (proto ``https``).
        trusted: True when the peer is in ``trusted_proxies``.
        host: The request's ``Host`` value (already validated), for
            ``Forwarded: host=``; None or empty leaves the parameter out.
    """

    client: tuple[str, int] | None
    destination: tuple[str, int] | None
    tls: bool
    trusted: bool
    host: bytes | None = None


def _parse_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address in *host*, IPv4-mapped IPv6 as IPv4, without a zone id.

    A zone id (``fe80::1%eth0``, as ``getpeername`` reports link-local peers)
    names an interface of this host: meaningless to the next hop, not part of the
    address syntax of RFC 7239 nodes or of X-Forwarded-For parsers, and free text
    (it could hold a comma, a quote or a control character).
    """
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped:
            return address.ipv4_mapped
        if address.scope_id is not None:
            return ipaddress.IPv6Address(address.packed)
    return address


def is_trusted_peer(host: str | None, trusted: Sequence[Network]) -> bool:
    """True when *host* (an IP address text) is inside one of *trusted*.

    An IPv4-mapped IPv6 address (``::ffff:10.0.0.1``) is judged as the IPv4
    address it carries; *trusted* holds the IPv4-mapped ranges of its networks
    as IPv4 too (``ForwardedConfig`` makes them so), so either form of an
    address matches either form of a network. Anything that is not an IP
    address is untrusted.
    """
    if host is None or not trusted:
        return False
    address = _parse_ip(host)
    if address is None:
        return False
    return any(address in network for network in trusted)


@functools.lru_cache(maxsize=4096)
def client_ip_text(host: str | None) -> bytes:
    """The ``X-Forwarded-For`` form of an address: canonical, IPv6 bare.

    An address that does not parse becomes ``unknown`` (RFC 7239's word for it)
    rather than letting odd text into a header. Cached: a client connection
    asks once per request, and parsing an address costs microseconds.
    """
    address = _parse_ip(host) if host is not None else None
    if address is None:
        return b"unknown"
    return str(address).encode("ascii")


def quote_value(value: bytes) -> bytes:
    """An RFC 7239 value: the token as it is, else a quoted-string.

    Raises:
        ValueError: *value* contains a control character (CR, LF, NUL, ...).
    """
    if _CONTROL_RE.search(value):
        msg = f"control character in forwarded value {value!r}"
        raise ValueError(msg)
    if _TOKEN_RE.fullmatch(value):
        return value
    escaped = value.replace(b"\\", b"\\\\").replace(b'"', b'\\"')
    return b'"' + escaped + b'"'


def forwarded_node(address: tuple[str, int] | None) -> bytes:
    """An RFC 7239 node (section 6) for ``for=`` / ``by=``, quoted as needed.

    ``192.0.2.1:80`` -> ``"192.0.2.1:80"``; IPv6 goes in brackets
    (``"[2001:db8::1]:4711"``); an unknown address is ``unknown``.
    """
    if address is None:
        return b"unknown"
    parsed = _parse_ip(address[0])
    if parsed is None:
        return b"unknown"
    text = f"[{parsed}]" if parsed.version == 6 else str(parsed)
    if address[1]:
        text = f"{text}:{int(address[1])}"
    return quote_value(text.encode("ascii"))


def forwarded_element(context: ForwardingContext) -> bytes:
    """Our hop as one ``Forwarded`` element: ``for=..;proto=..;host=..;by=..``."""
    pairs = [
        b"for=" + forwarded_node(context.client),
        b"proto=" + (b"https" if context.tls else b"http"),
    ]
    if context.host:
        # A value we would have to mangle is left out rather than emitted.
        with contextlib.suppress(ValueError):
            pairs.append(b"host=" + quote_value(context.host))
    if context.destination is not None:
        pairs.append(b"by=" + forwarded_node(context.destination))
    return b";".join(pairs)


def forwarding_key(name: bytes) -> bytes:
    """*name* as compared with the forwarding headers: lower case, ``_`` as ``-``.

    ``X_Forwarded_For`` -> ``x-forwarded-for``: the key CGI/WSGI servers give
    it (``HTTP_X_FORWARDED_FOR``) is the real header's.
    """
    return name.lower().replace(b"_", b"-")


def new_request_id() -> bytes:
    """A fresh random request id (32 lower-case hex digits)."""
    return os.urandom(REQUEST_ID_BYTES).hex().encode("ascii")


def is_valid_request_id(value: bytes) -> bool:
    """True when *value* is a request id we are willing to pass on and log."""
    return _REQUEST_ID_RE.fullmatch(value) is not None


def _joined(headers: Iterable[Header], name: bytes) -> bytes:
    """Every value of *name*, in order, as one comma-separated list.

    A value holding a control character (CR, LF, NUL, ...) is left out: it is
    no list of hops, and we never emit one (h11 refuses CR, LF and NUL on input
    already; this keeps the promise for any caller).
    """
    values = [v.strip() for n, v in headers if n.lower() == name]
    return b", ".join(v for v in values if v and not _CONTROL_RE.search(v))


def choose_request_id(
    headers: Sequence[Header], name: bytes, *, trusted: bool
) -> bytes:
    """Keep a trusted proxy's well-formed request id; otherwise make a new one.

    Exactly one occurrence is needed to keep it: two ids are ambiguous. *name*
    is compared case-insensitively, like the fields' names.
    """
    if trusted:
        name = name.lower()
        values = [v for n, v in headers if n.lower() == name]
        if len(values) == 1 and is_valid_request_id(values[0]):
            return values[0]
    return new_request_id()


@functools.lru_cache(maxsize=64)
def _removed_keys(
    trusted: bool, request_id_key: bytes | None
) -> tuple[frozenset[bytes], frozenset[bytes]]:
    """The `forwarding_key` of the fields that go (managed), and of those
    that go when their name has a ``_`` (look-alikes), for one kind of peer."""
    managed = {_XFF, _FORWARDED}
    if not trusted:
        managed |= FORWARDING_HEADERS
    lookalikes = set(FORWARDING_HEADERS)
    if request_id_key is not None:
        managed.add(request_id_key)
        lookalikes.add(request_id_key)
    return frozenset(managed), frozenset(lookalikes)


def rewrite_forwarding_headers(
    headers: Sequence[Header],
    config: ForwardedConfig,
    context: ForwardingContext,
    *,
    request_id: tuple[bytes, bytes] | None = None,
) -> list[Header]:
    """The request's headers with the forwarding headers for the next hop.

    Args:
        headers: The request's fields (name case is kept; compared lower-case).
        config: ``[listeners.forwarded]``.
        context: The connection facts and whether the peer is trusted.
        request_id: ``(header name, value)`` to set (every client-sent field of
            that name is replaced), or None.

    Returns:
        A new list: untouched fields in their order, then ours. From an
        untrusted peer every field named in `FORWARDING_HEADERS` is gone; from
        any peer, every underscore spelling of those names and of the request
        id's (`forwarding_key`).
    """
    managed, lookalikes = _removed_keys(
        context.trusted,
        forwarding_key(request_id[0]) if request_id is not None else None,
    )
    out = [
        (n, v)
        for n, v in headers
        if (key := n.lower().replace(b"_", b"-")) not in managed
        and (key not in lookalikes or b"_" not in n)
    ]
    present = (
        {n.lower() for n, _ in out}
        if config.x_forwarded_proto or config.x_forwarded_port
        else set()
    )
    if config.x_forwarded_for:
        chain = _joined(headers, _XFF) if context.trusted else b""
        ip = client_ip_text(context.client[0] if context.client else None)
        out.append((b"X-Forwarded-For", chain + b", " + ip if chain else ip))
    elif context.trusted and (chain := _joined(headers, _XFF)):
        out.append((b"X-Forwarded-For", chain))
    if config.x_forwarded_proto and _XFP not in present:
        out.append((b"X-Forwarded-Proto", b"https" if context.tls else b"http"))
    if (
        config.x_forwarded_port
        and _XFPORT not in present
        and context.destination is not None
    ):
        out.append((b"X-Forwarded-Port", str(int(context.destination[1])).encode()))
    if config.forwarded:
        chain = _joined(headers, _FORWARDED) if context.trusted else b""
        element = forwarded_element(context)
        out.append((b"Forwarded", chain + b", " + element if chain else element))
    elif context.trusted and (chain := _joined(headers, _FORWARDED)):
        out.append((b"Forwarded", chain))
    if request_id is not None:
        out.append(request_id)
    return out
