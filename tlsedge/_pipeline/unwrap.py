"""Stage: the PROXY header of a trusted load balancer (``proxy_protocol``).

The bridge from `proxyproto` (the sans-IO codec) to the edge: the trust
policy decides from the peer address, before any byte is read, whether a
header must come; the header must arrive within ``timeout``; what it says
replaces the socket's endpoints. Bytes that came after the header are handed
to the next stage as they are.

`ReactorHeaderRead` reads it, driven by the reactor from the accepted
non-blocking socket with no task at all (every mode): one ``recv`` at once
(the header has usually come with the connection), then, if it has not all
come, one per readiness event, each given to the codec; a reactor timer keeps
the header timeout. A
refusal is a `Refused`: ``rejected`` (the policy refuses the peer),
``header_timeout``, ``header_error`` (with the codec's reason for metrics) or
``client_error`` (the peer broke the connection first).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from proxyproto import (
    NEED_DATA,
    Command,
    Family,
    HeaderReader,
    Policy,
    ProxyHeader,
    RemoteProtocolError,
    TrustPolicy,
)
from proxyproto._adapters import inet_address, select_addresses
from tlsedge._core.accesslog import format_address
from tlsedge._core.config import ProxyProtocolConfig
from tlsedge._core.termination import Refused, Termination
from tlsedge._reactor.loop import READABLE, Cancellable, current_reactor
from tlsedge._reactor.relay import _scratch

__all__ = ["ReactorHeaderRead", "UnwrapResult", "Unwrapped"]

LOGGER = logging.getLogger("tlsedge.unwrap")

#: How many bytes one read may take while looking for the header. Bytes past
#: the header are not lost: they are the next stage's.
_READ_SIZE = 65536

#: `RemoteProtocolError.reason` values with a termination of their own.
_TERMINATIONS = {
    "rejected": Termination.REJECTED,
    "timeout": Termination.HEADER_TIMEOUT,
}


@dataclass(frozen=True, slots=True)
class Unwrapped:
    """What the PROXY stage found.

    Attributes:
        client: The real client (the header's source, else the peer).
        destination: Where the client connected (the header's, else ours).
        health_check: The header described no client (LOCAL, v1 UNKNOWN, v2
            UNSPEC): the load balancer's own connection.
        leftover: Bytes received after the header, for the next stage.
    """

    client: tuple[str, int] | None
    destination: tuple[str, int] | None
    health_check: bool
    leftover: bytes


#: How a `ReactorHeaderRead` ended: what it found; the refusal (or, for a
#: bug, the exception); None when drained.
UnwrapResult = Unwrapped | Exception | None


# -- the pure parts, shared by both ways ------------------------------------


def _reader_for(
    trust: TrustPolicy,
    settings: ProxyProtocolConfig,
    peer: tuple[str, int] | None,
    local: tuple[str, int] | None,
) -> tuple[Policy, HeaderReader | None]:
    """The policy for *peer*, and the reader of its header (None: SKIP,
    nothing to read).

    Raises:
        Refused: ``rejected`` (the policy refuses the peer).
    """
    policy = trust.decide(peer, local)
    if policy is Policy.REJECT:
        raise _refusal(
            RemoteProtocolError(
                f"peer {format_address(peer)} may not connect here "
                "(trust policy REJECT)",
                reason="rejected",
            )
        )
    if policy is Policy.SKIP:
        return policy, None
    reader = HeaderReader(versions=settings.versions, optional=policy is Policy.USE)
    return policy, reader


def _refusal(exc: RemoteProtocolError) -> Refused:
    """The refusal of a header the codec (or the policy) refused."""
    termination = _TERMINATIONS.get(exc.reason, Termination.HEADER_ERROR)
    return Refused(termination, str(exc), reason=exc.reason)


def _timed_out(settings: ProxyProtocolConfig, peer: tuple[str, int] | None) -> Refused:
    return _refusal(
        RemoteProtocolError(
            f"no complete PROXY header from {format_address(peer)} within "
            f"{settings.timeout} s",
            reason="timeout",
        )
    )


def _unwrapped(
    event: object,
    leftover: bytes,
    policy: Policy,
    peer: tuple[str, int] | None,
    local: tuple[str, int] | None,
) -> Unwrapped:
    """What the reader's final *event* (a header, or NO_HEADER) says."""
    header = event if isinstance(event, ProxyHeader) else None
    client, destination = select_addresses(header, policy, peer, local, inet_address)
    return Unwrapped(
        client=client or peer,
        destination=destination or local,
        health_check=header is not None
        and (header.command is Command.LOCAL or header.family is Family.UNSPEC),
        leftover=leftover,
    )


def _direct(peer: tuple[str, int] | None, local: tuple[str, int] | None) -> Unwrapped:
    return Unwrapped(client=peer, destination=local, health_check=False, leftover=b"")


# -- on the reactor --------------------------------------------------------------


class ReactorHeaderRead:
    """A client's PROXY header, read by the reactor from its socket.

    *on_done* gets the result once, from the reactor's task (or at once from
    `start` if the policy reads nothing): the caller owns the socket
    throughout (and closes it after a refusal).
    """

    __slots__ = (
        "_on_done",
        "_policy",
        "_reactor",
        "_reader",
        "_timer",
        "done",
        "fd",
        "local",
        "peer",
        "settings",
        "sock",
        "trust",
    )

    def __init__(
        self,
        sock: socket.socket,
        *,
        trust: TrustPolicy,
        settings: ProxyProtocolConfig,
        peer: tuple[str, int] | None,
        local: tuple[str, int] | None,
        on_done: Callable[[UnwrapResult], None],
    ) -> None:
        """*sock*: the accepted, non-blocking socket; the other arguments
        are `unwrap_proxy_header`'s."""
        self.sock = sock
        self.fd = sock.fileno()
        self.trust = trust
        self.settings = settings
        self.peer = peer
        self.local = local
        self._on_done: Callable[[UnwrapResult], None] | None = on_done
        self._reactor = current_reactor()
        self._policy = Policy.SKIP
        # The codec while the socket is registered with the reactor.
        self._reader: HeaderReader | None = None
        # What the timer heap holds until the timeout: let go at the end.
        self._timer = Cancellable(self._expired)
        self.done = False

    def start(self) -> None:
        """Decide the policy and read what came already: a load balancer
        sends its header as soon as it connected, so it is usually there
        by the time the connection is accepted (HAProxy reads at once too).
        Only if it is not (or not whole) is the socket registered with the
        reactor, and the header's timeout armed."""
        try:
            self._policy, reader = _reader_for(
                self.trust, self.settings, self.peer, self.local
            )
        except Refused as exc:
            self._end(exc)
            return
        if reader is None:
            self._end(_direct(self.peer, self.local))
            return
        if self._read(reader):
            return
        reactor = self._reactor
        reactor.register(self.fd, READABLE, self)
        self._reader = reader
        reactor.call_at(reactor.now() + self.settings.timeout, self._timer)

    def ready(self, fd: int, events: int) -> None:
        """One readiness event: one ``recv``, given to the codec."""
        reader = self._reader
        assert reader is not None  # registered only while reading
        self._read(reader)

    def _read(self, reader: HeaderReader) -> bool:
        """One ``recv``, given to *reader*; True once the read ended."""
        # Into the thread's scratch buffer (the codec copies what it keeps):
        # no 64 KiB allocation shrunk to the few bytes that came, per read.
        scratch, view = _scratch(_READ_SIZE)
        try:
            received = self.sock.recv_into(scratch)
        except BlockingIOError:
            return False
        except OSError as exc:
            # Worded as trio words it for the task's path.
            broken = f"socket connection broken: {exc}"
            self._end(Refused(Termination.CLIENT_ERROR, broken))
            return True
        try:
            reader.receive_data(view[:received])
            event = reader.next_event()
        except RemoteProtocolError as exc:
            self._end(_refusal(exc))
            return True
        if event is NEED_DATA:
            return False
        leftover = reader.trailing_data
        self._end(_unwrapped(event, leftover, self._policy, self.peer, self.local))
        return True

    def failed(self, exc: Exception) -> None:
        """A bug in `ready` (logged by the reactor): end the read."""
        self._end(exc)

    def drain(self) -> None:
        """End now (the edge stops): the result is None."""
        self._end(None)

    # -- internals -----------------------------------------------------------

    def _expired(self) -> None:
        if not self.done:
            self._end(_timed_out(self.settings, self.peer))

    def _end(self, result: UnwrapResult) -> None:
        if self.done:
            return
        self.done = True
        self._timer.cancel()
        if self._reader is not None:
            self._reader = None
            self._reactor.unregister(self.fd)
        # Let go of the callback: its closure may refer back to this stage
        # (a cycle would wait for the garbage collector).
        on_done, self._on_done = self._on_done, None
        assert on_done is not None  # called once: `done` guards
        try:
            on_done(result)
        except Exception:
            LOGGER.exception("PROXY header: the callback at its end failed")
