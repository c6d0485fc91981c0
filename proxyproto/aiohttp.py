"""Serve an ``aiohttp.web`` app behind a PROXY-protocol load balancer.

aiohttp has no hook below TLS and HTTP (aio-libs/aiohttp#11252), where the
header arrives. The sites here replace ``web.TCPSite`` / ``web.SockSite``:
every connection they accept reads the header first, then goes to the
runner's request handler::

    runner = web.AppRunner(app)
    await runner.setup()
    site = proxyproto.aiohttp.ProxyTCPSite(
        runner, "0.0.0.0", 8080, trusted=["10.0.0.0/8"]
    )
    await site.start()

or, like ``web.run_app``::

    proxyproto.aiohttp.run_app(app, port=8080, trusted=["10.0.0.0/8"])

What handlers see:

- ``request.remote``, ``request.host`` (without a Host header) and the access
  log: the addresses from the header.
- ``request.scheme`` / ``request.secure`` / ``request.url``: ``https`` when
  the site serves TLS itself (``ssl_context``, started *after* the header),
  or when the load balancer terminated TLS and says so in the header's SSL
  TLV (``SSLClient.SSL``: HAProxy ``send-proxy-v2-ssl``, tlsedge's
  ``send_proxy``).
- ``proxy_connection(request)``: the ``ProxyConnection`` (header with its
  TLVs, policy, the load balancer's address); the same keys as
  ``proxyproto.asyncio`` through ``request.get_extra_info("proxyproto.header")``.

How it hooks in: each site serves a ``ServerProtocolWrapper``
(``proxyproto._asgi``, as Uvicorn's and Hypercorn's asyncio adapters) per
connection, which hands the connection to ``runner.server()`` (aiohttp's
``RequestHandler``) once the header is read, with a transport reporting the
header's addresses. For the scheme, the site wraps the runner's
``web.Server.request_factory`` (a public attribute, read by each new request
handler): a request on a connection whose header says the client used TLS is
``request.clone(scheme="https")``, aiohttp's own way to set it.

Checked against aiohttp 3.14.5.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from proxyproto._asgi import (
    DEFAULT_SSL_HANDSHAKE_TIMEOUT,
    DEFAULT_TIMEOUT,
    DEFAULT_TRUSTED,
    AsyncioSettings,
    Connection,
    ServerProtocolWrapper,
    TrustedArg,
    make_trust_policy,
)
from proxyproto._extras import missing_extra
from proxyproto._policy import Policy, TrustPolicy
from proxyproto.sockets import ProxyConnection

try:
    from aiohttp import web
    from yarl import URL
except ModuleNotFoundError as exc:
    missing_extra(exc, feature="proxyproto.aiohttp", package="aiohttp", extra="aiohttp")

__all__ = [
    "DEFAULT_SSL_HANDSHAKE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "DEFAULT_TRUSTED",
    "ProxyConnection",
    "ProxySockSite",
    "ProxyTCPSite",
    "proxy_connection",
    "run_app",
]

LOGGER = logging.getLogger("proxyproto.aiohttp")

#: The transport ``extra`` keys ``proxyproto.asyncio`` sets on every
#: connection it hands over.
_HEADER = "proxyproto.header"
_POLICY = "proxyproto.policy"
_PEER = "proxyproto.peername"
_LOCAL = "proxyproto.sockname"


def proxy_connection(request: web.BaseRequest) -> ProxyConnection | None:
    """What *request*'s connection learned from its PROXY header.

    ``header`` (``None`` when the trust policy let the peer in without one),
    ``policy``, ``peer_address`` (the load balancer), ``local_address``, and
    ``client_address`` / ``server_address`` as ``request.remote`` reports
    them. ``None`` for a request that did not come through a proxyproto site.
    """
    policy = request.get_extra_info(_POLICY)
    if not isinstance(policy, Policy):
        return None
    return ProxyConnection(
        request.get_extra_info(_HEADER),
        policy,
        request.get_extra_info(_PEER),
        request.get_extra_info(_LOCAL),
    )


RequestFactory = Callable[..., web.BaseRequest]


class _SchemeFromHeader:
    """Stands in for a ``web.Server``'s ``request_factory``: requests on a
    connection whose header says the client used TLS to the load balancer
    (``Connection.client_tls``) get ``scheme="https"``; every other request
    is the wrapped factory's, untouched (plain sites share the runner)."""

    def __init__(self, factory: RequestFactory) -> None:
        self.factory = factory

    def __call__(self, *args: Any) -> web.BaseRequest:
        request = self.factory(*args)
        connection = proxy_connection(request)
        if (
            connection is not None
            and request.scheme == "http"  # never downgrade TLS at the server
            and Connection.from_header(
                connection.header, connection.policy, None
            ).client_tls
        ):
            return request.clone(scheme="https")
        return request


