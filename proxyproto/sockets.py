"""proxyproto for blocking sockets and ``socketserver``.

- ``read_header(sock, policy=...)`` reads exactly one PROXY header from an
  accepted socket and never a byte past it, so whatever follows (an HTTP
  request, a TLS ClientHello) is still in the socket for the application.
- ``ProxyProtocolMixin`` makes a ``socketserver`` server read the header in
  the thread (or process) that handles the connection, never in the accept
  loop, and hands the request handler the real client address.

How "never a byte past it" works: the reader peeks (``MSG_PEEK``) at what has
arrived, parses it, and then ``recv``\\ s exactly the bytes the parse says
belong to the header. While the header is incomplete every byte seen so far is
a header byte, so it can be taken off the socket and the next peek blocks until
more arrives. Only ``Policy.USE`` (guessing) must wait without consuming while
the first bytes could still start a header or not; it polls briefly then.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Unpack

from proxyproto._adapters import (
    DEFAULT_TIMEOUT,
    header_address,
    log_refusal,
    select_addresses,
)
from proxyproto._errors import RemoteProtocolError
from proxyproto._events import NEED_DATA, NO_HEADER, ProxyHeader
from proxyproto._options import DEFAULT_MAX_V2_LENGTH, V1_MAX_LENGTH
from proxyproto._policy import Policy, TrustPolicy
from proxyproto._reader import HeaderReader, ReaderOptions
from proxyproto._v1 import V1_PREFIX
from proxyproto._v2 import V2_FIXED_LENGTH, V2_SIGNATURE

if TYPE_CHECKING:
    import socketserver

__all__ = [
    "DEFAULT_TIMEOUT",
    "ProxyConnection",
    "ProxyProtocolMixin",
    "ProxyRequestHandlerMixin",
    "read_header",
]

LOGGER = logging.getLogger("proxyproto.sockets")

#: With ``Policy.USE``, how long to wait before peeking again while the first
#: bytes are still ambiguous (a few bytes of "PROXY " or of the v2 signature).
_USE_POLL_INTERVAL = 0.005

SocketAddress = tuple[Any, ...] | str


def _peek_size(consumed: int, first: bytes, max_v2_length: int) -> int:
    # Enough to see a whole header of the kind the first byte announces.
    if first == b"P":
        return max(1, V1_MAX_LENGTH - consumed)
    return max(1, V2_FIXED_LENGTH + max_v2_length - consumed)


def _committed(data: bytes, optional: bool) -> bool:
    # May the bytes of an incomplete header be taken off the socket? Always for
    # a mandatory header (they are header bytes or garbage); for USE only once
    # the prefix proves a header is coming.
    if not optional:
        return True
    return data[:6] == V1_PREFIX or data[:12] == V2_SIGNATURE


def _recv_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    parts: list[bytes] = []
    while size:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk = sock.recv(size)
        if not chunk:  # cannot happen: these bytes were peeked already
            raise RemoteProtocolError("connection closed mid-header", reason="eof")
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


def read_header(
    sock: socket.socket,
    *,
    policy: Policy = Policy.REQUIRE,
    header_timeout: float = DEFAULT_TIMEOUT,
    **reader_options: Unpack[ReaderOptions],
) -> ProxyHeader | None:
    """Read the PROXY header from an accepted stream socket, and nothing more.

    The socket's timeout is changed while reading (one deadline across all
    reads) and restored afterwards.

    Args:
        sock: a connected ``SOCK_STREAM`` socket nothing was read from yet.
        policy: REQUIRE / IGNORE read a mandatory header; USE reads one if
            present (guessing, see ``Policy``); SKIP reads nothing and returns
            None; REJECT raises at once.
        header_timeout: seconds the complete header may take to arrive.
        **reader_options: ``HeaderReader`` options (``versions``,
            ``max_v2_length``, ``verify_crc32c``, ...).

    Returns:
        The header, or None (SKIP, or USE and the connection has none).

    Raises:
        RemoteProtocolError: invalid, missing, incomplete at EOF
            (``reason == "eof"``; ``"empty"`` if not a byte came), late
            (``reason == "timeout"``), or the policy is REJECT
            (``reason == "rejected"``).
        OSError: the connection failed (e.g. reset by the peer).
    """
    if policy is Policy.REJECT:
        raise RemoteProtocolError(
            "this peer may not connect here (trust policy REJECT)", reason="rejected"
        )
    if policy is Policy.SKIP:
        return None
    optional = policy is Policy.USE
    max_v2_length = reader_options.get("max_v2_length", DEFAULT_MAX_V2_LENGTH)
    deadline = time.monotonic() + header_timeout
    previous_timeout = sock.gettimeout()
    consumed = b""
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
            first = consumed[:1]
            peeked = sock.recv(
                _peek_size(len(consumed), first, max_v2_length), socket.MSG_PEEK
            )
            data = consumed + peeked
            # A fresh reader over everything seen: cheap (headers are small)
            # and it tells exactly where the header ends without consuming.
            reader = HeaderReader(optional=optional, **reader_options)
            reader.receive_data(data)
            if not peeked:
                reader.receive_data(b"")
            event = reader.next_event()
            if event is NO_HEADER:
                # Only USE gets here, and only before anything was consumed.
                return None
            if event is not NEED_DATA:
                assert isinstance(event, ProxyHeader)
                take = len(data) - len(reader.trailing_data) - len(consumed)
                _recv_exactly(sock, take, deadline)
                return event
            if _committed(data, optional):
                consumed += _recv_exactly(sock, len(peeked), deadline)
            else:
                time.sleep(min(_USE_POLL_INTERVAL, max(remaining, 0)))
    except TimeoutError:
        raise RemoteProtocolError(
            f"no complete PROXY header within {header_timeout} s "
            f"({len(consumed)} bytes received)",
            reason="timeout",
        ) from None
    finally:
        sock.settimeout(previous_timeout)


@dataclass(frozen=True, slots=True)
class ProxyConnection:
    """What a server learned about one connection from its PROXY header.

    Attributes:
        header: the decoded header, or None (SKIP, or USE without a header).
        policy: the policy this connection was served under.
        peer_address: the socket's real peer (the load balancer).
        local_address: the socket's real local address.
    """

    header: ProxyHeader | None
    policy: Policy
    peer_address: SocketAddress | None
    local_address: SocketAddress | None

    def _addresses(self) -> tuple[SocketAddress | None, SocketAddress | None]:
        real = (self.peer_address, self.local_address)
        return select_addresses(self.header, self.policy, *real, header_address)

    @property
    def client_address(self) -> SocketAddress | None:
        """The client: ``(host, port)`` from the header when it applies,
        otherwise the real socket peer (LOCAL, UNKNOWN, IGNORE, SKIP)."""
        return self._addresses()[0]

    @property
    def server_address(self) -> SocketAddress | None:
        """The address the client connected to, by the same rule."""
        return self._addresses()[1]


def _socket_address(sock: socket.socket, peer: bool) -> SocketAddress | None:
    try:
        address = sock.getpeername() if peer else sock.getsockname()
    except OSError:
        return None
    if isinstance(address, tuple):
        return address
    if isinstance(address, str):
        return address
    return None


class ProxyProtocolMixin:
    """A ``socketserver`` mix-in: read the PROXY header of every request.

    Use it first in the bases, with a threading or forking server so that the
    header is read in the handling thread and a slow client delays nobody
    else (with a plain ``TCPServer`` requests are serial anyway)::

        class Server(ProxyProtocolMixin, socketserver.ThreadingTCPServer):
            pass

        trust = TrustPolicy.from_cidrs(["10.0.0.0/8"])
        server = Server(("", 8080), Handler, trust=trust)

    The request handler is built with the *real* client address as its
    ``client_address`` (so ``http.server`` logs the right client), and can
    get the rest with ``self.server.proxy_connection(self.request)``, or as
    ``self.proxy`` when it also inherits ``ProxyRequestHandlerMixin``.

    Connections whose policy is REJECT, whose header is bad, missing or late
    are closed and logged (logger ``proxyproto.sockets``) without reaching the
    handler.

    Class attributes (defaults for the keyword arguments of ``__init__``):
        proxy_trust: the ``TrustPolicy``; required.
        proxy_header_timeout: seconds the header may take.
        proxy_reader_options: ``HeaderReader`` options.
    """

    proxy_trust: ClassVar[TrustPolicy | None] = None
    proxy_header_timeout: ClassVar[float] = DEFAULT_TIMEOUT
    proxy_reader_options: ClassVar[ReaderOptions] = {}

    def __init__(
        self,
        *args: Any,
        trust: TrustPolicy | None = None,
        header_timeout: float | None = None,
        reader_options: ReaderOptions | None = None,
        **kwargs: Any,
    ) -> None:
        """Take the mix-in's keyword arguments and pass the rest on.

        Raises:
            TypeError: no trust policy was given.
        """
        trust = trust if trust is not None else type(self).proxy_trust
        if trust is None:
            raise TypeError(
                "ProxyProtocolMixin needs trust=TrustPolicy(...) (or a "
                "proxy_trust class attribute): whose PROXY headers to believe"
            )
        self._proxy_trust = trust
        self._proxy_timeout = (
            header_timeout if header_timeout is not None else self.proxy_header_timeout
        )
        self._proxy_options: ReaderOptions = (
            reader_options if reader_options is not None else self.proxy_reader_options
        )
        self._proxy_connections: dict[int, ProxyConnection] = {}
        self._proxy_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def proxy_connection(self, request: socket.socket) -> ProxyConnection | None:
        """What the header of *request* said (while its handler runs)."""
        with self._proxy_lock:
            return self._proxy_connections.get(id(request))

    def read_proxy_header(
        self, request: socket.socket, client_address: Any = None
    ) -> ProxyConnection:
        """Decide the policy for *request* and read its header.

        Override to customise; runs in the handling thread. *client_address*
        is what ``accept()`` returned (``getpeername()`` fails once the peer
        has reset the connection, which HAProxy's health checks do).

        Raises:
            RemoteProtocolError: REJECT, or a bad, missing or late header.
            OSError: the connection failed.
        """
        peer = client_address or _socket_address(request, peer=True)
        local = _socket_address(request, peer=False)
        policy = self._proxy_trust.decide(
            peer if isinstance(peer, tuple) else None,
            local if isinstance(local, tuple) else None,
        )
        header = read_header(
            request,
            policy=policy,
            header_timeout=self._proxy_timeout,
            **self._proxy_options,
        )
        return ProxyConnection(header, policy, peer, local)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Read the header, then run the handler with the real client address.

        ``ThreadingMixIn`` / ``ForkingMixIn`` call this in the handling thread
        or process. Errors in the header are logged and the request is
        dropped (the server then closes it as usual).
        """
        try:
            info = self.read_proxy_header(request, client_address)
        except RemoteProtocolError as exc:
            log_refusal(LOGGER, client_address, exc)
            return
        except OSError as exc:
            LOGGER.info(
                "connection from %s broke before its header: %s", client_address, exc
            )
            return
        key = id(request)
        with self._proxy_lock:
            self._proxy_connections[key] = info
        try:
            super().finish_request(  # type: ignore[misc]
                request, info.client_address
            )
        finally:
            with self._proxy_lock:
                self._proxy_connections.pop(key, None)


class ProxyRequestHandlerMixin:
    """A request-handler mix-in giving ``self.proxy``: the ``ProxyConnection``.

    ``class Handler(ProxyRequestHandlerMixin, socketserver.StreamRequestHandler)``
    served by a ``ProxyProtocolMixin`` server. ``self.client_address`` is
    already the real client's.
    """

    request: socket.socket
    server: socketserver.BaseServer

    @property
    def proxy(self) -> ProxyConnection | None:
        """The header and addresses of this connection (None if the server
        is not a ``ProxyProtocolMixin`` one)."""
        lookup = getattr(self.server, "proxy_connection", None)
        if lookup is None:
            return None
        info = lookup(self.request)
        assert info is None or isinstance(info, ProxyConnection)
        return info

    @property
    def proxy_header(self) -> ProxyHeader | None:
        """Shortcut for ``self.proxy.header``."""
        info = self.proxy
        return None if info is None else info.header
