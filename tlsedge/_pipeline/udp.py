"""``mode = "udp"`` listeners: datagrams relayed per flow, on the reactor.

Theory of operation
-------------------
A `UdpListener` owns the bound UDP sockets of one listener. Each socket is
registered with the worker's reactor (`tlsedge._reactor.loop`) for as long as it
is open, and takes a batch of datagrams per wake-up (as the TCP accept loop
accepts). The datagrams of one client address form a *flow* (see
`tlsedge._core.udp_flows`): the first one picks a healthy server with the
backend's balancer (source-ip affinity as for TCP), takes a lease on it and
opens a connected UDP socket to it; the rest go out on that socket. The flow
is the reactor's handler for that socket: it receives the server's replies (a
batch per wake-up) and sends them to the client **from the listener's
socket**, so the client hears back from the address it sent to. No trio task
runs per flow or per socket: the listener's one task (`UdpListener.run`, in
the edge's connections nursery) only waits for the listener's end.

A flow ends when no datagram went either way for the listener's
``idle_timeout`` (one reactor timer per listener, due when the least recently
used flow expires: `FlowTable` keeps the order), when the server's side fails
(an ICMP port unreachable comes back as ECONNREFUSED on the connected socket:
``server_error``, which counts against the server's health as a failed
connect does in tcp mode, while a flow's first reply counts as a connect that
succeeded), or at the drain deadline (``drained``: the edge cancels the
listener's task). A send to the server that fails for the datagram's own
cause (too large with the PROXY header: ``too_large``) or this host's (no
buffer: ``server_busy``) drops that datagram alone: the flow goes on and the
server's health is untouched (`tlsedge._core.udp_flows.send_drop_reason`), so no
client can take a server down by what it sends (such a datagram is counted
and logged as the drops below; a new client's flow stays open for its next
datagrams). The end is handled where it happens, in the reactor's callback
or the listener's task: the upstream socket leaves the reactor and closes,
the server's lease and the flow's ``max_connections`` tokens are released,
and the flow's metrics and its one access-log line (bytes each way;
``requests`` holds the datagrams from the client) are written.

The listener's ``max_connections`` (and the edge's) counts flows: a new
client beyond it is dropped, as are clients that ``allow``/``deny`` refuse,
datagrams when no server is healthy, and datagrams while draining: dropped
datagrams make no flow, hold no memory and write no access-log line; they are
counted by reason (``tlsedge_udp_datagrams_dropped``) and logged at most once
per second.

A socket bound to a wildcard address (``0.0.0.0``, ``::``) asks the kernel
for each datagram's destination (``IP_PKTINFO``): it is the flow's
destination (access log, PROXY header), and the flow's replies leave from it,
as the client expects on a host with several addresses.

Drain (and a reload that moves the listener) takes no new flows but keeps the
sockets open, as the flows still send their replies through them; the sockets
close when the last flow has ended, and the listener's task returns.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import time
from collections.abc import Callable, Hashable
from typing import Any, Final, TypeAlias

import trio

from proxyproto import TrustPolicy
from tlsedge._backends.health import ServerHealth
from tlsedge._backends.upstream import BackendPool
from tlsedge._core.accesslog import ConnectionLog, format_address
from tlsedge._core.admission import AccessRules
from tlsedge._core.config import ListenerConfig
from tlsedge._core.metrics import EdgeMetrics
from tlsedge._core.termination import Termination
from tlsedge._core.udp_flows import (
    MAX_DATAGRAM,
    DropLog,
    FlowTable,
    dgram_proxy_header,
    send_drop_reason,
    unwrap_datagram,
)
from tlsedge._pipeline.close import closed
from tlsedge._reactor.loop import READABLE, Cancellable, current_reactor

__all__ = ["UdpListener"]

LOGGER = logging.getLogger("tlsedge.udp")

#: Datagrams handled per reactor wake-up at most, each way: a burst costs
#: one wake-up, and the reactor's other handlers still run between bursts.
_BATCH = 64


class _Flow:
    """One client's datagrams to one server: the reactor's handler for the
    connected socket to the server while the flow lives."""

    __slots__ = (
        "datagrams_from_client",
        "datagrams_from_server",
        "ended",
        "fd",
        "header",
        "health",
        "key",
        "last_seen",
        "lease",
        "listener",
        "log",
        "out",
        "reply_from",
        "reply_to",
        "started",
        "token",
        "upstream",
    )

    def __init__(  # noqa: PLR0917
        self,
        listener: UdpListener,
        key: Hashable,
        reply: tuple[tuple[Any, ...], socket.socket, _Ancillary | None],
        upstream: socket.socket,
        header: bytes,
        log: ConnectionLog,
        token: object,
    ) -> None:
        self.listener = listener
        self.key = key
        # The peer's address as recvfrom gave it, the listener's socket the
        # client sent to, and (on a wildcard address) the IP_PKTINFO that
        # makes a reply leave from the address the client sent to.
        self.reply_to, self.out, self.reply_from = reply
        self.upstream = upstream
        self.fd = upstream.fileno()
        self.header = header  # PROXY v2 header before each datagram, or b""
        self.log = log
        self.last_seen = 0.0
        self.started = 0.0
        self.datagrams_from_client = 0
        self.datagrams_from_server = 0
        self.ended = False
        self.token = token  # held in the listener's and the edge's limiters
        self.lease: Callable[[], None] | None = None
        # The server's passive health: a first reply counts as a connect
        # that succeeded, a port unreachable as one that failed.
        self.health: ServerHealth | None = None

    def ready(self, fd: int, events: int) -> None:
        """Replies (or an ICMP error) from the server."""
        self.listener._replies(self)

    def failed(self, exc: Exception) -> None:
        """A bug while relaying (the reactor logged it): end this flow."""
        self.listener._end(
            self, Termination.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"
        )


class _Receiver:
    """The reactor's handler for one of a listener's sockets: datagrams from
    clients. *raw* is a stdlib object on the socket's descriptor (detached,
    never closed): its calls do not go through trio."""

    __slots__ = ("fd", "listener", "local", "raw", "wildcard")

    def __init__(self, listener: UdpListener, sock: trio.socket.SocketType) -> None:
        self.listener = listener
        self.fd = sock.fileno()
        self.local = _address(sock.getsockname())
        self.raw = socket.socket(sock.family, sock.type, sock.proto, fileno=self.fd)
        self.wildcard = self.local[0] in _WILDCARDS
        if self.wildcard:
            _ask_destinations(self.raw)

    def ready(self, fd: int, events: int) -> None:
        self.listener._receive_batch(self)

    def failed(self, exc: Exception) -> None:
        """A bug while handling a datagram (the reactor logged it): that
        datagram is lost; the socket stays registered for the next ones."""


def _address(address: object) -> tuple[str, int]:
    assert isinstance(address, tuple)
    return (str(address[0]), int(address[1]))


# Linux's IP_PKTINFO (Python's socket module names it from 3.13 on).
_IP_PKTINFO: Final = int(getattr(socket, "IP_PKTINFO", 8))
_WILDCARDS: Final = frozenset({"0.0.0.0", "::"})
# Room for one in6_pktinfo (the larger of the two).
_PKTINFO_SPACE: Final = socket.CMSG_SPACE(20)
_Ancillary: TypeAlias = list[tuple[int, int, bytes]]


def _ask_destinations(sock: socket.socket) -> None:
    """Have the kernel tell which address each datagram was sent to (a
    socket bound to a wildcard address receives for all of them)."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
    else:
        sock.setsockopt(socket.IPPROTO_IP, _IP_PKTINFO, 1)