def _install_scheme_from_header(server: web.Server) -> None:
    if not isinstance(server.request_factory, _SchemeFromHeader):
        server.request_factory = _SchemeFromHeader(server.request_factory)


class _ProxySite(web.BaseSite):
    """A site whose connections read a PROXY header first (see the module
    docstring); subclasses say where to listen."""

    def __init__(
        self,
        runner: web.BaseRunner,
        *,
        trusted: TrustPolicy | TrustedArg,
        untrusted: Policy,
        header_timeout: float,
        ssl_context: ssl.SSLContext | None,
        ssl_handshake_timeout: float,
        backlog: int,
        reader_options: Mapping[str, Any] | None,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._proxy_ssl = ssl_context
        self.settings = AsyncioSettings(
            trust=make_trust_policy(trusted, untrusted),
            logger=LOGGER,
            header_timeout=header_timeout,
            ssl_context=ssl_context,
            ssl_handshake_timeout=ssl_handshake_timeout,
            reader_options=dict(reader_options or {}),
        )

    @property
    def _scheme(self) -> str:
        return "https" if self._proxy_ssl is not None else "http"

    def _protocol_factory(self) -> Callable[[], asyncio.Protocol]:
        server = self._runner.server
        assert server is not None  # BaseSite.__init__ checked it

        def make_protocol(connection: Connection) -> asyncio.BaseProtocol:
            return server()

        _install_scheme_from_header(server)
        return partial(ServerProtocolWrapper, self.settings, make_protocol)


class ProxyTCPSite(_ProxySite):
    """``web.TCPSite``, reading a PROXY header on every connection.

    Args:
        runner: a set-up ``web.AppRunner`` (or any ``web.BaseRunner``).
        host: as for ``web.TCPSite`` (None: every interface).
        port: as for ``web.TCPSite`` (default 8080, 8443 with TLS; 0: any).
        trusted: load balancer CIDRs/addresses that must send a header, or a
            ``TrustPolicy``. Default: only 127.0.0.1 and ::1.
        untrusted: the policy for every other peer (``REJECT`` closes,
            ``SKIP`` serves them directly, without a header).
        header_timeout: seconds the complete header may take.
        ssl_context: serve TLS, started after the header.
        ssl_handshake_timeout: seconds the TLS handshake may take.
        backlog: as for ``web.TCPSite``.
        reuse_address: as for ``web.TCPSite``.
        reuse_port: as for ``web.TCPSite``.
        reader_options: ``HeaderReader`` options (``versions``,
            ``max_v2_length``, ``verify_crc32c``, ...).
    """

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str | None = None,
        port: int | None = None,
        *,
        trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
        untrusted: Policy = Policy.REJECT,
        header_timeout: float = DEFAULT_TIMEOUT,
        ssl_context: ssl.SSLContext | None = None,
        ssl_handshake_timeout: float = DEFAULT_SSL_HANDSHAKE_TIMEOUT,
        backlog: int = 128,
        reuse_address: bool | None = None,
        reuse_port: bool | None = None,
        reader_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            runner,
            trusted=trusted,
            untrusted=untrusted,
            header_timeout=header_timeout,
            ssl_context=ssl_context,
            ssl_handshake_timeout=ssl_handshake_timeout,
            backlog=backlog,
            reader_options=reader_options,
        )
        self._host = host
        self._requested_port = (
            port if port is not None else (8443 if ssl_context else 8080)
        )
        self._bound_port: int | None = None
        self._reuse_address = reuse_address
        self._reuse_port = reuse_port

    @property
    def port(self) -> int:
        """The port listened on once started (the one asked for before)."""
        if self._bound_port is not None:
            return self._bound_port
        return self._requested_port

    @property
    def name(self) -> str:
        """The site's URL, as ``web.run_app`` prints it."""
        host = self._host or "0.0.0.0"
        return str(URL.build(scheme=self._scheme, host=host, port=self.port))

    async def start(self) -> None:
        """Listen; connections are served from now on."""
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = server = await loop.create_server(
            self._protocol_factory(),
            self._host,
            self._requested_port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        self._bound_port = server.sockets[0].getsockname()[1]


class ProxySockSite(_ProxySite):
    """``web.SockSite``, reading a PROXY header on every connection.

    *sock* is a bound TCP or UNIX stream socket (a UNIX-socket peer has no IP
    address: it gets the trust policy's default, so pass
    ``trusted=TrustPolicy.everyone()`` for a socket only the load balancer
    can reach). The other arguments are ``ProxyTCPSite``'s.
    """

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: socket.socket,
        *,
        trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
        untrusted: Policy = Policy.REJECT,
        header_timeout: float = DEFAULT_TIMEOUT,
        ssl_context: ssl.SSLContext | None = None,
        ssl_handshake_timeout: float = DEFAULT_SSL_HANDSHAKE_TIMEOUT,
        backlog: int = 128,
        reader_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            runner,
            trusted=trusted,
            untrusted=untrusted,
            header_timeout=header_timeout,
            ssl_context=ssl_context,
            ssl_handshake_timeout=ssl_handshake_timeout,
            backlog=backlog,
            reader_options=reader_options,
        )
        self._sock = sock

    @property
    def name(self) -> str:
        """The site's URL, as ``web.run_app`` prints it."""
        address = self._sock.getsockname()
        if self._sock.family == socket.AF_UNIX:
            return f"{self._scheme}://unix:{address}:"
        host, port = address[:2]
        return str(URL.build(scheme=self._scheme, host=host, port=port))

    async def start(self) -> None:
        """Listen; connections are served from now on."""
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol_factory(), sock=self._sock, backlog=self._backlog
        )


