"""proxyproto for Twisted: read the PROXY header below TLS and the protocol.

Twisted's own ``twisted.protocols.haproxy`` wraps the *protocol*, so
``haproxy:ssl:...`` expects the header inside TLS (twisted/twisted#9041), has
no TLVs, and guesses nothing but trusts everyone. Here the header is read
directly on the socket, before anything else:

- the endpoint string ``proxyproto:<endpoint>`` (a Twisted plugin,
  ``twisted/plugins/proxyproto_endpoint.py``) works wherever Twisted takes
  one: ``daphne -e``, ``twistd web --listen``, ``serverFromString``::

      proxyproto:tcp:8000:interface=127.0.0.1:trusted=10.0.0.0/8
      proxyproto:ssl:8443:privateKey=key.pem:certKey=cert.pem

  With ``ssl:`` the TLS handshake starts on the bytes after the header.
- ``proxy_endpoint(reactor, "tcp:8000", trust=...)`` is the same in code;
  ``ProxyWrappingFactory(factory, trust=...)`` wraps a factory for
  ``reactor.listenTCP`` (``tls=`` for TLS after the header).

The application's transport reports the header's addresses from ``getPeer()``
and ``getHost()`` (so ``twisted.web``'s ``getClientAddress()`` and Daphne's
``scope["client"]`` are the real client), and
``find_proxy_protocol(transport)`` returns the ``ProxyProtocol`` holding the
``header`` (every TLV), the load balancer's address and ``client_tls`` (the
SSL TLV says the client used TLS to the load balancer). For Daphne,
``DaphneScopeMiddleware(app)`` puts the header in
``scope["extensions"]["proxyproto"]`` and makes the scheme ``https``/``wss``
when ``client_tls``. (The transport does not claim ``ISSLTransport`` for
that: code that sees one expects a TLS connection under it, as Autobahn
does for its channel id.)

Theory of operation
-------------------
The listening port's factory is a ``ProxyWrappingFactory``; each connection
starts as a ``ProxyProtocol`` with no application protocol behind it. On
``connectionMade`` it decides the ``Policy`` from the socket's peer and local
address: REJECT closes, SKIP hands over at once, otherwise a ``HeaderReader``
and one timer (``header_timeout``, for the whole header) start. Bytes go to
the reader until it returns the header; then the application's protocol is
built (by the wrapped factory, with the header's client address), connected
to this wrapper as its transport, and given the bytes that followed the
header. With TLS after the header the wrapped factory is a
``TLSMemoryBIOFactory``, so those bytes start the handshake. A bad, missing,
incomplete or late header closes the connection with one WARNING on the
``proxyproto.twisted`` logger; a peer that resets before its header is
complete (HAProxy's ``check``) or closes without sending a byte (a TCP health
check) gets one INFO line. The application never hears of a refused
connection.

An endpoint string's own endpoint (``tcp:``, ``ssl:``, ``unix:``,
``systemd:``, ...) is parsed by Twisted as usual, against a stand-in reactor
(``_ListeningReactor``) whose ``listenTCP``/``listenSSL``/``listenUNIX``/
``adoptStreamPort`` put a ``ProxyWrappingFactory`` directly on the socket and
TLS, if any, above it.

Checked against Twisted 26.10.0 and Daphne 4.2.3.
"""

from __future__ import annotations

import argparse
import enum
import functools
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from proxyproto._adapters import (
    DEFAULT_TIMEOUT,
    HeaderAddress,
    log_refusal,
    select_addresses,
)
from proxyproto._asgi import (
    DEFAULT_TRUSTED,
    Connection,
    make_trust_policy,
    parse_trusted,
    scope_with_connection,
)
from proxyproto._errors import RemoteProtocolError
from proxyproto._events import NEED_DATA, NO_HEADER, InetAddress, ProxyHeader
from proxyproto._extras import require
from proxyproto._policy import Policy, TrustPolicy
from proxyproto._reader import HeaderReader, ReaderOptions

require("twisted", feature="proxyproto.twisted", extra="twisted")

