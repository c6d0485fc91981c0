"""The ``tlsedge`` command: in-process ``main()``, then real processes and signals."""

from __future__ import annotations

import contextlib
import gc
import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path

import pytest
import trio

from tests.peers import free_port, require
from tests.tlsedge.control.test_admin import scrape, total
from tests.tlsedge.helpers import Backend, exchange, read_all, wait_until
from tlsedge._control.cli import main
from tlsedge._control.run import GC_YOUNG_THRESHOLD, tune_gc
from tlsedge._version import __version__

ROOT = Path(__file__).resolve().parents[3]


def config_text(port: int, server: str, *, drain_timeout: float = 30.0) -> str:
    return (
        f"[edge]\ndrain_timeout = {drain_timeout}\n\n"
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n\n'
        f'[[backends]]\nname = "b"\nservers = ["{server}"]\n'
    )


GOOD = config_text(8443, "127.0.0.1:8080")


def echo_handler(name: str) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """Send *name*, then echo until EOF."""

    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(name.encode())
        while data := await stream.receive_some(65536):
            await stream.send_all(data)

    return handler


# -- in process -----------------------------------------------------------


def test_check_good_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(config_text(8443, "127.0.0.1:8080"))
    assert main(["check", str(path)]) == 0
    assert "OK (1 listeners, 1 backends)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "dotted"),
    [
        (
            config_text(8443, "127.0.0.1:8080").replace(
                'backend = "b"', 'backend = "x"'
            ),
            "listeners[0].backend",
        ),
        (
            GOOD + "\n[backends.health]\nkind = 'udp'\n",
            "backends[0].health.kind",
        ),
        ("[edge]\nworkers = 0\n", "edge.workers"),
    ],
)
def test_check_bad_config_exits_2_with_the_dotted_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, dotted: str
) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(text)
    assert main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"{path}: {dotted}:" in captured.err
    assert captured.out == ""


