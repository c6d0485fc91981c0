"""Shared helpers for the reliability campaigns: processes, /proc figures, output.

Every process a campaign starts goes through ``Procs``: its own process group
(so ``stop_all`` ends it and its children), niced, RLIMIT_NOFILE raised, output
in a log file in the campaign's work directory. ``python campaigns/common.py
echo PORT`` runs the echo backend the campaigns share.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import trio

__all__ = [
    "REPO",
    "Procs",
    "banner",
    "cpu_seconds",
    "fd_count",
    "free_port",
    "make_certificate",
    "out",
    "raise_nofile",
    "render_table",
    "rss_kib",
    "run_probe",
    "terminate_on_sigterm",
    "wait_port",
    "write_json",
]

REPO = Path(__file__).resolve().parents[1]


def out(*lines: str) -> None:
    """The campaigns' only way to print (figures go to stdout)."""
    for line in lines:
        print(line, flush=True)


def banner(title: str) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out(
        f"# {title}",
        f"date: {now}",
        f"python: {platform.python_version()}, {os.cpu_count()} CPUs, load {load}",
    )


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    return "\n".join(
        [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]
    )


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True))


# -- resources -------------------------------------------------------------------


def raise_nofile(wanted: int) -> int:
    """Raise this process' RLIMIT_NOFILE to *wanted* (root may raise the hard
    limit too); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def run_probe(script: Path, port: int, count: int) -> Any:
    """Run *script*'s ``--probe PORT COUNT`` mode (the normal client) in its own
    process; its JSON output."""
    result = subprocess.run(  # noqa: S603 (our own argv)
        [sys.executable, str(script), "--probe", str(port), str(count)],
        capture_output=True,
        check=True,
        timeout=300,
    )
    return json.loads(result.stdout)


def rss_kib(pid: int) -> int:
    """Resident set size of *pid* in KiB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time *pid* has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago, for a server started
    next. It is taken below the kernel's ephemeral range: a port in that
    range can be handed to an outgoing connection (the campaign's own
    clients, a server's upstream connections) before the server binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral = int(ports.read().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, ephemeral - 12000), ephemeral)  # noqa: S311
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


#: Ports `free_port` gave this process (a server may not have bound one yet).
_HANDED_OUT: set[int] = set()


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), 1),
        ):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what}: nothing listening on port {port}")


def make_certificate(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a leaf for "edge.test": (ca.pem, cert+chain.pem, key.pem);
    also ``edge.pem.full`` (cert and key in one file, for HAProxy)."""
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert("edge.test")
    ca_path, cert, key = (
        directory / "ca.pem",
        directory / "edge.pem",
        directory / "edge.key",
    )
    ca.cert_pem.write_to_path(str(ca_path))
    cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    key.write_bytes(leaf.private_key_pem.bytes())
    (directory / "edge.pem.full").write_bytes(cert.read_bytes() + key.read_bytes())
    return ca_path, cert, key


# -- processes ---------------------------------------------------------------------


def _child_setup(nofile: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child, before exec
        os.setpgrp()
        os.nice(10)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return setup


@dataclass
class Procs:
    """The processes a campaign started; ``stop_all`` ends every one."""

    workdir: Path
    running: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(
        self, name: str, argv: Sequence[str], *, nofile: int = 4096
    ) -> subprocess.Popen[bytes]:
        with (self.workdir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(  # noqa: S603 (our own argv)
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                preexec_fn=_child_setup(nofile),  # noqa: PLW1509 (no threads yet)
            )
        self.running.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of its group
        if proc in self.running:
            self.running.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.running)):
            self.stop(proc)

    def echo_backend(self, port: int, nofile: int) -> subprocess.Popen[bytes]:
        proc = self.start(
            f"echo-{port}",
            [sys.executable, str(Path(__file__).resolve()), "echo", str(port)],
            nofile=nofile,
        )
        wait_port(port, proc, "echo backend")
        return proc

    def tlsedge(
        self, name: str, toml: str, port: int, nofile: int
    ) -> subprocess.Popen[bytes]:
        path = self.workdir / f"{name}.toml"
        path.write_text(toml)
        proc = self.start(
            name,
            [
                sys.executable,
                "-m",
                "tlsedge",
                "--log-level",
                "warning",
                "run",
                str(path),
            ],
            nofile=nofile,
        )
        try:
            wait_port(port, proc, name)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}: {self.log(name)[-1500:]}") from exc
        return proc

    def haproxy(self, cfg: str, port: int, nofile: int) -> subprocess.Popen[bytes]:
        path = self.workdir / "haproxy.cfg"
        path.write_text(cfg)
        proc = self.start("haproxy", ["haproxy", "-db", "-f", str(path)], nofile=nofile)
        try:
            wait_port(port, proc, "haproxy")
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}: {self.log('haproxy')[-1500:]}") from exc
        return proc


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks clean up."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# -- the echo backend ---------------------------------------------------------------


async def _echo(stream: trio.SocketStream) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        while data := await stream.receive_some(65536):
            await stream.send_all(data)


async def _serve_echo(port: int) -> None:
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1", backlog=65535)
    await trio.serve_listeners(_echo, listeners)


if __name__ == "__main__":
    if sys.argv[1:2] == ["echo"]:
        raise_nofile(200_000)
        with contextlib.suppress(KeyboardInterrupt):
            trio.run(_serve_echo, int(sys.argv[2]))