from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress
from twisted.internet.endpoints import quoteStringArgument, serverFromString
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IListeningPort,
    IReactorTime,
    IStreamServerEndpoint,
    IStreamServerEndpointStringParser,
    ITransport,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.plugin import IPlugin
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from zope.interface import directlyProvides, implementer, providedBy

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TRUSTED",
    "DaphneScopeMiddleware",
    "ProxyEndpointParser",
    "ProxyProtocol",
    "ProxyWrappingFactory",
    "find_proxy_protocol",
    "proxy_endpoint",
]

LOGGER = logging.getLogger("proxyproto.twisted")

#: The endpoint string prefix: ``proxyproto:<endpoint>``.
PREFIX = "proxyproto"

#: How far ``find_proxy_protocol`` follows ``.transport`` links (TLS, HTTP/2
#: and other wrappers add one each).
_MAX_TRANSPORT_DEPTH = 8


class _Stage(enum.Enum):
    #: Waiting for the header (or for the policy decision in connectionMade).
    READING = "reading"
    #: The application's protocol is connected and gets every byte.
    HANDED_OVER = "handed_over"
    #: Refused, or lost before its header: bytes are dropped.
    CLOSED = "closed"


def _socket_tuple(address: IAddress) -> tuple[str, int] | None:
    if isinstance(address, (IPv4Address, IPv6Address)):
        return (address.host, address.port)
    return None


def _twisted_address(address: HeaderAddress) -> IAddress:
    if isinstance(address, InetAddress):
        kind = IPv6Address if address.host.version == 6 else IPv4Address
        return kind("TCP", str(address.host), address.port)
    assert address is not None  # uses_header_addresses: a PROXY command
    return UNIXAddress(address.path)


