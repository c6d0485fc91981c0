"""Logging for the ``tlsedge`` command: formats, destinations, reopening.

Two streams leave a running edge:

- the *process log* (every ``tlsedge.*`` logger but the access log) on stderr,
  as ``text`` (``2025-01-31 12:00:00,123 INFO tlsedge.server: message``) or
  ``json`` (one object per line: ``time``, ``level``, ``logger``, ``pid``,
  ``message``, and ``exc_info`` / ``stack_info`` when there are any);
- the *access log* (logger ``tlsedge.access``, one JSON object per connection,
  built by `tlsedge._core.accesslog`, and in HTTP mode one per request, built by
  `tlsedge._http.RequestLog`; times in RFC 3339 with milliseconds, UTC, like
  the ``time`` of the JSON process log), written as it is to stderr (``"-"``), stdout
  or a file, whatever the process-log format. Access lines are written at any
  ``--log-level``, in batches, not through `logging`:
  `tlsedge._core.accesslog.AccessLogWriter` (`run_access_log_flusher` writes what is
  pending every `tlsedge._core.accesslog.FLUSH_INTERVAL`). Records logged on
  ``tlsedge.access`` the ordinary way join the same batches.

A file is opened in append mode, so several worker processes (``edge.workers``)
can share one: each opens it itself and every batch of whole lines goes out in
one ``write()`` on an ``O_APPEND`` descriptor, which the kernel never
interleaves with another process's ``write()``; to a pipe, batches go in
pieces of whole lines of at most ``PIPE_BUF`` bytes, for the same reason. For
log rotation, logrotate (or anything else) renames the file and sends SIGUSR1:
`reopen_logs` writes what is pending to the old file and opens the file by name
again (a new one), and the supervisor forwards SIGUSR1 to its workers.

Nothing else reaches stderr while the logs are set up: an exception Python
cannot raise (in a ``__del__``, in a callback from C code), which it would
print with a traceback as "Exception ignored in ...", goes through
``sys.unraisablehook`` to the process log (`log_unraisable`, ERROR on
``tlsedge.unraisable``), and warnings go through `logging` (``py.warnings``):
every line is in the configured format.

Log lines never carry raw bytes from the network: peers control parts of many
messages (PROXY and TLS errors quote what they sent). JSON escapes every control
and non-ASCII character. The text format escapes control and other
non-printable characters in the message (``\\x1b``, ``\\r``, ``\\n``,
``\\u2028``...), and every line of a traceback it appends starts with ``"  | "``,
so no peer-chosen text can start a line that looks like a log record.
Backslashes are not doubled (messages quote bytes with ``repr``, which is full
of them); escaping is about terminals and line-based parsers, not reversibility.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal, TextIO

import trio

from tlsedge._core.accesslog import (
    ACCESS_LOG_OFF,
    FLUSH_INTERVAL,
    AccessLogWriter,
    access_log_writer,
    flush_access_log,
    install_access_log_writer,
)

__all__ = [
    "ACCESS_LOGGER_NAME",
    "EscapingFormatter",
    "JsonFormatter",
    "StdStreamHandler",
    "escape_control",
    "log_unraisable",
    "reopen_logs",
    "run_access_log_flusher",
    "setup_logging",
    "shutdown_logging",
    "switch_access_log",
]

LOGGER = logging.getLogger("tlsedge.logging")
UNRAISABLE_LOGGER = logging.getLogger("tlsedge.unraisable")

ACCESS_LOGGER_NAME: Final = "tlsedge.access"
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Prefix of each traceback line in the text format.
CONTINUATION: Final = "  | "

_NAMED_ESCAPES: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_control(text: str) -> str:
    """Escape what is not printable: controls, separators, unpaired surrogates.

    ``"\\n"``, ``"\\r"`` and ``"\\t"`` become their backslash names; other
    characters ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``. Printable text (the
    common case) is returned as is, at the cost of one ``str.isprintable`` call.
    """
    if text.isprintable():
        return text
    parts: list[str] = []
    for char in text:
        if char.isprintable():
            parts.append(char)
        elif char in _NAMED_ESCAPES:
            parts.append(_NAMED_ESCAPES[char])
        else:
            code = ord(char)
            if code < 0x100:
                parts.append(f"\\x{code:02x}")
            elif code < 0x10000:
                parts.append(f"\\u{code:04x}")
            else:
                parts.append(f"\\U{code:08x}")
    return "".join(parts)


def _escape_block(text: str) -> str:
    """A multi-line block (a traceback): escape each line, prefix it."""
    return "\n".join(CONTINUATION + escape_control(line) for line in text.split("\n"))


class EscapingFormatter(logging.Formatter):
    """A `logging.Formatter` whose output has no raw control characters.

    The formatted record is one line with its non-printables escaped
    (`escape_control`); a traceback or stack follows on lines that each start
    with `CONTINUATION`.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        """Format the record's line and escape it."""
        return escape_control(super().formatMessage(record))

    def formatException(self, ei: logging._SysExcInfoType) -> str:
        """The traceback, escaped line by line."""
        return _escape_block(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        """The stack, escaped line by line."""
        return _escape_block(super().formatStack(stack_info))


class JsonFormatter(logging.Formatter):
    """One JSON object per record (``ensure_ascii``: pure printable ASCII)."""

    def format(self, record: logging.LogRecord) -> str:
        """Format *record* as a JSON object on one line."""
        created = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line: dict[str, object] = {
            "time": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=True, separators=(",", ":"))


class StdStreamHandler(logging.StreamHandler[TextIO]):
    """Writes to ``sys.stderr`` or ``sys.stdout`` as they are at each record.

    Like logging's last-resort handler: a replaced ``sys.stderr`` (a test's
    capture, a redirect) is followed instead of writing to a stale stream.
    """

    def __init__(self, name: Literal["stderr", "stdout"]) -> None:
        """Write to ``sys.<name>``."""
        self._stream_name = name
        super().__init__()

    @property
    def stream(self) -> TextIO:
        """The current ``sys.stderr`` or ``sys.stdout``."""
        stream: TextIO = getattr(sys, self._stream_name)
        return stream

    @stream.setter
    def stream(self, value: TextIO) -> None:
        """Ignored: the stream is looked up at each use."""


class AccessRecordHandler(logging.Handler):
    """Records logged on ``tlsedge.access`` (rather than through
    `tlsedge._core.accesslog.write_access_line`) go to the same writer, escaped."""

    def __init__(self, writer: AccessLogWriter) -> None:
        """Add each record's message to *writer*."""
        super().__init__()
        self._writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        """Add the record's message, its non-printables escaped."""
        try:
            self._writer.write(escape_control(record.getMessage()))
        except Exception:  # noqa: BLE001 (logging's contract: never raise)
            self.handleError(record)


def _not_access(record: logging.LogRecord) -> bool:
    return record.name != ACCESS_LOGGER_NAME


#: The most characters of the object an unraisable exception names.
_UNRAISABLE_OBJECT_TEXT: Final = 200


def log_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """``sys.unraisablehook``: log an exception Python could not raise as an
    ERROR with its traceback, as CPython's own hook words it (``Exception
    ignored in: <object>``), instead of writing it to stderr."""
    message = unraisable.err_msg or "Exception ignored in"
    if unraisable.object is not None:
        try:
            shown = repr(unraisable.object)
        except Exception:  # noqa: BLE001 (a broken __repr__ must not hide the error)
            shown = f"<{type(unraisable.object).__name__} object>"
        if len(shown) > _UNRAISABLE_OBJECT_TEXT:
            shown = shown[:_UNRAISABLE_OBJECT_TEXT] + "..."
        message = f"{message}: {shown}"
    value = unraisable.exc_value
    UNRAISABLE_LOGGER.error(
        "%s",
        message,
        exc_info=None
        if value is None
        else (unraisable.exc_type, value, unraisable.exc_traceback),
    )


@dataclass
class _Installed:
    """What `setup_logging` changed, so that it can be undone."""

    writer: AccessLogWriter | None  # None: ``access_log = "off"``
    unraisablehook: Callable[[sys.UnraisableHookArgs], object]  # the one before
    handlers: list[tuple[logging.Logger, logging.Handler]] = field(default_factory=list)
    root_level: int = logging.WARNING
    access_level: int = logging.NOTSET


class _State:
    installed: _Installed | None = None


_STATE: Final = _State()


def setup_logging(
    level: str = "info",
    log_format: Literal["text", "json"] | str = "text",
    access_log: str = "-",
    *,
    stream: TextIO | None = None,
) -> None:
    """Install the process log and the access log (replacing a previous setup).

    Args:
        level: ``"debug"``, ``"info"``, ``"warning"`` or ``"error"``: the root
            logger's level (the access log is always written).
        log_format: ``"text"`` or ``"json"``, for the process log.
        access_log: ``"-"`` (stderr), ``"stdout"``, a file path, or ``"off"``
            (no access log: no line is even built).
        stream: Where the process log goes (default: ``sys.stderr``).

    Raises:
        OSError: the access-log file cannot be opened (nothing is changed).
        ValueError: unknown *level* or *log_format*.
    """
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    if log_format not in {"text", "json"}:
        raise ValueError(f"unknown log format {log_format!r}")
    # May raise: before any change.
    writer = None if access_log == ACCESS_LOG_OFF else AccessLogWriter(access_log)
    shutdown_logging()
    process_handler: logging.Handler = (
        StdStreamHandler("stderr") if stream is None else logging.StreamHandler(stream)
    )
    process_handler.setFormatter(
        JsonFormatter() if log_format == "json" else EscapingFormatter(TEXT_FORMAT)
    )
    process_handler.addFilter(_not_access)
    root = logging.getLogger()
    access = logging.getLogger(ACCESS_LOGGER_NAME)
    installed = _Installed(
        writer,
        sys.unraisablehook,
        root_level=root.level,
        access_level=access.level,
    )
    root.addHandler(process_handler)
    installed.handlers = [(root, process_handler)]
    root.setLevel(numeric)
    _install_access_log(installed, writer)
    sys.unraisablehook = log_unraisable
    logging.captureWarnings(True)
    _STATE.installed = installed


def _install_access_log(installed: _Installed, writer: AccessLogWriter | None) -> None:
    """Send the access log to *writer* (None: off), recording the handler in
    *installed*."""
    access = logging.getLogger(ACCESS_LOGGER_NAME)
    if writer is None:
        # Nothing reads access lines: `access_log_enabled` is then False.
        access.setLevel(logging.CRITICAL + 1)
    else:
        access_handler = AccessRecordHandler(writer)
        access.addHandler(access_handler)
        installed.handlers.append((access, access_handler))
        access.setLevel(logging.INFO)
    install_access_log_writer(writer)
    installed.writer = writer


def switch_access_log(writer: AccessLogWriter | None) -> None:
    """Send the access log to *writer* from now on (None: ``"off"``), the
    process log unchanged; the previous writer is flushed and closed.

    A reload that changes ``edge.access_log`` opens the new writer first
    (`AccessLogWriter` raises if it cannot, and nothing changes), then calls
    this.

    Raises:
        RuntimeError: `setup_logging` was not called.
    """
    installed = _STATE.installed
    if installed is None:
        raise RuntimeError("switch_access_log() needs setup_logging() first")
    previous = installed.writer
    kept = []
    for logger, handler in installed.handlers:
        if logger.name == ACCESS_LOGGER_NAME:
            logger.removeHandler(handler)
        else:
            kept.append((logger, handler))
    installed.handlers = kept
    _install_access_log(installed, writer)
    if previous is not None:
        previous.close()


def reopen_logs() -> None:
    """Reopen the access-log file (SIGUSR1, after rotation); failures are
    logged. What is pending is written to the old file first; stderr and
    stdout are only flushed."""
    installed = _STATE.installed
    if installed is None or installed.writer is None:
        return
    writer = installed.writer
    try:
        writer.reopen()
    except OSError as exc:
        LOGGER.error(
            "cannot reopen %s (%s); still writing to the old file",
            writer.destination,
            os.strerror(exc.errno) if exc.errno else exc,
        )
    else:
        if writer.is_file:
            LOGGER.info("reopened %s", writer.destination)


def shutdown_logging() -> None:
    """Write the pending access lines, remove what `setup_logging` installed
    and restore the levels."""
    installed, _STATE.installed = _STATE.installed, None
    if installed is None:
        return
    install_access_log_writer(None)
    sys.unraisablehook = installed.unraisablehook
    logging.captureWarnings(False)
    if installed.writer is not None:
        installed.writer.close()
    for logger, handler in installed.handlers:
        logger.removeHandler(handler)
        handler.flush()
    logging.getLogger().setLevel(installed.root_level)
    logging.getLogger(ACCESS_LOGGER_NAME).setLevel(installed.access_level)


async def run_access_log_flusher() -> None:
    """Write pending access lines every `FLUSH_INTERVAL` (``Edge.run`` runs
    it), so that a quiet edge's last lines do not wait for the next one.

    Returns when no writer is installed (without `setup_logging`, lines go
    through `logging` as they come); runs until cancelled otherwise.
    """
    while access_log_writer() is not None:
        await trio.sleep(FLUSH_INTERVAL)
        flush_access_log()