def _destination(
    ancillary: list[tuple[int, int, bytes]], local: tuple[str, int]
) -> tuple[tuple[str, int], _Ancillary | None]:
    """The address a datagram was sent to (from its IP_PKTINFO), and the
    ancillary data that sends a reply from that address."""
    for level, kind, data in ancillary:
        if level == socket.IPPROTO_IP and kind == _IP_PKTINFO and len(data) >= 12:
            # struct in_pktinfo: ifindex, spec_dst, addr (the header's destination)
            ip = data[8:12]
            reply = struct.pack("=i4s4s", 0, ip, bytes(4))
            return (socket.inet_ntop(socket.AF_INET, ip), local[1]), [
                (socket.IPPROTO_IP, _IP_PKTINFO, reply)
            ]
        if (
            level == socket.IPPROTO_IPV6
            and kind == socket.IPV6_PKTINFO
            and len(data) >= 20
        ):
            # struct in6_pktinfo: addr, ifindex (kept: link-local replies need it)
            return (socket.inet_ntop(socket.AF_INET6, data[:16]), local[1]), [
                (socket.IPPROTO_IPV6, socket.IPV6_PKTINFO, bytes(data[:20]))
            ]
    return local, None


def _connect(address: tuple[str, int]) -> socket.socket:
    """A non-blocking UDP socket connected to a server (numeric: no lookup)."""
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _describe(exc: OSError) -> str:
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