class ProxyProtocol(ProtocolWrapper):
    """Reads one connection's PROXY header, then serves it with the wrapped
    factory's protocol, as that protocol's transport.

    Attributes:
        header: the header once read (None before, and for SKIP).
        policy: the policy applied (None before ``connectionMade``).
        peer_address: the socket's peer (the load balancer).
        local_address: the socket's local address.
        client_tls: the header applies and its SSL TLV says the client used
            TLS to the load balancer.
    """

    factory: ProxyWrappingFactory

    def __init__(self, factory: ProxyWrappingFactory) -> None:
        # The application's protocol is built once the header is known;
        # until then this placeholder never sees an event.
        super().__init__(factory, Protocol())
        self._stage = _Stage.READING
        self._reader: HeaderReader | None = None
        self._timer: IDelayedCall | None = None
        self.header: ProxyHeader | None = None
        self.policy: Policy | None = None
        self.peer_address: IAddress | None = None
        self.local_address: IAddress | None = None
        self.client_tls = False

    def logPrefix(self) -> str:
        return f"{type(self.factory.wrappedFactory).__name__} (PROXY)"

    # -- the transport the application sees --------------------------------

    def getPeer(self) -> IAddress:
        """The client: the header's source when it applies, else the socket's
        peer (LOCAL, UNKNOWN, IGNORE, SKIP)."""
        return self._addresses()[0]

    def getHost(self) -> IAddress:
        """The address the client connected to, by the same rule."""
        return self._addresses()[1]

    def _addresses(self) -> tuple[IAddress, IAddress]:
        assert self.transport is not None
        peer = self.peer_address or self.transport.getPeer()
        local = self.local_address or self.transport.getHost()
        if self.policy is None:
            return peer, local
        return select_addresses(self.header, self.policy, peer, local, _twisted_address)

    # -- events from the real transport --------------------------------------

    def makeConnection(self, transport: ITransport) -> None:
        # ProtocolWrapper's, minus connecting the application: that waits
        # for the header.
        directlyProvides(self, providedBy(transport))
        Protocol.makeConnection(self, transport)
        self.factory.registerProtocol(self)

    def connectionMade(self) -> None:
        assert self.transport is not None
        self.peer_address = self.transport.getPeer()
        self.local_address = self.transport.getHost()
        settings = self.factory.settings
        self.policy = policy = settings.trust.decide(
            _socket_tuple(self.peer_address), _socket_tuple(self.local_address)
        )
        if policy is Policy.REJECT:
            self._refuse(
                RemoteProtocolError(
                    "not a trusted source (trust policy REJECT)", reason="rejected"
                )
            )
            return
        if policy is Policy.SKIP:
            self._hand_over(None, b"")
            return
        self._reader = HeaderReader(
            optional=policy is Policy.USE, **settings.reader_options
        )
        self._timer = settings.reactor().callLater(
            settings.header_timeout, self._timed_out
        )

    def dataReceived(self, data: bytes) -> None:
        if self._stage is _Stage.HANDED_OVER:
            self.wrappedProtocol.dataReceived(data)
        elif self._stage is _Stage.READING and self._reader is not None:
            self._reader.receive_data(data)
            self._advance()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_timer()
        if self._stage is _Stage.READING and self._reader is not None:
            if reason.check(ConnectionDone) is not None:
                # A FIN inside the header: the reader says what was missing.
                self._reader.receive_data(b"")
                self._advance()
            else:
                LOGGER.info(
                    "connection from %s lost before its header: %s",
                    _socket_tuple_or_none(self.peer_address),
                    reason.getErrorMessage(),
                )
        stage, self._stage = self._stage, _Stage.CLOSED
        self.factory.unregisterProtocol(self)
        if stage is _Stage.HANDED_OVER:
            self.wrappedProtocol.connectionLost(reason)

    # -- internals --------------------------------------------------------------

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            if self._timer.active():
                self._timer.cancel()
            self._timer = None

    def _refuse(self, exc: RemoteProtocolError) -> None:
        self._stage = _Stage.CLOSED
        self._cancel_timer()
        self._reader = None
        log_refusal(LOGGER, _socket_tuple_or_none(self.peer_address), exc)
        assert self.transport is not None
        self.transport.loseConnection()

    def _timed_out(self) -> None:
        self._timer = None
        if self._stage is _Stage.READING:
            timeout = self.factory.settings.header_timeout
            self._refuse(
                RemoteProtocolError(
                    f"no complete PROXY header within {timeout} s", reason="timeout"
                )
            )

    def _advance(self) -> None:
        assert self._reader is not None
        try:
            event = self._reader.next_event()
        except RemoteProtocolError as exc:
            self._refuse(exc)
            return
        if event is NEED_DATA:
            return
        header = None if event is NO_HEADER else event
        assert header is None or isinstance(header, ProxyHeader)
        leftover = self._reader.trailing_data
        self._reader = None
        self._hand_over(header, leftover)

    def _hand_over(self, header: ProxyHeader | None, leftover: bytes) -> None:
        self._cancel_timer()
        self.header = header
        assert self.policy is not None
        self.client_tls = Connection.from_header(header, self.policy, None).client_tls
        protocol = self.factory.wrappedFactory.buildProtocol(self.getPeer())
        assert self.transport is not None
        if protocol is None:  # the factory refused the client
            self._stage = _Stage.CLOSED
            self.transport.loseConnection()
            return
        self._stage = _Stage.HANDED_OVER
        self.wrappedProtocol = protocol
        protocol.makeConnection(self)
        if leftover and self._stage is _Stage.HANDED_OVER:
            protocol.dataReceived(leftover)


def _socket_tuple_or_none(address: IAddress | None) -> tuple[str, int] | None:
    return None if address is None else _socket_tuple(address)


@dataclass(frozen=True)
class _Settings:
    trust: TrustPolicy
    header_timeout: float
    reader_options: ReaderOptions
    reactor: Callable[[], IReactorTime]


def _global_reactor() -> IReactorTime:
    # Imported when first needed: importing it installs the default reactor,
    # which must not happen before Daphne (or twistd) installs theirs.
    from twisted.internet import reactor

    return cast(IReactorTime, reactor)


