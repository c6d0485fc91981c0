"""gunicorn workers that read the PROXY header strictly, before TLS and HTTP.

::

    gunicorn -k proxyproto.gunicorn.ThreadWorker --proxy-allow-from 10.0.0.0/8 app:app

gunicorn's own ``--proxy-protocol`` serves connections that arrive without a
header in every mode (the guessing the spec forbids), reads the header from
inside TLS, skips every TLV, and leaves the scheme ``http`` behind a load
balancer that terminated TLS. These workers subclass gunicorn's and read the
header with ``proxyproto``'s reader on every connection, before anything else:

- ``SyncWorker`` (``sync``) and ``ThreadWorker`` (``gthread``) for WSGI:
  ``environ["REMOTE_ADDR"]``/``["REMOTE_PORT"]`` are the client from the
  header (so is gunicorn's access log), ``environ["wsgi.url_scheme"]`` is
  ``https`` when the header's SSL TLV says the client used TLS to the load
  balancer, ``environ["proxyproto.header"]`` is the ``ProxyHeader`` (every
  TLV) and ``environ["proxyproto.peer"]`` the load balancer.
- ``ASGIWorker`` (``asgi``): ``scope["client"]``/``["server"]`` from the
  header, ``scope["extensions"]["proxyproto"] == {"header": ..., "peer":
  ...}``, and ``https``/``wss`` from the SSL TLV.

gunicorn's settings say who must send a header: ``proxy_allow_ips``
(``--proxy-allow-from``, default ``127.0.0.1,::1``; ``*`` for every peer)
are the load balancers; everyone else is refused. ``proxy_protocol``
(``--proxy-protocol v1|v2``) narrows the versions accepted (default both);
gunicorn's own reading is turned off in these workers. The rest are class
attributes of a subclass (``proxy_untrusted = Policy.SKIP`` serves other
peers directly; ``proxy_header_timeout``; ``proxy_reader_options``), which a
config file can name: ``worker_class = MyWorker``.

A refused connection (REJECT, a bad, missing, truncated or late header) is
closed with one WARNING on gunicorn's error log; a peer gone before its header
(HAProxy's ``check`` resets, a TCP health check closes without a byte) gets
one INFO line. With ``--certfile`` the TLS handshake starts on the bytes after
the header.

Checked against gunicorn 27.0.1.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from proxyproto._adapters import (
    DEFAULT_TIMEOUT,
    format_address,
    header_address,
    log_refusal,
    uses_header_addresses,
)
from proxyproto._asgi import (
    AsyncioSettings,
    Connection,
    ProxyScopeMiddleware,
    ServerProtocolWrapper,
    make_trust_policy,
    set_current_connection,
)
from proxyproto._errors import RemoteProtocolError
from proxyproto._events import ProxyHeader
from proxyproto._extras import require
from proxyproto._policy import Policy, TrustPolicy
from proxyproto._reader import ReaderOptions
from proxyproto.sockets import read_header

require("gunicorn", feature="proxyproto.gunicorn", extra="gunicorn")

from gunicorn import util
from gunicorn.workers import gasgi, gthread, sync

__all__ = ["ASGIWorker", "SyncWorker", "ThreadWorker"]

#: gunicorn's error log: where refused connections are logged.
LOGGER = logging.getLogger("gunicorn.error")

#: gunicorn's ``proxy_protocol`` values that narrow the versions read.
_VERSIONS = {"v1": {1}, "v2": {2}}


@dataclass(frozen=True, slots=True)
class _Proxied:
    """One connection's header, as its requests get it."""

    connection: Connection
    client: tuple[str, int] | str | None

    def apply(self, environ: dict[str, Any]) -> None:
        header = self.connection.info["header"]
        environ["proxyproto.header"] = header
        environ["proxyproto.peer"] = self.connection.info["peer"]
        if isinstance(self.client, tuple):
            environ["REMOTE_ADDR"], port = self.client
            environ["REMOTE_PORT"] = str(port)
        elif self.client is not None:
            environ["REMOTE_ADDR"] = self.client
            environ.pop("REMOTE_PORT", None)
        if self.connection.client_tls:
            environ["wsgi.url_scheme"] = "https"


