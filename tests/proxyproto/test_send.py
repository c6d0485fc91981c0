"""``proxyproto send HOST:PORT``: a header, a request, the answer.

Run as a command (``python -m proxyproto send``) against proxyproto's trio
adapter and HAProxy with ``accept-proxy``, plain and with TLS after the
header.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.peers import free_port
from tests.proxyproto.client_peers import TrioReceiver, haproxy_receiver, tls_files


async def send(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "proxyproto", "send", *args],
        stdin=stdin,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


def body(answer: bytes) -> dict[str, object]:
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK"), answer
    result: dict[str, object] = json.loads(payload)
    return result


async def test_default_header_names_the_connection(nursery: trio.Nursery) -> None:
    receiver = TrioReceiver()
    port = await receiver.start(nursery)
    result = await send(f"127.0.0.1:{port}", "--get", "/", "--wait", "0.5")
    assert result.returncode == 0, result.stderr
    answer = body(result.stdout)
    assert answer["version"] == 2
    assert answer["destination"] == ["127.0.0.1", port]
    assert result.stderr == b""


async def test_v1_source_and_stdin_request(nursery: trio.Nursery) -> None:
    receiver = TrioReceiver()
    port = await receiver.start(nursery)
    result = await send(
        f"127.0.0.1:{port}",
        "--version",
        "1",
        "--source",
        "203.0.113.7:5555",
        "--destination",
        "192.0.2.1:443",
        "--wait",
        "0.5",
        stdin=b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    assert result.returncode == 0, result.stderr
    answer = body(result.stdout)
    assert answer["source"] == ["203.0.113.7", 5555]
    assert answer["destination"] == ["192.0.2.1", 443]
    assert answer["version"] == 1


async def test_tls_after_the_header_and_verbose(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    files = tls_files(tmp_path)
    receiver = TrioReceiver(tls=files.server_context())
    port = await receiver.start(nursery)
    result = await send(
        f"127.0.0.1:{port}",
        "--source",
        "203.0.113.7:5555",
        "--authority",
        "example.com",
        "--crc32c",
        "--tls",
        "--cacert",
        str(files.ca_pem),
        "--get",
        "/",
        "--wait",
        "0.5",
        "-v",
    )
    assert result.returncode == 0, result.stderr
    answer = body(result.stdout)
    assert answer["authority"] == "example.com"
    assert answer["crc32c"] is True
    verbose = result.stderr.decode()
    assert verbose.startswith(
        f"proxyproto send: sent v2 PROXY 203.0.113.7:5555 -> 127.0.0.1:{port}, "
        f"TLVs AUTHORITY CRC32C ("
    )
    assert ", TLS (TLSv1.3), " in verbose
    assert verbose.endswith("bytes, then the server stayed silent for 0.5 s\n")


async def test_an_unverified_certificate_is_an_error(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    receiver = TrioReceiver(tls=tls_files(tmp_path).server_context())
    port = await receiver.start(nursery)
    result = await send(f"127.0.0.1:{port}", "--tls", "--get", "/")
    assert result.returncode == 2
    assert result.stderr.startswith(
        b"proxyproto send: error: TLS handshake after the header: "
    )
    assert b"CERTIFICATE_VERIFY_FAILED" in result.stderr
    # --insecure skips the check.
    result = await send(f"127.0.0.1:{port}", "--tls", "--insecure", "--get", "/")
    assert result.returncode == 0, result.stderr


async def test_a_refused_header_exits_1(nursery: trio.Nursery) -> None:
    receiver = TrioReceiver()
    port = await receiver.start(nursery)
    # v2 PROXY with UNSPEC family: the strict reader closes the connection.
    result = await send(f"127.0.0.1:{port}", "--unknown", "--get", "/")
    assert result.returncode == 1
    assert result.stdout == b""
    assert result.stderr == (
        b"proxyproto send: no answer: the server closed the connection without "
        b"sending a byte (a server refusing the header does this)\n"
    )


async def test_no_connection_exits_2() -> None:
    port = free_port()
    result = await send(f"127.0.0.1:{port}", "--get", "/")
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"proxyproto send: error: connect to 127.0.0.1:{port}: ".encode()
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cacert", "ca.pem"], "--cacert, --insecure and --sni go with --tls"),
        (["--local", "--source", "1.2.3.4:1"], "take no --source/--destination"),
        (["--local", "--unknown"], "exclude each other"),
        (["--version", "1", "--alpn", "h2"], "v1 headers cannot carry TLVs"),
        (["--get", "/a b"], "not a request target"),
        (["--data", "/nonexistent/x"], "--data: "),
        (["--source", "unix:/run/x"], "needs the other one too"),
    ],
)
async def test_usage_errors_exit_2(args: list[str], message: str) -> None:
    result = await send("127.0.0.1:9", *args)
    assert result.returncode == 2
    assert message in result.stderr.decode()
    assert result.stdout == b""


@pytest.mark.peers
async def test_haproxy_accept_proxy_plain_and_tls(tmp_path: Path) -> None:
    files = tls_files(tmp_path)
    with haproxy_receiver(files) as ports:
        plain = await send(
            f"127.0.0.1:{ports.plain}",
            "--source",
            "203.0.113.7:5555",
            "--authority",
            "example.com",
            "--get",
            "/",
        )
        tls = await send(
            f"127.0.0.1:{ports.tls}",
            "--version",
            "1",
            "--source",
            "203.0.113.7:5555",
            "--tls",
            "--cacert",
            str(files.ca_pem),
            "--get",
            "/",
        )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.endswith(
        f"\r\n\r\n203.0.113.7 5555 127.0.0.1 {ports.plain} example.com 0".encode()
    )
    assert tls.returncode == 0, tls.stderr
    assert tls.stdout.endswith(
        f"\r\n\r\n203.0.113.7 5555 127.0.0.1 {ports.tls}  1".encode()
    )