class ProxyWrappingFactory(WrappingFactory):
    """A server factory whose connections start by reading a PROXY header.

    ``reactor.listenTCP(8000, ProxyWrappingFactory(site, trust=trust))``.

    Args:
        wrapped_factory: the application's factory; its protocols are built
            once the header is read, with the header's client address.
        trust: decides each connection's ``Policy`` from its peer and local
            address.
        header_timeout: seconds the complete header may take to arrive.
        tls: start TLS after the header with this context factory
            (``twisted.internet.ssl.CertificateOptions``, ...); needs
            pyOpenSSL (``twisted[tls]``).
        reader_options: ``HeaderReader`` options (``versions``,
            ``max_v2_length``, ``verify_crc32c``, ...).
        reactor: for the header timer (default: the global reactor).
    """

    protocol = ProxyProtocol

    def __init__(
        self,
        wrapped_factory: Factory,
        *,
        trust: TrustPolicy,
        header_timeout: float = DEFAULT_TIMEOUT,
        tls: object = None,
        reader_options: ReaderOptions | None = None,
        reactor: IReactorTime | None = None,
    ) -> None:
        if tls is not None:
            from twisted.protocols.tls import TLSMemoryBIOFactory

            wrapped_factory = TLSMemoryBIOFactory(tls, False, wrapped_factory)
        super().__init__(wrapped_factory)
        self.settings = _Settings(
            trust=trust,
            header_timeout=header_timeout,
            reader_options=reader_options or {},
            reactor=_global_reactor if reactor is None else lambda: reactor,
        )

    def buildProtocol(self, addr: IAddress | None) -> ProxyProtocol:
        return ProxyProtocol(self)


class _ListeningReactor:
    """The reactor as an endpoint string's own endpoint sees it.

    Its listen calls put a ``ProxyWrappingFactory`` directly on the socket
    (with TLS, if the endpoint asked for it, above the PROXY layer); every
    other attribute is the real reactor's.
    """

    def __init__(self, reactor: Any, wrap: Callable[..., ProxyWrappingFactory]) -> None:
        self._reactor = reactor
        self._wrap = wrap

    def listenTCP(
        self, port: int, factory: Factory, backlog: int = 50, interface: str = ""
    ) -> IListeningPort:
        listen = self._reactor.listenTCP
        return cast(
            IListeningPort, listen(port, self._wrap(factory), backlog, interface)
        )

    def listenSSL(
        self,
        port: int,
        factory: Factory,
        contextFactory: object,
        backlog: int = 50,
        interface: str = "",
    ) -> IListeningPort:
        wrapped = self._wrap(factory, tls=contextFactory)
        return cast(
            IListeningPort,
            self._reactor.listenTCP(port, wrapped, backlog, interface),
        )

    def listenUNIX(
        self,
        address: str,
        factory: Factory,
        backlog: int = 50,
        mode: int = 0o666,
        wantPID: bool = False,
    ) -> IListeningPort:
        return cast(
            IListeningPort,
            self._reactor.listenUNIX(
                address, self._wrap(factory), backlog, mode, wantPID
            ),
        )

    def adoptStreamPort(
        self, fileDescriptor: int, addressFamily: socket.AddressFamily, factory: Factory
    ) -> IListeningPort:
        adopt = self._reactor.adoptStreamPort
        return cast(
            IListeningPort, adopt(fileDescriptor, addressFamily, self._wrap(factory))
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reactor, name)


def proxy_endpoint(
    reactor: Any,
    description: str,
    *,
    trust: TrustPolicy,
    header_timeout: float = DEFAULT_TIMEOUT,
    reader_options: ReaderOptions | None = None,
) -> IStreamServerEndpoint:
    """The server endpoint *description* (``"tcp:8000"``, ``"ssl:8443:..."``,
    ``"unix:/run/app.sock"``, ...) with a PROXY header read on every
    connection before anything else (before TLS, too).

    Raises:
        ValueError: *description* is not a server endpoint description.
    """

    def wrap(factory: Factory, tls: object = None) -> ProxyWrappingFactory:
        return ProxyWrappingFactory(
            factory,
            trust=trust,
            header_timeout=header_timeout,
            tls=tls,
            reader_options=reader_options,
            reactor=reactor,
        )

    endpoint: IStreamServerEndpoint = serverFromString(
        _ListeningReactor(reactor, wrap), description
    )
    return endpoint


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"headerTimeout: expected seconds > 0, got {value!r}")
    return seconds


def _versions(value: str) -> set[int]:
    versions = {part.strip() for part in value.split(",")}
    if not versions or not versions <= {"1", "2"}:
        raise ValueError(f"versions: expected 1, 2 or 1,2, got {value!r}")
    return {int(version) for version in versions}


