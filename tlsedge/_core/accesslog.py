"""One JSON access-log line per connection (logger ``tlsedge.access``).

Every connection ends with exactly one line saying who it was, where it went,
how many bytes went each way, when it started, how long it took and why it
ended (HTTP mode adds a line per request: ``tlsedge._http.log``, with
the same names and formats for the fields both have; docs/operations.md
describes every field). JSON encoding
escapes anything a peer could smuggle into a field (addresses come from
validated headers, error texts quote peer bytes with ``repr``).

Cost: the line is built from the slots directly (``dataclasses.asdict`` deep-copies
every value, ~18 us a call) by `JsonLine`, which knows the keys in advance and
escapes each string with the C function the ``json`` module uses:
``json.JSONEncoder.encode`` costs ~3.5 us per call before the first value
(it builds its encoder each time) and ~11 us for a request line. The output is
byte-identical to ``json.dumps(asdict(log), separators=(",", ":"))`` with
``start`` and ``duration`` formatted as below (``start``: `format_time`).

Writing: every line goes through `write_access_line`. Once
`tlsedge._control.logs.setup_logging` installed an `AccessLogWriter` (the
``tlsedge`` command always does), lines are appended to its buffer and written
with ``os.write`` in batches: when the buffer passes `BATCH_SIZE`, when a line
comes and the oldest pending one is older than `FLUSH_INTERVAL`, from the
periodic flusher (`tlsedge._control.logs.run_access_log_flusher`), before a
reopen, at shutdown and at interpreter exit. Without it (library use, tests)
lines go through the ``tlsedge.access`` logger as ``logging`` records.
Through the logger, a line costs a record, a handler lock, a formatter and a
``write`` (and ``getpid``) system call; in the writer, one ``list.append``.

Request lines are made late (`AccessLogWriter.write_later`): the writer keeps
the record and the function that makes its line, and makes the lines of up to
`DEFERRED_LINES` records in one loop, before any other line and before each
batch is written, so lines keep their order. Made at the end of each request,
a line cost ~13 µs of CPU in the edge under load, made in a loop ~3.5 µs: the
same ~30,000 instructions, but run once between two requests' worth of other
code, they find the caches and the branch predictors cold each time
(``bench/README.md``, "Issue 24, the access log in wall clock").

Lines must be printable text (the JSON encoders here escape every control and
non-ASCII character); the writer adds the line break.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import io
import json
import logging
import math
import os
import select
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final, Literal, TextIO, TypeVar, overload

from tlsedge._core.termination import Termination

__all__ = [
    "ACCESS_LOGGER",
    "ACCESS_LOG_OFF",
    "BATCH_SIZE",
    "DEFERRED_LINES",
    "FLUSH_INTERVAL",
    "AccessLogWriter",
    "ConnectionLog",
    "JsonLine",
    "access_log_enabled",
    "access_log_writer",
    "flush_access_log",
    "format_address",
    "format_time",
    "install_access_log_writer",
    "second_text",
    "write_access_line",
]

ACCESS_LOGGER = logging.getLogger("tlsedge.access")
#: ``edge.access_log`` value that turns the access log off.
ACCESS_LOG_OFF: Final = "off"
#: Where write failures are reported (the process log).
LOGGER = logging.getLogger("tlsedge.logging")

#: Pending bytes (about: characters) that make a write at once.
BATCH_SIZE: Final = 64 * 1024
#: Records whose lines `AccessLogWriter.write_later` makes in one loop.
DEFERRED_LINES: Final = 64
#: Pending lines are written at the latest this long after the first one
#: (by the periodic flusher; without it, by the next line after that).
FLUSH_INTERVAL: Final = 0.1
#: How long a flush waits for a pipe or terminal to take more bytes before it
#: drops the batch. While failing, it does not wait at all, so a reader that
#: stopped reading costs no more than a ``poll`` per batch.
WRITE_TIMEOUT: Final = 1.0
#: Writes to a pipe of at most this many bytes are never interleaved with
#: another process's writes (POSIX; Linux's value).
PIPE_BUF: Final = select.PIPE_BUF


@overload
def format_address(address: tuple[str, int]) -> str: ...
@overload
def format_address(address: None) -> None: ...
@overload
def format_address(address: tuple[str, int] | None) -> str | None: ...
def format_address(address: tuple[str, int] | None) -> str | None:
    """``"ip:port"``, with IPv6 in brackets; None stays None.

    The one way the edge writes an address (access log, refusal details, the
    process log, the status page). *host* is text as the socket API gives it
    (``inet_ntop``) or as `proxyproto._ip.ip_text` writes an ``ipaddress``
    value: an IPv4-mapped client reads ``[::ffff:192.0.2.66]:40000`` (RFC 5952
    section 5) on every Python.
    """
    if address is None:
        return None
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def format_time(timestamp: float) -> str:
    """A Unix time in RFC 3339, UTC, milliseconds: ``2026-11-23T19:50:01.123Z``.

    Milliseconds are cut, not rounded, so a time never shows the next second.
    """
    millis = math.floor(timestamp * 1000)
    seconds, millis = divmod(millis, 1000)
    return f"{second_text(seconds)}.{millis:03d}Z"


@functools.lru_cache(maxsize=4)
def second_text(seconds: int) -> str:
    """``2026-11-23T19:50:01``: the whole seconds of `format_time` (the lines
    of one second share it: cached)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


