"""Stage: the client's TLS handshake (``[listeners.tls]``).

Bytes that came after a PROXY header are fed to the handshake first (never
over-read, never dropped). A connection that described no client in its PROXY
header and closes without a byte of TLS is the load balancer's check, not a
failed handshake. A ClientHello whose server name Python's ``ssl`` cannot
decode (not ASCII) is refused before the engine reads it
(`tlsedge._tls.client_hello`): an ``unrecognized_name`` alert and a
``tls_error`` that says why, instead of a traceback on stderr.

`ReactorHandshake` is driven by the reactor from the accepted socket, with no
task at all (every mode, after the PROXY header if one was read): each
readiness event is one ``recv``, the engine's step
(`TLSStream.handshake_nowait`) and one ``send`` of what it produced; a reactor
timer keeps the handshake timeout. A failure is a `Refused` (``tls_error``,
``tls_handshake_timeout``, or ``health_check``), with the alert the engine
made sent first.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable

import trio

from tlsedge._core.downstream import SSLFacts
from tlsedge._core.termination import Refused, Termination
from tlsedge._reactor.loop import (
    ERROR,
    HANGUP,
    READABLE,
    WRITABLE,
    Cancellable,
    current_reactor,
)
from tlsedge._reactor.relay import _scratch
from tlsedge._tls.client_hello import UNRECOGNIZED_NAME_ALERT, ServerNameCheck
from tlsedge._tls.contexts import ServerTLS, ssl_facts
from tlsedge._tls.stream import TRANSPORT_RECEIVE_SIZE, TLSStream

__all__ = ["HandshakeResult", "ReactorHandshake"]

LOGGER = logging.getLogger("tlsedge.tls")


def _failure(
    exc: trio.BrokenResourceError, tls_stream: TLSStream, *, health_check: bool
) -> Refused:
    """The refusal of a handshake that failed with *exc*."""
    return _refusal(str(exc.__cause__ or exc), tls_stream, health_check=health_check)


def _refusal(detail: str, tls_stream: TLSStream, *, health_check: bool) -> Refused:
    """The refusal of a handshake that failed (*detail* says how)."""
    if health_check and tls_stream.transport_bytes_received == 0:
        # The load balancer's check: connect, header, close.
        return Refused(Termination.HEALTH_CHECK, detail)
    return Refused(Termination.TLS_ERROR, detail)


def _timed_out(handshake_timeout: float) -> Refused:
    return Refused(
        Termination.TLS_HANDSHAKE_TIMEOUT,
        f"no TLS handshake within {handshake_timeout:g} s",
    )


#: How a `ReactorHandshake` ended: the stream and its facts; the refusal
#: (or, for a bug, the exception); None when drained.
HandshakeResult = tuple[TLSStream, SSLFacts] | Exception | None


class ReactorHandshake:
    """The server side of a client's handshake, driven by the reactor.

    The socket stays registered with the reactor until the handshake ends:
    for reading while the engine waits for the client, for writing while
    records wait to go. *on_done* gets the result from the reactor's task,
    once: the caller owns the socket throughout (and closes it after a
    refusal).
    """

    __slots__ = (
        "_names",
        "_on_done",
        "_out",
        "_reactor",
        "_refusal",
        "_registered",
        "_timer",
        "done",
        "fd",
        "health_check",
        "server_tls",
        "sock",
        "stream",
        "timeout",
    )

    def __init__(
        self,
        sock: socket.socket,
        server_tls: ServerTLS,
        *,
        initial_data: bytes = b"",
        handshake_timeout: float,
        health_check: bool = False,
        on_done: Callable[[HandshakeResult], None],
    ) -> None:
        """*sock*: the accepted, non-blocking socket (with the stream options
        `trio.SocketStream` would set); the other arguments are
        `accept_tls`'s."""
        self.sock = sock
        self.fd = sock.fileno()
        self.server_tls = server_tls
        self.timeout = handshake_timeout
        self.health_check = health_check
        # Over the socket itself: the TLS stream makes its trio transport
        # only if whoever takes it over waits on it (an HTTP connection's
        # task); the reactor's relay never does.
        self.stream = TLSStream(
            sock,
            server_tls.context,
            server_side=True,
            initial_data=initial_data,
        )
        # The ClientHello's server name, checked before the engine reads it.
        self._names = ServerNameCheck()
        self._refusal = self._names.feed(initial_data)
        self._on_done: Callable[[HandshakeResult], None] | None = on_done
        self._out = b""  # records the socket has not taken yet
        self._reactor = current_reactor()
        self._registered = 0  # the interest registered; 0: none
        # What the timer heap holds until the timeout: let go at the end.
        self._timer = Cancellable(self._expired)
        self.done = False

    def start(self) -> None:
        """Wait for the ClientHello (and arm the handshake timeout); with
        initial data, take the engine's first step on it now."""
        reactor = self._reactor
        reactor.register(self.fd, READABLE, self)
        self._registered = READABLE
        reactor.call_at(reactor.now() + self.timeout, self._timer)
        if self._refusal is not None:
            self._refuse_server_name(self._refusal)
        elif self.stream.transport_bytes_received:
            self._step(None)

    def ready(self, fd: int, events: int) -> None:
        if self._out:
            self._send(self._out)
            if self.done or self._out:
                return
            if self.stream.established:
                self._end(self._facts())
                return
        if not events & (READABLE | ERROR | HANGUP):
            return
        # Into the thread's scratch buffer (the engine copies what it takes):
        # no 64 KiB allocation shrunk to the few bytes that came, per read.
        scratch, view = _scratch(TRANSPORT_RECEIVE_SIZE)
        try:
            received = self.sock.recv_into(scratch)
        except BlockingIOError:
            return
        except OSError as exc:
            detail = f"socket read failed: {exc}"
            self._end(_refusal(detail, self.stream, health_check=self.health_check))
            return
        self._step(view[:received])

    def failed(self, exc: Exception) -> None:
        """A bug in `ready` (logged by the reactor): end the handshake."""
        self._end(exc)

    def drain(self) -> None:
        """End now (the edge stops): the result is None."""
        self._end(None)

    # -- internals -----------------------------------------------------------

    def _step(self, data: memoryview | None) -> None:
        """The engine's step on *data* (read from the socket; None: none),
        and the send of what it produced."""
        if data is not None and not self._names.done:
            refusal = self._names.feed(data)
            if refusal is not None:
                self._refuse_server_name(refusal)
                return
        try:
            finished = self.stream.handshake_nowait(data)
        except trio.BrokenResourceError as exc:
            self._send_alert()
            self._end(_failure(exc, self.stream, health_check=self.health_check))
            return
        records = self.stream.take_transport_data()
        if records:
            self._send(records)
            if self.done:
                return
        if finished and not self._out:
            self._end(self._facts())

    def _facts(self) -> tuple[TLSStream, SSLFacts]:
        return self.stream, ssl_facts(self.stream.ssl_object, self.server_tls)

    def _send(self, records: bytes) -> None:
        """Send *records* (behind none owed); what the socket does not take
        waits for writability."""
        try:
            sent = self.sock.send(records)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._end(Refused(Termination.TLS_ERROR, f"socket write failed: {exc}"))
            return
        self._out = records[sent:]
        self._watch(WRITABLE if self._out else READABLE)

    def _refuse_server_name(self, detail: str) -> None:
        """End with a ClientHello the engine must not read: the alert OpenSSL
        sends for a server name it cannot use (best effort, behind what is
        owed), and a ``tls_error`` saying why."""
        with contextlib.suppress(OSError):
            self.sock.send(self._out + UNRECOGNIZED_NAME_ALERT)
        self._out = b""
        self._end(Refused(Termination.TLS_ERROR, detail))

    def _send_alert(self) -> None:
        """Best effort: the alert of a failed handshake, if the socket takes
        it at once (a few bytes)."""
        alert = self._out + self.stream.take_transport_data()
        if alert:
            with contextlib.suppress(OSError):
                self.sock.send(alert)

    def _watch(self, interest: int) -> None:
        if interest != self._registered:
            self._reactor.modify(self.fd, interest)
            self._registered = interest

    def _expired(self) -> None:
        if not self.done:
            self._end(_timed_out(self.timeout))

    def _end(self, result: HandshakeResult) -> None:
        if self.done:
            return
        self.done = True
        self._timer.cancel()
        if self._registered:
            self._registered = 0
            self._reactor.unregister(self.fd)
        # Let go of the callback: its closure may refer back to this stage
        # (a cycle would wait for the garbage collector).
        on_done, self._on_done = self._on_done, None
        assert on_done is not None  # called once: `done` guards
        try:
            on_done(result)
        except Exception:
            LOGGER.exception("TLS handshake: the callback at its end failed")