def _trust(trusted: str | None, untrusted: str) -> TrustPolicy:
    try:
        policy = {"reject": Policy.REJECT, "skip": Policy.SKIP}[untrusted]
    except KeyError:
        raise ValueError(
            f"untrusted: expected reject or skip, got {untrusted!r}"
        ) from None
    if trusted is None:
        return make_trust_policy(DEFAULT_TRUSTED, policy)
    try:
        entries = parse_trusted(trusted)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"trusted: {exc}") from None
    if "*" in entries:
        return TrustPolicy.everyone(Policy.REQUIRE)
    return make_trust_policy(entries, policy)


def _unparse(args: tuple[object, ...], kwargs: Mapping[str, object]) -> str:
    return ":".join(
        [quoteStringArgument(str(arg)) for arg in args]
        + [
            f"{quoteStringArgument(str(key))}={quoteStringArgument(str(value))}"
            for key, value in kwargs.items()
        ]
    )


#: The keyword arguments of a ``proxyproto:`` string that are not its endpoint's.
_OPTIONS = ("trusted", "untrusted", "headerTimeout", "versions")


@implementer(IPlugin, IStreamServerEndpointStringParser)
class ProxyEndpointParser:
    """The ``proxyproto:`` endpoint string (installed as a Twisted plugin).

    ``proxyproto:<endpoint>[:trusted=CIDRS][:untrusted=reject|skip]
    [:headerTimeout=SECONDS][:versions=1,2]``: *endpoint* is any server
    endpoint string (``tcp:8000:interface=127.0.0.1``, ``ssl:...``,
    ``unix:...``). ``trusted`` lists the load balancers, comma-separated,
    colons escaped (``trusted=10.0.0.0/8,fd00\\:\\:/8``), or ``*``; default
    127.0.0.1 and ::1.
    """

    prefix = PREFIX

    def parseStreamServer(
        self, reactor: Any, *args: object, **kwargs: object
    ) -> IStreamServerEndpoint:
        """The endpoint for ``proxyproto:`` + *args* and *kwargs*.

        Raises:
            ValueError: a bad option value or endpoint description.
        """
        options = {k: str(kwargs.pop(k)) for k in _OPTIONS if k in kwargs}
        if not args:
            raise ValueError("proxyproto: needs an endpoint, e.g. proxyproto:tcp:8000")
        reader_options: ReaderOptions = {}
        if "versions" in options:
            reader_options["versions"] = _versions(options["versions"])
        return proxy_endpoint(
            reactor,
            _unparse(args, kwargs),
            trust=_trust(options.get("trusted"), options.get("untrusted", "reject")),
            header_timeout=_positive_seconds(
                options.get("headerTimeout", str(DEFAULT_TIMEOUT))
            ),
            reader_options=reader_options,
        )


def find_proxy_protocol(transport: object) -> ProxyProtocol | None:
    """The ``ProxyProtocol`` below *transport* (a protocol's ``transport``,
    through TLS and other wrappers), or None if there is none."""
    for _ in range(_MAX_TRANSPORT_DEPTH):
        if isinstance(transport, ProxyProtocol):
            return transport
        transport = getattr(transport, "transport", None)
        if transport is None:
            return None
    return None


ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


class DaphneScopeMiddleware:
    """Gives a Daphne app the PROXY header: ``scope["extensions"]["proxyproto"]
    == {"header": ProxyHeader | None, "peer": (host, port)}`` (``peer`` is
    the load balancer), and the scheme ``https`` / ``wss`` when the client
    used TLS to the load balancer (``ProxyProtocol.client_tls``).

    ``application = DaphneScopeMiddleware(get_asgi_application())``, served
    by ``daphne -e proxyproto:tcp:8000 ...``.

    Private API: Daphne's ``send`` is ``functools.partial(server.handle_reply,
    protocol)`` (checked against Daphne 4.2.3; ``test_private_api`` checks
    it); the connection is found below ``protocol.transport``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] in ("http", "websocket") and isinstance(
            send, functools.partial
        ):
            protocol = send.args[0] if send.args else None
            proxy = find_proxy_protocol(getattr(protocol, "transport", None))
            if proxy is not None and proxy.policy is not None:
                connection = Connection.from_header(
                    proxy.header,
                    proxy.policy,
                    _socket_tuple_or_none(proxy.peer_address),
                )
                scope = scope_with_connection(scope, connection)
        await self.app(scope, receive, send)