@dataclass(slots=True)
class ConnectionLog:
    """The fields of one access-log line, filled in as the connection goes."""

    id: str
    listener: str
    peer: str | None
    client: str | None = None
    destination: str | None = None
    backend: str | None = None
    server: str | None = None
    tls: str | None = None
    sni: str | None = None
    bytes_from_client: int = 0
    bytes_from_server: int = 0
    requests: int | None = None  # HTTP mode: requests on this connection
    termination: str = Termination.UNKNOWN
    detail: str | None = None
    start: float = 0.0
    duration: float = 0.0

    def traffic(self) -> tuple[int, int, str | None]:
        """The byte counts so far and the server, for the metrics while the
        connection runs (a udp flow adds to its log as datagrams go)."""
        return self.bytes_from_client, self.bytes_from_server, self.server

    def to_json(self) -> str:
        """The access-log line: one JSON object, fields in declaration order."""
        values = [getattr(self, name) for name in _FIELD_NAMES]
        values[_START] = format_time(self.start)
        values[_DURATION] = round(self.duration, 6)
        return _LINE.encode(values)

    def emit(self) -> None:
        """Write the line (if anyone reads the access log)."""
        if access_log_enabled():
            write_access_line(self.to_json())


class JsonLine:
    """A JSON object with fixed keys, encoded from its values in order.

    Byte-identical to ``json.dumps(dict(zip(keys, values)),
    separators=(",", ":"))`` for values that are None, str (StrEnum included),
    int, bool or float (finite); anything else is encoded by `json.dumps`.
    """

    __slots__ = ("_empty", "_prefixes")

    def __init__(self, keys: Sequence[str], *, first: str = "") -> None:
        """*first*: encoded members put before the keys (``'"type":"http"'``)."""
        separator = "{" + first + "," if first else "{"
        prefixes = []
        for key in keys:
            prefixes.append(f"{separator}{_json_string(key)}:")
            separator = ","
        self._prefixes = tuple(prefixes)
        self._empty = "{" + first + "}"

    def encode(self, values: Sequence[object]) -> str:
        if not self._prefixes:
            return self._empty
        parts = []
        for prefix, value in zip(self._prefixes, values, strict=True):
            parts.append(prefix)
            if value is None:
                parts.append("null")
            elif isinstance(value, str):
                parts.append(_json_string(value))
            elif value is True:
                parts.append("true")
            elif value is False:
                parts.append("false")
            elif type(value) is int or (type(value) is float and math.isfinite(value)):
                parts.append(repr(value))
            else:
                parts.append(json.dumps(value, separators=(",", ":")))
        parts.append("}")
        return "".join(parts)


_json_string: Callable[[str], str] = json.encoder.encode_basestring_ascii
_FIELD_NAMES = tuple(f.name for f in fields(ConnectionLog))
_LINE = JsonLine(_FIELD_NAMES)
_START = _FIELD_NAMES.index("start")
_DURATION = _FIELD_NAMES.index("duration")


_Record = TypeVar("_Record")


