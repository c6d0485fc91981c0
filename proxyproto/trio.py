"""proxyproto for trio servers: read the PROXY header, then serve the stream.

Two ways in:

- ``read_proxy_header(stream, policy=...)`` reads the header from any
  ``trio.abc.Stream`` within a timeout and returns a ``ProxyStream`` that
  replays the bytes read past the header and then delegates to the transport.
- ``open_proxy_listener(listener, trust=...)`` wraps a listener for
  ``trio.serve_listeners``: its ``accept()`` hands out only streams whose header
  is complete and valid. Headers are read in one task per connection (bounded
  by ``max_pending``), so a silent or slow client never holds up other accepts,
  and a bad one is closed and logged without disturbing the accept loop.

Both decide a ``Policy`` per connection from the peer and local addresses
before reading a byte (see ``proxyproto.TrustPolicy``).
"""

from __future__ import annotations

import logging
import operator
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from proxyproto._adapters import (
    DEFAULT_TIMEOUT,
    format_address,
    inet_address,
    log_refusal,
    select_addresses,
)
from proxyproto._errors import RemoteProtocolError
from proxyproto._events import NEED_DATA, NO_HEADER, ProxyHeader
from proxyproto._options import DEFAULT_MAX_V2_LENGTH
from proxyproto._policy import Policy, TrustPolicy
from proxyproto._reader import HeaderReader

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "DEFAULT_TIMEOUT",
    "ProxyListener",
    "ProxyStream",
    "accept_proxy_header",
    "open_proxy_listener",
    "read_proxy_header",
    "socket_addresses",
]

LOGGER = logging.getLogger("proxyproto.trio")

#: How many bytes one read may take while looking for the header. Bytes past
#: the header are not lost: the returned stream replays them.
_READ_SIZE = 65536
#: Connections whose header is still being read, per listener (cf.
#: proxy-protocol-rs ``max_pending_handshakes``).
DEFAULT_MAX_PENDING = 1024

SocketAddress = tuple[str, int]
_INET_FAMILIES = (socket.AF_INET, socket.AF_INET6)


class _ConflictDetector:
    # Same contract as trio's private ConflictDetector: two tasks in the same
    # operation at once is a bug in the caller, reported as BusyResourceError.
    def __init__(self, msg: str) -> None:
        self._msg = msg
        self._held = False

    def __enter__(self) -> None:
        if self._held:
            raise trio.BusyResourceError(self._msg)
        self._held = True

    def __exit__(self, *exc: object) -> None:
        self._held = False


def socket_addresses(
    stream: trio.abc.Stream,
) -> tuple[SocketAddress | None, SocketAddress | None]:
    """The real ``(peer, local)`` addresses of *stream*'s socket, if it has one.

    Follows ``transport_stream`` through wrapper streams (e.g. ``SSLStream``).
    """
    sock = _find_socket(stream)
    if sock is None:
        return None, None
    try:
        peer = format_address(sock.getpeername())
    except OSError:  # e.g. ENOTCONN: the peer reset the connection already
        peer = None
    try:
        local = format_address(sock.getsockname())
    except OSError:
        local = None
    return peer, local


def _find_socket(stream: trio.abc.Stream) -> Any:
    current: object = stream
    for _ in range(8):
        sock = getattr(current, "socket", None)
        if sock is not None:
            return sock
        current = getattr(current, "transport_stream", None)
        if current is None:
            break
    return None


