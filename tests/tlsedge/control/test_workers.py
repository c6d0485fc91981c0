"""``edge.workers = N``: a supervisor and N worker processes on one port."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.peers import free_port
from tests.tlsedge.control.test_admin import http_get, scrape, total
from tests.tlsedge.helpers import (
    Backend,
    exchange,
    read_all,
    tag_handler,
    wait_until,
)
from tlsedge._control.cli import main
from tlsedge._control.worker_link import (
    Committed,
    Link,
    Message,
    Prepare,
    Prepared,
    Settle,
)
from tlsedge._control.workers import _Supervisor, _Worker
from tlsedge._core.config import parse_config
from tlsedge._core.metrics import multiprocess_directory

ROOT = Path(__file__).resolve().parents[3]


def config_text(
    port: int, server: str, workers: int = 2, *, edge: str = "", listener: str = ""
) -> str:
    """Listener ``in`` on *port* in front of *server*; *edge* and *listener*
    are more lines of the ``[edge]`` table and after the listener's."""
    return (
        f"[edge]\nworkers = {workers}\n{edge}\n"
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n'
        f"{listener}\n"
        f'[[backends]]\nname = "b"\nservers = ["{server}"]\n'
    )


def children(pid: int) -> set[int]:
    """The live child processes of *pid* (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after ")".
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry))
    return found


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.asynccontextmanager
async def supervisor(config: Path, log: Path) -> AsyncIterator[trio.Process]:
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tlsedge", "run", str(config)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    try:
        yield process
    finally:
        if process.returncode is None:
            for child in children(process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def serve_one(port: int, within: float = 20.0) -> bytes:
    """One exchange with the edge, retried until a worker answers."""
    with trio.fail_after(within):
        while True:
            try:
                return await exchange(("127.0.0.1", port))
            except (OSError, trio.BrokenResourceError):
                # Refused, or reset: queued on a worker that just died.
                await trio.sleep(0.05)


async def test_two_workers_share_the_port_and_a_dead_one_is_replaced(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    port = free_port()
    path = tmp_path / "edge.toml"
    path.write_text(config_text(port, backend.address))
    log = tmp_path / "log"
    async with supervisor(path, log) as process:
        assert await serve_one(port) == b"hi"
        await wait_until(lambda: len(children(process.pid)) == 2, 20, 0.05)
        workers = children(process.pid)
        await wait_until(lambda: "listener in on" in log.read_text(), 20, 0.05)
        await wait_until(lambda: log.read_text().count("listener in on") == 2, 20)
        before = {pid: open_fds(pid) for pid in workers}
        # Connections from one client spread over both workers (SO_REUSEPORT
        # hashes the source port): each open connection holds descriptors in
        # the worker that serves it. All 16 in one worker: p = 2 ** -15.
        clients = []
        for _ in range(16):
            client = await trio.open_tcp_stream("127.0.0.1", port)
            clients.append(client)
            assert await client.receive_some(2) == b"hi"
        grew = {pid for pid in workers if open_fds(pid) > before[pid]}
        for client in clients:
            await client.aclose()
        assert grew == workers

        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        assert await serve_one(port) == b"hi"  # the other worker goes on
        await wait_until(
            lambda: (
                len(children(process.pid) - {victim}) == 2
                and victim not in children(process.pid)
            ),
            20,
            0.05,
        )
        await wait_until(lambda: log.read_text().count("listener in on") == 3, 20)
        assert await serve_one(port) == b"hi"

        # SIGHUP to the supervisor reloads every worker (one log line).
        other = await Backend(tag_handler("new", hold=True)).start(nursery)
        path.write_text(config_text(port, other.address))
        process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "configuration reloaded" in log.read_text(), 20)
        assert {await serve_one(port) for _ in range(8)} == {b"new"}

        # SIGTERM to the supervisor drains every worker, then it exits 0.
        held = await trio.open_tcp_stream("127.0.0.1", port)
        async with held:
            assert await held.receive_some(3) == b"new"
            process.send_signal(signal.SIGTERM)
            await wait_until(
                lambda: log.read_text().count("SIGTERM: draining") == 2, 20
            )
            with trio.fail_after(5):
                await held.send_eof()
                assert await read_all(held) == b""
        with trio.fail_after(20):
            assert await process.wait() == 0
    text = log.read_text()
    assert "worker 0 (pid" in text
    assert "worker 1 (pid" in text
    assert "died with -9; restarting" in text


def test_port_zero_with_workers_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(config_text(0, "127.0.0.1:9"))
    assert main(["run", str(path)]) == 2
    assert f"{path}: listeners[0].bind: port 0 with edge.workers = 2" in (
        capsys.readouterr().err
    )
    assert main(["check", str(path)]) == 2  # check says what run would say


async def wait_started(log: Path, count: int) -> None:
    """Until *count* workers in all bound their listener (starts and restarts)."""
    await wait_until(lambda: log.read_text().count("listener in on") >= count, 30)


async def answers(port: int, count: int = 16) -> set[bytes]:
    """What *count* connections got (from both workers: SO_REUSEPORT spreads
    them by source port)."""
    return {await serve_one(port) for _ in range(count)}


async def test_a_respawned_worker_runs_the_running_configuration(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Issue 23: a worker restarted after a crash read the file on disk, so
    # an edited file (no SIGHUP) split the edge between two configurations,
    # and a typo in it took the whole edge down.
    old = await Backend(tag_handler("old")).start(nursery)
    new = await Backend(tag_handler("new")).start(nursery)
    port = free_port()
    path = tmp_path / "edge.toml"
    path.write_text(config_text(port, old.address))
    log = tmp_path / "log"
    async with supervisor(path, log) as process:
        await wait_started(log, 2)
        path.write_text(config_text(port, new.address))  # no SIGHUP
        os.kill(min(children(process.pid)), signal.SIGKILL)
        await wait_started(log, 3)
        assert await answers(port) == {b"old"}

        path.write_text(config_text(port, old.address) + "workers = = 2\n")
        os.kill(min(children(process.pid)), signal.SIGKILL)
        await wait_started(log, 4)
        assert process.returncode is None
        assert await answers(port) == {b"old"}
        assert "Traceback" not in log.read_text()

        # Only SIGHUP changes it: refused once (not once per worker) ...
        process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "reload refused" in log.read_text(), 20)
        assert await answers(port) == {b"old"}
        # ... not a SIGHUP sent to one worker: the supervisor's only ...
        path.write_text(config_text(port, new.address))
        os.kill(min(children(process.pid)), signal.SIGHUP)
        await wait_until(lambda: "SIGHUP to a worker is ignored" in log.read_text(), 20)
        assert await answers(port) == {b"old"}
        # ... and applied everywhere once the file is right.
        process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "configuration reloaded" in log.read_text(), 20)
        assert await answers(port) == {b"new"}
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await process.wait() == 0
    text = log.read_text()
    (refused,) = [line for line in text.splitlines() if "reload refused" in line]
    assert " ERROR " in refused
    assert f"{path}: invalid TOML" in refused
    assert text.count("configuration reloaded") == 1


async def test_a_worker_that_cannot_restart_is_retried_while_the_others_serve(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # What a restart still reads from disk (here the access log's folder)
    # can fail: the edge goes on with the other worker and tries again,
    # rather than stopping (the rule for a worker that cannot start when
    # the edge starts, test_cli's start failures).
    backend = await Backend(tag_handler("hi")).start(nursery)
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    path = tmp_path / "edge.toml"
    path.write_text(
        config_text(port, backend.address, edge='access_log = "logs/access.log"')
    )
    log = tmp_path / "log"
    async with supervisor(path, log) as process:
        await wait_started(log, 2)
        (logs / "access.log").unlink()
        logs.rmdir()
        os.kill(min(children(process.pid)), signal.SIGKILL)
        await wait_until(lambda: "cannot start: edge.access_log" in log.read_text(), 20)
        assert process.returncode is None
        assert await serve_one(port) == b"hi"  # the other worker
        logs.mkdir()
        await wait_started(log, 3)
        assert await answers(port) == {b"hi"}
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await process.wait() == 0
    line = next(
        line
        for line in log.read_text().splitlines()
        if "cannot start: edge.access_log" in line
    )
    assert " ERROR " in line
    assert "No such file or directory; trying again in 1 s" in line


async def test_sigterm_during_a_restart_pause_does_not_restart(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = await Backend(tag_handler("hi")).start(nursery)
    port = free_port()
    path = tmp_path / "edge.toml"
    path.write_text(config_text(port, backend.address))
    log = tmp_path / "log"
    async with supervisor(path, log) as process:
        await wait_until(lambda: log.read_text().count("listener in on") == 2, 20)
        victim = min(children(process.pid))
        os.kill(victim, signal.SIGKILL)
        await wait_until(lambda: "died with -9" in log.read_text(), 10)
        process.send_signal(signal.SIGTERM)  # within the restart pause
        with trio.fail_after(10):
            assert await process.wait() == 0
    text = log.read_text()
    assert text.count("started (pid") == 2, text  # no third worker


async def wait_refused(port: int) -> None:
    """Until nothing listens on *port* (a closing listener may still reset
    what was in its backlog)."""
    with trio.fail_after(20):
        while True:
            try:
                probe = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                return
            await probe.aclose()
            await trio.sleep(0.05)


def reload_series(text: str) -> tuple[float, ...]:
    """The reload series of a /metrics body: successful, timestamp, and the
    count of each result."""
    return (
        total(text, "tlsedge_config_last_reload_successful"),
        total(text, "tlsedge_config_last_reload_timestamp_seconds"),
        *(
            total(text, "tlsedge_config_reloads_total", result=result)
            for result in ("applied", "partial", "refused")
        ),
    )


def worker_info(text: str) -> dict[str, str]:
    """The labels of ``tlsedge_worker_info``: the worker that answered."""
    for family in text_string_to_metric_families(text):
        if family.name == "tlsedge_worker_info":
            return dict(family.samples[0].labels)
    raise AssertionError("no tlsedge_worker_info")


async def test_sighup_applies_workers_admin_and_access_log(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Issue 23: these three were ignored by SIGHUP, and the log said
    # "configuration reloaded" (once per worker).
    backend = await Backend(tag_handler("hi")).start(nursery)
    port, first_admin, moved_admin = free_port(), free_port(), free_port()
    path = tmp_path / "edge.toml"
    path.write_text(
        config_text(port, backend.address, edge=f'admin = "127.0.0.1:{first_admin}"')
    )
    log = tmp_path / "log"
    access = tmp_path / "access.log"
    moved = f'admin = "127.0.0.1:{moved_admin}"\naccess_log = "access.log"\n'
    async with supervisor(path, log) as process:
        await wait_started(log, 2)
        path.write_text(config_text(port, backend.address, workers=3, edge=moved))
        process.send_signal(signal.SIGHUP)
        await wait_until(lambda: len(children(process.pid)) == 3, 30, 0.05)
        await wait_started(log, 3)
        await wait_refused(first_admin)  # no worker left on the old port
        text = await scrape(("127.0.0.1", moved_admin))
        assert worker_info(text)["workers"] == "3"
        assert reload_series(text)[0] == 1
        assert reload_series(text)[2:] == (1, 0, 0)
        assert await answers(port, 8) == {b"hi"}
        await wait_until(
            lambda: access.exists() and len(access.read_text().splitlines()) == 8, 20
        )
        assert '"listener":"in"' not in log.read_text()  # not on stderr now

        # Fewer workers, and a key that waits for a restart.
        path.write_text(
            config_text(
                port,
                backend.address,
                workers=1,
                edge=moved + 'log_format = "json"\n',
            )
        )
        process.send_signal(signal.SIGHUP)
        await wait_until(lambda: len(children(process.pid)) == 1, 30, 0.05)
        text = await scrape(("127.0.0.1", moved_admin))
        assert worker_info(text)["workers"] == "1"
        assert reload_series(text)[0] == 0  # the file is not all in force
        assert reload_series(text)[2:] == (1, 1, 0)
        assert await serve_one(port) == b"hi"
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await process.wait() == 0
    lines = log.read_text().splitlines()
    reloaded = [line for line in lines if "configuration reloaded" in line]
    assert len(reloaded) == 2
    assert " INFO " in reloaded[0]
    assert f'edge.admin: "127.0.0.1:{first_admin}" -> ' in reloaded[0]
    assert "edge.workers: 2 -> 3" in reloaded[0]
    assert " WARNING " in reloaded[1]
    assert "except what needs a restart (edge.log_format)" in reloaded[1]
    (pending,) = [line for line in lines if "needs a restart;" in line]
    assert " WARNING " in pending
    assert 'edge.log_format: "text" -> "json" needs a restart' in pending
    assert sum("retired: draining" in line for line in lines) == 2
    assert not any(line.startswith("{") for line in lines)  # still text


async def test_a_refused_reload_changes_no_worker_and_every_worker_reports_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = await Backend(tag_handler("hi")).start(nursery)
    port, admin_port, other_admin = free_port(), free_port(), free_port()
    admin = ("127.0.0.1", admin_port)
    path = tmp_path / "edge.toml"
    running = config_text(
        port, backend.address, edge=f'admin = "127.0.0.1:{admin_port}"'
    )
    path.write_text(running)
    log = tmp_path / "log"
    async with supervisor(path, log) as process:
        await wait_started(log, 2)
        started = reload_series(await scrape(admin))
        assert started[0] == 1
        assert started[2:] == (0, 0, 0)

        # A certificate that does not load, with the admin endpoint moved.
        (tmp_path / "bad.pem").write_text("not a certificate\n")
        path.write_text(
            config_text(
                port,
                backend.address,
                edge=f'admin = "127.0.0.1:{other_admin}"',
                listener="[listeners.tls]\n"
                'certificates = [{ cert = "bad.pem", key = "bad.pem" }]\n',
            )
        )
        process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "reload refused" in log.read_text(), 20)
        # A new listener on a port another program holds: each worker binds
        # it while preparing; none may keep the new configuration.
        with trio.socket.socket() as taken:
            await taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            taken_port = taken.getsockname()[1]
            path.write_text(
                running
                + f'\n[[listeners]]\nname = "more"\nbind = "127.0.0.1:{taken_port}"'
                '\nbackend = "b"\n'
            )
            process.send_signal(signal.SIGHUP)
            await wait_until(lambda: log.read_text().count("reload refused") == 2, 20)
        assert await answers(port) == {b"hi"}  # plain TCP: no TLS listener
        await wait_refused(other_admin)
        pids = set()
        seen = set()
        for _ in range(16):  # both workers answer some (by source port)
            text = await scrape(admin)
            pids.add(worker_info(text)["pid"])
            seen.add(reload_series(text))
        assert pids == {str(pid) for pid in children(process.pid)}
        (series,) = seen  # one value for the edge, whichever worker answers
        assert series[0] == 0
        assert series[1] > started[1]
        assert series[2:] == (0, 0, 2)
        status = (await http_get(admin, "/status")).text
        assert '<span class="badge bad">REFUSED</span>' in status
        assert f"cannot bind 127.0.0.1:{taken_port}: Address already in use" in status
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            assert await process.wait() == 0
    lines = log.read_text().splitlines()
    refused = [line for line in lines if "reload refused" in line]
    assert len(refused) == 2, refused  # once each, not once per worker
    assert all(" ERROR " in line for line in refused)
    assert "listeners[0].tls.certificates[0].cert: " in refused[0]
    assert f"listeners[1].bind: cannot bind 127.0.0.1:{taken_port}" in refused[1]


@dataclass
class LinkedWorker:
    """A supervisor whose one worker is the test: the worker's end of the
    link, and what the supervisor reads as the worker's answers."""

    supervisor: _Supervisor
    end: Link
    answers: trio.MemorySendChannel[Message]


