"""Serve an ASGI app with Hypercorn behind a PROXY-protocol load balancer.

Hypercorn has no hook at the connection level (pgjones/hypercorn#174: the
header comes before TLS and before HTTP, so middleware cannot read it), so
this module runs Hypercorn's per-connection server (``TCPServer``) from its
own accept loop, with the PROXY header read first and TLS started after it::

    config = hypercorn.config.Config()
    config.bind = ["0.0.0.0:8000"]
    await proxyproto.hypercorn.serve(app, config, trusted=["10.0.0.0/8"])

``serve`` works under asyncio and trio (whichever is running). From the
command line::

    python -m proxyproto.hypercorn myapp:app --bind 0.0.0.0:8000 \\
        --proxy-trusted 10.0.0.0/8 [other hypercorn options]

The app sees the addresses from the header in ``scope["client"]`` and
``scope["server"]``, and the whole header in
``scope["extensions"]["proxyproto"] == {"header": ProxyHeader | None,
"peer": (host, port)}`` (``peer`` is the load balancer).

This module also holds the asyncio connection layer shared with
``proxyproto.uvicorn`` (a protocol that reads the header, then hands the
connection, with the bytes read past the header, to the server's protocol,
optionally through TLS started with ``loop.start_tls``). It imports Hypercorn
and trio only when used.

Checked against Hypercorn 0.17.3 and 0.18.0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import importlib
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import TYPE_CHECKING, Any, TypedDict

from proxyproto._errors import RemoteProtocolError
from proxyproto._events import (
    NEED_DATA,
    NO_HEADER,
    Command,
    InetAddress,
    ProxyHeader,
    UnixAddress,
)
from proxyproto._policy import Policy, TrustPolicy

if TYPE_CHECKING:
    import trio
    from hypercorn.config import Config

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_TRUSTED",
    "EXTENSION",
    "ProxyInfo",
    "ProxyScopeMiddleware",
    "main",
    "make_trust_policy",
    "run",
    "serve",
]

LOGGER = logging.getLogger("proxyproto.hypercorn")

#: The spec asks receivers to wait at least 3 s; 5 s is Caddy's default.
DEFAULT_TIMEOUT = 5.0
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


def _socket_address(address: object) -> SocketAddress | None:
    if isinstance(address, (tuple, list)) and len(address) >= 2:
        return (str(address[0]), int(address[1]))
    return None


def _header_address(address: InetAddress | UnixAddress | None) -> Any:
    if isinstance(address, InetAddress):
        if isinstance(address.host, IPv6Address):
            return (str(address.host), address.port, 0, 0)
        return (str(address.host), address.port)
    if isinstance(address, UnixAddress):
        return address.path
    return None


def header_addresses(
    header: ProxyHeader | None, policy: Policy
) -> tuple[Any, Any] | None:
    """``(client, server)`` in socket-address form if the header's addresses
    replace the socket's (a PROXY command with addresses, under REQUIRE or
    USE); ``None`` when the real endpoints apply (LOCAL, UNKNOWN, IGNORE)."""
    if (
        header is None
        or policy not in (Policy.REQUIRE, Policy.USE)
        or header.command is not Command.PROXY
        or header.source is None
    ):
        return None
    return _header_address(header.source), _header_address(header.destination)


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
# asyncio connection layer (shared with proxyproto.uvicorn)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class AsyncioSettings:
    """How the asyncio connection layer treats each connection.

    Attributes:
        trust: decides each connection's policy from its peer/local address.
        header_timeout: seconds the complete header may take.
        ssl_context: if set, TLS is started after the header with it.
        ssl_handshake_timeout: seconds the TLS handshake may take.
        reader_options: further ``HeaderReader`` options.
        logger: where refused connections are logged.
    """

    trust: TrustPolicy
    header_timeout: float = DEFAULT_TIMEOUT
    ssl_context: ssl.SSLContext | None = None
    ssl_handshake_timeout: float = DEFAULT_SSL_HANDSHAKE_TIMEOUT
    reader_options: Mapping[str, Any] = field(default_factory=dict)
    logger: logging.Logger = LOGGER


def _feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    if isinstance(protocol, asyncio.BufferedProtocol):
        view = memoryview(data)
        while view:
            buf = memoryview(protocol.get_buffer(len(view))).cast("B")
            size = min(len(buf), len(view))
            if not size:
                raise RuntimeError("get_buffer() returned an empty buffer")
            buf[:size] = view[:size]
            protocol.buffer_updated(size)
            view = view[size:]
    else:
        assert isinstance(protocol, asyncio.Protocol)
        protocol.data_received(data)


class HeaderTransport(asyncio.Transport):
    """The transport the server's protocol sees once the header is read.

    It delivers first the bytes that arrived after the header, then what the
    socket transport delivers; reports the header's addresses through
    ``get_extra_info`` (``peername``, ``sockname``, ``socket``); and passes
    writes and closing to the socket transport. ``loop.start_tls`` accepts it
    (``_start_tls_compatible``), which is how TLS is started after the header.
    """

    _start_tls_compatible = True

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._overrides = dict(extra or {})
        self._transport = transport
        self._loop = loop
        self._protocol: asyncio.BaseProtocol | None = None
        self._paused = False
        self._pending = bytearray()
        self._eof = False

    # Extra info: our overrides, then the socket transport's.
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    # Reading.
    def is_reading(self) -> bool:
        return not self._paused and not self._transport.is_closing()

    def pause_reading(self) -> None:
        if not self._paused:
            self._paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            self._transport.resume_reading()
            if self._pending or self._eof:
                self._loop.call_soon(self._flush)

    def feed_data(self, data: bytes) -> None:
        """Deliver *data* from the socket to the protocol (or hold it)."""
        if self._paused or self._protocol is None or self._pending:
            self._pending += data
        else:
            _feed(self._protocol, data)

    def feed_eof(self) -> bool | None:
        """Deliver EOF; the return value is ``eof_received``'s."""
        if self._paused or self._protocol is None or self._pending:
            self._eof = True
            return True  # keep the socket open until the EOF is delivered
        return self._protocol.eof_received()  # type: ignore[attr-defined, no-any-return]

    def _flush(self) -> None:
        if self._paused or self._protocol is None or self._transport.is_closing():
            return
        if self._pending:
            data = bytes(self._pending)
            self._pending.clear()
            _feed(self._protocol, data)
        if self._eof and not self._pending and self.is_reading():
            self._eof = False
            if not self._protocol.eof_received():  # type: ignore[attr-defined]
                self._transport.close()

    # Writing and closing: the socket transport's.
    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._transport.write(data)

    def writelines(
        self, list_of_data: Iterable[bytes | bytearray | memoryview]
    ) -> None:
        self._transport.writelines(list_of_data)

    def write_eof(self) -> None:
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(
        self, high: int | None = None, low: int | None = None
    ) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()

    def _force_close(self, exc: BaseException | None) -> None:
        # asyncio's SSLProtocol calls this (private) on fatal TLS errors.
        force_close = getattr(self._transport, "_force_close", None)
        if force_close is not None:
            force_close(exc)
        else:
            self._transport.abort()


