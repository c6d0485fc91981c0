"""A TLS stream over ``ssl.SSLObject`` that can half-close.

Theory of operation
-------------------
``trio.SSLStream`` is a ``Stream``, not a ``HalfCloseableStream``: it has no
``send_eof``, because TLS 1.2 has no half-close. TLS 1.3 does (RFC 8446 6.1:
close_notify closes one direction), and an edge needs it to forward a FIN
from a backend to a TLS client while still reading what the client sends.
``TLSStream`` is that stream: a ``HalfCloseableStream`` whose ``send_eof()``
sends close_notify and keeps reading.

The TLS engine is an ``ssl.SSLObject`` between two ``MemoryBIO`` buffers:
``incoming`` (bytes read from the transport, waiting to be decrypted) and
``outgoing`` (records produced by the engine, waiting to be sent). Every
operation runs the engine until it has what it needs:

- receiving: ``ssl_object.read()``; on ``SSLWantReadError`` read the transport
  into ``incoming`` and try again. close_notify from the peer reads as EOF
  (``b""``); so does a transport EOF without close_notify (a "ragged" EOF,
  what most HTTPS clients do), recorded in ``ragged_eof``.
- sending: ``ssl_object.write()`` (never needs to read: renegotiation is off
  and TLS 1.3 has none), then send ``outgoing`` on the transport. Records
  leave in the order the engine produced them because one lock covers
  encrypting, taking bytes out of ``outgoing`` and sending them; a send
  cancelled midway has cut a record, so the stream becomes broken.
- the handshake runs once, under a lock, on the first send or receive (or an
  explicit ``do_handshake()``). Bytes that arrived before the stream was made
  (what a PROXY header reader read past its header: the ClientHello) are
  passed as ``initial_data`` and fed to the engine first.
- ``send_eof()``: Python's ``SSLObject.unwrap()`` calls ``SSL_shutdown``
  twice; the second call reads on, and fails the connection
  (APPLICATION_DATA_AFTER_CLOSE_NOTIFY) if the peer's data is already
  waiting. So pending input is parked around the call: decrypted bytes go to
  a side buffer that ``receive_some`` serves first, raw bytes are taken out of
  ``incoming`` and put back. OpenSSL then keeps reading after our
  close_notify, for TLS 1.3 and 1.2 alike.

Memory. A ``MemoryBIO`` keeps the largest size it ever held for its whole
life (OpenSSL's buffer grows, never shrinks: 344 KiB after a 256 KiB relay
read), so neither buffer is given more than four records at once: the engine
gets what the transport delivered in pieces of `ENGINE_CHUNK` (the rest waits
as a view, consumed before the call returns, or copied), and plaintext is
encrypted `WRITE_CHUNK` at a time, its records taken out of ``outgoing`` at
once. A connection that once moved megabytes then keeps under 90 KiB per
buffer, not the largest read or write it saw. The
trio locks exist from the first operation that waits for them (a stream the
reactor drives has none), and a stream over a stdlib socket builds its
`trio.SocketStream` only if an async operation needs it.

TLS 1.2 peers: the mechanics are the same, but RFC 5246 tells a peer that
receives close_notify to answer with its own and close at once, so after a
backend FIN a TLS 1.2 client usually ends the connection right away.
"""

from __future__ import annotations

import contextlib
import enum
import operator
import socket
import ssl
from typing import Final

import trio

from tlsedge._tls import sockio

__all__ = ["TLSStream"]

#: How much to read from the transport at once (one TLS record is <= 16 KiB
#: of plaintext, plus overhead).
TRANSPORT_RECEIVE_SIZE = 65536
#: Default ``receive_some`` size when the caller gives none.
DEFAULT_RECEIVE_SIZE = 65536
#: Plaintext handed to the engine per write (its records are then taken out
#: of the engine's output buffer), so huge sends do not hold their whole
#: ciphertext in memory at once.
WRITE_CHUNK = 65536
#: How long a failed handshake may take to send its alert before closing.
ALERT_SEND_TIMEOUT = 1.0
#: Most bytes given to the engine's input buffer at once: four of the
#: largest TLS records on the wire (16 KiB of plaintext, 256 bytes of
#: expansion, a 5-byte header). See "Memory" above: one record at a time
#: cost a third more CPU on bulk transfers (a failed read per record).
ENGINE_CHUNK: Final = 4 * (16384 + 256 + 5)

