"""proxyproto for asyncio servers: streams or protocols behind a PROXY header.

- ``start_server(cb, host, port, trust=...)`` works like
  ``asyncio.start_server``, but *cb* runs only once a valid header has
  arrived; the ``StreamReader`` yields the bytes after the header first, and
  ``writer.get_extra_info("peername")`` is the real client.
- ``ProxyProtocolWrapper(protocol, trust=...)`` does the same for protocol
  based servers: ``loop.create_server(lambda: ProxyProtocolWrapper(
  MyProtocol(), trust=trust), host, port)``.

Theory of operation
-------------------
The wrapper is the protocol the event loop sees. ``connection_made`` decides
the ``Policy`` from the socket's peer and local address and starts the header
timer; ``data_received`` feeds a ``HeaderReader`` until the header is complete.
Then the inner protocol gets ``connection_made`` with a transport proxy whose
``get_extra_info`` reports the header's addresses, followed by the bytes that
came after the header (``data_received`` or, for a ``BufferedProtocol``,
``get_buffer``/``buffer_updated``), and from then on every event of the real
transport. A bad, missing, truncated or late header closes the connection
and logs a WARNING (logger ``proxyproto.asyncio``; INFO for a peer that reset,
or closed without sending a byte, before its header); the inner protocol
never hears of it.

TLS after the header (a load balancer passing TLS through, with PROXY in
front) cannot use ``create_server(ssl=...)``: that would expect the header
inside TLS. Pass ``ssl=`` to the wrapper or to ``start_server`` instead; the
handshake then starts with the bytes after the header.

``extra`` keys on the inner protocol's transport:

================================  ===========================================
``"peername"``                    the real client (header source), or the
                                  socket peer when the header does not apply
                                  (LOCAL, UNKNOWN, IGNORE, SKIP)
``"sockname"``                    the address the client connected to
``"proxyproto.header"``           the ``ProxyHeader`` (None: SKIP, or USE and
                                  none was sent)
``"proxyproto.policy"``           the ``Policy`` applied
``"proxyproto.peername"``         the socket's peer (the load balancer)
``"proxyproto.sockname"``         the socket's local address
================================  ===========================================

Addresses from the header are ``(host, port)`` tuples, also for IPv6.

Subclasses may adapt the hand-over (``proxyproto.uvicorn`` and
``proxyproto.hypercorn`` do, through ``proxyproto._asgi``): ``make_protocol``
builds the inner protocol once the header is known, ``extra_info`` adds or
changes transport extra keys, ``handshake_failed`` reports a failed TLS
handshake; the ``logger`` argument picks where refusals are logged.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as _ssl
from asyncio import constants, sslproto, transports
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from proxyproto._adapters import (
    DEFAULT_TIMEOUT,
    header_address,
    log_refusal,
    select_addresses,
)
from proxyproto._errors import RemoteProtocolError
from proxyproto._events import NEED_DATA, NO_HEADER, ProxyHeader
from proxyproto._policy import Policy, TrustPolicy
from proxyproto._reader import HeaderReader, ReaderOptions

__all__ = ["DEFAULT_TIMEOUT", "ProxyProtocolWrapper", "start_server"]

LOGGER = logging.getLogger("proxyproto.asyncio")

_INET_FAMILIES = (socket.AF_INET, socket.AF_INET6)

ClientConnectedCallback = Callable[
    [asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None] | None
]


def _feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    # The same copy loop asyncio's own SSL layer uses for buffered protocols.
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
    elif isinstance(protocol, asyncio.Protocol):
        protocol.data_received(data)
    else:
        raise TypeError(f"cannot deliver data to {type(protocol).__name__}")


def _eof_received(protocol: asyncio.BaseProtocol) -> bool | None:
    if isinstance(protocol, (asyncio.Protocol, asyncio.BufferedProtocol)):
        return protocol.eof_received()
    return None


class _ProxyTransport(transports._FlowControlMixin):
    # The transport the inner protocol sees: the real one, with the header's
    # addresses in get_extra_info and reads paused/resumed through the
    # wrapper (which may still hold bytes from after the header).

    # loop.start_tls() accepts this transport (it only needs the methods below).
    _start_tls_compatible = True
    # loop.sendfile() too (aiohttp's FileResponse calls it): asyncio then
    # copies the file with write() under flow control, for which it wants a
    # _FlowControlMixin with _loop and _protocol_paused. (Native sendfile
    # takes only the loop's own socket transports.)
    _sendfile_compatible = constants._SendfileMode.FALLBACK

    def __init__(
        self,
        transport: asyncio.Transport,
        wrapper: ProxyProtocolWrapper,
        extra: dict[str, object],
    ) -> None:
        # Not _FlowControlMixin.__init__: flow control is the real transport's.
        asyncio.Transport.__init__(self)
        self._loop = asyncio.get_running_loop()
        self._extra_info = extra
        self._transport = transport
        self._wrapper = wrapper

    @property
    def _protocol_paused(self) -> bool:
        # Whether the real transport has paused the protocol's writing.
        return bool(getattr(self._transport, "_protocol_paused", False))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name in self._extra_info:
            return self._extra_info[name]
        return self._transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._wrapper._inner = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        inner = self._wrapper._inner
        assert inner is not None
        return inner

    def is_reading(self) -> bool:
        return not self._wrapper._paused and self._transport.is_reading()

    def pause_reading(self) -> None:
        self._wrapper._paused = True
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._wrapper._paused = False
        self._transport.resume_reading()
        if self._wrapper._pending or self._wrapper._pending_eof:
            asyncio.get_running_loop().call_soon(self._wrapper._flush_pending)

    def set_write_buffer_limits(
        self, high: int | None = None, low: int | None = None
    ) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

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

    def _force_close(self, exc: BaseException | None) -> None:
        # asyncio's SSLProtocol calls this (private) on fatal TLS errors and
        # handshake timeouts; transports without it (uvloop's) are aborted.
        force_close = getattr(self._transport, "_force_close", None)
        if force_close is not None:
            force_close(exc)
        else:
            self._transport.abort()


class ProxyProtocolWrapper(asyncio.Protocol):
    """Reads the PROXY header, then hands the connection to *protocol*.

    *protocol* may be an ``asyncio.Protocol`` or an ``asyncio.BufferedProtocol``
    (bytes are copied into its buffers). Its transport reports the real client
    and server addresses and the header through ``get_extra_info`` (see the
    module docstring for the keys).

    Args:
        protocol: the application's protocol instance for this connection
            (None if a subclass's ``make_protocol`` builds it).
        trust: decides the ``Policy`` from the socket's peer and local address.
        header_timeout: seconds the complete header may take to arrive.
        ssl: terminate TLS after the header, with this server context.
        ssl_handshake_timeout: for *ssl*; asyncio's default (60 s) if None.
        reader_options: ``HeaderReader`` options (``versions``,
            ``max_v2_length``, ``verify_crc32c``, ...).
        logger: where refused connections and failed TLS handshakes are
            logged (default: the ``proxyproto.asyncio`` logger).

    Attributes:
        header: the header once read (None before, and for SKIP / USE
            without a header).
        policy: the policy applied (None before ``connection_made``).
        logger: the *logger* argument.
    """

    def __init__(
        self,
        protocol: asyncio.BaseProtocol | None,
        *,
        trust: TrustPolicy,
        header_timeout: float = DEFAULT_TIMEOUT,
        ssl: _ssl.SSLContext | None = None,
        ssl_handshake_timeout: float | None = None,
        reader_options: ReaderOptions | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self._app = protocol
        self._trust = trust
        self._timeout = header_timeout
        self._ssl = ssl
        self._ssl_handshake_timeout = ssl_handshake_timeout
        self._options: ReaderOptions = reader_options or {}
        self._transport: asyncio.Transport | None = None
        self._inner: asyncio.BaseProtocol | None = None
        self._reader: HeaderReader | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._peer: object = None
        self._local: object = None
        self._done = False
        # Bytes after the header that the inner protocol is not ready for
        # (it paused reading in connection_made), and an EOF behind them.
        self._pending = b""
        self._pending_eof = False
        self._paused = False
        self.header: ProxyHeader | None = None
        self.policy: Policy | None = None
        self.logger = logger or LOGGER

    # -- hooks for subclasses ---------------------------------------------------

    def make_protocol(self, extra: Mapping[str, object]) -> asyncio.BaseProtocol:
        """The protocol the connection is handed to, once the header is read.

        Called once, with ``header`` and ``policy`` set and *extra* the keys
        its transport will report (after ``extra_info``). With ``ssl`` it is
        called before the handshake, and gets ``connection_made`` only when
        the handshake has succeeded. Default: the *protocol* given.
        """
        if self._app is None:
            raise TypeError("ProxyProtocolWrapper needs a protocol")
        return self._app

    def extra_info(self, extra: dict[str, object]) -> dict[str, object]:
        """The ``get_extra_info`` overrides of the inner protocol's transport.

        *extra* holds the keys listed in the module docstring; a subclass may
        add or replace keys (e.g. a ``"socket"`` reporting the header's
        addresses) and returns the dict to use. Default: *extra* unchanged.
        """
        return extra

    def handshake_failed(self, exc: BaseException) -> None:
        """Called when TLS after the header fails (the connection is closed
        already). Default: a warning on ``logger``."""
        self.logger.warning("TLS handshake with %s failed: %s", self._peer, exc)

    # -- events from the real transport --------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._peer = transport.get_extra_info("peername")
        self._local = transport.get_extra_info("sockname")
        peer = self._peer if isinstance(self._peer, tuple) else None
        local = self._local if isinstance(self._local, tuple) else None
        sock = transport.get_extra_info("socket")
        if peer is None and getattr(sock, "family", None) in _INET_FAMILIES:
            # getpeername() failed: the peer is already gone (HAProxy's
            # health checks reset right after connecting).
            self._done = True
            self.logger.info("connection closed by its peer before its header")
            transport.close()
            return
        self.policy = policy = self._trust.decide(peer, local)
        if policy is Policy.REJECT:
            self._fail(
                RemoteProtocolError(
                    "not a trusted source (trust policy REJECT)", reason="rejected"
                )
            )
            return
        if policy is Policy.SKIP:
            self._start(None, b"")
            return
        self._reader = HeaderReader(optional=policy is Policy.USE, **self._options)
        self._timer = asyncio.get_running_loop().call_later(
            self._timeout, self._timed_out
        )

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            if self._paused or self._pending:
                self._pending += data
            else:
                _feed(self._inner, data)
        elif self._reader is not None and not self._done:
            self._reader.receive_data(data)
            self._advance()

    def eof_received(self) -> bool | None:
        if self._inner is None and self._reader is not None and not self._done:
            self._reader.receive_data(b"")
            self._advance()
        if self._inner is None:
            return False
        if self._paused or self._pending:
            self._pending_eof = True
            return True
        return _eof_received(self._inner)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done:
            self.logger.info(
                "connection from %s lost before its header: %s", self._peer, exc
            )
        self._done = True
        self._cancel_timer()
        inner, self._inner = self._inner, None
        self._pending = b""
        if inner is not None:
            inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    # -- internals --------------------------------------------------------------

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fail(self, exc: RemoteProtocolError) -> None:
        self._done = True
        self._cancel_timer()
        log_refusal(self.logger, self._peer, exc)
        assert self._transport is not None
        self._transport.close()

    def _timed_out(self) -> None:
        self._timer = None
        if not self._done and self._inner is None:
            self._fail(
                RemoteProtocolError(
                    f"no complete PROXY header within {self._timeout} s",
                    reason="timeout",
                )
            )

    def _advance(self) -> None:
        assert self._reader is not None
        try:
            event = self._reader.next_event()
        except RemoteProtocolError as exc:
            self._fail(exc)
            return
        if event is NEED_DATA:
            return
        header = None if event is NO_HEADER else event
        assert header is None or isinstance(header, ProxyHeader)
        self._start(header, self._reader.trailing_data)

    def _start(self, header: ProxyHeader | None, leftover: bytes) -> None:
        self._cancel_timer()
        self._done = True
        self.header = header
        policy = self.policy
        assert self._transport is not None
        assert policy is not None
        client, server = select_addresses(
            header, policy, self._peer, self._local, header_address
        )
        extra: dict[str, object] = {
            "peername": client,
            "sockname": server,
            "proxyproto.header": header,
            "proxyproto.policy": policy,
            "proxyproto.peername": self._peer,
            "proxyproto.sockname": self._local,
        }
        extra = self.extra_info(extra)
        transport = _ProxyTransport(self._transport, self, extra)
        app = self.make_protocol(extra)
        inner = app
        if self._ssl is not None:
            loop = asyncio.get_running_loop()
            # What create_server(ssl=...) builds below its protocols, started
            # here on the bytes after the header instead of the first bytes.
            waiter = loop.create_future()
            waiter.add_done_callback(self._handshake_done)
            inner = sslproto.SSLProtocol(
                loop,
                app,
                self._ssl,
                waiter,
                server_side=True,
                call_connection_made=True,
                ssl_handshake_timeout=self._ssl_handshake_timeout,  # type: ignore[arg-type]
            )
        self._inner = inner
        inner.connection_made(transport)
        if leftover:
            self._pending = leftover
            if not self._paused:
                self._flush_pending()

    def _is_paused(self) -> bool:
        # A method, not the attribute: the inner protocol may pause in _feed.
        return self._paused

    def _handshake_done(self, waiter: asyncio.Future[None]) -> None:
        exc = None if waiter.cancelled() else waiter.exception()
        if exc is not None:
            self.handshake_failed(exc)

    def _flush_pending(self) -> None:
        if self._inner is None or self._paused:
            return
        data, self._pending = self._pending, b""
        if data:
            _feed(self._inner, data)
        if self._pending_eof and not self._pending and not self._is_paused():
            self._pending_eof = False
            if not _eof_received(self._inner) and self._transport is not None:
                self._transport.close()


async def start_server(
    client_connected_cb: ClientConnectedCallback,
    host: str | Sequence[str] | None = None,
    port: int | None = None,
    *,
    trust: TrustPolicy,
    header_timeout: float = DEFAULT_TIMEOUT,
    limit: int = 2**16,
    ssl: _ssl.SSLContext | None = None,
    ssl_handshake_timeout: float | None = None,
    reader_options: ReaderOptions | None = None,
    **kwargs: Any,
) -> asyncio.Server:
    """Like ``asyncio.start_server``, for connections behind a PROXY header.

    *client_connected_cb(reader, writer)* runs only after a valid header (or
    at once for SKIP peers). The reader yields the bytes after the header
    first; ``writer.get_extra_info("peername")`` / ``("sockname")`` are the
    real client and server, ``("proxyproto.header")`` the ``ProxyHeader`` and
    ``("proxyproto.peername")`` the load balancer.

    Args:
        client_connected_cb: as for ``asyncio.start_server``.
        host: as for ``asyncio.start_server``.
        port: as for ``asyncio.start_server``.
        trust: decides each connection's ``Policy`` from its peer and local
            address (required: whose headers to believe).
        header_timeout: seconds the complete header may take to arrive.
        limit: the ``StreamReader`` buffer limit.
        ssl: terminate TLS *after* the header with this server context.
        ssl_handshake_timeout: for *ssl*.
        reader_options: ``HeaderReader`` options.
        **kwargs: passed to ``loop.create_server`` (``backlog``,
            ``reuse_port``, ``start_serving``, ...).

    Returns:
        The ``asyncio.Server``.

    Raises:
        OSError: binding failed.
    """
    loop = asyncio.get_running_loop()

    def factory() -> ProxyProtocolWrapper:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, client_connected_cb, loop=loop)
        return ProxyProtocolWrapper(
            protocol,
            trust=trust,
            header_timeout=header_timeout,
            ssl=ssl,
            ssl_handshake_timeout=ssl_handshake_timeout,
            reader_options=reader_options,
        )

    return await loop.create_server(factory, host, port, **kwargs)
