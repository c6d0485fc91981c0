"""What the client session and the upstream exchange hand the driver (pure).

Both sides speak the same small vocabulary, h11's in spirit: a head
(`Request`, `Informational`, `Response`), then `Body` pieces, then one
`EndOfBody`; `NEED_DATA` when more bytes must arrive first; `ConnectionClosed`
when the peer closed where that is allowed. The exchange takes a request as a
method, a target, fields and a `BodyKind`; whatever reads requests from a
client (this package's HTTP/1.1 session today, an HTTP/2 stream later) hands it
those and relays what comes back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, NamedTuple

from tlsedge._http.body import BodyKind
from tlsedge._http.head import RequestHead, ResponseHead

__all__ = [
    "NEED_DATA",
    "Body",
    "ConnectionClosed",
    "EndOfBody",
    "Informational",
    "NeedData",
    "Request",
    "Response",
]

Header = tuple[bytes, bytes]


class NeedData(enum.Enum):
    """More bytes must arrive before the next event (the only member)."""

    NEED_DATA = "need_data"


NEED_DATA: Final = NeedData.NEED_DATA


class Request(NamedTuple):
    """A request head from the client, checked; ``size`` is its length in bytes
    (a named tuple, as the heads: one per request, and a frozen dataclass sets
    each field with a call)."""

    head: RequestHead
    size: int


@dataclass(frozen=True, slots=True)
class Informational:
    """A 1xx response head from the upstream (101: the protocol switches)."""

    head: ResponseHead


class Response(NamedTuple):
    """The final response head from the upstream, and how its body is framed
    (a named tuple, as `Request`)."""

    head: ResponseHead
    body: BodyKind


@dataclass(frozen=True, slots=True)
class Body:
    """Body bytes (never empty; chunked framing removed)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class EndOfBody:
    """The end of a message body, with its trailer fields (chunked only)."""

    trailers: list[Header]


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    """The client closed between requests (``in_head``: inside a head's bytes)."""

    in_head: bool = False