def _send_failure(flow: _Flow, data: bytes, exc: OSError) -> str:
    """Why a datagram of *flow* could not go to its server: its size (with
    the PROXY header), the server, and the error."""
    size = f"{len(data)} bytes"
    if flow.header:
        size += f" ({len(flow.header) + len(data)} with the PROXY header)"
    return f"datagram of {size} to {flow.log.server}: {_describe(exc)}"


class UdpListener:
    """The flows of one ``mode = "udp"`` listener over its bound sockets.

    Args:
        sockets: The bound UDP sockets
            (`tlsedge._reactor.listen.open_datagram_sockets`).
        limiter: The listener's ``max_connections`` (a token per flow).
        edge_limiter: The edge's ``max_connections`` (a token per flow).
        metrics: The edge's metrics.
        on_flows: Told +1 / -1 as flows open and end (the edge's count).
    """

    def __init__(
        self,
        sockets: list[trio.socket.SocketType],
        limiter: trio.CapacityLimiter,
        edge_limiter: trio.CapacityLimiter,
        metrics: EdgeMetrics,
        on_flows: Callable[[int], None],
    ) -> None:
        self._sockets = sockets
        self._limiter = limiter
        self._edge_limiter = edge_limiter
        self._metrics = metrics
        self._on_flows = on_flows
        self._reactor = current_reactor()
        self.flows: FlowTable[_Flow] = FlowTable()
        self.closing = False
        self._receivers: list[_Receiver] = []
        self._closed = trio.Event()
        # The expiry timer: the earliest deadline it is due at (inf: none).
        self._expiry_due = math.inf
        self._expiry = Cancellable(self._expire)
        self._drops = DropLog()
        self._config: ListenerConfig | None = None
        self._trust: TrustPolicy | None = None
        self._access: AccessRules | None = None
        self._pool: BackendPool | None = None

    def configure(
        self,
        config: ListenerConfig,
        trust: TrustPolicy | None,
        access: AccessRules | None,
        pool: BackendPool,
    ) -> None:
        """Settings for new flows (at start and on reload); ``idle_timeout``
        applies to every flow of the listener at once."""
        self._config = config
        self._trust = trust
        self._access = access
        self._pool = pool
        self._arm_expiry()

    def close(self) -> None:
        """Take no new flows; close the sockets once the last flow ended."""
        self.closing = True
        if not len(self.flows):
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self._closed.is_set():
            return
        self._expiry.cancel()
        for receiver in self._receivers:
            self._reactor.unregister(receiver.fd)
            receiver.raw.detach()
        self._receivers = []
        for sock in self._sockets:
            sock.close()
        self._closed.set()

    async def run(self) -> None:
        """Receive on every socket until the listener is closed and its last
        flow has ended. Flows still open when this is cancelled (the drain
        deadline, a stop) end as ``drained``, and the sockets close."""
        if self._closed.is_set():
            return
        try:
            for sock in self._sockets:
                receiver = _Receiver(self, sock)
                self._receivers.append(receiver)
                self._reactor.register(receiver.fd, READABLE, receiver)
            await self._closed.wait()
        finally:
            self.closing = True
            for flow in self.flows.values():
                self._end(flow, Termination.DRAINED)
            self._close_sockets()

    # -- datagrams from clients ---------------------------------------------

    def _receive_batch(self, receiver: _Receiver) -> None:
        raw, local = receiver.raw, receiver.local
        now = self._reactor.now()
        count = 0
        here, reply_from = local, None
        for _ in range(_BATCH):
            try:
                if receiver.wildcard:
                    data, ancillary, _, address = raw.recvmsg(
                        MAX_DATAGRAM, _PKTINFO_SPACE
                    )
                    here, reply_from = _destination(ancillary, local)
                else:
                    data, address = raw.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                if raw.fileno() == -1:
                    break  # a flow's end closed the listener
                # An ICMP error for an earlier reply to a client: nothing
                # to do for it here (the flow ends when idle).
                continue
            if self._datagram(raw, here, reply_from, data, address, now):
                count += 1
        if count:
            assert self._config is not None
            self._metrics.udp_datagrams(self._config.name, "from_client", count)

    def _datagram(  # noqa: PLR0917
        self,
        raw: socket.socket,
        local: tuple[str, int],
        reply_from: _Ancillary | None,
        data: bytes,
        address: tuple[Any, ...],
        now: float,
    ) -> bool:
        """Forward one client datagram to *local* (the address it was sent
        to); False when it was dropped."""
        peer = _address(address)
        trust = self._trust
        key: Hashable
        if trust is None:
            key, client, destination = peer, peer, local
        else:
            unwrapped = unwrap_datagram(data, trust.decide(peer, local), peer, local)
            if unwrapped.drop is not None:
                self._drop(unwrapped.drop, peer, unwrapped.detail, now)
                return False
            assert unwrapped.client is not None
            assert unwrapped.destination is not None
            client, destination = unwrapped.client, unwrapped.destination
            key, data = (peer, client), unwrapped.payload
        flow = self.flows.get(key)
        if flow is None:
            flow = self._open_flow(
                key, (address, raw, reply_from), peer, client, destination, now
            )
            if flow is None:
                return False
        else:
            self.flows.touch(key, flow, now)
        try:
            flow.upstream.send(flow.header + data if flow.header else data)
        except (BlockingIOError, InterruptedError):
            self._drop("server_busy", peer, "send buffer full", now)
            return False
        except OSError as exc:
            reason = send_drop_reason(exc)
            if reason is None:
                self._end(flow, Termination.SERVER_ERROR, _describe(exc))
            else:
                self._drop(reason, peer, _send_failure(flow, data, exc), now)
            return False
        flow.datagrams_from_client += 1
        flow.log.bytes_from_client += len(data)
        return True

    def _open_flow(  # noqa: PLR0917
        self,
        key: Hashable,
        reply: tuple[tuple[Any, ...], socket.socket, _Ancillary | None],
        peer: tuple[str, int],
        client: tuple[str, int],
        destination: tuple[str, int],
        now: float,
    ) -> _Flow | None:
        """Admit, balance and connect a new flow; None when it is dropped."""
        config, pool = self._config, self._pool
        assert config is not None
        assert pool is not None
        if self.closing:
            self._drop("draining", peer, "the listener is draining", now)
            return None
        if self._access is not None:
            verdict = self._access.check(client[0])
            if not verdict.admitted:
                self._drop("denied", peer, verdict.reason, now)
                return None
        token = object()
        try:
            self._edge_limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            self._drop("flow_cap", peer, "edge.max_connections flows open", now)
            return None
        try:
            self._limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            self._edge_limiter.release_on_behalf_of(token)
            self._drop("flow_cap", peer, "max_connections flows open", now)
            return None
        server = pool.balancer.pick(client[0])
        if server is None:
            self._release(token)
            self._drop("no_server", peer, f"backend {pool.name}: none healthy", now)
            return None
        try:
            upstream = _connect(server.address)
        except OSError as exc:
            self._release(token)
            # Out of descriptors or ports here: not the server's fault.
            self._drop("connect_failed", peer, f"{server}: {_describe(exc)}", now)
            return None
        backend = pool.config
        try:
            log = ConnectionLog(
                id=os.urandom(8).hex(),
                listener=config.name,
                peer=format_address(peer),
                client=format_address(client),
                destination=format_address(destination),
                backend=backend.name,
                server=str(server),
                requests=0,
                start=time.time(),
            )
            header = b""
            if backend.send_proxy == "v2":
                header = dgram_proxy_header(
                    client,
                    destination,
                    unique_id=log.id.encode()
                    if "unique-id" in backend.proxy_tlvs
                    else None,
                    crc32c="crc32c" in backend.proxy_tlvs,
                )
        except BaseException:  # a bug: the reactor logs it, nothing leaks
            upstream.close()
            self._release(token)
            raise
        flow = _Flow(self, key, reply, upstream, header, log, token)
        flow.started = now
        flow.lease = pool.lease(server).release
        flow.health = next((h for h in pool.servers if h.server is server), None)
        if pool.observer is not None:
            pool.observer.server_connection_opened(pool.name, str(server), 1)
        self._reactor.register(flow.fd, READABLE, flow)
        self.flows.add(key, flow, now)
        self._on_flows(1)
        self._metrics.connection_opened(config.name)
        self._metrics.metering(log, log)
        if len(self.flows) == 1:
            # The timer is due by the first flow's expiry while there is one;
            # a flow added behind others expires after them.
            self._arm_expiry()
        return flow

    def _release(self, token: object) -> None:
        self._limiter.release_on_behalf_of(token)
        self._edge_limiter.release_on_behalf_of(token)

    def _drop(
        self, reason: str, peer: tuple[str, int], detail: str, now: float
    ) -> None:
        assert self._config is not None
        name = self._config.name
        self._metrics.udp_dropped(name, reason)
        counts = self._drops.add(reason, now)
        if counts is not None:
            LOGGER.warning(
                "listener %s: dropped datagrams (%s); the last from %s: %s",
                name,
                ", ".join(f"{why}: {n}" for why, n in sorted(counts.items())),
                format_address(peer),
                detail,
            )

    # -- one flow -------------------------------------------------------------

    def _replies(self, flow: _Flow) -> None:
        """Relay a batch of the server's replies to the client."""
        upstream, out, reply_to = flow.upstream, flow.out, flow.reply_to
        reply_from = flow.reply_from
        count = 0
        size = 0
        failed: OSError | None = None
        for _ in range(_BATCH):
            try:
                data = upstream.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # ICMP unreachable: nobody on that port
                failed = exc
                break
            count += 1
            size += len(data)
            try:
                if reply_from is None:
                    out.sendto(data, reply_to)
                else:
                    out.sendmsg([data], reply_from, 0, reply_to)
            except (BlockingIOError, InterruptedError):
                self._drop(
                    "client_busy",
                    _address(reply_to),
                    "send buffer full",
                    self._reactor.now(),
                )
            except OSError as exc:
                self._drop(
                    "client_error",
                    _address(reply_to),
                    _describe(exc),
                    self._reactor.now(),
                )
        if count:
            if not flow.datagrams_from_server and flow.health is not None:
                flow.health.connect_succeeded()
            flow.datagrams_from_server += count
            flow.log.bytes_from_server += size
            self._metrics.udp_datagrams(flow.log.listener, "from_server", count)
        if failed is not None:
            self._end(flow, Termination.SERVER_ERROR, _describe(failed))
        elif count:
            self.flows.touch(flow.key, flow, self._reactor.now())

    def _end(
        self, flow: _Flow, termination: Termination, detail: str | None = None
    ) -> None:
        """End *flow* now: close its socket, release what it holds, write
        its metrics and access-log line (once; later calls do nothing)."""
        if flow.ended:
            return
        flow.ended = True
        if termination == Termination.SERVER_ERROR and flow.health is not None:
            flow.health.connect_failed(detail or "server error")
        self.flows.discard(flow.key, flow)
        # Closed before the reactor polls again: the close takes it out of
        # the selector.
        self._reactor.forget(flow.fd)
        flow.upstream.close()
        if flow.lease is not None:
            flow.lease()
        self._release(flow.token)
        self._on_flows(-1)
        log = flow.log
        log.requests = flow.datagrams_from_client
        closed(
            log,
            self._metrics,
            self._reactor.now() - flow.started,
            termination=termination,
            detail=detail,
        )
        if self.closing and not len(self.flows):
            self._close_sockets()

    def _arm_expiry(self) -> None:
        """Have the expiry timer due when the first flow would expire."""
        if self._config is None:
            return
        deadline = self.flows.next_expiry(self._config.idle_timeout)
        if deadline is not None and deadline < self._expiry_due:
            self._expiry_due = deadline
            self._reactor.call_at(deadline, self._expiry)

    def _expire(self) -> None:
        """The expiry timer: end the flows idle for ``idle_timeout``, then
        be due again at the next one's expiry. (Flows used since it was set
        expire later: it then finds none, and sets itself again.)"""
        assert self._config is not None
        now = self._reactor.now()
        if self._expiry_due <= now:
            self._expiry_due = math.inf  # this was the earliest
        for flow in self.flows.pop_expired(now, self._config.idle_timeout):
            self._end(flow, Termination.IDLE_TIMEOUT)
        self._arm_expiry()
