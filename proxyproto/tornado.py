"""Serve Tornado behind a PROXY-protocol load balancer: HTTP and TCP servers.

Tornado has no hook below TLS and HTTP (tornadoweb/tornado#2492), where the
header arrives. ``ProxyHTTPServer`` is ``tornado.httpserver.HTTPServer`` and
``ProxyTCPServer`` is ``tornado.tcpserver.TCPServer``, reading a header on
every connection before anything else::

    server = proxyproto.tornado.ProxyHTTPServer(app, trusted=["10.0.0.0/8"])
    server.listen(8888)  # or add_sockets(), as with HTTPServer

    class Echo(proxyproto.tornado.ProxyTCPServer):
        async def handle_stream(self, stream, address):  # the real client
            connection = proxyproto.tornado.proxy_connection(stream)

What applications see:

- ``request.remote_ip`` (and ``address`` in ``handle_stream``): the client
  from the header.
- ``request.protocol``: ``https`` when the server serves TLS itself
  (``ssl_options``, started *after* the header), or when the load balancer
  terminated TLS and says so in the header's SSL TLV (``SSLClient.SSL``:
  HAProxy ``send-proxy-v2-ssl``, tlsedge's ``send_proxy``).
- ``proxy_connection(request)`` / ``proxy_connection(stream)``: the
  ``ProxyConnection`` (header with its TLVs, policy, the load balancer's
  address).

Theory of operation
-------------------
``TCPServer`` accepts a socket and hands it to its ``_handle_connection``,
which wraps it in TLS at once if ``ssl_options`` is set and calls
``handle_stream(stream, address)``. Both servers here replace that step (a
private method, checked against Tornado 6.6.1 by ``test_private_api``): a task
per connection decides the ``Policy`` from the peer and local address, then
reads the header under one deadline (``header_timeout``) the way
``proxyproto.sockets`` does, but waiting for the socket on the event loop:
peek (``MSG_PEEK``) at what has arrived, parse it, and ``recv`` exactly the
bytes that belong to the header. Nothing past the header is read, so the
request or the TLS ClientHello is still in the socket when the task builds
the ``IOStream`` (an ``SSLIOStream`` with ``ssl_options``, as Tornado's own
step would) and calls ``handle_stream`` with the client address. A refused
peer, a bad, missing, truncated or late header: the socket is closed and one
line is logged on ``proxyproto.tornado`` (WARNING; INFO for a peer that reset
or closed without a byte before its header, as health checks do).

``ProxyHTTPServer.handle_stream`` builds Tornado's per-connection request
context (private ``_HTTPRequestContext``) with the header's protocol, and
whose ``remote_ip`` comes from the header also when the load balancer
connects over a UNIX socket.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import weakref
from typing import Any

from proxyproto._adapters import log_refusal
from proxyproto._asgi import (
    DEFAULT_TIMEOUT,
    DEFAULT_TRUSTED,
    Connection,
    TrustedArg,
    make_trust_policy,
)
from proxyproto._errors import RemoteProtocolError
from proxyproto._events import NEED_DATA, NO_HEADER, ProxyHeader
from proxyproto._extras import missing_extra
from proxyproto._options import DEFAULT_MAX_V2_LENGTH
from proxyproto._policy import Policy, TrustPolicy
from proxyproto._reader import HeaderReader, ReaderOptions
from proxyproto.sockets import (
    _USE_POLL_INTERVAL,
    ProxyConnection,
    _committed,
    _peek_size,
)

try:
    from tornado import gen
    from tornado.http1connection import HTTP1ServerConnection
    from tornado.httpserver import HTTPServer, _HTTPRequestContext
    from tornado.httputil import HTTPServerRequest
    from tornado.ioloop import IOLoop
    from tornado.iostream import IOStream, SSLIOStream
    from tornado.log import app_log
    from tornado.netutil import ssl_wrap_socket
    from tornado.tcpserver import TCPServer
except ModuleNotFoundError as exc:
    missing_extra(exc, feature="proxyproto.tornado", package="tornado", extra="tornado")

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TRUSTED",
    "ProxyConnection",
    "ProxyHTTPServer",
    "ProxyTCPServer",
    "proxy_connection",
]

LOGGER = logging.getLogger("proxyproto.tornado")

_INET_FAMILIES = (socket.AF_INET, socket.AF_INET6)

#: Streams handed to ``handle_stream``, and what their header said.
_CONNECTIONS: weakref.WeakKeyDictionary[IOStream, ProxyConnection] = (
    weakref.WeakKeyDictionary()
)


def proxy_connection(
    target: IOStream | HTTPServerRequest,
) -> ProxyConnection | None:
    """What the PROXY header of *target*'s connection said.

    *target* is a stream given to ``handle_stream`` or a request served by
    ``ProxyHTTPServer`` (``self.request`` in a ``RequestHandler``). The
    ``ProxyConnection`` has ``header`` (None when the trust policy let the
    peer in without one), ``policy``, ``peer_address`` (the load balancer),
    ``local_address``, ``client_address`` and ``server_address``. ``None``
    for anything not served by these servers.
    """
    if isinstance(target, HTTPServerRequest):
        context = getattr(target.connection, "context", None)
        return context.proxy if isinstance(context, _RequestContext) else None
    return _CONNECTIONS.get(target)


def _client_tls(connection: ProxyConnection) -> bool:
    return Connection.from_header(connection.header, connection.policy, None).client_tls


# --------------------------------------------------------------------------
# Reading the header off a non-blocking socket
# --------------------------------------------------------------------------


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock, wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock)


def _take(sock: socket.socket, size: int) -> bytes:
    # Bytes already peeked at: in the socket's queue, so recv returns them.
    parts: list[bytes] = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise RemoteProtocolError("connection closed mid-header", reason="eof")
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


async def _read_header(
    sock: socket.socket, policy: Policy, options: ReaderOptions
) -> ProxyHeader | None:
    """The header at the start of *sock* (REQUIRE, IGNORE or USE), taken
    off the socket to its last byte and not one byte further; None for USE
    without a header. Raises ``RemoteProtocolError`` or ``OSError``."""
    loop = asyncio.get_running_loop()
    optional = policy is Policy.USE
    max_v2_length = options.get("max_v2_length", DEFAULT_MAX_V2_LENGTH)
    consumed = b""
    while True:
        await _readable(loop, sock)
        try:
            peeked = sock.recv(
                _peek_size(len(consumed), consumed[:1], max_v2_length),
                socket.MSG_PEEK,
            )
        except BlockingIOError:
            continue
        data = consumed + peeked
        # A fresh reader over everything seen tells where the header ends
        # without consuming anything (as proxyproto.sockets.read_header).
        reader = HeaderReader(optional=optional, **options)
        reader.receive_data(data)
        if not peeked:
            reader.receive_data(b"")
        event = reader.next_event()
        if event is NO_HEADER:
            return None
        if event is not NEED_DATA:
            assert isinstance(event, ProxyHeader)
            _take(sock, len(data) - len(reader.trailing_data) - len(consumed))
            return event
        if _committed(data, optional):
            consumed += _take(sock, len(peeked))
        else:
            await asyncio.sleep(_USE_POLL_INTERVAL)


def _address(sock: socket.socket) -> Any:
    try:
        return sock.getsockname()
    except OSError:
        return None


# --------------------------------------------------------------------------
# The servers
# --------------------------------------------------------------------------


class _ProxyServer(TCPServer):
    """What both servers share: the header step before ``handle_stream``."""

    proxy_trust: TrustPolicy
    proxy_header_timeout: float
    proxy_reader_options: ReaderOptions

    def _init_proxy(
        self,
        trusted: TrustPolicy | TrustedArg,
        untrusted: Policy,
        header_timeout: float,
        reader_options: ReaderOptions | None,
    ) -> None:
        self.proxy_trust = make_trust_policy(trusted, untrusted)
        self.proxy_header_timeout = header_timeout
        self.proxy_reader_options = reader_options or {}
        self._proxy_tasks: set[asyncio.Task[None]] = set()

    def _handle_connection(self, connection: socket.socket, address: Any) -> None:
        # Replaces TCPServer._handle_connection (see the module docstring).
        task = asyncio.get_running_loop().create_task(
            self._accept_proxy(connection, address)
        )
        self._proxy_tasks.add(task)
        task.add_done_callback(self._proxy_tasks.discard)
        # Cancelled by stop(), perhaps before it even started: close.
        task.add_done_callback(lambda t: connection.close() if t.cancelled() else None)

    def stop(self) -> None:
        """Stop listening, as ``TCPServer.stop``, and close the connections
        still sending their header (requests being served go on)."""
        super().stop()
        for task in self._proxy_tasks:
            task.cancel()

    async def _accept_proxy(self, sock: socket.socket, address: Any) -> None:
        connection = await self._read_proxy_connection(sock, address)
        if connection is None:
            sock.close()
            return
        stream = self._make_stream(sock)
        if stream is None:
            return
        _CONNECTIONS[stream] = connection
        client = connection.client_address
        # From here on as TCPServer._handle_connection.
        try:
            future = self.handle_stream(stream, client)  # type: ignore[arg-type]
            if future is not None:
                IOLoop.current().add_future(
                    gen.convert_yielded(future), lambda f: f.result()
                )
        except Exception:  # noqa: BLE001 (the app's bug: logged as Tornado does)
            app_log.exception("Error in connection callback")

    async def _read_proxy_connection(
        self, sock: socket.socket, address: Any
    ) -> ProxyConnection | None:
        """The connection's policy and header; None once refused and logged."""
        local = _address(sock)
        policy = self.proxy_trust.decide(
            address if isinstance(address, tuple) else None,
            local if isinstance(local, tuple) else None,
        )
        if policy is Policy.REJECT:
            LOGGER.warning(
                "closing connection from %s: not a trusted source "
                "(trust policy REJECT)",
                address,
            )
            return None
        header = None
        if policy is not Policy.SKIP:
            sock.setblocking(False)
            try:
                async with asyncio.timeout(self.proxy_header_timeout):
                    header = await _read_header(sock, policy, self.proxy_reader_options)
            except RemoteProtocolError as exc:
                log_refusal(LOGGER, address, exc)
                return None
            except TimeoutError:
                LOGGER.warning(
                    "closing connection from %s: no complete PROXY header within %s s",
                    address,
                    self.proxy_header_timeout,
                )
                return None
            except OSError as exc:
                LOGGER.info(
                    "connection from %s broke before its header: %s", address, exc
                )
                return None
        return ProxyConnection(header, policy, address, local)

    def _make_stream(self, sock: socket.socket) -> IOStream | None:
        """The stream ``handle_stream`` gets, as ``TCPServer`` makes it; None
        (socket closed) if the peer left before TLS could start."""
        if self.ssl_options is None:
            return IOStream(
                sock,
                max_buffer_size=self.max_buffer_size,
                read_chunk_size=self.read_chunk_size,
            )
        try:
            # A peer gone already (a health check that reset after its LOCAL
            # header) makes ``wrap_socket`` raise from inside the SSLSocket it
            # made, and that socket, owning the descriptor, is never closed
            # (CPython 3.11): find out first.
            sock.getpeername()
        except OSError:
            sock.close()
            return None
        try:
            tls_sock = ssl_wrap_socket(
                sock, self.ssl_options, server_side=True, do_handshake_on_connect=False
            )
        except (ssl.SSLError, OSError) as exc:
            # Tornado closes quietly for these (a port scan, a peer gone).
            if isinstance(exc, ssl.SSLError) and exc.args[0] == ssl.SSL_ERROR_EOF:
                sock.close()
                return None
            if exc.errno in (errno.ECONNABORTED, errno.EINVAL):
                sock.close()
                return None
            raise
        return SSLIOStream(
            tls_sock,
            max_buffer_size=self.max_buffer_size,
            read_chunk_size=self.read_chunk_size,
        )


