"""Log formats, access-log destinations, reopening, and escaping of peer bytes."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
import trustme

from tests.peers import free_port
from tests.tlsedge.helpers import (
    Backend,
    client_hello,
    exchange,
    make_config,
    read_all,
    running_edge,
    tag_handler,
    wait_until,
)
from tlsedge._control.cli import main
from tlsedge._control.logs import (
    EscapingFormatter,
    JsonFormatter,
    escape_control,
    log_unraisable,
    reopen_logs,
    run_access_log_flusher,
    setup_logging,
    shutdown_logging,
    switch_access_log,
)
from tlsedge._core import accesslog as _accesslog
from tlsedge._core.accesslog import (
    BATCH_SIZE,
    DEFERRED_LINES,
    FLUSH_INTERVAL,
    PIPE_BUF,
    AccessLogWriter,
    ConnectionLog,
    access_log_enabled,
    access_log_writer,
    flush_access_log,
    format_time,
    write_access_line,
)

ROOT = Path(__file__).resolve().parents[3]

# What a peer might send where an error message quotes it: a colour escape
# and a line break followed by a forged record.
GARBAGE = "PROXY \x1b[31mTCP4\r\n2025-01-01 00:00:00,000 INFO tlsedge.access: {}"


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    shutdown_logging()


def record(
    message: str, *args: object, name: str = "tlsedge.server"
) -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, message, args, None)


# --- escaping -------------------------------------------------------------------


def test_escape_control() -> None:
    assert escape_control("plain text: 'quoted' \\x00") == "plain text: 'quoted' \\x00"
    assert escape_control("a\x1b[31mb\r\nc\td\x00\x7f") == (
        "a\\x1b[31mb\\r\\nc\\td\\x00\\x7f"
    )
    assert escape_control("\x9b\u2028\u0085\udcff") == "\\x9b\\u2028\\x85\\udcff"
    assert escape_control("\U000e0001") == "\\U000e0001"
    assert escape_control("déjà vu ✓") == "déjà vu ✓"  # printable Unicode stays


def test_text_format_escapes_peer_garbage() -> None:
    formatter = EscapingFormatter("%(levelname)s %(name)s: %(message)s")
    line = formatter.format(
        record("listener %s: closing %s: %s", "in", "peer", GARBAGE)
    )
    assert "\x1b" not in line
    assert "\r" not in line
    assert "\n" not in line
    assert line == (
        "INFO tlsedge.server: listener in: closing peer: PROXY \\x1b[31mTCP4\\r\\n"
        "2025-01-01 00:00:00,000 INFO tlsedge.access: {}"
    )


def test_text_format_tracebacks_cannot_forge_lines() -> None:
    formatter = EscapingFormatter("%(levelname)s %(name)s: %(message)s")
    try:
        raise ValueError(GARBAGE)
    except ValueError:
        rec = logging.LogRecord(
            "tlsedge.tls", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    text = formatter.format(rec)
    first, *rest = text.split("\n")
    assert first == "ERROR tlsedge.tls: failed"
    assert rest
    assert all(line.startswith("  | ") for line in rest)
    assert "\x1b" not in text
    assert "\r" not in text
    # The message's own line break starts a continuation line, not a record.
    assert "  | ValueError: PROXY \\x1b[31mTCP4\\r\n  | 2025-01-01 00:00" in text


def test_json_format() -> None:
    line = JsonFormatter().format(record("closing %s: %s", "peer", GARBAGE))
    assert "\n" not in line
    assert line.isascii()
    assert line.isprintable()
    data = json.loads(line)
    assert data["message"] == f"closing peer: {GARBAGE}"  # exact, once decoded
    assert data["level"] == "INFO"
    assert data["logger"] == "tlsedge.server"
    assert data["pid"] == os.getpid()
    assert data["time"].endswith("Z")
    assert "exc_info" not in data
    try:
        raise RuntimeError("\x1b[2J")
    except RuntimeError:
        rec = logging.LogRecord(
            "tlsedge", logging.ERROR, __file__, 1, "boom", (), sys.exc_info()
        )
    line = JsonFormatter().format(rec)
    assert line.isprintable()
    assert "RuntimeError: \x1b[2J" in json.loads(line)["exc_info"]


# --- setup_logging ----------------------------------------------------------------


def emit_access(id_: str = "c1") -> None:
    ConnectionLog(id=id_, listener="in", peer="10.0.0.1:5555", detail=GARBAGE).emit()


def test_access_log_times_are_rfc3339_utc_with_milliseconds() -> None:
    assert format_time(1795463401.123) == "2026-11-23T19:50:01.123Z"
    assert format_time(0) == "1970-01-01T00:00:00.000Z"
    # Cut, not rounded: a time never shows the next second.
    assert format_time(59.9999) == "1970-01-01T00:00:59.999Z"
    line = ConnectionLog(id="c", listener="l", peer=None, start=1795463401.5)
    assert json.loads(line.to_json())["start"] == "2026-11-23T19:50:01.500Z"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_process_log_and_access_log_to_stderr(
    log_format: str, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("info", log_format)
    logging.getLogger("tlsedge.server").info("hello %s", GARBAGE)
    logging.getLogger("tlsedge.server").debug("not shown at info")
    emit_access()
    flush_access_log()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert "\x1b" not in err
    assert "\r" not in err
    process, access = lines
    if log_format == "json":
        assert json.loads(process)["message"] == f"hello {GARBAGE}"
    else:
        assert process.endswith(
            "INFO tlsedge.server: hello PROXY \\x1b[31mTCP4\\r\\n"
            "2025-01-01 00:00:00,000 INFO tlsedge.access: {}"
        )
    # The access line is the bare JSON object, whatever the format.
    assert json.loads(access)["detail"] == GARBAGE
    assert json.loads(access)["id"] == "c1"


def test_access_log_off_writes_and_builds_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    setup_logging("debug", "text", "off")
    assert not access_log_enabled()
    assert access_log_writer() is None

    def built(self: ConnectionLog) -> str:
        raise AssertionError("a line was built with the access log off")

    monkeypatch.setattr(ConnectionLog, "to_json", built)
    emit_access()
    flush_access_log()
    reopen_logs()  # SIGUSR1: nothing to reopen
    logging.getLogger("tlsedge.server").info("the process log still works")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith("INFO tlsedge.server: the process log still works\n")
    shutdown_logging()
    assert logging.getLogger("tlsedge.access").level == logging.NOTSET  # restored


def test_access_log_to_stdout_at_any_level(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("error", "text", "stdout")
    logging.getLogger("tlsedge.server").warning("below error: not shown")
    emit_access()
    flush_access_log()
    captured = capsys.readouterr()
    assert captured.err == ""
    assert json.loads(captured.out)["listener"] == "in"


def test_access_log_file_reopens_after_rotation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "access.log"
    path.write_text('{"kept":true}\n')  # append mode: existing lines stay
    setup_logging("info", "text", str(path))
    emit_access("before")
    path.rename(tmp_path / "access.log.1")
    emit_access("rotated")  # still to the renamed file, as with any logger
    reopen_logs()
    emit_access("after")
    flush_access_log()
    old = [
        json.loads(line)
        for line in (tmp_path / "access.log.1").read_text().splitlines()
    ]
    new = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line.get("id") for line in old] == [None, "before", "rotated"]
    assert [line["id"] for line in new] == ["after"]
    assert f"reopened {path}" in capsys.readouterr().err


def test_reopen_failure_keeps_the_old_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    setup_logging("info", "text", str(folder / "access.log"))
    folder.rename(tmp_path / "moved")
    reopen_logs()  # the folder is gone: cannot open
    emit_access("still")
    flush_access_log()
    assert "cannot reopen" in capsys.readouterr().err
    assert "still" in (tmp_path / "moved" / "access.log").read_text()


def test_unopenable_access_log_changes_nothing(tmp_path: Path) -> None:
    root = logging.getLogger()
    handlers = list(root.handlers)
    with pytest.raises(FileNotFoundError):
        setup_logging("info", "text", str(tmp_path / "missing" / "access.log"))
    assert root.handlers == handlers
    with pytest.raises(ValueError, match="unknown log format"):
        setup_logging("info", "xml")
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging("loud", "text")


def test_switch_access_log_moves_the_lines_and_keeps_the_process_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A reload that changes edge.access_log (tlsedge._control.run.ProcessReload).
    setup_logging("info", "text")
    emit_access("stderr")
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    switch_access_log(AccessLogWriter(str(first)))
    emit_access("first")
    switch_access_log(None)  # "off"
    assert not access_log_enabled()
    emit_access("nowhere")
    switch_access_log(AccessLogWriter(str(second)))
    emit_access("second")
    logging.getLogger("tlsedge.access").info('{"id":"logged"}')
    flush_access_log()
    logging.getLogger("tlsedge.server").info("process log")
    err = capsys.readouterr().err.splitlines()
    assert [json.loads(line)["id"] for line in err[:1]] == ["stderr"]
    assert err[1].endswith("INFO tlsedge.server: process log")
    assert len(err) == 2
    assert [json.loads(line)["id"] for line in first.read_text().splitlines()] == [
        "first"
    ]
    assert [json.loads(line)["id"] for line in second.read_text().splitlines()] == [
        "second",
        "logged",
    ]
    shutdown_logging()
    assert logging.getLogger("tlsedge.access").handlers == []


def test_switch_access_log_needs_setup_logging() -> None:
    with pytest.raises(RuntimeError, match="setup_logging"):
        switch_access_log(None)


def test_shutdown_restores_the_loggers() -> None:
    root, access = logging.getLogger(), logging.getLogger("tlsedge.access")
    before = (list(root.handlers), root.level, list(access.handlers), access.level)
    setup_logging("debug", "json")
    setup_logging("warning", "text")  # replaces, does not stack
    assert len(root.handlers) == len(before[0]) + 1
    assert len(access.handlers) == len(before[2]) + 1
    shutdown_logging()
    assert (
        list(root.handlers),
        root.level,
        list(access.handlers),
        access.level,
    ) == before
    reopen_logs()  # nothing installed: a no-op


# --- the access-log writer: batches, flushes, failures -----------------------------


def numbered_lines(count: int, tag: str = "t") -> list[str]:
    """Access-like lines of varying length (up to ~750 bytes)."""
    return [
        json.dumps(
            {"p": tag, "i": i, "pad": "x" * (i * 37 % 700)}, separators=(",", ":")
        )
        for i in range(count)
    ]


def record_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Record what every os.write wrote (the writer's only way out)."""
    written: list[bytes] = []
    real_write = os.write

    def write(fd: int, data: bytes | memoryview, /) -> int:
        count = real_write(fd, data)
        written.append(bytes(data[:count]))
        return count

    monkeypatch.setattr(os, "write", write)
    return written


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "tlsedge.logging" and r.levelno == logging.ERROR
    ]