class AccessLogWriter:
    """Writes access lines in batches to stderr, stdout or a file.

    A file is opened with ``O_APPEND`` and each batch is one ``write`` of whole
    lines, which the kernel never interleaves with another process's write to
    the same file (workers share it). Anything else (a pipe, a terminal, a
    socket) gets pieces of at most `PIPE_BUF` bytes cut at line ends, the size
    up to which a pipe write is atomic (a longer line goes alone). stderr and
    stdout are looked up at each flush, so a replaced ``sys.stderr`` is
    followed, as `logging`'s handlers do.

    A failed write never raises: the batch is dropped and counted in
    `dropped`, the first failure is logged at ERROR on ``tlsedge.logging``, and
    the next successful write logs how many lines were lost. Meant for one
    thread (the one running trio; the ``atexit`` flush runs after it).
    """

    def __init__(self, destination: str) -> None:
        """Write to stderr (``"-"``), ``"stdout"`` or the file *destination*.

        Raises:
            OSError: the file cannot be opened.
        """
        #: ``"-"``, ``"stdout"``, or the file's absolute path.
        self.destination = destination
        self._stream: Literal["stderr", "stdout"] | None = None
        self._fd = -1
        self._regular = False
        if destination == "-":
            self._stream = "stderr"
        elif destination == "stdout":
            self._stream = "stdout"
        else:
            self.destination = os.path.abspath(destination)
            self._fd, self._regular = _open_append(self.destination)
        self._lines: list[str] = []
        self._size = 0
        #: Records of `write_later` and what makes their lines.
        self._deferred: list[tuple[Callable[[Any], str], Any]] = []
        self._since: float | None = None  # time.monotonic() of the oldest pending
        self._failing = False
        self._dropped_since_failure = 0
        #: Lines dropped by failed writes, since the start.
        self.dropped = 0

    @property
    def is_file(self) -> bool:
        """Whether the destination is a file (not stderr or stdout)."""
        return self._stream is None

    def write(self, line: str) -> None:
        """Add *line* (printable, without a line break) to the next batch."""
        if self._deferred:  # they came first
            self._make_deferred()
        self._lines.append(line)
        self._size += len(line) + 1
        if self._size >= BATCH_SIZE:
            self.flush()
        elif self._since is None:
            self._since = time.monotonic()
        elif time.monotonic() - self._since >= FLUSH_INTERVAL:
            self.flush()

    def write_later(self, make_line: Callable[[_Record], str], record: _Record) -> None:
        """Add the line ``make_line(record)`` to the next batch, made later
        (with other records' lines, in one loop): *record* must not change
        any more."""
        deferred = self._deferred
        deferred.append((make_line, record))
        if len(deferred) >= DEFERRED_LINES:
            self._make_deferred()
            if self._size >= BATCH_SIZE:
                self.flush()
                return
        if self._since is None:
            self._since = time.monotonic()
        elif time.monotonic() - self._since >= FLUSH_INTERVAL:
            self.flush()

    def _make_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        lines = [make_line(record) for make_line, record in deferred]
        self._lines += lines
        self._size += sum(map(len, lines)) + len(lines)

    def flush(self) -> None:
        """Write the pending lines now (dropped if that fails)."""
        if self._deferred:
            self._make_deferred()
        if not self._lines:
            return
        lines = self._lines
        self._lines = []
        self._size = 0
        self._since = None
        text = "\n".join(lines)
        text += "\n"
        if self._stream is None:
            self._write_fd(self._fd, self._regular, text)
            return
        stream: TextIO | None = getattr(sys, self._stream)
        try:
            if stream is None:
                raise OSError(errno.EBADF, f"sys.{self._stream} is None")
            stream.flush()  # what was written through it goes first
            fd = stream.fileno()
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except io.UnsupportedOperation:
            # No descriptor (a test's capture, a StringIO): through the stream.
            assert stream is not None
            self._write_stream(stream, text, len(lines))
        except (OSError, ValueError) as exc:  # ValueError: a closed stream
            self._failed(exc, len(lines))
        else:
            self._write_fd(fd, regular, text)

    def reopen(self) -> None:
        """Flush, then open the file by name again (after log rotation).

        Stderr and stdout are not reopened.

        Raises:
            OSError: the file cannot be opened (the old one stays in use).
        """
        self.flush()
        if self._stream is not None:
            return
        fd, regular = _open_append(self.destination)
        old, self._fd, self._regular = self._fd, fd, regular
        with contextlib.suppress(OSError):
            os.close(old)

    def close(self) -> None:
        """Flush, and close the file (if it is one)."""
        self.flush()
        if self._stream is None and self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.dropped:
            LOGGER.warning(
                "access log %s: %d lines dropped in all", self.destination, self.dropped
            )

    def _write_fd(self, fd: int, regular: bool, text: str) -> None:
        data = text.encode("utf-8", "backslashreplace")
        view = memoryview(data)
        position = 0
        # Once failing, do not wait: a reader that stopped reading must not
        # stall the event loop for WRITE_TIMEOUT at every batch.
        deadline = time.monotonic() + (0.0 if self._failing else WRITE_TIMEOUT)
        try:
            while position < len(data):
                end = len(data) if regular else _piece_end(data, position)
                if not regular:
                    _wait_writable(fd, deadline)
                try:
                    position += os.write(fd, view[position:end])
                except BlockingIOError:  # a non-blocking pipe filled up: wait
                    continue
        except OSError as exc:
            self._failed(exc, data.count(b"\n", position))
            return
        self._succeeded()

    def _write_stream(self, stream: TextIO, text: str, count: int) -> None:
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError) as exc:
            self._failed(exc, count)
        else:
            self._succeeded()

    def _failed(self, exc: OSError | ValueError, count: int) -> None:
        self.dropped += count
        self._dropped_since_failure += count
        if not self._failing:
            self._failing = True
            LOGGER.error(
                "access log %s: cannot write (%s); dropping lines until it can",
                self.destination,
                _describe(exc),
            )

    def _succeeded(self) -> None:
        if self._failing:
            LOGGER.warning(
                "access log %s: writing again; %d lines were dropped",
                self.destination,
                self._dropped_since_failure,
            )
            self._failing = False
            self._dropped_since_failure = 0


