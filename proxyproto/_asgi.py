"""What the ASGI adapters (``proxyproto.uvicorn``, ``.hypercorn``, Daphne's in
``.twisted``, gunicorn's ASGI worker in ``.gunicorn``) share (private).

- the scope extension: ``ProxyInfo``, ``Connection`` (what a connection
  brings to its scopes: the extension and, from the header's SSL TLV, the
  scheme), ``scope_with_connection``, ``ProxyScopeMiddleware`` and the
  context variable Hypercorn's connections carry their ``Connection`` in;
- ``make_trust_policy`` for the ``trusted``/``untrusted`` arguments, and the
  ``--proxy-*`` command-line options;
- the header's addresses in the form servers read from a socket
  (``header_addresses``, ``AddressSocket``);
- ``ServerProtocolWrapper``: ``proxyproto.asyncio.ProxyProtocolWrapper`` set
  up for a server's per-connection protocol, built once the header is read.

Server-agnostic: imports none of the servers (nor trio).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any, TypedDict, cast

from proxyproto._adapters import (
    DEFAULT_TIMEOUT,
    HeaderAddress,
    format_address,
    uses_header_addresses,
)
from proxyproto._events import InetAddress, ProxyHeader, SSLClient, UnixAddress
from proxyproto._ip import ip_text
from proxyproto._policy import Policy, TrustPolicy
from proxyproto._reader import ReaderOptions
from proxyproto.asyncio import ProxyProtocolWrapper

__all__ = [
    "DEFAULT_SSL_HANDSHAKE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "DEFAULT_TRUSTED",
    "EXTENSION",
    "TRUSTED_ENVIRONMENT",
    "ASGIApp",
    "AddressSocket",
    "AsyncioSettings",
    "Connection",
    "ProxyInfo",
    "ProxyScopeMiddleware",
    "ServerProtocolWrapper",
    "SocketAddress",
    "TrustedArg",
    "header_addresses",
    "make_trust_policy",
    "parse_proxy_arguments",
    "parse_trusted",
    "print_proxy_help",
    "proxy_argument_parser",
    "scope_with_connection",
    "set_current_connection",
]

#: Who may send a header when nothing else is configured: only this host.
DEFAULT_TRUSTED: tuple[str, ...] = ("127.0.0.1/32", "::1/128")
#: The key of the scope extension: ``scope["extensions"]["proxyproto"]``.
EXTENSION = "proxyproto"
#: TLS handshake time limit after the header (asyncio; Hypercorn's own
#: ``ssl_handshake_timeout`` is used when serving with Hypercorn).
DEFAULT_SSL_HANDSHAKE_TIMEOUT = 60.0

SocketAddress = tuple[str, int]
ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]
TrustedArg = Iterable[str | IPv4Network | IPv6Network | IPv4Address | IPv6Address]


class ProxyInfo(TypedDict):
    """The value of ``scope["extensions"]["proxyproto"]``.

    Attributes:
        header: the connection's PROXY header; ``None`` when the trust policy
            let the peer in without one (``Policy.SKIP``, or ``Policy.USE``
            and none was sent).
        peer: the real socket peer (the load balancer), ``None`` if unknown.
    """

    header: ProxyHeader | None
    peer: SocketAddress | None


#: The scheme of a connection whose client used TLS to the load balancer.
_TLS_SCHEMES = {"http": "https", "ws": "wss"}


@dataclass(frozen=True, slots=True)
class Connection:
    """What a connection brings to each of its HTTP and WebSocket scopes.

    Attributes:
        info: ``scope["extensions"]["proxyproto"]``.
        client_tls: the client reached the load balancer over TLS: the
            header applies (``uses_header_addresses``: a PROXY command under
            ``REQUIRE`` or ``USE``) and its SSL TLV has the ``SSLClient.SSL``
            flag. The scope's ``scheme`` is then ``https`` / ``wss``.
    """

    info: ProxyInfo
    client_tls: bool

    @classmethod
    def from_header(
        cls, header: ProxyHeader | None, policy: Policy, peer: SocketAddress | None
    ) -> Connection:
        """The ``Connection`` of a header read under *policy* from *peer*."""
        ssl_info = header.ssl if uses_header_addresses(header, policy) else None
        return cls(
            info=ProxyInfo(header=header, peer=peer),
            client_tls=ssl_info is not None and SSLClient.SSL in ssl_info.client,
        )


def make_trust_policy(
    trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
    untrusted: Policy = Policy.REJECT,
) -> TrustPolicy:
    """The ``TrustPolicy`` for the adapters' ``trusted``/``untrusted`` arguments.

    Args:
        trusted: a ``TrustPolicy``, or CIDRs/addresses of the load balancers,
            which must send a header (``Policy.REQUIRE``).
        untrusted: the policy for every other peer (``REJECT``: close;
            ``SKIP``: serve directly, no header).
    """
    if isinstance(trusted, TrustPolicy):
        return trusted
    if isinstance(trusted, str):
        trusted = [trusted]
    return TrustPolicy.from_cidrs(trusted, untrusted=untrusted)


# --------------------------------------------------------------------------
# The header's addresses as a server's socket reports them
# --------------------------------------------------------------------------


def _socket_form(address: HeaderAddress) -> Any:
    # What getpeername() would return: a 4-tuple for IPv6, the raw path for
    # a UNIX address (servers check the family, then index the tuple).
    if isinstance(address, InetAddress):
        if isinstance(address.host, IPv6Address):
            return (ip_text(address.host), address.port, 0, 0)
        return (ip_text(address.host), address.port)
    if isinstance(address, UnixAddress):
        return address.path
    return None


def header_addresses(
    header: ProxyHeader | None, policy: Policy
) -> tuple[Any, Any] | None:
    """``(client, server)`` in socket-address form if the header's addresses
    replace the socket's (a PROXY command with addresses, under REQUIRE or
    USE); ``None`` when the real endpoints apply (LOCAL, UNKNOWN, IGNORE)."""
    if not uses_header_addresses(header, policy):
        return None
    return _socket_form(header.source), _socket_form(header.destination)


class AddressSocket:
    """Stands in for a connection's socket where servers ask it for addresses.

    ``getpeername()``/``getsockname()`` give the header's addresses and
    ``family`` their family; everything else goes to the real socket.
    """

    def __init__(self, sock: Any, peer: Any, local: Any) -> None:
        self._sock = sock
        self._peer = peer
        self._local = local
        if isinstance(peer, str):
            self.family = socket.AF_UNIX
        elif isinstance(peer, tuple) and len(peer) == 4:
            self.family = socket.AF_INET6
        else:
            self.family = socket.AF_INET

    def getpeername(self) -> Any:
        """The client address from the header."""
        return self._peer

    def getsockname(self) -> Any:
        """The server address from the header."""
        return self._local

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def __repr__(self) -> str:
        return f"<AddressSocket peer={self._peer!r} local={self._local!r}>"


# --------------------------------------------------------------------------
# asyncio: the server's protocol behind a ProxyProtocolWrapper
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class AsyncioSettings:
    """How ``ServerProtocolWrapper`` treats each connection.

    Attributes:
        trust: decides each connection's policy from its peer/local address.
        header_timeout: seconds the complete header may take.
        ssl_context: if set, TLS is started after the header with it.
        ssl_handshake_timeout: seconds the TLS handshake may take.
        reader_options: further ``HeaderReader`` options.
        logger: where refused connections are logged.
    """

    trust: TrustPolicy
    logger: logging.Logger
    header_timeout: float = DEFAULT_TIMEOUT
    ssl_context: ssl.SSLContext | None = None
    ssl_handshake_timeout: float = DEFAULT_SSL_HANDSHAKE_TIMEOUT
    reader_options: Mapping[str, Any] = field(default_factory=dict)


class ServerProtocolWrapper(ProxyProtocolWrapper):
    """Reads the PROXY header, then hands the connection to *make_protocol*.

    One per connection, made by the server's protocol factory; everything
    but the three hooks below is ``ProxyProtocolWrapper``'s (REJECT closes
    at once, SKIP hands over at once, a bad, missing or late header closes
    the connection with a warning on ``settings.logger``; with
    ``settings.ssl_context`` TLS starts on the bytes after the header).

    - ``make_protocol``: the server's protocol, built from the connection's
      ``Connection`` once the header is read.
    - ``extra_info``: when the header's addresses apply, ``peername``,
      ``sockname`` and ``socket`` (an ``AddressSocket``) report them in
      socket-address form, which is where Uvicorn and Hypercorn look.
    - ``handshake_failed``: logged at INFO (a client's TLS trouble).

    Args:
        settings: trust policy, timeouts, TLS context, logger.
        make_protocol: builds the server's protocol from the ``Connection``.
    """

    def __init__(
        self,
        settings: AsyncioSettings,
        make_protocol: Callable[[Connection], asyncio.BaseProtocol],
    ) -> None:
        super().__init__(
            None,
            trust=settings.trust,
            header_timeout=settings.header_timeout,
            ssl=settings.ssl_context,
            ssl_handshake_timeout=settings.ssl_handshake_timeout,
            reader_options=cast(ReaderOptions, dict(settings.reader_options)),
            logger=settings.logger,
        )
        self._make_server_protocol = make_protocol
        self._connection: Connection | None = None

    def extra_info(self, extra: dict[str, object]) -> dict[str, object]:
        policy = extra["proxyproto.policy"]
        assert isinstance(policy, Policy)
        addresses = header_addresses(self.header, policy)
        if addresses is not None:
            client, server = addresses
            assert self._transport is not None
            sock = self._transport.get_extra_info("socket")
            extra["peername"] = client
            extra["sockname"] = server
            extra["socket"] = AddressSocket(sock, client, server)
        return extra

    def make_protocol(self, extra: Mapping[str, object]) -> asyncio.BaseProtocol:
        policy = extra["proxyproto.policy"]
        assert isinstance(policy, Policy)
        self._connection = Connection.from_header(
            self.header, policy, format_address(extra["proxyproto.peername"])
        )
        return self._make_server_protocol(self._connection)

    def handshake_failed(self, exc: BaseException) -> None:
        peer = None if self._connection is None else self._connection.info["peer"]
        self.logger.info("TLS handshake with %s failed: %r", peer, exc)


# --------------------------------------------------------------------------
# ASGI: the scope extension
# --------------------------------------------------------------------------

_CURRENT: contextvars.ContextVar[Connection] = contextvars.ContextVar(
    "proxyproto_connection"
)


def set_current_connection(connection: Connection) -> None:
    """Make *connection* the current task's connection (the app's tasks
    inherit it): what ``ProxyScopeMiddleware`` finds by default."""
    _CURRENT.set(connection)


def _current_connection(scope: Mapping[str, Any]) -> Connection | None:
    return _CURRENT.get(None)


class ProxyScopeMiddleware:
    """Adds ``scope["extensions"]["proxyproto"]`` to HTTP and WebSocket scopes,
    and makes their ``scheme`` ``https`` / ``wss`` when the client used TLS to
    the load balancer (``Connection.client_tls``), so that the URLs the app
    builds (``url_for``, redirects) use the scheme the client sees.

    The adapters wrap the app in it; *lookup* finds the ``Connection`` a
    scope belongs to (how depends on the server).

    Args:
        app: the ASGI 3 application.
        lookup: returns the ``Connection`` a scope belongs to, or ``None``.
    """

    def __init__(
        self,
        app: ASGIApp,
        lookup: Callable[[Mapping[str, Any]], Connection | None] = _current_connection,
    ) -> None:
        self.app = app
        self.lookup = lookup

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] in ("http", "websocket"):
            connection = self.lookup(scope)
            if connection is not None:
                scope = scope_with_connection(scope, connection)
        await self.app(scope, receive, send)


def scope_with_connection(
    scope: Mapping[str, Any], connection: Connection
) -> dict[str, Any]:
    """A copy of the HTTP or WebSocket *scope* with *connection*'s extension
    and, if the client used TLS to the load balancer, scheme."""
    scope = dict(scope)
    scope["extensions"] = {
        **(scope.get("extensions") or {}),
        EXTENSION: connection.info,
    }
    if connection.client_tls:
        # "scheme" is optional: "http" / "ws" by default.
        plain = scope.get("scheme", "http" if scope["type"] == "http" else "ws")
        scope["scheme"] = _TLS_SCHEMES.get(plain, plain)
    return scope


# --------------------------------------------------------------------------
# Command line: the --proxy-* options
# --------------------------------------------------------------------------


#: The environment variable read when ``--proxy-trusted`` is not given.
TRUSTED_ENVIRONMENT = "PROXYPROTO_TRUSTED"
_EVERYONE = "*"


def parse_trusted(text: str) -> list[str]:
    """A ``--proxy-trusted`` value: addresses and networks (CIDR), separated
    by commas, or ``*`` for every peer (as Uvicorn's ``--forwarded-allow-ips``).

    Raises:
        argparse.ArgumentTypeError: an entry is neither.
    """
    entries = [entry.strip() for entry in text.split(",")]
    for entry in entries:
        if entry == _EVERYONE:
            continue
        try:
            ipaddress.ip_network(entry)
        except ValueError as exc:
            where = f" in {text!r}" if len(entries) > 1 else ""
            raise argparse.ArgumentTypeError(
                "expected IP addresses or networks (CIDR) separated by commas, "
                f"or '*', got {entry!r}{where} ({exc})"
            ) from None
    return entries


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def proxy_argument_parser(prog: str) -> argparse.ArgumentParser:
    """The ``--proxy-*`` options both command lines add to the server's own."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    parser.add_argument(
        "--proxy-trusted",
        action="append",
        type=parse_trusted,
        metavar="CIDRS",
        help="load balancer addresses or networks that must send a PROXY header, "
        "comma-separated, or '*' for every peer (repeatable; default: "
        f"${TRUSTED_ENVIRONMENT}, else 127.0.0.1 and ::1)",
    )
    parser.add_argument(
        "--proxy-untrusted",
        choices=["reject", "skip"],
        default="reject",
        help="other peers: reject (close, the default) or skip (serve directly)",
    )
    parser.add_argument(
        "--proxy-timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"how long the header may take (default {DEFAULT_TIMEOUT})",
    )
    parser.add_argument(
        "--proxy-version",
        type=int,
        choices=[1, 2],
        action="append",
        help="accept only this PROXY version (repeatable; default both)",
    )
    return parser