class ProxyStream(trio.abc.HalfCloseableStream):
    """A stream after its PROXY header: the header and the real addresses.

    Reads first return the bytes that arrived after the header, untouched,
    then whatever the transport delivers. ``send_eof`` needs a half-closeable
    transport (a plain TCP ``SocketStream`` is one).

    Attributes:
        transport_stream: the stream the header was read from.
        header: the decoded header, or None (policy SKIP, or USE without one).
        policy: the policy this connection was served under.
        peer_address: the real socket peer (the proxy, for proxied traffic).
        local_address: the real local socket address.
    """

    def __init__(
        self,
        transport_stream: trio.abc.Stream,
        *,
        header: ProxyHeader | None,
        policy: Policy,
        leftover: bytes = b"",
        peer_address: SocketAddress | None = None,
        local_address: SocketAddress | None = None,
    ) -> None:
        self.transport_stream = transport_stream
        self.header = header
        self.policy = policy
        self.peer_address = peer_address
        self.local_address = local_address
        self._leftover = leftover
        self._closed = False
        self._receive_conflict = _ConflictDetector(
            "another task is currently receiving data on this ProxyStream"
        )

    def _addresses(self) -> tuple[SocketAddress | None, SocketAddress | None]:
        real = (self.peer_address, self.local_address)
        return select_addresses(self.header, self.policy, *real, inet_address)

    @property
    def client_address(self) -> SocketAddress | None:
        """The client's ``(host, port)``: from the header when it applies,
        otherwise the real socket peer (LOCAL, UNKNOWN, IGNORE, SKIP).
        ``None`` for UNIX-socket clients."""
        return self._addresses()[0]

    @property
    def server_address(self) -> SocketAddress | None:
        """The address the client connected to, by the same rule."""
        return self._addresses()[1]

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        with self._receive_conflict:
            if max_bytes is not None:
                max_bytes = operator.index(max_bytes)
                if max_bytes < 1:
                    raise ValueError("max_bytes must be >= 1")
            if self._closed:
                await trio.lowlevel.checkpoint()
                raise trio.ClosedResourceError("this ProxyStream was closed")
            if self._leftover:
                await trio.lowlevel.checkpoint()
                if self._closed:
                    raise trio.ClosedResourceError("this ProxyStream was closed")
                size = len(self._leftover) if max_bytes is None else max_bytes
                data, self._leftover = self._leftover[:size], self._leftover[size:]
                return data
            return await self.transport_stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError("this ProxyStream was closed")
        await self.transport_stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError("this ProxyStream was closed")
        await self.transport_stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        """Close the sending direction (``shutdown(SHUT_WR)`` on TCP).

        Raises:
            TypeError: the transport cannot half-close.
        """
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError("this ProxyStream was closed")
        transport = self.transport_stream
        if not isinstance(transport, trio.abc.HalfCloseableStream):
            await trio.lowlevel.checkpoint()
            raise TypeError(f"{type(transport).__name__} cannot half-close")
        await transport.send_eof()

    async def aclose(self) -> None:
        self._closed = True
        self._leftover = b""
        await self.transport_stream.aclose()

    def detach(self) -> tuple[trio.abc.Stream, bytes]:
        """Hand back the transport and the bytes read past the header.

        For code that wants the raw transport (e.g. a relay with a fast path
        for plain sockets). This stream is closed afterwards; the transport is
        not, and is now the caller's.
        """
        leftover, self._leftover = self._leftover, b""
        self._closed = True
        return self.transport_stream, leftover


async def read_proxy_header(
    stream: trio.abc.Stream,
    *,
    policy: Policy = Policy.REQUIRE,
    header_timeout: float = DEFAULT_TIMEOUT,
    versions: Iterable[int] = (1, 2),
    max_v2_length: int = DEFAULT_MAX_V2_LENGTH,
    **reader_options: Any,
) -> ProxyStream:
    """Read the PROXY header from *stream* as *policy* says.

    Args:
        stream: a freshly accepted connection (nothing read from it yet).
        policy: REQUIRE / IGNORE read a mandatory header; USE reads one if
            present; SKIP reads nothing; REJECT refuses at once.
        header_timeout: seconds the complete header may take to arrive.
        versions: accepted versions.
        max_v2_length: largest v2 length field accepted.
        **reader_options: further ``HeaderReader`` options
            (``verify_crc32c``, ``accept_unspec_proxy``, ``accept_ipv4_in_tcp6``).

    Returns:
        A ``ProxyStream`` wrapping *stream*. The caller still owns *stream*:
        close the returned stream (which closes *stream*), or *stream* itself
        if this raises.

    Raises:
        RemoteProtocolError: the header is invalid, missing, incomplete at EOF
            (``reason == "eof"``; ``"empty"`` if not a byte came), too slow
            (``reason == "timeout"``), or the policy is REJECT
            (``reason == "rejected"``).
        trio.BrokenResourceError: the connection failed while reading.
    """
    peer, local = socket_addresses(stream)
    if policy is Policy.REJECT:
        raise RemoteProtocolError(
            f"peer {peer} may not connect here (trust policy REJECT)", reason="rejected"
        )
    if policy is Policy.SKIP:
        return ProxyStream(
            stream, header=None, policy=policy, peer_address=peer, local_address=local
        )
    reader = HeaderReader(
        versions=versions,
        max_v2_length=max_v2_length,
        optional=policy is Policy.USE,
        **reader_options,
    )
    with trio.move_on_after(header_timeout) as header_timeout_scope:
        while True:
            event = reader.next_event()
            if event is not NEED_DATA:
                break
            reader.receive_data(await stream.receive_some(_READ_SIZE))
    if header_timeout_scope.cancelled_caught:
        raise RemoteProtocolError(
            f"no complete PROXY header from {peer} within {header_timeout} s",
            reason="timeout",
        )
    header = None if event is NO_HEADER else event
    assert header is None or isinstance(header, ProxyHeader)
    return ProxyStream(
        stream,
        header=header,
        policy=policy,
        leftover=reader.trailing_data,
        peer_address=peer,
        local_address=local,
    )