_CURRENT: contextvars.ContextVar[_Proxied] = contextvars.ContextVar(
    "proxyproto_gunicorn_connection"
)

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _EnvironMiddleware:
    """Applies the current connection's header to each request's environ
    (in place, so gunicorn's access log sees the client too)."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        proxied = _CURRENT.get(None)
        if proxied is not None:
            proxied.apply(environ)
        return self.app(environ, start_response)


class _ProxyWorker:
    """What the three workers share: settings from gunicorn's config, the
    header read of a blocking socket, and the application wrapper."""

    #: The policy of peers not in ``proxy_allow_ips``: REJECT or SKIP.
    proxy_untrusted: ClassVar[Policy] = Policy.REJECT
    #: Seconds the complete header may take to arrive.
    proxy_header_timeout: ClassVar[float] = DEFAULT_TIMEOUT
    #: Further ``HeaderReader`` options (``max_v2_length``, ...).
    proxy_reader_options: ClassVar[Mapping[str, Any]] = {}

    cfg: Any
    proxy_trust: TrustPolicy
    proxy_options: ReaderOptions

    def init_process(self) -> None:
        """Read the settings, turn gunicorn's own PROXY reading off (it would
        take a second header from the request stream), then start."""
        allowed = list(self.cfg.proxy_allow_ips)
        if "*" in allowed:
            self.proxy_trust = TrustPolicy.everyone(Policy.REQUIRE)
        else:
            self.proxy_trust = make_trust_policy(allowed, self.proxy_untrusted)
        options = dict(self.proxy_reader_options)
        versions = _VERSIONS.get(self.cfg.proxy_protocol)
        if versions is not None:
            options["versions"] = versions
        self.proxy_options = cast(ReaderOptions, options)
        self.cfg.set("proxy_protocol", "off")
        super().init_process()  # type: ignore[misc]

    def read_proxy_header(self, sock: Any, addr: Any) -> _Proxied | None:
        """Decide the policy for *sock* (accepted from *addr*) and read its
        header; None if the connection was refused or broke (logged)."""
        peer = format_address(addr)
        local = format_address(_local_address(sock))
        policy = self.proxy_trust.decide(peer, local)
        try:
            header = read_header(
                sock,
                policy=policy,
                header_timeout=self.proxy_header_timeout,
                **self.proxy_options,
            )
        except RemoteProtocolError as exc:
            log_refusal(LOGGER, peer, exc)
            return None
        except OSError as exc:
            LOGGER.info("connection from %s lost before its header: %s", peer, exc)
            return None
        return _proxied(header, policy, peer)


def _local_address(sock: Any) -> Any:
    try:
        return sock.getsockname()
    except OSError:
        return None


def _proxied(
    header: ProxyHeader | None, policy: Policy, peer: tuple[str, int] | None
) -> _Proxied:
    client = (
        header_address(header.source) if uses_header_addresses(header, policy) else None
    )
    return _Proxied(Connection.from_header(header, policy, peer), client)


class _WSGIWorker(_ProxyWorker):
    wsgi: WSGIApp

    def load_wsgi(self) -> None:
        """Load the app as gunicorn does, behind the environ middleware."""
        super().load_wsgi()  # type: ignore[misc]
        self.wsgi = _EnvironMiddleware(self.wsgi)


class SyncWorker(_WSGIWorker, sync.SyncWorker):
    """gunicorn's ``sync`` worker, reading a PROXY header per connection."""

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        """Read the header (closing a refused connection), then serve the
        request as gunicorn does with the header applied to its environ."""
        proxied = self.read_proxy_header(client, addr)
        if proxied is None:
            util.close(client)
            return
        token = _CURRENT.set(proxied)
        try:
            super().handle(listener, client, addr)
        finally:
            _CURRENT.reset(token)


class ThreadWorker(_WSGIWorker, gthread.ThreadWorker):
    """gunicorn's ``gthread`` worker, reading a PROXY header per connection
    (in the pool thread that serves its first request; keep-alive requests
    reuse it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._proxied: weakref.WeakKeyDictionary[Any, _Proxied] = (
            weakref.WeakKeyDictionary()
        )
        self._proxied_lock = threading.Lock()

    def handle(self, conn: Any) -> Any:
        """Read the header on a connection's first visit (False closes a
        refused one), then serve as gunicorn does with it applied."""
        with self._proxied_lock:
            proxied = self._proxied.get(conn)
        if proxied is None:
            proxied = self.read_proxy_header(conn.sock, conn.client)
            if proxied is None:
                return False
            with self._proxied_lock:
                self._proxied[conn] = proxied
        token = _CURRENT.set(proxied)
        try:
            return super().handle(conn)
        finally:
            _CURRENT.reset(token)


class ASGIWorker(_ProxyWorker, gasgi.ASGIWorker):
    """gunicorn's ``asgi`` worker, each connection behind a
    ``ServerProtocolWrapper`` (``proxyproto.asyncio``) that reads the header
    and then starts gunicorn's protocol, with TLS (``--certfile``) after the
    header.

    Private API: ``ASGIWorker._serve`` calls
    ``self.loop.create_server(factory, sock=..., ssl=context, ...)`` (checked
    against gunicorn 27.0.1; ``test_private_api`` checks it): this worker's
    loop makes that server with the factory wrapped and TLS moved above the
    header.
    """

    asgi: Any
    loop: Any

    def load_wsgi(self) -> None:
        """Load the app as gunicorn does, behind the scope middleware."""
        super().load_wsgi()
        self.asgi = ProxyScopeMiddleware(self.asgi)

    def _setup_event_loop(self) -> None:
        super()._setup_event_loop()
        create_server = self.loop.create_server

        async def create_proxy_server(
            protocol_factory: Callable[[], Any], *args: Any, **kwargs: Any
        ) -> Any:
            settings = AsyncioSettings(
                trust=self.proxy_trust,
                logger=LOGGER,
                header_timeout=self.proxy_header_timeout,
                ssl_context=kwargs.pop("ssl", None),
                reader_options=dict(self.proxy_options),
            )

            def make_protocol(connection: Connection) -> Any:
                # This callback's context: the protocol's tasks inherit it.
                set_current_connection(connection)
                return protocol_factory()

            return await create_server(
                lambda: ServerProtocolWrapper(settings, make_protocol), *args, **kwargs
            )

        self.loop.create_server = create_proxy_server