def _trusted_argument(
    parser: argparse.ArgumentParser,
    lists: list[list[str]] | None,
    environ: Mapping[str, str],
) -> TrustPolicy | list[str]:
    if lists is None:
        text = environ.get(TRUSTED_ENVIRONMENT)
        if text is None:
            return list(DEFAULT_TRUSTED)
        try:
            lists = [parse_trusted(text)]
        except argparse.ArgumentTypeError as exc:
            parser.error(f"environment variable {TRUSTED_ENVIRONMENT}: {exc}")
    entries = [entry for entries in lists for entry in entries]
    if _EVERYONE in entries:
        return TrustPolicy.everyone(Policy.REQUIRE)
    return entries


def parse_proxy_arguments(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Split *argv* into the adapters' keyword arguments and the rest.

    ``--proxy-trusted`` defaults to ``$PROXYPROTO_TRUSTED`` (from *environ*,
    default ``os.environ``), then to ``DEFAULT_TRUSTED``. A bad value is a
    usage error (``parser.error``: the message and exit status 2).
    """
    args, rest = parser.parse_known_args(list(argv))
    kwargs: dict[str, Any] = {
        "trusted": _trusted_argument(
            parser, args.proxy_trusted, os.environ if environ is None else environ
        ),
        "untrusted": Policy(args.proxy_untrusted),
        "header_timeout": args.proxy_timeout,
    }
    if args.proxy_version:
        kwargs["versions"] = set(args.proxy_version)
    return kwargs, rest


def print_proxy_help(parser: argparse.ArgumentParser) -> None:
    """Print the ``--proxy-*`` options after the server's own ``--help``."""
    print("\nPROXY protocol options (proxyproto):")
    for action in parser._actions:
        print(f"  {', '.join(action.option_strings):<22} {action.help}")