def _open_append(path: str) -> tuple[int, bool]:
    """Open *path* for appending (created if missing): (fd, regular file)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        os.close(fd)
        raise
    return fd, regular


def _piece_end(data: bytes, start: int) -> int:
    """Where the piece written from *start* ends: whole lines, at most
    PIPE_BUF bytes, or one longer line alone (*data* ends with a line break)."""
    if len(data) - start <= PIPE_BUF:
        return len(data)
    cut = data.rfind(b"\n", start, start + PIPE_BUF)
    if cut < 0:
        cut = data.index(b"\n", start)
    return cut + 1


def _wait_writable(fd: int, deadline: float) -> None:
    """Return once *fd* takes a write (or reports an error that the write will
    raise).

    Raises:
        TimeoutError: it did not before *deadline*.
    """
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    timeout = max(0.0, deadline - time.monotonic())
    if not poller.poll(timeout * 1000):
        raise TimeoutError(
            errno.ETIMEDOUT,
            f"not writable for {WRITE_TIMEOUT:g} s (the reader is not reading)",
        )


def _describe(exc: OSError | ValueError) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.strerror or os.strerror(exc.errno)
    return str(exc)


class _Installed:
    writer: AccessLogWriter | None = None


_INSTALLED: Final = _Installed()


def install_access_log_writer(writer: AccessLogWriter | None) -> None:
    """Send every access line to *writer* (None: back to the logger).

    The previous writer, if any, is flushed first (not closed).
    """
    flush_access_log()
    _INSTALLED.writer = writer


def access_log_writer() -> AccessLogWriter | None:
    """The installed writer, if any."""
    return _INSTALLED.writer


def access_log_enabled() -> bool:
    """Whether anyone reads access lines (skip building one when not)."""
    return _INSTALLED.writer is not None or ACCESS_LOGGER.isEnabledFor(logging.INFO)


def write_access_line(line: str) -> None:
    """Write one access-log line: one JSON object, printable, no line break.

    To the installed `AccessLogWriter`, else as a ``tlsedge.access`` record.
    Never raises because of the destination.
    """
    writer = _INSTALLED.writer
    if writer is not None:
        writer.write(line)
    elif ACCESS_LOGGER.isEnabledFor(logging.INFO):
        ACCESS_LOGGER.info("%s", line)


def flush_access_log() -> None:
    """Write the installed writer's pending lines now."""
    writer = _INSTALLED.writer
    if writer is not None:
        writer.flush()


atexit.register(flush_access_log)
