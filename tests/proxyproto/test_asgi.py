"""The ``--proxy-*`` options of ``python -m proxyproto.uvicorn`` and
``python -m proxyproto.hypercorn`` (proxyproto._asgi), run as real commands.

Loopback is 127.0.0.0/8 on Linux: connecting from 127.0.0.2 gives the server
a peer that the default trust (127.0.0.1 and ::1) does not cover.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.peers import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 10.0
V1_HEADER = b"PROXY TCP4 192.0.2.1 198.51.100.2 1234 443\r\n"
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answer with the client address the server reports."""
    if scope["type"] != "http":
        return
    body = json.dumps(scope["client"]).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


SERVERS = {
    "uvicorn": ["--host", "127.0.0.1", "--port", "{port}", "--lifespan", "off"],
    "hypercorn": ["--bind", "127.0.0.1:{port}"],
}


@pytest.fixture(params=sorted(SERVERS))
def server(request: pytest.FixtureRequest) -> str:
    pytest.importorskip(request.param, reason=f"{request.param} is not installed")
    return str(request.param)


def command(server: str, *args: str, port: int = 0) -> list[str]:
    options = [arg.format(port=port) for arg in SERVERS[server]]
    return [
        sys.executable,
        "-m",
        f"proxyproto.{server}",
        "tests.proxyproto.test_asgi:app",
        *options,
        *args,
    ]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROXYPROTO_TRUSTED"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def request_from(source: str, port: int) -> bytes:
    """Send a v1 header and a request from *source*; what the server answered
    (b"" if it closed the connection)."""
    with socket.socket() as sock:
        sock.settimeout(TIMEOUT)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", port))
        answer = b""
        try:
            sock.sendall(V1_HEADER + REQUEST)
            while chunk := sock.recv(65536):
                answer += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
    return answer


@contextmanager
def serving(server: str, *args: str, env: dict[str, str]) -> Iterator[int]:
    """Run the command line; yield its port once it accepts connections."""
    port = free_port()
    process = subprocess.Popen(
        command(server, *args, port=port),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, (
                process.stderr.read() if process.stderr else ""
            )
            assert time.monotonic() < deadline, "the server did not start"
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


def served(answer: bytes) -> bool:
    if not answer:
        return False
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert answer.endswith(b'["192.0.2.1", 1234]'), answer
    return True


@pytest.mark.parametrize(
    ("args", "env", "trusted", "refused"),
    [
        pytest.param(
            ["--proxy-trusted", "192.0.2.0/24, 127.0.0.2"],
            {},
            "127.0.0.2",
            "127.0.0.1",
            id="comma-list",
        ),
        pytest.param(
            ["--proxy-trusted", "192.0.2.0/24", "--proxy-trusted", "127.0.0.2/32"],
            {},
            "127.0.0.2",
            "127.0.0.1",
            id="repeated",
        ),
        pytest.param(
            [], {"PROXYPROTO_TRUSTED": "127.0.0.2,::1"}, "127.0.0.2", "127.0.0.1",
            id="environment",
        ),
        pytest.param(
            ["--proxy-trusted", "127.0.0.1"],
            {"PROXYPROTO_TRUSTED": "127.0.0.2"},
            "127.0.0.1",
            "127.0.0.2",
            id="option-over-environment",
        ),
        pytest.param([], {}, "127.0.0.1", "127.0.0.2", id="default"),
    ],
)  # fmt: skip
def test_trusted_peers(
    server: str, args: list[str], env: dict[str, str], trusted: str, refused: str
) -> None:
    with serving(server, *args, env=environment(**env)) as port:
        assert served(request_from(trusted, port))
        assert not served(request_from(refused, port))


@pytest.mark.parametrize(
    ("args", "env"),
    [
        pytest.param(["--proxy-trusted", "*"], {}, id="option"),
        pytest.param([], {"PROXYPROTO_TRUSTED": "*"}, id="environment"),
    ],
)
def test_trusted_star_is_every_peer(
    server: str, args: list[str], env: dict[str, str]
) -> None:
    with serving(server, *args, env=environment(**env)) as port:
        assert served(request_from("127.0.0.1", port))
        assert served(request_from("127.0.0.3", port))


def usage_error(server: str, *args: str, **env: str) -> str:
    """Run the command, which must fail with a usage error; its last line."""
    result = subprocess.run(
        command(server, *args, port=free_port()),
        cwd=ROOT,
        env=environment(**env),
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("usage: "), result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"python -m proxyproto.{server}: error: "), last
    return last.split(": error: ", 1)[1]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("10.0.0.0/8,bogus", "got 'bogus' in '10.0.0.0/8,bogus' ("),
        ("10.0.0.1/8", "got '10.0.0.1/8' (10.0.0.1/8 has host bits set)"),
        ("", "got '' ("),
        ("10.0.0.0/8,", "got '' in '10.0.0.0/8,' ("),
    ],
)
def test_bad_trusted_value_is_a_usage_error(
    server: str, value: str, message: str
) -> None:
    error = usage_error(server, "--proxy-trusted", value)
    assert error.startswith(
        "argument --proxy-trusted: expected IP addresses or networks (CIDR) "
        "separated by commas, or '*', "
    ), error
    assert message in error
    error = usage_error(server, PROXYPROTO_TRUSTED=value)
    assert error.startswith("environment variable PROXYPROTO_TRUSTED: expected "), error
    assert message in error


def test_bad_timeout_is_a_usage_error(server: str) -> None:
    error = usage_error(server, "--proxy-timeout", "0")
    assert error == "argument --proxy-timeout: expected seconds > 0, got '0'"


@pytest.mark.parametrize("workers", ["4", "-1"])
def test_hypercorn_workers_is_a_usage_error(workers: str) -> None:
    pytest.importorskip("hypercorn", reason="hypercorn is not installed")
    error = usage_error("hypercorn", "--workers", workers)
    assert error == (
        "argument -w/--workers: proxyproto.hypercorn runs one worker per process, "
        f"got {workers}; run several processes with SO_REUSEPORT binds instead"
    )


def test_hypercorn_worker_class_is_a_usage_error() -> None:
    pytest.importorskip("hypercorn", reason="hypercorn is not installed")
    error = usage_error("hypercorn", "--worker-class", "gevent")
    assert error == (
        "argument -k/--worker-class: expected asyncio, uvloop or trio, got 'gevent'"
    )