class _TLSHandoff(asyncio.Protocol):
    # start_tls() does not call connection_made() on its protocol and may
    # deliver decrypted bytes as soon as the handshake ends, before it
    # returns; this placeholder holds them until the server's protocol is
    # attached to the TLS transport.
    def __init__(self) -> None:
        self._data: list[bytes] = []
        self._eof = False
        self._lost = False
        self._exc: Exception | None = None

    def data_received(self, data: bytes) -> None:
        self._data.append(bytes(data))

    def eof_received(self) -> bool:
        self._eof = True
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._exc = exc

    def attach(self, transport: asyncio.Transport, protocol: asyncio.Protocol) -> None:
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        for data in self._data:
            protocol.data_received(data)
        self._data.clear()
        if self._eof and not protocol.eof_received():
            transport.close()
        if self._lost:
            protocol.connection_lost(self._exc)


class HeaderProtocol(asyncio.Protocol):
    """Reads the PROXY header, then hands the connection to *make_protocol*.

    One per connection, made by the server's protocol factory. The policy is
    decided from the peer and local addresses before any byte is read:
    REJECT closes at once; SKIP hands over at once; otherwise the header must
    arrive within ``settings.header_timeout``. A bad, missing or late header
    closes the connection (nothing is sent) with a warning logged. Once the
    header is read, the server's protocol gets a ``HeaderTransport`` (or, with
    ``settings.ssl_context``, the TLS transport on top of it) and the bytes
    that followed the header, intact.

    Args:
        settings: trust policy, timeouts, TLS context.
        make_protocol: builds the server's protocol for the connection from
            the ``ProxyInfo`` (called once the header is read).
        loop: the running loop.
    """

    def __init__(
        self,
        settings: AsyncioSettings,
        make_protocol: Callable[[ProxyInfo], asyncio.Protocol],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        from proxyproto._reader import HeaderReader

        self._settings = settings
        self._make_protocol = make_protocol
        self._loop = loop or asyncio.get_running_loop()
        self._reader_class = HeaderReader
        self._reader: HeaderReader | None = None
        self._transport: asyncio.Transport | None = None
        self._downstream: HeaderTransport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tls_task: asyncio.Task[None] | None = None
        self._peer: SocketAddress | None = None
        self._policy = Policy.REJECT

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self._peer = _socket_address(peer)
        self._policy = self._settings.trust.decide(
            peer if isinstance(peer, (tuple, str)) else None,
            local if isinstance(local, (tuple, str)) else None,
        )
        if self._policy is Policy.REJECT:
            self._refuse(
                f"peer {self._peer} may not connect here (trust policy REJECT)"
            )
            return
        if self._policy is Policy.SKIP:
            self._hand_over(None, b"")
            return
        self._reader = self._reader_class(
            optional=self._policy is Policy.USE, **self._settings.reader_options
        )
        self._timer = self._loop.call_later(
            self._settings.header_timeout, self._on_timeout
        )

    def _refuse(self, reason: str) -> None:
        self._settings.logger.warning(
            "closing connection from %s: %s", self._peer, reason
        )
        self._reader = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.close()

    def _on_timeout(self) -> None:
        self._timer = None
        if self._reader is not None:
            self._refuse(
                f"no complete PROXY header within {self._settings.header_timeout} s"
            )

    def data_received(self, data: bytes) -> None:
        if self._downstream is not None:
            self._downstream.feed_data(data)
            return
        reader = self._reader
        if reader is None:
            return  # refused; closing
        try:
            reader.receive_data(data)
            event = reader.next_event()
        except RemoteProtocolError as exc:
            self._refuse(str(exc))
            return
        if event is NEED_DATA:
            return
        header = None if event is NO_HEADER else event
        assert header is None or isinstance(header, ProxyHeader)
        self._hand_over(header, reader.trailing_data)

    def eof_received(self) -> bool | None:
        if self._downstream is not None:
            return self._downstream.feed_eof()
        reader = self._reader
        if reader is not None:
            try:
                reader.receive_data(b"")
                event = reader.next_event()
            except RemoteProtocolError as exc:
                self._refuse(str(exc))
                return False
            if event is NO_HEADER:
                return self._hand_over(None, reader.trailing_data).feed_eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._reader = None
        downstream = self._downstream
        if downstream is not None and downstream._protocol is not None:
            downstream._protocol.connection_lost(exc)

    def pause_writing(self) -> None:
        downstream = self._downstream
        if downstream is not None and downstream._protocol is not None:
            downstream._protocol.pause_writing()

    def resume_writing(self) -> None:
        downstream = self._downstream
        if downstream is not None and downstream._protocol is not None:
            downstream._protocol.resume_writing()

    def _hand_over(
        self, header: ProxyHeader | None, leftover: bytes
    ) -> HeaderTransport:
        assert self._transport is not None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._reader = None
        info = ProxyInfo(header=header, peer=self._peer)
        extra: dict[str, Any] = {}
        addresses = header_addresses(header, self._policy)
        if addresses is not None:
            client, server = addresses
            extra = {
                "peername": client,
                "sockname": server,
                "socket": AddressSocket(
                    self._transport.get_extra_info("socket"), client, server
                ),
            }
        downstream = HeaderTransport(self._transport, self._loop, extra)
        self._downstream = downstream
        if leftover:
            downstream.feed_data(leftover)  # held until a protocol is attached
        if self._settings.ssl_context is None:
            protocol = self._make_protocol(info)
            downstream.set_protocol(protocol)
            protocol.connection_made(downstream)
            downstream._flush()
        else:
            self._tls_task = self._loop.create_task(
                self._start_tls(downstream, self._settings.ssl_context, info)
            )
        return downstream

    async def _start_tls(
        self, downstream: HeaderTransport, context: ssl.SSLContext, info: ProxyInfo
    ) -> None:
        handoff = _TLSHandoff()
        try:
            transport = await self._loop.start_tls(
                downstream,
                handoff,
                context,
                server_side=True,
                ssl_handshake_timeout=self._settings.ssl_handshake_timeout,
            )
        except (OSError, ssl.SSLError, TimeoutError, EOFError) as exc:
            self._settings.logger.info(
                "TLS handshake with %s failed: %r", info["peer"], exc
            )
            downstream.abort()
            return
        assert isinstance(transport, asyncio.Transport)
        handoff.attach(transport, self._make_protocol(info))


# --------------------------------------------------------------------------
# ASGI: the scope extension
# --------------------------------------------------------------------------

_CURRENT: contextvars.ContextVar[ProxyInfo] = contextvars.ContextVar(
    "proxyproto_connection"
)


def _current_info(scope: Mapping[str, Any]) -> ProxyInfo | None:
    return _CURRENT.get(None)


class ProxyScopeMiddleware:
    """Adds ``scope["extensions"]["proxyproto"]`` to HTTP and WebSocket scopes.

    The adapters wrap the app in it; *lookup* finds the connection's
    ``ProxyInfo`` for a scope (how depends on the server).

    Args:
        app: the ASGI 3 application.
        lookup: returns the ``ProxyInfo`` of the connection a scope belongs
            to, or ``None``.
    """

    def __init__(
        self,
        app: ASGIApp,
        lookup: Callable[[Mapping[str, Any]], ProxyInfo | None] = _current_info,
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
            info = self.lookup(scope)
            if info is not None:
                scope = dict(scope)
                scope["extensions"] = {
                    **(scope.get("extensions") or {}),
                    EXTENSION: info,
                }
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------
# Hypercorn
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    trust: TrustPolicy
    header_timeout: float
    reader_options: Mapping[str, Any]


def _hypercorn_internals(flavour: str) -> tuple[Any, Any, Any]:
    """Hypercorn's per-worker pieces: ``(Lifespan, TCPServer, WorkerContext)``.

    Private API (``hypercorn.{asyncio,trio}.{lifespan,tcp_server,
    worker_context}``), checked against Hypercorn 0.17.3 and 0.18.0, where
    ``worker_serve`` builds them with these signatures::

        asyncio: Lifespan(app, config, loop, state)
                 TCPServer(app, loop, config, context, state, reader, writer)
        trio:    Lifespan(app, config, state)
                 TCPServer(app, config, context, state, stream)
        both:    WorkerContext(max_requests)

    ``tests/proxyproto/test_hypercorn.py::test_private_api`` checks them.
    """
    if flavour == "asyncio":
        from hypercorn.asyncio.lifespan import Lifespan
        from hypercorn.asyncio.tcp_server import TCPServer
        from hypercorn.asyncio.worker_context import WorkerContext
    else:
        from hypercorn.trio.lifespan import Lifespan  # type: ignore[assignment]
        from hypercorn.trio.tcp_server import TCPServer  # type: ignore[assignment]
        from hypercorn.trio.worker_context import (  # type: ignore[assignment]
            WorkerContext,
        )
    return Lifespan, TCPServer, WorkerContext


def _wrap(app: ASGIApp, config: Config) -> Any:
    from hypercorn.utils import wrap_app

    return wrap_app(ProxyScopeMiddleware(app), config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]


def _max_requests(config: Config) -> int | None:
    import random

    if config.max_requests is None:
        return None
    return config.max_requests + random.randint(0, config.max_requests_jitter)  # noqa: S311


async def _wait_first(*waits: Callable[[], Awaitable[Any]]) -> None:
    tasks = [asyncio.ensure_future(wait()) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _serve_asyncio(
    app: ASGIApp,
    config: Config,
    options: _Options,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None,
) -> None:
    lifespan_class, tcp_server_class, worker_context_class = _hypercorn_internals(
        "asyncio"
    )
    loop = asyncio.get_running_loop()
    wrapped = _wrap(app, config)
    state: dict[str, Any] = {}
    lifespan = lifespan_class(wrapped, config, loop, state)
    lifespan_task = loop.create_task(lifespan.handle_lifespan())
    await lifespan.wait_for_startup()
    if lifespan_task.done() and lifespan_task.exception() is not None:
        raise lifespan_task.exception()  # type: ignore[misc]

    if shutdown_trigger is None:
        event = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, event.set)
        shutdown_trigger = event.wait

    sockets = config.create_sockets()
    ssl_context = config.create_ssl_context() if config.ssl_enabled else None
    context = worker_context_class(_max_requests(config))
    tasks: set[asyncio.Task[Any]] = set()

    async def connected(
        info: ProxyInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        _CURRENT.set(info)  # this task's context: the app's tasks inherit it
        await tcp_server_class(wrapped, loop, config, context, state, reader, writer)

    def make_stream_protocol(info: ProxyInfo) -> asyncio.Protocol:
        reader = asyncio.StreamReader(loop=loop)
        return asyncio.StreamReaderProtocol(reader, partial(connected, info), loop=loop)

    servers = []
    for secure, group in (
        (True, sockets.secure_sockets),
        (False, sockets.insecure_sockets),
    ):
        settings = AsyncioSettings(
            trust=options.trust,
            header_timeout=options.header_timeout,
            ssl_context=ssl_context if secure else None,
            ssl_handshake_timeout=config.ssl_handshake_timeout,
            reader_options=options.reader_options,
            logger=LOGGER,
        )
        for sock in group:
            server = await loop.create_server(
                partial(HeaderProtocol, settings, make_stream_protocol, loop),
                sock=sock,
                backlog=config.backlog,
            )
            servers.append(server)
            scheme = "https" if secure else "http"
            await config.log.info(
                f"Running on {scheme}://{_repr_address(sock)} "
                "with PROXY protocol (CTRL + C to quit)"
            )
    try:
        await _wait_first(shutdown_trigger, context.terminate.wait)
    finally:
        await context.terminated.set()
        for server in servers:
            server.close()
            await server.wait_closed()
        if tasks:
            _, pending = await asyncio.wait(
                list(tasks), timeout=config.graceful_timeout
            )
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        await lifespan.wait_for_shutdown()
        lifespan_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lifespan_task


def _repr_address(sock: socket.socket) -> str:
    address = sock.getsockname()
    if sock.family == socket.AF_INET6:
        return f"[{address[0]}]:{address[1]}"
    if isinstance(address, tuple):
        return f"{address[0]}:{address[1]}"
    return str(address)


async def _serve_trio(
    app: ASGIApp,
    config: Config,
    options: _Options,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None,
    task_status: trio.TaskStatus[list[str]] | None,
) -> None:
    import trio

    from proxyproto.trio import read_proxy_header, socket_addresses

    lifespan_class, tcp_server_class, worker_context_class = _hypercorn_internals(
        "trio"
    )
    from hypercorn.typing import ConnectionState

    wrapped = _wrap(app, config)
    state: dict[str, Any] = {}
    lifespan = lifespan_class(wrapped, config, state)
    context = worker_context_class(_max_requests(config))

    async def handle(ssl_context: ssl.SSLContext | None, stream: Any) -> None:
        peer, local = socket_addresses(stream)
        policy = options.trust.decide(peer, local)
        try:
            proxy_stream = await read_proxy_header(
                stream,
                policy=policy,
                header_timeout=options.header_timeout,
                **options.reader_options,
            )
        except (RemoteProtocolError, trio.BrokenResourceError) as exc:
            LOGGER.warning("closing connection from %s: %s", peer, exc)
            await trio.aclose_forcefully(stream)
            return
        _CURRENT.set(ProxyInfo(header=proxy_stream.header, peer=peer))
        wrapped_stream: Any = _SocketStream(proxy_stream, policy)
        if ssl_context is not None:
            wrapped_stream = trio.SSLStream(
                wrapped_stream, ssl_context, server_side=True, https_compatible=True
            )
        await tcp_server_class(
            wrapped, config, context, ConnectionState(state.copy()), wrapped_stream
        )

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            ssl_context = config.create_ssl_context() if config.ssl_enabled else None
            binds = []
            listeners: list[trio.SocketListener] = []
            async with trio.open_nursery() as accept_nursery:
                for secure, group in (
                    (True, sockets.secure_sockets),
                    (False, sockets.insecure_sockets),
                ):
                    for sock in group:
                        sock.listen(config.backlog)
                        listener = trio.SocketListener(
                            trio.socket.from_stdlib_socket(sock)
                        )
                        listeners.append(listener)
                        scheme = "https" if secure else "http"
                        binds.append(f"{scheme}://{_repr_address(sock)}")
                        await config.log.info(
                            f"Running on {binds[-1]} with PROXY protocol "
                            "(CTRL + C to quit)"
                        )
                        accept_nursery.start_soon(
                            partial(
                                trio.serve_listeners,
                                partial(handle, ssl_context if secure else None),
                                [listener],
                                handler_nursery=server_nursery,
                            )
                        )
                if task_status is not None:
                    task_status.started(binds)
                if shutdown_trigger is None:
                    with trio.open_signal_receiver(
                        signal.SIGINT, signal.SIGTERM
                    ) as signals:
                        trigger: Callable[[], Awaitable[Any]] = partial(
                            anext, signals.__aiter__()
                        )
                        await _trio_wait_first(trigger, context.terminate.wait)
                else:
                    await _trio_wait_first(shutdown_trigger, context.terminate.wait)
                accept_nursery.cancel_scope.cancel()
            for listener in listeners:
                await listener.aclose()
            await context.terminated.set()
            server_nursery.cancel_scope.deadline = (
                trio.current_time() + config.graceful_timeout
            )
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _trio_wait_first(*waits: Callable[[], Awaitable[Any]]) -> None:
    import trio

    async with trio.open_nursery() as nursery:

        async def run(wait: Callable[[], Awaitable[Any]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        for wait in waits:
            nursery.start_soon(run, wait)


def _make_socket_stream_class() -> type[Any]:
    import trio

    from proxyproto.trio import ProxyStream

    class SocketStream(trio.abc.HalfCloseableStream):
        # Hypercorn's trio TCPServer reads the addresses from ``stream.socket``
        # (or ``stream.transport_stream.socket`` under TLS): this stream is the
        # ProxyStream with a ``socket`` reporting the header's addresses.
        def __init__(self, stream: ProxyStream, policy: Policy) -> None:
            self.transport_stream = stream
            sock = getattr(stream.transport_stream, "socket", None)
            addresses = header_addresses(stream.header, policy)
            self.socket = sock if addresses is None else AddressSocket(sock, *addresses)

        async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
            return await self.transport_stream.receive_some(max_bytes)

        async def send_all(self, data: bytes | bytearray | memoryview) -> None:
            await self.transport_stream.send_all(data)

        async def wait_send_all_might_not_block(self) -> None:
            await self.transport_stream.wait_send_all_might_not_block()

        async def send_eof(self) -> None:
            await self.transport_stream.send_eof()

        async def aclose(self) -> None:
            await self.transport_stream.aclose()

    return SocketStream


class _LazySocketStream:
    _class: type[Any] | None = None

    def __call__(self, stream: Any, policy: Policy) -> Any:
        if self._class is None:
            type(self)._class = _make_socket_stream_class()
        assert self._class is not None
        return self._class(stream, policy)


_SocketStream = _LazySocketStream()


def _running_library() -> str:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return "trio"
    return "asyncio"


async def serve(
    app: ASGIApp,
    config: Config,
    *,
    trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
    untrusted: Policy = Policy.REJECT,
    header_timeout: float = DEFAULT_TIMEOUT,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    task_status: trio.TaskStatus[list[str]] | None = None,
    **reader_options: Any,
) -> None:
    """Serve *app* with Hypercorn, reading a PROXY header on every connection.

    Like ``hypercorn.asyncio.serve`` / ``hypercorn.trio.serve`` (whichever
    library is running): binds ``config.bind`` (TLS on them if
    ``config.certfile`` is set; ``config.insecure_bind`` plain), runs the
    lifespan, and serves until *shutdown_trigger* returns (default: SIGINT or
    SIGTERM). HTTP/1.1 and HTTP/2 over TCP; QUIC binds are not served.

    Args:
        app: an ASGI 3 application.
        config: a ``hypercorn.config.Config``.
        trusted: load balancer CIDRs/addresses that must send a header, or a
            ``TrustPolicy``. Default: only 127.0.0.1 and ::1.
        untrusted: policy for everyone else (``REJECT`` or ``SKIP``).
        header_timeout: seconds the complete header may take.
        shutdown_trigger: awaited; its return starts a graceful shutdown.
        task_status: trio only: ``nursery.start`` gets the bound URLs.
        **reader_options: ``HeaderReader`` options (``versions``,
            ``max_v2_length``, ``verify_crc32c``, ...).
    """
    options = _Options(
        trust=make_trust_policy(trusted, untrusted),
        header_timeout=header_timeout,
        reader_options=dict(reader_options),
    )
    if _running_library() == "asyncio":
        await _serve_asyncio(app, config, options, shutdown_trigger)
    else:
        await _serve_trio(app, config, options, shutdown_trigger, task_status)


def run(
    app: ASGIApp | str,
    config: Config,
    *,
    trusted: TrustPolicy | TrustedArg = DEFAULT_TRUSTED,
    untrusted: Policy = Policy.REJECT,
    header_timeout: float = DEFAULT_TIMEOUT,
    **reader_options: Any,
) -> None:
    """Run ``serve`` in a new event loop of ``config.worker_class``
    (``asyncio``, ``uvloop`` or ``trio``) until SIGINT/SIGTERM.

    Args:
        app: the app, or ``"module:attribute"`` to import.
        config: a ``hypercorn.config.Config`` (``workers`` must be 1).
        trusted: as for ``serve``.
        untrusted: as for ``serve``.
        header_timeout: as for ``serve``.
        **reader_options: as for ``serve``.

    Raises:
        ValueError: more than one worker, or an unknown worker class.
    """
    if config.workers not in (0, 1):
        raise ValueError(
            "proxyproto.hypercorn runs one worker; run several processes with "
            "SO_REUSEPORT binds instead of --workers"
        )
    if config.worker_class == "uvloop" and config.ssl_enabled:
        raise ValueError(
            "TLS after a PROXY header needs the asyncio or trio worker "
            "(uvloop's start_tls() accepts only its own transports)"
        )
    loaded = _load_app(app, config) if isinstance(app, str) else app
    coroutine = partial(
        serve,
        loaded,
        config,
        trusted=trusted,
        untrusted=untrusted,
        header_timeout=header_timeout,
        **reader_options,
    )
    if config.worker_class == "trio":
        import trio

        trio.run(coroutine)
    elif config.worker_class in ("asyncio", "uvloop"):
        loop_factory = None
        if config.worker_class == "uvloop":
            import uvloop  # type: ignore[import-not-found]

            loop_factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(coroutine())
    else:
        raise ValueError(f"unknown worker class {config.worker_class!r}")


def _load_app(path: str, config: Config) -> ASGIApp:
    from hypercorn.app_wrappers import ASGIWrapper
    from hypercorn.utils import load_application

    wrapper = load_application(path, config.wsgi_max_body_size)
    if not isinstance(wrapper, ASGIWrapper):
        raise ValueError(f"{path} is not an ASGI application")
    return wrapper.app  # type: ignore[return-value]


def _hypercorn_cli_config(argv: Sequence[str]) -> Config | int:
    """Hypercorn's own command line parsed into a ``Config``.

    Private API: ``hypercorn.__main__.main`` parses *argv* and ends with
    ``return run(config)`` using the module global ``run`` (checked against
    Hypercorn 0.17.3 and 0.18.0); we swap that global for the length of the
    call to capture the config. Returns the exit status if Hypercorn exits
    (``--help``, usage errors).
    """
    hypercorn_main: Any = importlib.import_module("hypercorn.__main__")

    captured: list[Config] = []

    def capture(config: Config) -> int:
        captured.append(config)
        return 0

    original = hypercorn_main.run
    hypercorn_main.run = capture
    try:
        status = hypercorn_main.main(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        hypercorn_main.run = original
    return captured[0] if captured else status


def proxy_argument_parser(prog: str) -> argparse.ArgumentParser:
    """The ``--proxy-*`` options both command lines add to the server's own."""
    parser = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    parser.add_argument(
        "--proxy-trusted",
        action="append",
        metavar="CIDR",
        help="a load balancer address or network that must send a PROXY header "
        "(repeatable; default: 127.0.0.1 and ::1)",
    )
    parser.add_argument(
        "--proxy-untrusted",
        choices=["reject", "skip"],
        default="reject",
        help="other peers: reject (close, the default) or skip (serve directly)",
    )
    parser.add_argument(
        "--proxy-timeout",
        type=float,
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


def parse_proxy_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[dict[str, Any], list[str]]:
    """Split *argv* into the adapters' keyword arguments and the rest."""
    args, rest = parser.parse_known_args(list(argv))
    kwargs: dict[str, Any] = {
        "trusted": args.proxy_trusted or list(DEFAULT_TRUSTED),
        "untrusted": Policy(args.proxy_untrusted),
        "header_timeout": args.proxy_timeout,
    }
    if args.proxy_version:
        kwargs["versions"] = set(args.proxy_version)
    return kwargs, rest


def _print_proxy_help(parser: argparse.ArgumentParser) -> None:
    print("\nPROXY protocol options (proxyproto):")
    for action in parser._actions:
        print(f"  {', '.join(action.option_strings):<22} {action.help}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m proxyproto.hypercorn APP [--proxy-* ...] [hypercorn options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = proxy_argument_parser("python -m proxyproto.hypercorn")
    proxy_kwargs, rest = parse_proxy_arguments(parser, argv)
    config = _hypercorn_cli_config(rest)
    if "-h" in rest or "--help" in rest:
        _print_proxy_help(parser)
    if isinstance(config, int):
        return config
    run(config.application_path, config, **proxy_kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
