"""``edge.workers = N``: a supervisor and N worker processes on one port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.peers import free_port
from tests.tlsedge.helpers import (
    Backend,
    exchange,
    read_all,
    tag_handler,
    wait_until,
)
from tlsedge._cli import main

ROOT = Path(__file__).resolve().parents[2]


def config_text(port: int, server: str, workers: int = 2) -> str:
    return (
        f"[edge]\nworkers = {workers}\n\n"
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n\n'
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

        # SIGHUP to the supervisor reloads every worker.
        other = await Backend(tag_handler("new", hold=True)).start(nursery)
        path.write_text(config_text(port, other.address))
        process.send_signal(signal.SIGHUP)
        await wait_until(
            lambda: log.read_text().count("configuration reloaded") == 2, 20
        )
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


async def test_a_worker_that_cannot_restart_stops_the_edge(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Gunicorn's rule: a worker that fails to boot stops the arbiter, rather
    # than being restarted every second with the same error.
    backend = await Backend(tag_handler("hi", hold=True)).start(nursery)
    port = free_port()
    path = tmp_path / "edge.toml"
    path.write_text(config_text(port, backend.address))
    log = tmp_path / "log"
    async with supervisor(path, log) as process:
        await wait_until(lambda: log.read_text().count("listener in on") == 2, 20)
        workers = children(process.pid)
        assert await serve_one(port) == b"hi"
        path.write_text(config_text(port, "nonexistent.invalid:80"))
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        # Not a timing assertion: without the rule this never ends.
        with trio.fail_after(30):
            assert await process.wait() == 2
    # The other worker was stopped, not left behind.
    assert not workers & {int(pid) for pid in os.listdir("/proc") if pid.isdigit()}
    text = log.read_text()
    assert "Traceback" not in text
    (line,) = [line for line in text.splitlines() if "backends[0]" in line]
    assert line.startswith(
        f"tlsedge: {path}: backends[0].servers[0]: host 'nonexistent.invalid'"
    )


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