async def _serve_app(
    app: web.Application,
    *,
    host: str | Sequence[str] | None,
    port: int | None,
    sock: socket.socket | None,
    site_options: Mapping[str, Any],
    print_: Callable[..., None] | None,
    runner_options: Mapping[str, Any],
) -> None:
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    try:
        sites: list[_ProxySite] = []
        hosts = [host] if isinstance(host, str) or host is None else list(host)
        sock_options = {
            key: value
            for key, value in site_options.items()
            if key not in ("reuse_address", "reuse_port")
        }
        if sock is None or host is not None or port is not None:
            sites.extend(ProxyTCPSite(runner, h, port, **site_options) for h in hosts)
        if sock is not None:
            sites.append(ProxySockSite(runner, sock, **sock_options))
        for site in sites:
            await site.start()
        if print_ is not None:
            names = ", ".join(sorted(site.name for site in sites))
            print_(
                f"======== Running on {names} with PROXY protocol ========\n"
                "(Press CTRL+C to quit)"
            )
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_app(
    app: web.Application,
    *,
    host: str | Sequence[str] | None = None,
    port: int | None = None,
    sock: socket.socket | None = None,
    trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
    untrusted: Policy = Policy.REJECT,
    header_timeout: float = DEFAULT_TIMEOUT,
    ssl_context: ssl.SSLContext | None = None,
    ssl_handshake_timeout: float = DEFAULT_SSL_HANDSHAKE_TIMEOUT,
    backlog: int = 128,
    reuse_address: bool | None = None,
    reuse_port: bool | None = None,
    reader_options: Mapping[str, Any] | None = None,
    print: Callable[..., None] | None = print,
    **runner_options: Any,
) -> None:
    """Like ``web.run_app``, with a PROXY header read on every connection.

    Serves *app* on *host*/*port* (``ProxyTCPSite``, one per host) and/or on
    *sock* (``ProxySockSite``) until SIGINT or SIGTERM, then shuts it down as
    aiohttp does (``on_shutdown``, open requests finish, ``on_cleanup``).

    Args:
        app: the ``web.Application``.
        host: a host or several (None: every interface).
        port: the port (default 8080, 8443 with TLS).
        sock: an already bound socket to serve as well (or instead).
        trusted: as for ``ProxyTCPSite``.
        untrusted: as for ``ProxyTCPSite``.
        header_timeout: as for ``ProxyTCPSite``.
        ssl_context: as for ``ProxyTCPSite``.
        ssl_handshake_timeout: as for ``ProxyTCPSite``.
        backlog: as for ``ProxyTCPSite``.
        reuse_address: as for ``ProxyTCPSite``.
        reuse_port: as for ``ProxyTCPSite``.
        reader_options: as for ``ProxyTCPSite``.
        print: prints the "Running on" line (None: quiet).
        **runner_options: ``web.AppRunner`` options (``access_log``,
            ``shutdown_timeout``, ``keepalive_timeout``, ``handle_signals``,
            ...).
    """
    site_options: dict[str, Any] = {
        "trusted": trusted,
        "untrusted": untrusted,
        "header_timeout": header_timeout,
        "ssl_context": ssl_context,
        "ssl_handshake_timeout": ssl_handshake_timeout,
        "backlog": backlog,
        "reuse_address": reuse_address,
        "reuse_port": reuse_port,
        "reader_options": reader_options,
    }
    runner_options.setdefault("handle_signals", True)
    # The suppress block ends first: the runner then cancels _serve_app, whose
    # finally cleans the app up (as web.run_app does).
    with (
        asyncio.Runner() as loop_runner,
        contextlib.suppress(web.GracefulExit, KeyboardInterrupt),
    ):
        loop_runner.run(
            _serve_app(
                app,
                host=host,
                port=port,
                sock=sock,
                site_options=site_options,
                print_=print,
                runner_options=runner_options,
            )
        )