async def accept_proxy_header(
    stream: trio.abc.Stream,
    *,
    trust: TrustPolicy,
    header_timeout: float = DEFAULT_TIMEOUT,
    logger: logging.Logger = LOGGER,
    **reader_options: Any,
) -> ProxyStream | None:
    """Serve a freshly accepted *stream* as a listener would: decide its
    policy from its addresses, read its header, and hand it over.

    What ``open_proxy_listener`` does per connection, for servers with their
    own accept loop (``proxyproto.hypercorn``). Nothing is raised for what
    the peer does: *stream* is closed, one line is logged on *logger*, and
    ``None`` returned.

    - A peer gone before its header (the connection reset before we asked
      for its address: HAProxy's health checks connect, send a ``LOCAL``
      header and reset at once), whose connection broke while sending it,
      or that closed without sending a byte (a TCP health check, a port
      scan): INFO. Nothing is wrong with its bytes.
    - A ``REJECT`` peer, a bad, missing, incomplete or late header: WARNING.

    A ``LOCAL`` header is a complete, valid header: the stream is returned,
    with the real endpoints as its addresses.

    Args:
        stream: the accepted connection (nothing read from it yet).
        trust: decides the policy from the peer and local address.
        header_timeout: seconds the complete header may take.
        logger: where refused connections are logged.
        **reader_options: ``read_proxy_header`` options.

    Returns:
        The ``ProxyStream`` (the caller owns it), or ``None``.
    """
    peer = None
    try:
        peer, local = socket_addresses(stream)
        sock = _find_socket(stream)
        if peer is None and getattr(sock, "family", None) in _INET_FAMILIES:
            # getpeername() failed on a TCP socket: the peer is gone already.
            logger.info("connection closed by its peer before its header")
            await trio.aclose_forcefully(stream)
            return None
        policy = trust.decide(peer, local)
        return await read_proxy_header(
            stream, policy=policy, header_timeout=header_timeout, **reader_options
        )
    except RemoteProtocolError as exc:
        log_refusal(logger, peer, exc)
        await trio.aclose_forcefully(stream)
        return None
    except trio.BrokenResourceError as exc:
        logger.info("connection from %s broke before its header: %s", peer, exc)
        await trio.aclose_forcefully(stream)
        return None
    except BaseException:
        # Cancelled (e.g. the listener is closing) or a bug: never leak the fd.
        await trio.aclose_forcefully(stream)
        raise


class ProxyListener(trio.abc.Listener[ProxyStream]):
    """A listener whose accepted streams have a complete, valid PROXY header.

    Made by ``open_proxy_listener``; ``accept()`` takes streams from the
    background task that reads headers.
    """

    def __init__(
        self,
        inner: trio.abc.Listener[Any],
        receive: trio.MemoryReceiveChannel[ProxyStream],
    ) -> None:
        self.inner = inner
        self._receive = receive

    async def accept(self) -> ProxyStream:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise trio.ClosedResourceError("this ProxyListener was closed") from None

    async def aclose(self) -> None:
        try:
            await self._receive.aclose()
        finally:  # close the socket even when cancelled at the checkpoint
            await self.inner.aclose()


@asynccontextmanager
async def open_proxy_listener(
    listener: trio.abc.Listener[Any],
    *,
    trust: TrustPolicy,
    header_timeout: float = DEFAULT_TIMEOUT,
    max_pending: int = DEFAULT_MAX_PENDING,
    **reader_options: Any,
) -> AsyncIterator[ProxyListener]:
    """Wrap *listener* so that accepted streams come with their PROXY header.

    Example::

        listeners = await trio.open_tcp_listeners(8080)
        trust = TrustPolicy.from_cidrs(["10.0.0.0/8"])
        async with open_proxy_listener(listeners[0], trust=trust) as listener:
            await trio.serve_listeners(handler, [listener])

    Connections whose policy is REJECT, whose header is bad or late, are closed
    and logged (logger ``proxyproto.trio``) and never reach ``accept()``.
    Leaving the block closes *listener* and the connections whose header
    was still being read.

    Args:
        listener: e.g. a ``trio.SocketListener``.
        trust: decides each connection's policy from its peer/local address.
        header_timeout: seconds a header may take.
        max_pending: connections whose header may be read at once; more wait
            in the kernel's accept queue.
        **reader_options: ``read_proxy_header`` options.
    """
    send, receive = trio.open_memory_channel[ProxyStream](0)
    wrapped = ProxyListener(listener, receive)
    pending = trio.CapacityLimiter(max_pending)

    async def handshake(stream: trio.abc.Stream) -> None:
        try:
            result = await accept_proxy_header(
                stream, trust=trust, header_timeout=header_timeout, **reader_options
            )
        finally:
            pending.release_on_behalf_of(stream)
        if result is None:
            return
        try:
            await send.send(result)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await trio.aclose_forcefully(result)
        except BaseException:
            await trio.aclose_forcefully(result)
            raise

    async def accept_loop() -> None:
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                LOGGER.error("accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            await pending.acquire_on_behalf_of(stream)
            nursery.start_soon(handshake, stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_loop)
        try:
            yield wrapped
        finally:
            nursery.cancel_scope.cancel()
            send.close()
            await trio.aclose_forcefully(wrapped)
