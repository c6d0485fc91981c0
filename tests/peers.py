"""Real peers for tests: HAProxy, nginx, curl, openssl from Debian's packages.

A test that needs a program calls ``require(name)``: it skips with a clear
reason when the program is missing, unless ``TLSEDGE_REQUIRE_PEERS=1`` (set by
``.ci/run`` after installing them), where a missing program fails the test.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["free_port", "haproxy", "nginx", "require", "wait_for_port"]

_STARTUP_TIMEOUT = 15.0

# Ports free_port() handed out in this process: two peers of one test must
# not get the same one.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago, for a peer started
    next, never one this process was given before. It is taken below the
    kernel's ephemeral range (as campaigns/common.py does): a port in that
    range can go to an outgoing connection before the peer binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral = int(ports.read().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, ephemeral - 12000), ephemeral)
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


def require(program: str) -> str:
    """The path of *program*; skip (or fail under TLSEDGE_REQUIRE_PEERS=1)."""
    path = shutil.which(program) or next(
        (p for p in (f"/usr/sbin/{program}", f"/sbin/{program}") if os.path.exists(p)),
        None,
    )
    if path is None:
        message = f"{program} is not installed (apt-get install {program})"
        if os.environ.get("TLSEDGE_REQUIRE_PEERS") == "1":
            pytest.fail(message + " but TLSEDGE_REQUIRE_PEERS=1")
        pytest.skip(message)
    return path


def wait_for_port(
    port: int,
    host: str = "127.0.0.1",
    *,
    process: subprocess.Popen[bytes] | None = None,
) -> None:
    """Block until something accepts on host:port (or the process died)."""
    deadline = time.monotonic() + _STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            out = (
                process.stdout.read().decode(errors="replace") if process.stdout else ""
            )
            raise RuntimeError(f"peer exited with {process.returncode}: {out}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port}")


@contextlib.contextmanager
def _process(
    args: list[str], ports: list[int], cwd: Path
) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        args,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        for port in ports:
            wait_for_port(port, process=process)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@contextlib.contextmanager
def haproxy(config: str, ports: list[int]) -> Iterator[subprocess.Popen[bytes]]:
    """Run HAProxy in the foreground with *config* until the block ends.

    *ports* are the frontend ports to wait for. A ``global``/``defaults``
    preamble with short timeouts is added unless *config* has its own.
    """
    binary = require("haproxy")
    if "defaults" not in config:
        config = (
            "global\n    maxconn 4096\n"
            "defaults\n    mode tcp\n    timeout connect 5s\n"
            "    timeout client 30s\n    timeout server 30s\n" + config
        )
    with tempfile.TemporaryDirectory(prefix="tlsedge-haproxy-") as tmp:
        path = Path(tmp, "haproxy.cfg")
        path.write_text(config)
        with _process([binary, "-db", "-f", str(path)], ports, Path(tmp)) as process:
            yield process


@contextlib.contextmanager
def nginx(body: str, ports: list[int]) -> Iterator[subprocess.Popen[bytes]]:
    """Run nginx in the foreground; *body* goes at the top level of nginx.conf
    (``stream { ... }`` and/or ``http { ... }``)."""
    binary = require("nginx")
    with tempfile.TemporaryDirectory(prefix="tlsedge-nginx-") as tmp:
        conf = Path(tmp, "nginx.conf")
        modules = (
            "load_module /usr/lib/nginx/modules/ngx_stream_module.so;\n"
            if "stream {" in body
            else ""
        )
        conf.write_text(
            modules + "daemon off;\nmaster_process off;\nworker_processes 1;\n"
            f"pid {tmp}/nginx.pid;\nerror_log {tmp}/error.log info;\n"
            "events { worker_connections 1024; }\n" + body
        )
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            Path(tmp, name).mkdir()
        with _process(
            [binary, "-p", tmp, "-c", str(conf), "-e", f"{tmp}/error.log"],
            ports,
            Path(tmp),
        ) as process:
            yield process