class ProxyTCPServer(_ProxyServer):
    """``tornado.tcpserver.TCPServer``, reading a PROXY header first.

    Subclass it and override ``handle_stream(stream, address)`` as with
    ``TCPServer``: it runs once the header is read, with *address* the
    client from the header (the socket's peer when the header does not
    apply: LOCAL, UNKNOWN, ``IGNORE``, ``SKIP``), and *stream* positioned on
    the first byte after the header (an ``SSLIOStream`` with *ssl_options*).
    ``proxy_connection(stream)`` has the rest.

    Args:
        ssl_options: serve TLS, started after the header (as for
            ``TCPServer``).
        max_buffer_size: as for ``TCPServer``.
        read_chunk_size: as for ``TCPServer``.
        trusted: load balancer CIDRs/addresses that must send a header, or a
            ``TrustPolicy``. Default: only 127.0.0.1 and ::1.
        untrusted: the policy for every other peer (``REJECT`` closes,
            ``SKIP`` serves them directly, without a header).
        header_timeout: seconds the complete header may take.
        reader_options: ``HeaderReader`` options (``versions``,
            ``max_v2_length``, ``verify_crc32c``, ...).
    """

    def __init__(
        self,
        ssl_options: dict[str, Any] | ssl.SSLContext | None = None,
        max_buffer_size: int | None = None,
        read_chunk_size: int | None = None,
        *,
        trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
        untrusted: Policy = Policy.REJECT,
        header_timeout: float = DEFAULT_TIMEOUT,
        reader_options: ReaderOptions | None = None,
    ) -> None:
        super().__init__(ssl_options, max_buffer_size, read_chunk_size)
        self._init_proxy(trusted, untrusted, header_timeout, reader_options)