def test_check_missing_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nope.toml"
    assert main(["check", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"tlsedge: {path}: cannot read: No such file or directory\n"
    )


def test_check_warns_about_a_grpc_backend_behind_http_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(
        config_text(8443, "127.0.0.1:50051").replace(
            'backend = "b"', 'backend = "b"\nmode = "http"'
        )
    )
    assert main(["check", "--config-only", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"tlsedge: {path}: warning: backends[0]: 'b' ")
    assert "every call would get 502" in captured.err
    assert "OK (1 listeners, 1 backends)" in captured.out


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_file_that_is_not_toml_is_named_once(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    # It used to say "tlsedge: bad.toml: bad.toml: invalid TOML: ...".
    monkeypatch.chdir(tmp_path)
    Path("bad.toml").write_text("[edge\n")
    assert main([command, "bad.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tlsedge: bad.toml: invalid TOML: "), err
    assert err.count("bad.toml") == 1, err


def test_check_meets_what_run_would_meet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The cases: backends/test_preflight.py; here, how the CLI reports them.
    path = tmp_path / "edge.toml"
    path.write_text(
        GOOD
        + '[listeners.tls]\ncertificates = [{ cert = "gone.pem", key = "gone.key" }]\n'
    )
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"tlsedge: {path}: listeners[0].tls.certificates[0].cert: "
        f"{tmp_path}/gone.pem: cannot read the certificate: No such file or "
        "directory\n"
    )
    # --config-only: the file alone is fine.
    assert main(["check", "--config-only", str(path)]) == 0
    assert "OK (1 listeners, 1 backends)" in capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tlsedge {__version__}"


def test_python_dash_m_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tlsedge", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0
    for command in ("run", "check", "demo"):
        assert command in result.stdout


# -- real processes -----------------------------------------------------------


class EdgeProcess:
    """``python -m tlsedge ARGS`` with its stderr in a file."""

    def __init__(self, process: trio.Process, log: Path) -> None:
        self.process = process
        self.log = log

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait(self, within: float = 15.0) -> int:
        with trio.fail_after(within):
            return await self.process.wait()

    async def wait_for_log(self, text: str, within: float = 15.0) -> None:
        await wait_until(lambda: text in self.output, within, 0.05)

    async def wait_for_port(self, port: int) -> None:
        with trio.fail_after(20):
            while True:
                if self.process.returncode is not None:
                    raise AssertionError(
                        f"exited with {self.process.returncode}:\n{self.output}"
                    )
                try:
                    probe = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    await trio.sleep(0.05)
                    continue
                await probe.aclose()
                return


@contextlib.asynccontextmanager
async def tlsedge_process(*args: str, log: Path) -> AsyncIterator[EdgeProcess]:
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tlsedge", *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    try:
        yield EdgeProcess(process, log)
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


async def assert_refused(port: int) -> None:
    with (
        trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock,
        pytest.raises(ConnectionRefusedError),
    ):
        await sock.connect(("127.0.0.1", port))


async def wait_refused(port: int) -> None:
    with trio.fail_after(10):
        while True:
            try:
                await assert_refused(port)
            except (pytest.fail.Exception, ConnectionResetError):
                # Accepted, or queued by a listener that closed meanwhile
                # (the kernel resets what was still in its backlog): not yet.
                await trio.sleep(0.02)
                continue
            return


async def test_run_reloads_on_sighup(nursery: trio.Nursery, tmp_path: Path) -> None:
    one = await Backend(echo_handler("one")).start(nursery)
    two = await Backend(echo_handler("two")).start(nursery)
    port = free_port()
    path = tmp_path / "edge.toml"
    path.write_text(config_text(port, one.address))
    async with tlsedge_process("run", str(path), log=tmp_path / "log") as edge:
        await edge.wait_for_port(port)
        address = ("127.0.0.1", port)
        assert await exchange(address) == b"one"
        path.write_text(config_text(port, two.address))
        edge.signal(signal.SIGHUP)
        await edge.wait_for_log("configuration reloaded")
        assert await exchange(address) == b"two"
        path.write_text(config_text(port, "no-such-host.invalid:80"))
        edge.signal(signal.SIGHUP)
        await edge.wait_for_log("reload refused")
        assert await exchange(address) == b"two"
        path.write_text("this is = = not toml")
        edge.signal(signal.SIGHUP)
        await wait_until(lambda: edge.output.count("reload refused") == 2, 15, 0.05)
        assert await exchange(address, b"still") == b"twostill"
        edge.signal(signal.SIGTERM)
        assert await edge.wait() == 0


async def test_sighup_without_workers_moves_admin_and_access_log(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Issue 23: SIGHUP ignored edge.admin, edge.access_log and edge.workers
    # and logged "configuration reloaded" all the same.
    backend = await Backend(echo_handler("hi")).start(nursery)
    port, first_admin, moved_admin = free_port(), free_port(), free_port()
    path = tmp_path / "edge.toml"
    text = config_text(port, backend.address)
    path.write_text(
        text.replace("[edge]\n", f'[edge]\nadmin = "127.0.0.1:{first_admin}"\n')
    )
    access = tmp_path / "access.log"
    async with tlsedge_process("run", str(path), log=tmp_path / "log") as edge:
        await edge.wait_for_port(port)
        path.write_text(
            text.replace(
                "[edge]\n",
                f'[edge]\nadmin = "127.0.0.1:{moved_admin}"\n'
                'access_log = "access.log"\nworkers = 2\n',
            )
        )
        edge.signal(signal.SIGHUP)
        await edge.wait_for_log("configuration reloaded")
        # After the line (the reload is in force): wait_for_port's probe may
        # be accepted after the SIGHUP, and logged on stderr before the commit.
        reloaded_at = time.time()
        await wait_refused(first_admin)
        metrics = await scrape(("127.0.0.1", moved_admin))
        assert total(metrics, "tlsedge_config_last_reload_successful") == 0
        assert total(metrics, "tlsedge_config_reloads_total", result="partial") == 1
        assert 'workers="1"' in metrics  # one process: as it runs
        assert await exchange(("127.0.0.1", port)) == b"hi"
        await wait_until(lambda: access.exists() and access.read_text() != "", 10)
        edge.signal(signal.SIGTERM)
        assert await edge.wait() == 0
    lines = edge.output.splitlines()
    (pending,) = [line for line in lines if "needs a restart;" in line]
    assert " WARNING " in pending
    assert "edge.workers: 1 -> 2 needs a restart" in pending
    (reloaded,) = [line for line in lines if "configuration reloaded" in line]
    assert " WARNING " in reloaded
    assert "except what needs a restart (edge.workers)" in reloaded
    assert f'edge.admin: "127.0.0.1:{first_admin}" -> "127.0.0.1:{moved_admin}"' in (
        reloaded
    )
    assert '"listener":"in"' in access.read_text()
    # Only wait_for_port's probe, before the reload, may have a line on stderr.
    on_stderr = [
        json.loads(line[line.index("{") :])
        for line in lines
        if '"listener":"in"' in line
    ]
    assert all(
        datetime.fromisoformat(entry["start"]).timestamp() < reloaded_at
        for entry in on_stderr
    )


async def test_sigterm_drains_and_exits_0(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = await Backend(echo_handler("hi")).start(nursery)
    port = free_port()
    path = tmp_path / "edge.toml"
    path.write_text(config_text(port, backend.address))
    async with tlsedge_process("run", str(path), log=tmp_path / "log") as edge:
        await edge.wait_for_port(port)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        async with client:
            assert await client.receive_some(2) == b"hi"
            edge.signal(signal.SIGTERM)
            await wait_refused(port)  # the listener is closed ...
            await client.send_all(b"ping")  # ... the open connection goes on
            with trio.fail_after(5):
                assert await client.receive_some(4) == b"ping"
            assert edge.process.returncode is None
            await client.send_eof()
            assert await read_all(client) == b""
        assert await edge.wait() == 0
    assert "SIGTERM: draining" in edge.output
    assert '"termination":"client_closed"' in edge.output


async def test_second_sigterm_exits_at_once(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    backend = await Backend(echo_handler("hi")).start(nursery)
    port = free_port()
    path = tmp_path / "edge.toml"
    path.write_text(config_text(port, backend.address, drain_timeout=600.0))
    async with tlsedge_process("run", str(path), log=tmp_path / "log") as edge:
        await edge.wait_for_port(port)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        async with client:
            assert await client.receive_some(2) == b"hi"
            edge.signal(signal.SIGTERM)
            await edge.wait_for_log("SIGTERM: draining")
            edge.signal(signal.SIGTERM)
            assert await edge.wait(within=10) == 0
            with trio.fail_after(5):
                assert await read_all(client) == b""
    assert '"termination":"drained"' in edge.output


def three_free_ports() -> int:
    """A port P such that P, P + 1 and P + 2 were free a moment ago (ports in
    TIME_WAIT count as free: the demo binds with SO_REUSEADDR too).

    P is taken below the kernel's ephemeral range: ports in it are where
    outgoing connections land, and a benchmark or a busy test run leaves
    thousands of them in TIME_WAIT, which a listener cannot bind over."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral = int(ports.read().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, ephemeral - 12000), ephemeral - 3)
        with socket.socket() as a, socket.socket() as b, socket.socket() as c:
            try:
                for offset, sock in enumerate((a, b, c)):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
            return port
    raise AssertionError("no three adjacent free ports")


async def curl(*args: str) -> str:
    result = await trio.run_process(
        [require("curl"), "-sS", "--max-time", "10", *args],
        capture_stdout=True,
        capture_stderr=True,
    )
    return result.stdout.decode()


async def test_demo_answers_curl_direct_and_behind_a_proxy(tmp_path: Path) -> None:
    require("curl")
    port = three_free_ports()
    log = tmp_path / "log"
    async with tlsedge_process("demo", "--port", str(port), log=log) as demo:
        for p in (port, port + 1, port + 2):
            await demo.wait_for_port(p)
        await demo.wait_for_log("--cacert ")  # printed once listening
        ca = re.search(r"--cacert (\S+)", log.read_text())
        assert ca is not None
        tls = ["--cacert", ca.group(1)]
        direct = await curl(
            *tls,
            "--resolve",
            f"localhost:{port}:127.0.0.1",
            f"https://localhost:{port}/direct",
        )
        lb = port + 1
        proxied = await curl(
            *tls,
            "--haproxy-protocol",
            "--resolve",
            f"localhost:{lb}:127.0.0.1",
            f"https://localhost:{lb}/lb",
        )
        plain = await curl(f"http://127.0.0.1:{port + 2}/plain")
        demo.signal(signal.SIGTERM)
        assert await demo.wait() == 0
    assert "tlsedge demo backend" in direct
    assert "PROXY header:  v2 PROXY INET/STREAM" in direct
    assert "b'GET /direct HTTP/1.1'" in direct
    assert "TLS (SSL TLV): TLSv1.3" in direct
    assert "TLV AUTHORITY: b'localhost'" in direct
    assert "b'GET /lb HTTP/1.1'" in proxied
    # curl's own PROXY v1 header reached the edge; the backend got our v2.
    assert "PROXY header:  v2 PROXY INET/STREAM" in proxied
    assert "real client:         127.0.0.1:" in proxied
    assert "b'GET /plain HTTP/1.1'" in plain
    assert "TLS (SSL TLV)" not in plain


def test_check_opens_the_access_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.toml"
    path.write_text(
        GOOD.replace("[edge]\n", '[edge]\naccess_log = "no-such-dir/access.log"\n')
    )
    assert main(["check", str(path)]) == 2
    assert (
        f"tlsedge: {path}: edge.access_log: cannot open "
        f"{tmp_path}/no-such-dir/access.log: No such file or directory"
    ) in capsys.readouterr().err
    (tmp_path / "no-such-dir").mkdir()
    assert main(["check", str(path)]) == 0


# -- start-up errors: one line, exit 2, with one process or several -----------

START_FAILURES = ["port in use", "missing certificate", "unresolvable host"]


def start_failure(case: str, port: int, folder: Path) -> tuple[str, str]:
    """A configuration that fails at start in *case*, and its message."""
    listener = f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n'
    backend = '[[backends]]\nname = "b"\nservers = ["127.0.0.1:9"]\n'
    if case == "port in use":
        message = (
            f"listeners[0].bind: cannot bind 127.0.0.1:{port}: Address already in use"
        )
        return listener + backend, message
    if case == "missing certificate":
        tls = (
            "[listeners.tls]\n"
            'certificates = [{ cert = "gone.pem", key = "gone.key" }]\n'
        )
        message = (
            f"listeners[0].tls.certificates[0].cert: {folder}/gone.pem: cannot read "
            "the certificate: No such file or directory"
        )
        return listener + tls + backend, message
    assert case == "unresolvable host"
    backend = backend.replace("127.0.0.1:9", "nonexistent.invalid:80")
    message = (
        "backends[0].servers[0]: host 'nonexistent.invalid' of backend 'b' does "
        "not resolve: "
    )
    return listener + backend, message


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("case", START_FAILURES)
async def test_run_start_failure_is_one_line_and_exit_2(
    tmp_path: Path, case: str, workers: int
) -> None:
    with trio.socket.socket() as taken:
        await taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1] if case == "port in use" else free_port()
        text, message = start_failure(case, port, tmp_path)
        path = tmp_path / "edge.toml"
        path.write_text(f"[edge]\nworkers = {workers}\n\n{text}")
        # Not a timing assertion: a supervisor that restarts its failing
        # workers forever would hang here without it.
        with trio.fail_after(30):
            result = await trio.run_process(
                [sys.executable, "-m", "tlsedge", "run", str(path)],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr
    naming = [
        line
        for line in stderr.splitlines()
        if "listeners[" in line or "backends[" in line
    ]
    assert len(naming) == 1, stderr
    assert naming[0].startswith(f"tlsedge: {path}: {message}"), stderr
    assert "restarting" not in stderr


def test_tune_gc_freezes_startup_and_spaces_young_collections() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