@contextlib.asynccontextmanager
async def linked_supervisor(tmp_path: Path) -> AsyncIterator[LinkedWorker]:
    """A `LinkedWorker`; the supervisor's tasks run in its nursery."""
    path = tmp_path / "edge.toml"
    text = config_text(free_port(), "127.0.0.1:9", workers=1)
    path.write_text(text)
    with multiprocess_directory() as metrics_dir:
        supervisor = _Supervisor(
            [],
            config_path=str(path),
            text=text,
            config=parse_config(text, str(path)),
            log_format="text",
            metrics_dir=metrics_dir,
        )
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        answers_in, answers = trio.open_memory_channel[Message](math.inf)
        link = Link(ours)
        worker = _Worker(0, link=link, answers=answers)
        supervisor.running.add(worker)
        supervisor.workers[0] = worker
        async with Link(theirs) as end, link, trio.open_nursery() as nursery:
            supervisor.nursery = nursery
            yield LinkedWorker(supervisor, end, answers_in)


async def test_a_stop_while_workers_prepare_abandons_the_reload_unrefused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGHUP then SIGTERM: the workers exit instead of answering the
    reload; that is no refusal (no ERROR line, the record unchanged), and
    the reload is aborted in every worker that was asked."""
    caplog.set_level(logging.INFO, logger="tlsedge.workers")
    async with linked_supervisor(tmp_path) as linked:
        supervisor = linked.supervisor
        before = supervisor.reloads
        assert supervisor.nursery is not None
        supervisor.nursery.start_soon(supervisor.reload)
        assert isinstance(await linked.end.receive(), Prepare)
        supervisor.stopping = True  # SIGTERM, forwarded
        linked.answers.close()  # the worker's link closed as it exited
        settle = await linked.end.receive()
    assert isinstance(settle, Settle)
    assert not settle.commit
    assert supervisor.reloads == before
    assert "reload refused" not in caplog.text
    assert "reload abandoned: stopping" in caplog.text


async def test_a_reload_is_logged_once_every_worker_committed_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ "configuration reloaded" means in force: logged once every worker
    answered `Committed` (it was logged before the commits went out, and a
    client could still meet the old configuration after the line)."""
    caplog.set_level(logging.INFO, logger="tlsedge")
    async with linked_supervisor(tmp_path) as linked:
        supervisor = linked.supervisor
        assert supervisor.nursery is not None
        supervisor.nursery.start_soon(supervisor.reload)
        prepare = await linked.end.receive()
        assert isinstance(prepare, Prepare)
        linked.answers.send_nowait(Prepared(prepare.serial))
        settle = await linked.end.receive()
        assert isinstance(settle, Settle)
        assert settle.commit
        await trio.sleep(0.1)
        assert "configuration reloaded" not in caplog.text
        linked.answers.send_nowait(Committed(prepare.serial))
    assert "configuration reloaded: 1 listeners, 1 backends" in caplog.text


def running(pid: int) -> bool:
    """Whether process *pid* runs (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_workers_drain_and_exit_when_the_supervisor_dies(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Orphans would serve on with nobody to restart or reload them, and hold
    # the ports against the next supervisor's workers.
    backend = await Backend(tag_handler("hi")).start(nursery)
    port = free_port()
    path = tmp_path / "edge.toml"
    path.write_text(config_text(port, backend.address))
    log = tmp_path / "log"
    async with supervisor(path, log) as process:
        await wait_started(log, 2)
        workers = children(process.pid)
        try:
            process.kill()
            await process.wait()
            await wait_until(lambda: not any(running(pid) for pid in workers), 20, 0.05)
        finally:
            for pid in workers:
                if running(pid):
                    os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert text.count("the supervisor is gone; draining") == 2
    assert text.count("all connections closed; stopped") == 2