def test_without_setup_lines_go_through_the_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "tlsedge.access")
    assert access_log_writer() is None
    assert access_log_enabled()
    write_access_line('{"id":"direct"}')
    assert [r.getMessage() for r in caplog.records] == ['{"id":"direct"}']


def test_lines_reach_the_file_complete_and_in_order(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    setup_logging("info", "text", str(path))
    lines = numbered_lines(5000)
    for line in lines:
        write_access_line(line)
    # Records logged on tlsedge.access join the same batches, escaped.
    logging.getLogger("tlsedge.access").info("via logging\x1b[0m")
    write_access_line("last")
    shutdown_logging()
    assert path.read_text().splitlines() == [*lines, "via logging\\x1b[0m", "last"]


def test_a_burst_is_written_in_few_large_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "access.log"
    setup_logging("info", "text", str(path))
    writes = record_writes(monkeypatch)
    lines = numbered_lines(10_000)
    for line in lines:
        write_access_line(line)
    shutdown_logging()
    total = sum(len(line) + 1 for line in lines)
    assert sum(map(len, writes)) == total == path.stat().st_size
    # A write per BATCH_SIZE of lines, and a few more if the burst took longer
    # than FLUSH_INTERVAL (a loaded machine): nowhere near one per line.
    assert total // BATCH_SIZE <= len(writes) <= 100
    assert all(w.endswith(b"\n") for w in writes)  # a file: whole batches
    assert path.read_text().splitlines() == lines


def test_a_line_is_written_once_it_waited_an_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "access.log"
    setup_logging("info", "text", str(path))
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    write_access_line("first")
    now[0] += FLUSH_INTERVAL / 2
    write_access_line("second")
    assert path.read_text() == ""  # pending: nobody flushed, not due yet
    now[0] += FLUSH_INTERVAL
    write_access_line("third")  # the first has waited long enough: all go
    assert path.read_text() == "first\nsecond\nthird\n"


def test_records_lines_are_made_together_and_keep_their_place(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    setup_logging("info", "text", str(path))
    writer = access_log_writer()
    assert writer is not None
    made: list[int] = []

    def make_line(record: int) -> str:
        made.append(record)
        return f"record {record}"

    for record in range(DEFERRED_LINES - 1):
        writer.write_later(make_line, record)
    assert made == []  # kept as records
    writer.write_later(make_line, DEFERRED_LINES - 1)
    assert made == list(range(DEFERRED_LINES))  # their lines made in one go
    writer.write_later(make_line, 100)
    write_access_line("connection")  # a line comes: the record's line first
    writer.write_later(make_line, 101)
    assert path.read_text() == ""
    shutdown_logging()
    assert path.read_text().splitlines() == [
        *(f"record {record}" for record in range(DEFERRED_LINES)),
        "record 100",
        "connection",
        "record 101",
    ]


def test_a_records_line_is_written_once_it_waited_an_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "access.log"
    setup_logging("info", "text", str(path))
    writer = access_log_writer()
    assert writer is not None
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    writer.write_later(str, 1)
    now[0] += FLUSH_INTERVAL / 2
    writer.write_later(str, 2)
    assert path.read_text() == ""  # pending: nobody flushed, not due yet
    now[0] += FLUSH_INTERVAL
    writer.write_later(str, 3)  # the first has waited long enough: all go
    assert path.read_text() == "1\n2\n3\n"


async def test_the_flusher_writes_a_lone_pending_line(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "access.log"
    setup_logging("info", "text", str(path))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_access_log_flusher)
        write_access_line("lonely")
        assert path.read_text() == ""
        await trio.sleep(FLUSH_INTERVAL * 1.5)
        assert path.read_text() == "lonely\n"
        shutdown_logging()  # no writer any more: the flusher returns by itself
    await run_access_log_flusher()  # nothing installed: returns at once


def test_shutdown_flushes(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    setup_logging("info", "text", str(path))
    emit_access("pending")
    assert path.read_text() == ""
    shutdown_logging()
    assert json.loads(path.read_text())["id"] == "pending"
    write_access_line("after shutdown")  # to the logger, not the closed file
    assert json.loads(path.read_text())["id"] == "pending"


def test_a_failed_write_drops_the_batch_logs_once_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    setup_logging("info", "text", "/dev/full")  # every write: ENOSPC
    writer = access_log_writer()
    assert writer is not None
    for line in numbered_lines(3):
        write_access_line(line)
    flush_access_log()
    for line in numbered_lines(2):
        write_access_line(line)
    flush_access_log()
    assert writer.dropped == 5
    assert errors(caplog) == [
        "access log /dev/full: cannot write (No space left on device); "
        "dropping lines until it can"
    ]
    shutdown_logging()
    assert "access log /dev/full: 5 lines dropped in all" in caplog.text


def test_a_pipe_without_reader_drops_lines(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w", encoding="utf-8") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        setup_logging("info", "text", "stdout")
        emit_access("lost")
        flush_access_log()  # EPIPE (SIGPIPE is ignored by Python)
        writer = access_log_writer()
        assert writer is not None
        assert writer.dropped == 1
        assert errors(caplog) == [
            "access log stdout: cannot write (Broken pipe); dropping lines until it can"
        ]
        shutdown_logging()


def test_pipe_writes_are_whole_lines_of_at_most_pipe_buf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read_end, write_end = os.pipe()
    with (
        open(read_end, "rb", buffering=0) as reader,
        open(write_end, "w", encoding="utf-8") as stdout,
    ):
        monkeypatch.setattr(sys, "stdout", stdout)
        setup_logging("info", "text", "stdout")
        writes = record_writes(monkeypatch)
        long_line = "y" * (PIPE_BUF + 100)
        lines = numbered_lines(40)
        lines.insert(20, long_line)
        for line in lines:
            write_access_line(line)
        flush_access_log()
        assert reader.read(1 << 20) == b"".join(writes)  # ~20 kB: all in the pipe
    assert len(writes) > 2
    assert all(w.endswith(b"\n") for w in writes)
    # Never more than PIPE_BUF, but for the one longer line, written alone.
    assert [w for w in writes if len(w) > PIPE_BUF] == [long_line.encode() + b"\n"]
    assert b"".join(writes).decode().splitlines() == lines


def test_a_full_pipe_does_not_block_and_recovers(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_accesslog, "WRITE_TIMEOUT", 0.0)  # no real waiting
    read_end, write_end = os.pipe()
    with (
        open(read_end, "rb", buffering=0) as reader,
        open(write_end, "w", encoding="utf-8") as stdout,
    ):
        monkeypatch.setattr(sys, "stdout", stdout)
        setup_logging("info", "text", "stdout")
        writer = access_log_writer()
        assert writer is not None
        lines = numbered_lines(1000)  # ~350 kB: more than a pipe holds
        for line in lines:
            write_access_line(line)
        flush_access_log()  # the reader does not read: returns, drops the rest
        assert errors(caplog) == [
            "access log stdout: cannot write (not writable for 0 s (the reader "
            "is not reading)); dropping lines until it can"
        ]
        os.set_blocking(read_end, False)
        received = b""
        while chunk := reader.read(65536):  # None once empty
            received += chunk
        delivered = received.decode().splitlines()
        assert delivered == lines[: len(delivered)]  # whole lines, in order
        assert writer.dropped == len(lines) - len(delivered) > 0
        write_access_line("again")
        flush_access_log()
        assert reader.read(65536) == b"again\n"
        assert (
            f"access log stdout: writing again; {writer.dropped} lines were dropped"
            in caplog.text
        )
        shutdown_logging()


WRITER_SCRIPT = """
import json, sys
from tlsedge._core.accesslog import write_access_line
from tlsedge._control.logs import setup_logging
setup_logging("info", "text", "stdout")
tag, count = sys.argv[1], int(sys.argv[2])
for i in range(count):
    pad = "x" * (i * 37 % 700)
    write_access_line(json.dumps({"p": tag, "i": i, "pad": pad}, separators=(",", ":")))
# no shutdown_logging(): the rest is written at interpreter exit
"""


def test_two_processes_on_one_pipe_never_interleave_mid_line() -> None:
    count = 3000
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER_SCRIPT, tag, str(count)],
            stdout=write_end,
            env=env,
        )
        for tag in ("a", "b")
    ]
    os.close(write_end)
    with open(read_end, "rb") as reader:
        output = reader.read()
    assert [p.wait(timeout=60) for p in processes] == [0, 0]
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for line in output.decode().splitlines():
        record = json.loads(line)  # an interleaved line would not parse
        assert record["pad"] == "x" * (record["i"] * 37 % 700)
        seen[record["p"]].append(record["i"])
    assert seen == {"a": list(range(count)), "b": list(range(count))}
    assert len(output) > 4 * 65536  # more than the pipe holds: writers raced


# --- through an Edge: a garbage PROXY header ----------------------------------------


async def test_edge_logs_garbage_proxy_header_escaped(nursery: trio.Nursery) -> None:
    backend = await Backend(tag_handler("hi")).start(nursery)
    stream = io.StringIO()
    setup_logging("info", "text", stream=stream)
    config = make_config(
        [{"name": "in", "backend": "b", "proxy_protocol": {"trusted": ["127.0.0.1"]}}],
        [{"name": "b", "servers": [backend.address]}],
    )
    async with running_edge(config) as edge:
        address = edge.listen_addresses["in"][0]
        await exchange(address, GARBAGE.encode("latin-1") + b"\r\n\xff\x1b[0m")
        await wait_until(lambda: "closing" in stream.getvalue())
    text = stream.getvalue()
    assert "\x1b" not in text
    assert "\r" not in text
    for line in text.splitlines():
        assert line.startswith(("20", "  | ")), line  # every line is a record


# --- the command: --log-format, access_log file, SIGUSR1 with workers ----------------


def test_log_format_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(
        '[edge]\naccess_log = "missing/access.log"\n'
        '[[listeners]]\nname = "in"\nbind = "127.0.0.1:0"\nbackend = "b"\n'
        '[[backends]]\nname = "b"\nservers = ["127.0.0.1:9"]\n'
    )
    assert main(["--log-format", "json", "run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "edge.access_log: cannot open" in err
    assert str(tmp_path / "missing" / "access.log") in err
    with pytest.raises(SystemExit):
        main(["--log-format", "xml", "check", str(path)])


@contextlib.asynccontextmanager
async def edge_process(
    config: Path, log: Path, *, flags: tuple[str, ...] = ("--log-format", "json")
) -> AsyncIterator[trio.Process]:
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tlsedge", *flags, "run", str(config)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await process.wait()
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()


def log_messages(log: Path) -> list[str]:
    messages = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            messages.append(json.loads(line)["message"])
    return messages


async def test_workers_share_the_access_log_and_reopen_on_sigusr1(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = await Backend(tag_handler("hi")).start(nursery)
    port = free_port()
    config = tmp_path / "edge.toml"
    config.write_text(
        '[edge]\nworkers = 2\naccess_log = "access.log"\n\n'
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n\n'
        f'[[backends]]\nname = "b"\nservers = ["{backend.address}"]\n'
    )
    access = tmp_path / "access.log"
    log = tmp_path / "stderr.log"

    def bound() -> int:
        return sum(m.startswith("listener in on") for m in log_messages(log))

    def ids(path: Path) -> list[str]:
        # Whole lines only: a worker's batch may be half written as we read
        # (its write is atomic against the other writers, not against us).
        text = path.read_text()
        whole = text[: text.rfind("\n") + 1]
        return [json.loads(line)["id"] for line in whole.splitlines()]

    async with edge_process(config, log) as process:
        await wait_until(lambda: bound() == 2, 30, 0.05)
        for _ in range(20):
            assert await exchange(("127.0.0.1", port)) == b"hi"
        await wait_until(lambda: access.exists() and len(ids(access)) == 20, 10)
        # ids() parsed every line: whole JSON objects, none interleaved.

        access.rename(tmp_path / "access.log.1")
        process.send_signal(signal.SIGUSR1)
        # Both workers reopen (the supervisor writes no access lines, so it
        # holds no access log: one a reload moved would not be reopened).
        await wait_until(
            lambda: sum(m.startswith("reopened ") for m in log_messages(log)) == 2, 10
        )
        for _ in range(6):
            assert await exchange(("127.0.0.1", port)) == b"hi"
        await wait_until(lambda: access.exists() and len(ids(access)) == 6, 10)
        assert len(ids(tmp_path / "access.log.1")) == 20
        assert process.returncode is None  # SIGUSR1 did not kill anything
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await process.wait() == 0
    # The process log is JSON (--log-format json), the workers' too.
    assert bound() == 2


# --- nothing but the configured format on stderr ------------------------------------


class _Unraisable:
    def __del__(self) -> None:
        raise RuntimeError("raised in __del__ \x1b[31m")


def test_unraisable_exceptions_go_to_the_process_log() -> None:
    stream = io.StringIO()
    before = sys.unraisablehook
    setup_logging("info", "json", "off", stream=stream)
    assert sys.unraisablehook is log_unraisable
    _Unraisable()  # collected at once: its __del__ raises where none can catch
    shutdown_logging()
    assert sys.unraisablehook is before
    (line,) = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert line["level"] == "ERROR"
    assert line["logger"] == "tlsedge.unraisable"
    assert line["message"].startswith(
        "Exception ignored in: <function _Unraisable.__del__"
    )
    assert "RuntimeError: raised in __del__ \x1b[31m" in line["exc_info"]


def test_warnings_go_to_the_process_log() -> None:
    stream = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        setup_logging("info", "json", "off", stream=stream)
        warnings.warn("something to know", UserWarning, stacklevel=1)
        shutdown_logging()
    (line,) = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert line["logger"] == "py.warnings"
    assert "UserWarning: something to know" in line["message"]


async def test_a_non_ascii_server_name_is_refused_in_the_log_format(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # The ssl module cannot decode such a name: before the fix, CPython
    # printed "Exception ignored in ..." and a traceback (5 lines of text)
    # per handshake into a JSON log.
    backend = await Backend(tag_handler("hi")).start(nursery)
    ca = trustme.CA()
    leaf = ca.issue_cert("edge.test")
    leaf.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "edge.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "edge.key"))
    port = free_port()
    config = tmp_path / "edge.toml"
    config.write_text(
        '[edge]\nlog_format = "json"\n\n'
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n'
        '[listeners.tls]\ncertificates = [{ cert = "edge.pem", key = "edge.key" }]\n\n'
        f'[[backends]]\nname = "b"\nservers = ["{backend.address}"]\n'
    )
    log = tmp_path / "stderr.log"
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)

    def handshake() -> bytes:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            client_context.wrap_socket(raw, server_hostname="edge.test") as tls,
        ):
            return tls.recv(10)

    async with edge_process(config, log, flags=()) as process:
        await wait_until(
            lambda: any(m.startswith("listener in on") for m in log_messages(log)),
            30,
            0.05,
        )
        answers = []
        for _ in range(3):
            async with await trio.open_tcp_stream("127.0.0.1", port) as client:
                await client.send_all(client_hello(b"\xff\xfe\xc3("))
                with trio.fail_after(10):
                    answers.append(await read_all(client))
        assert await trio.to_thread.run_sync(handshake) == b"hi"
        await wait_until(lambda: log.read_text().count('"termination":') >= 4, 10)
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await process.wait() == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]  # all JSON
    assert answers == [b"\x15\x03\x03\x00\x02\x02\x70"] * 3  # unrecognized_name
    reason = "the ClientHello's server name is not ASCII: b'\\xff\\xfe\\xc3('"
    refused = [r for r in lines if r.get("termination") == "tls_error"]
    assert len(refused) == 3
    assert {r["detail"] for r in refused} == {reason}
    closing = [
        r["message"]
        for r in lines
        if r.get("logger") == "tlsedge.server" and "tls_error" in r["message"]
    ]
    assert len(closing) == 3
    assert all(m.endswith(f": tls_error: {reason}") for m in closing)
    assert not [r for r in lines if r.get("level") in {"ERROR", "CRITICAL"}]