_NO_INPUT: Final = memoryview(b"")

# The operations that must not run in two tasks at once (`TLSStream._busy`).
_SENDING: Final = 1
_RECEIVING: Final = 2
_BUSY_MESSAGES: Final = {
    _SENDING: "another task is currently sending data on this TLSStream",
    _RECEIVING: "another task is currently receiving data on this TLSStream",
}


class _State(enum.Enum):
    OK = "OK"
    BROKEN = "BROKEN"
    CLOSED = "CLOSED"


class TLSStream(trio.abc.HalfCloseableStream):
    """TLS over any ``trio.abc.Stream``, with ``send_eof()`` = close_notify.

    Args:
        transport_stream: the connection to encrypt (e.g. a ``SocketStream``),
            or a connected non-blocking stdlib socket: its ``SocketStream`` is
            then made when an async operation first needs it (a stream the
            reactor drives never does).
        ssl_context: server or client context.
        server_side: True for the server end.
        server_hostname: SNI and name to verify (client side).
        initial_data: bytes already read from the transport (e.g. past a PROXY
            header); the engine reads them first.

    Attributes:
        transport_socket: the stdlib socket given as the transport, else None.
        ssl_object: the ``ssl.SSLObject`` (version, cipher, peer cert, ...).
        ragged_eof: True if the peer closed without close_notify.
    """

    __slots__ = (
        "_backlog",
        "_busy",
        "_eof_received",
        "_eof_sent",
        "_flush_lock",
        "_handshake_done",
        "_handshake_lock",
        "_incoming",
        "_input_eof",
        "_outgoing",
        "_parked",
        "_state",
        "_transport",
        "_transport_drained",
        "ragged_eof",
        "ssl_object",
        "transport_bytes_received",
        "transport_socket",
    )

    def __init__(
        self,
        transport_stream: trio.abc.Stream | socket.socket,
        ssl_context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        initial_data: bytes = b"",
    ) -> None:
        self.transport_socket: socket.socket | None = None
        self._transport: trio.abc.Stream | None = None
        if isinstance(transport_stream, socket.socket):
            self.transport_socket = transport_stream
        else:
            self._transport = transport_stream
        #: Bytes read from the transport (``initial_data`` included).
        self.transport_bytes_received = 0
        self._transport_drained = False  # the last transport read was short
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        # Transport bytes not given to the engine yet, and whether the
        # transport's EOF waits behind them (see "Memory" above).
        self._backlog = _NO_INPUT
        self._input_eof = False
        if initial_data:
            self._give_engine(initial_data)
            self._keep_backlog()
        self.ssl_object = ssl_context.wrap_bio(
            self._incoming,
            self._outgoing,
            server_side=server_side,
            server_hostname=server_hostname,
        )
        self.ragged_eof = False
        self._state = _State.OK
        self._handshake_done = False
        self._eof_sent = False
        self._eof_received = False
        self._parked = b""
        # Made by the first operation that waits for them.
        self._handshake_lock: trio.Lock | None = None
        self._flush_lock: trio.Lock | None = None
        self._busy = 0  # _SENDING | _RECEIVING: an operation is running

    @property
    def transport_stream(self) -> trio.abc.Stream:
        """The underlying stream (made now over `transport_socket` if the
        stream was given a socket and no async operation made it yet)."""
        transport = self._transport
        if transport is None:
            assert self.transport_socket is not None
            transport = self._transport = trio.SocketStream(
                trio.socket.from_stdlib_socket(self.transport_socket)
            )
        return transport

    # -- engine plumbing ---------------------------------------------------

    def _enter(self, operation: int) -> None:
        """Start *operation* (`_SENDING`, `_RECEIVING`); the caller ends it
        with `_leave` in a ``finally``."""
        if self._busy & operation:
            raise trio.BusyResourceError(_BUSY_MESSAGES[operation])
        self._busy |= operation

    def _leave(self, operation: int) -> None:
        self._busy &= ~operation

    def _lock_for_flush(self) -> trio.Lock:
        lock = self._flush_lock
        if lock is None:
            lock = self._flush_lock = trio.Lock()
        return lock

    def _flush_locked(self) -> bool:
        return self._flush_lock is not None and self._flush_lock.locked()

    def _check_status(self) -> None:
        if self._state is _State.CLOSED:
            raise trio.ClosedResourceError("this TLSStream was closed")
        if self._state is _State.BROKEN:
            raise trio.BrokenResourceError("this TLSStream is broken")

    def _fail(self, exc: BaseException) -> trio.BrokenResourceError:
        if self._state is _State.OK:
            self._state = _State.BROKEN
        return trio.BrokenResourceError(f"TLS connection failed: {exc}")

    async def _flush(self, plaintext: memoryview | None = None) -> None:
        """Send every record the engine has produced, in order; with
        *plaintext*, encrypt it first (under the lock: records must leave in
        the engine's order).

        An uncontended lock is taken without a checkpoint (the caller's
        operation has its own): `sockio.send_all` then yields only if the
        transport makes it wait.

        Raises:
            ssl.SSLError: encrypting *plaintext* failed.
        """
        lock = self._lock_for_flush()
        if lock.locked():
            await lock.acquire()
        else:
            lock.acquire_nowait()
        try:
            data = (
                self._outgoing.read() if plaintext is None else self._encrypt(plaintext)
            )
            # Loop: records the receiving side produced while this send was
            # blocked (it does not wait for the lock, see _flush_if_idle) go
            # out here.
            while data:
                try:
                    await sockio.send_all(self.transport_stream, data)
                except trio.ClosedResourceError:
                    if self._state is _State.CLOSED:
                        raise
                    raise self._fail(
                        trio.ClosedResourceError("transport closed")
                    ) from None
                except BaseException:
                    # A record may have been cut in two: nothing sensible can
                    # follow.
                    if self._state is _State.OK:
                        self._state = _State.BROKEN
                    raise
                data = self._outgoing.read()
        finally:
            lock.release()

    def _encrypt(self, plaintext: memoryview) -> bytes:
        """The records of *plaintext* (after those the engine holds), taken
        out of ``outgoing`` every `WRITE_CHUNK` of plaintext (see "Memory"
        above).

        Raises:
            ssl.SSLError: the engine failed.
        """
        ssl_object, outgoing = self.ssl_object, self._outgoing
        records = []
        while plaintext:
            chunk, plaintext = plaintext[:WRITE_CHUNK], plaintext[WRITE_CHUNK:]
            while chunk:
                chunk = chunk[ssl_object.write(chunk) :]
            if plaintext:
                records.append(outgoing.read())
        if not records:
            return outgoing.read()
        records.append(outgoing.read())
        return b"".join(records)

    async def _flush_if_idle(self) -> None:
        """Flush from the receiving side, unless a send is flushing already.

        Waiting for the lock there would deadlock a full-duplex transfer: the
        send blocks until the peer reads, while the peer blocks sending to us
        until we read. The send's `_flush` loop sends our records after its own.
        """
        if self._flush_locked():
            await trio.lowlevel.checkpoint()
        else:
            await self._flush()

    async def _feed(self) -> None:
        """Read the transport into the engine (EOF is passed on too)."""
        try:
            data = await sockio.receive_some(
                self.transport_stream,
                TRANSPORT_RECEIVE_SIZE,
                wait_first=self._transport_drained,
            )
            # A short read almost always emptied the socket: wait before the
            # next one rather than make a read that fails.
            self._transport_drained = len(data) < TRANSPORT_RECEIVE_SIZE
        except trio.ClosedResourceError:
            if self._state is _State.CLOSED:
                raise
            raise self._fail(trio.ClosedResourceError("transport closed")) from None
        except trio.BrokenResourceError as exc:
            raise self._fail(exc) from exc
        self._give_engine(data)

    async def do_handshake(self) -> None:
        """Run the handshake now (otherwise it runs on first use).

        Raises:
            trio.BrokenResourceError: the handshake failed (the cause is the
                ``__cause__``, often an ``ssl.SSLError``).
            trio.ClosedResourceError: the stream was closed.
        """
        if self._handshake_lock is None:
            self._handshake_lock = trio.Lock()
        async with self._handshake_lock:
            self._check_status()
            if self._handshake_done:
                return
            while True:
                try:
                    self.ssl_object.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await self._flush()
                    if self._more_input():
                        continue
                    if self._incoming.eof:
                        raise self._fail(
                            EOFError("peer closed during the handshake")
                        ) from None
                    await self._feed()
                except ssl.SSLError as exc:
                    # Send the alert the engine produced (unrecognized_name,
                    # bad_certificate, ...), best effort: a few bytes, so a
                    # short bound. (move_on_after(0) would cancel the send
                    # before it starts.)
                    with (
                        trio.move_on_after(ALERT_SEND_TIMEOUT),
                        contextlib.suppress(
                            trio.BrokenResourceError, trio.ClosedResourceError
                        ),
                    ):
                        await self._flush()
                    raise self._fail(exc) from exc
            self._handshake_done = True
            await self._flush()

    def _give_engine(self, transport_data: bytes | memoryview | None) -> None:
        """Give the engine bytes read from the transport (``b""``: its EOF;
        None: nothing): at most `ENGINE_CHUNK` of them now, the rest when
        the engine wants more (`_more_input`)."""
        if transport_data is None:
            return
        if not transport_data:
            if self._backlog:
                self._input_eof = True
            else:
                self._incoming.write_eof()
            return
        self.transport_bytes_received += len(transport_data)
        if self._backlog:  # behind what waits already (rare: copied)
            self._backlog = memoryview(bytes(self._backlog) + bytes(transport_data))
        elif len(transport_data) <= ENGINE_CHUNK:
            self._incoming.write(transport_data)
        else:
            self._backlog = memoryview(transport_data).cast("B")
            self._more_input()

    def _more_input(self) -> bool:
        """Give the engine the next piece of what the transport delivered
        (then its EOF); False when nothing waits."""
        backlog = self._backlog
        if backlog:
            self._incoming.write(backlog[:ENGINE_CHUNK])
            # An empty view of the caller's buffer would keep it alive.
            rest = backlog[ENGINE_CHUNK:]
            self._backlog = rest or _NO_INPUT
            return True
        if self._input_eof:
            self._input_eof = False
            self._incoming.write_eof()
            return True
        return False

    def _keep_backlog(self) -> None:
        """At the end of a call given transport bytes: what the engine did
        not take yet may be a view of the caller's buffer; keep a copy."""
        if self._backlog:
            self._backlog = memoryview(bytes(self._backlog))

    def handshake_nowait(
        self, transport_data: bytes | memoryview | None = None
    ) -> bool:
        """Run the handshake as far as it goes without waiting.

        For a caller that reads and writes the transport itself (the
        reactor, `tlsedge._pipeline.handshake.ReactorHandshake`): what the engine
        has to send (also a failed handshake's alert) is in
        `take_transport_data`.

        Args:
            transport_data: Bytes just read from the transport, given to the
                engine first; ``b""`` for the transport's EOF; None for none.

        Returns:
            Whether the handshake is done.

        Raises:
            trio.BrokenResourceError: the handshake failed, as `do_handshake`
                raises it (the cause, an ``ssl.SSLError``, is the ``__cause__``).
            trio.ClosedResourceError: the stream was closed.
        """
        self._check_status()
        if self._handshake_done:
            return True
        self._give_engine(transport_data)
        try:
            while True:
                try:
                    self.ssl_object.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    if self._more_input():
                        continue
                    if self._incoming.eof:
                        raise self._fail(
                            EOFError("peer closed during the handshake")
                        ) from None
                    return False
                except ssl.SSLError as exc:
                    raise self._fail(exc) from exc
        finally:
            self._keep_backlog()
        self._handshake_done = True
        return True

    async def _ensure_handshake(self, *, schedule: bool = True) -> None:
        """Run the handshake if it has not run; otherwise a checkpoint, or
        only a cancel point without *schedule* (`receive_some` and `send_all`
        yield through their transport I/O, or `_yield_unless_fed`)."""
        if not self._handshake_done:
            await self.do_handshake()
        elif schedule:
            await trio.lowlevel.checkpoint()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()

    @staticmethod
    async def _yield_unless_fed(fed: bool) -> None:
        """The schedule point of an operation that did no transport I/O (it
        consumed data already: shielded, the data must not be lost)."""
        if not fed:
            await trio.lowlevel.cancel_shielded_checkpoint()

    # -- receiving ----------------------------------------------------------

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        self._enter(_RECEIVING)
        try:
            return await self._receive_some(max_bytes)
        finally:
            self._leave(_RECEIVING)

    async def _receive_some(self, max_bytes: int | None) -> bytes:
        if max_bytes is None:
            max_bytes = DEFAULT_RECEIVE_SIZE
        else:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        self._check_status()
        await self._ensure_handshake(schedule=False)
        self._check_status()
        fed = False
        if self._parked:
            data, self._parked = self._parked[:max_bytes], self._parked[max_bytes:]
            await self._yield_unless_fed(fed)
            return data
        while True:
            if self._eof_received:
                await self._yield_unless_fed(fed)
                return b""
            try:
                data = self.ssl_object.read(max_bytes)
            except ssl.SSLWantReadError:
                if self._outgoing.pending:
                    await self._flush_if_idle()
                if not self._more_input():
                    await self._feed()
                    fed = True
                continue
            except ssl.SSLZeroReturnError:
                self._eof_received = True
                await self._yield_unless_fed(fed)
                return b""
            except ssl.SSLEOFError:
                # Transport EOF without close_notify.
                self._eof_received = True
                self.ragged_eof = True
                await self._yield_unless_fed(fed)
                return b""
            except ssl.SSLError as exc:
                raise self._fail(exc) from exc
            if self._outgoing.pending:
                # Post-handshake messages (tickets, key updates) to send.
                await self._flush_if_idle()
                fed = True
            await self._yield_unless_fed(fed)
            if data:
                return data
            self._eof_received = True
            return b""

    def receive_available(
        self, transport_data: bytes | memoryview | None = None
    ) -> tuple[bytes, bool]:
        """Everything the engine can return now, without waiting.

        For a caller that reads the transport itself (the reactor's relay,
        and the HTTP keep-alive pool, which checks idle connections this
        way). Records without application data (TLS 1.3 session tickets, key
        updates) are consumed; what the engine has to send meanwhile is in
        `take_transport_data`.

        Args:
            transport_data: Bytes just read from the transport, given to the
                engine first; ``b""`` for the transport's EOF; None for none.

        Returns:
            The plaintext (``b""`` for none yet: nothing received, part of a
            record, the handshake not done) and whether the peer closed
            (close_notify or EOF) after it.

        Raises:
            trio.BrokenResourceError: a TLS error (a fatal alert, a bad record).
            trio.ClosedResourceError: the stream was closed.
        """
        self._enter(_RECEIVING)
        try:
            self._check_status()
            self._give_engine(transport_data)
            if not self._handshake_done:
                return b"", False
            return self._read_available()
        finally:
            if self._backlog:
                self._keep_backlog()
            self._leave(_RECEIVING)

    def _read_available(self) -> tuple[bytes, bool]:
        incoming = self._incoming
        chunks = []
        if self._parked:
            chunks.append(self._parked)
            self._parked = b""
        ssl_object = self.ssl_object
        # Read while the engine may have more: a read that would only fail
        # with SSLWantReadError is skipped (the next piece of a large
        # delivery goes in first).
        while not self._eof_received:
            if not (incoming.pending or ssl_object.pending() or incoming.eof):
                if self._backlog or self._input_eof:
                    self._more_input()
                    continue
                break
            try:
                data = ssl_object.read(DEFAULT_RECEIVE_SIZE)
            except ssl.SSLWantReadError:
                if self._more_input():
                    continue
                break
            except ssl.SSLZeroReturnError:
                data = b""
            except ssl.SSLEOFError:
                self.ragged_eof = True
                data = b""
            except ssl.SSLError as exc:
                raise self._fail(exc) from exc
            if not data:
                self._eof_received = True
            else:
                chunks.append(data)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return data, self._eof_received

    # -- driven by a caller that owns the transport (the reactor) -------------

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bytes:
        """Encrypt *data* and return the records for the caller to send.

        For a caller that writes the transport itself (`tlsedge._reactor.relay` on the
        reactor), in the order this and `take_transport_data` return them.

        Raises:
            trio.BrokenResourceError: a TLS error.
            trio.ClosedResourceError: the stream was closed, or ``send_eof``
                was called.
        """
        self._enter(_SENDING)
        try:
            self._check_status()
            if self._eof_sent:
                raise trio.ClosedResourceError(
                    "send_eof() was called on this TLSStream"
                )
            try:
                return self._encrypt(memoryview(data).cast("B"))
            except ssl.SSLError as exc:
                raise self._fail(exc) from exc
        finally:
            self._leave(_SENDING)

    def send_eof_nowait(self) -> bytes:
        """Like `send_eof`, but return the close_notify for the caller to send.

        Raises:
            trio.BrokenResourceError: a TLS error.
            trio.ClosedResourceError: the stream was closed.
        """
        self._enter(_SENDING)
        try:
            self._check_status()
            if not self._eof_sent:
                self._send_close_notify()
            return self._outgoing.read()
        finally:
            self._leave(_SENDING)

    def take_transport_data(self) -> bytes:
        """Records the engine produced on its own while receiving (session
        tickets, key update answers), for a caller that writes the transport."""
        return self._outgoing.read()

    @property
    def established(self) -> bool:
        """The handshake is done and the stream neither broken nor closed."""
        return self._handshake_done and self._state is _State.OK

    # -- sending --------------------------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._enter(_SENDING)
        try:
            await self._send_all(data)
        finally:
            self._leave(_SENDING)

    async def _send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._check_status()
        await self._ensure_handshake(schedule=False)
        self._check_status()
        if self._eof_sent:
            raise trio.ClosedResourceError("send_eof() was called on this TLSStream")
        view = memoryview(data).cast("B")
        await self._yield_unless_fed(bool(view))
        try:
            while view:
                chunk, view = view[:WRITE_CHUNK], view[WRITE_CHUNK:]
                await self._flush(chunk)
        except ssl.SSLError as exc:
            raise self._fail(exc) from exc

    async def wait_send_all_might_not_block(self) -> None:
        self._enter(_SENDING)
        try:
            self._check_status()
            await self._ensure_handshake()
            async with self._lock_for_flush():
                await self.transport_stream.wait_send_all_might_not_block()
        finally:
            self._leave(_SENDING)

    async def send_eof(self) -> None:
        """Send close_notify; keep receiving until the peer closes too.

        Raises:
            trio.BrokenResourceError: the connection failed.
            trio.ClosedResourceError: the stream was closed.
        """
        self._enter(_SENDING)
        try:
            self._check_status()
            await self._ensure_handshake()
            if self._eof_sent:
                return
            self._send_close_notify()
            await self._flush()
        finally:
            self._leave(_SENDING)

    def _send_close_notify(self) -> None:
        self._eof_sent = True
        parked = []
        try:
            while self.ssl_object.pending():
                parked.append(self.ssl_object.read(self.ssl_object.pending()))
        except ssl.SSLError:
            pass
        waiting = self._incoming.read()
        try:
            self.ssl_object.unwrap()
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLError as exc:
            raise self._fail(exc) from exc
        finally:
            if waiting:
                self._incoming.write(waiting)
        self._parked += b"".join(parked)

    # -- closing ------------------------------------------------------------

    async def aclose(self) -> None:
        """Send close_notify if not sent yet (best effort), close the transport."""
        if self._state is _State.CLOSED:
            await trio.lowlevel.checkpoint()
            return
        was_ok = self._state is _State.OK
        self._state = _State.CLOSED
        try:
            if was_ok and self._handshake_done and not self._eof_sent:
                try:
                    self._send_close_notify()
                    data = self._outgoing.read()
                    if data and not self._flush_locked():
                        await self.transport_stream.send_all(data)
                except (
                    trio.BrokenResourceError,
                    trio.ClosedResourceError,
                    ssl.SSLError,
                ):
                    pass
        finally:
            await self.transport_stream.aclose()
