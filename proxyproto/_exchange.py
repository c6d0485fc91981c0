"""One connection to a probed target: send bytes, watch what it does (private).

``proxyproto probe`` (``proxyproto._probe``, the battery) and ``proxyproto
probe --diagnose`` (``proxyproto._diagnose``) both judge a target by what
it does with one new connection: it answers (the first bytes are kept), holds
the connection open, closes it or resets it. Plain blocking sockets with a
timeout on every connect, send and receive; stdlib only (the diagnosis needs
no Hypothesis).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["GONE", "Observation", "Outcome", "Target", "connect", "escape", "exchange"]

Outcome = Literal["answered", "held_open", "closed", "reset", "error", "skipped"]

_RESPONSE_KEEP = 256  # bytes of an answer kept for the report
_CONNECT_ATTEMPTS = 3
# errnos meaning "the target reset the connection" (seen on send, shutdown or
# recv depending on timing).
GONE = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ECONNABORTED})


class Target(Protocol):
    """Where and how patiently to connect (``ProbeConfig``, ``DiagnoseConfig``)."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def wait(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Observation:
    """What the target did with one connection."""

    outcome: Outcome
    response: bytes = b""
    elapsed: float = 0.0
    detail: str = ""

    def describe(self, wait: float) -> str:
        if self.outcome == "answered":
            text = f"answered {escape(self.response, 64)}"
            status = self.response[9:12]
            if self.response[:7] == b"HTTP/1." and status[:1] in (b"4", b"5"):
                text += (
                    f" (HTTP {status.decode('ascii', 'replace')}: the bytes got "
                    f"past the PROXY layer; the HTTP layer then rejected what "
                    f"followed)"
                )
            return text
        if self.outcome == "held_open":
            return (
                f"kept the connection open for {wait:g} s without answering "
                f"(waiting for more?)"
            )
        if self.outcome == "closed":
            return f"closed without answering after {self.elapsed:.2f} s"
        if self.outcome == "reset":
            return f"reset the connection without answering after {self.elapsed:.2f} s"
        if self.outcome == "skipped":
            return "not sent (--max-time reached)"
        return f"error: {self.detail}"


def escape(data: bytes, limit: int | None = None) -> str:
    """Peer bytes, escaped (printable ASCII as is, the rest ``\\xNN``)."""
    shown = data if limit is None else data[:limit]
    text = repr(shown)[1:]
    if limit is not None and len(data) > limit:
        text = text[:-1] + "...'"
    return text


def connect(target: Target) -> socket.socket:
    """A TCP connection to *target* (refused or timed-out connects are
    retried twice)."""
    last: OSError | None = None
    for attempt in range(_CONNECT_ATTEMPTS):
        try:
            sock = socket.create_connection(
                (target.host, target.port), timeout=target.connect_timeout
            )
        except (ConnectionRefusedError, TimeoutError) as exc:
            # A full accept queue looks like this too: retry a little later.
            last = exc
            time.sleep(0.1 * (attempt + 1))
            continue
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    assert last is not None
    raise last


def exchange(
    target: Target,
    data: bytes | Callable[[socket.socket], bytes],
    *,
    payload: bytes = b"",
    shut_wr: bool = False,
    trickle: float | None = None,
    wait: float | None = None,
) -> Observation:
    """Send *data* (+ *payload*) on a new connection and watch what happens.

    *data* may be a function of the connected socket (a header naming the
    connection's own endpoints).
    *trickle* sends *data* one byte every *trickle* seconds. Watches for
    *wait* seconds (default ``target.wait``) after the last byte is sent.
    """
    window = target.wait if wait is None else wait
    start = time.monotonic()
    try:
        sock = connect(target)
    except OSError as exc:
        return Observation(
            "error", detail=f"connect to {target.host}:{target.port}: {exc}"
        )
    with sock:
        sock.settimeout(max(window, 1.0))
        try:
            if callable(data):
                data = data(sock)
            if trickle is not None:
                for i in range(len(data)):
                    sock.sendall(data[i : i + 1])
                    if i + 1 < len(data):
                        time.sleep(trickle)
                if payload:
                    sock.sendall(payload)
            else:
                sock.sendall(data + payload)
            if shut_wr:
                sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            if exc.errno not in GONE:
                return Observation(
                    "error", elapsed=time.monotonic() - start, detail=f"send: {exc}"
                )
            # Refused (reset) while we were still sending: see what is left.
        deadline = time.monotonic() + window
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Observation("held_open", elapsed=time.monotonic() - start)
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(_RESPONSE_KEEP)
            except TimeoutError:
                continue
            except OSError as exc:
                if exc.errno in GONE:
                    return Observation("reset", elapsed=time.monotonic() - start)
                return Observation(
                    "error", elapsed=time.monotonic() - start, detail=f"recv: {exc}"
                )
            elapsed = time.monotonic() - start
            if not chunk:
                return Observation("closed", elapsed=elapsed)
            return Observation("answered", response=chunk, elapsed=elapsed)