class _RequestContext(_HTTPRequestContext):
    """Tornado's per-connection request context, from the header: the
    protocol is ``https`` when the client used TLS to the load balancer, and
    an INET client address counts as one also on a UNIX-socket connection."""

    def __init__(
        self,
        stream: IOStream,
        address: Any,
        protocol: str | None,
        trusted_downstream: list[str] | None,
        proxy: ProxyConnection | None,
    ) -> None:
        if proxy is not None and _client_tls(proxy):
            protocol = "https"
        super().__init__(stream, address, protocol, trusted_downstream)
        self.proxy = proxy
        if self.address_family not in _INET_FAMILIES and isinstance(address, tuple):
            host = str(address[0])
            self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.remote_ip = self._orig_remote_ip = host


class ProxyHTTPServer(_ProxyServer, HTTPServer):
    """``tornado.httpserver.HTTPServer``, reading a PROXY header first.

    Takes every ``HTTPServer`` argument (``ssl_options`` starts TLS after the
    header), plus:

    Args:
        trusted: load balancer CIDRs/addresses that must send a header, or a
            ``TrustPolicy``. Default: only 127.0.0.1 and ::1.
        untrusted: the policy for every other peer (``REJECT`` closes,
            ``SKIP`` serves them directly, without a header).
        header_timeout: seconds the complete header may take.
        reader_options: ``HeaderReader`` options.

    ``xheaders=True`` would let X-Forwarded-For / X-Forwarded-Proto override
    what the PROXY header said; leave it off unless a proxy behind the load
    balancer sets them.
    """

    def initialize(  # type: ignore[override]
        self,
        request_callback: Any,
        *,
        trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
        untrusted: Policy = Policy.REJECT,
        header_timeout: float = DEFAULT_TIMEOUT,
        reader_options: ReaderOptions | None = None,
        **kwargs: Any,
    ) -> None:
        """Set up as ``HTTPServer.initialize`` (Tornado calls it from the
        constructor), with the PROXY options."""
        super().initialize(request_callback, **kwargs)
        self._init_proxy(trusted, untrusted, header_timeout, reader_options)

    def handle_stream(self, stream: IOStream, address: tuple[Any, ...]) -> None:
        """``HTTPServer.handle_stream``, with the context built from the
        header (private API, checked against Tornado 6.6.1)."""
        context = _RequestContext(
            stream,
            address,
            self.protocol,
            self.trusted_downstream,
            _CONNECTIONS.get(stream),
        )
        conn = HTTP1ServerConnection(stream, self.conn_params, context)
        self._connections.add(conn)
        conn.start_serving(self)
