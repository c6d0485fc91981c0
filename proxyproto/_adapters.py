"""Helpers shared by the I/O adapters (private).

``proxyproto.trio``, ``proxyproto.sockets``, ``proxyproto.asyncio`` and the
servers built on them all answer the same questions about a connection: does
the PROXY header's address pair replace the socket's, in what form is an
address handed to the application, and how is a refused header logged.
Functions on values: stdlib only, no ``socket`` import (``import proxyproto``
never loads this module, but the adapters that do load it should not pay for
one either).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeGuard, TypeVar

from proxyproto._errors import RemoteProtocolError
from proxyproto._events import Command, InetAddress, ProxyHeader, UnixAddress
from proxyproto._ip import ip_text
from proxyproto._policy import Policy

#: The spec asks receivers to wait at least 3 s (a TCP retransmit); 5 s is
#: Caddy's and proxy-protocol-rs's default.
DEFAULT_TIMEOUT = 5.0

HeaderAddress = InetAddress | UnixAddress | None
_Real = TypeVar("_Real")
_Converted = TypeVar("_Converted")


def format_address(address: object) -> tuple[str, int] | None:
    """A socket address as ``(host, port)`` (IPv6 flow info and scope id
    dropped); ``None`` for anything else (a UNIX socket path, ``None``)."""
    if isinstance(address, (tuple, list)) and len(address) >= 2:
        return (str(address[0]), int(address[1]))
    return None


def inet_address(address: HeaderAddress) -> tuple[str, int] | None:
    """A header address as ``(host, port)`` (also for IPv6; IPv4-mapped as
    ``::ffff:a.b.c.d``, `ip_text`); ``None`` for a UNIX address or none."""
    if isinstance(address, InetAddress):
        return (ip_text(address.host), address.port)
    return None


def header_address(address: HeaderAddress) -> tuple[str, int] | str | None:
    """A header address as ``(host, port)``, or the decoded path of a UNIX
    address; ``None`` if there is none."""
    if isinstance(address, UnixAddress):
        return os.fsdecode(address.path)
    return inet_address(address)


def uses_header_addresses(
    header: ProxyHeader | None, policy: Policy
) -> TypeGuard[ProxyHeader]:
    """Whether *header*'s addresses replace the socket's: a PROXY command
    with addresses, under ``REQUIRE`` or ``USE``. Not for LOCAL, UNKNOWN,
    ``IGNORE`` or ``SKIP`` (no header), where the real endpoints apply."""
    return (
        header is not None
        and policy in (Policy.REQUIRE, Policy.USE)
        and header.command is Command.PROXY
        and header.source is not None
    )


def select_addresses(
    header: ProxyHeader | None,
    policy: Policy,
    peer: _Real,
    local: _Real,
    convert: Callable[[HeaderAddress], _Converted],
) -> tuple[_Real | _Converted, _Real | _Converted]:
    """``(client, server)``: the header's source and destination (through
    *convert*) when ``uses_header_addresses``, otherwise the socket's real
    *peer* and *local* addresses."""
    if uses_header_addresses(header, policy):
        return convert(header.source), convert(header.destination)
    return peer, local


def log_refusal(logger: logging.Logger, peer: object, exc: RemoteProtocolError) -> None:
    """Log, in one line on *logger*, why *peer*'s connection is closed before
    its header was read.

    A peer that closed without sending a byte (``reason == "empty"``) is what
    TCP health checks and port scans do: not a refused client, so INFO, as
    for a peer that reset. Anything else (a ``REJECT`` peer; a bad, missing,
    truncated or late header): WARNING.
    """
    if exc.reason == "empty":
        logger.info(
            "connection from %s closed before its header, without sending a byte",
            peer,
        )
    else:
        logger.warning("closing connection from %s: %s", peer, exc)
