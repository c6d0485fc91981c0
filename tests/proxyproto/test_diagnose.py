"""``proxyproto probe --diagnose``: one line and an exit code per port.

Every verdict against a real receiver where one exists: proxyproto's trio
adapter (REQUIRE, REQUIRE with v2 only, TLS after the header, and USE, which
guesses), HAProxy, nginx and tlsedge (a header required, then plain or TLS;
no header expected); fake targets for the rest (a port that refuses
everything, nothing listening).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from proxyproto import Policy, TrustPolicy
from proxyproto._diagnose import (
    DiagnoseConfig,
    Diagnosis,
    Verdict,
    diagnose,
    http_request,
)
from tests.peers import free_port, require
from tests.proxyproto.client_peers import TrioReceiver, tls_files
from tests.proxyproto.diagnose_peers import running_peer
from tests.proxyproto.test_probe import close_at_once, fake_target


def config(port: int) -> DiagnoseConfig:
    return DiagnoseConfig(
        host="127.0.0.1", port=port, payload=http_request("127.0.0.1"), wait=0.5
    )


async def diagnose_in_thread(port: int) -> Diagnosis:
    return await trio.to_thread.run_sync(diagnose, config(port))


async def test_a_port_requiring_a_header_then_plain(nursery: trio.Nursery) -> None:
    port = await TrioReceiver().start(nursery)
    diagnosis = await diagnose_in_thread(port)
    assert diagnosis.verdict is Verdict.REQUIRED
    assert diagnosis.versions == [1, 2]
    assert diagnosis.line() == (
        f"127.0.0.1:{port}: requires a PROXY header: v1 and v2, then plain data "
        f"(answered 'HTTP/1.1 200 OK'); without one it refuses the connection "
        f"(closed)"
    )


async def test_a_port_requiring_a_v2_header_then_tls(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    receiver = TrioReceiver(
        tls=tls_files(tmp_path).server_context(), versions=frozenset({2})
    )
    port = await receiver.start(nursery)
    diagnosis = await diagnose_in_thread(port)
    assert diagnosis.verdict is Verdict.REQUIRED
    assert diagnosis.versions == [2]
    assert diagnosis.line() == (
        f"127.0.0.1:{port}: requires a PROXY header: v2 only (v1 refused: closed "
        f"during the handshake), then TLS (TLSv1.3); without one it refuses the "
        f"connection (closed during the handshake)"
    )


async def test_a_guessing_port(nursery: trio.Nursery) -> None:
    # Policy.USE reads a header if one is there: the guessing the spec forbids.
    port = await TrioReceiver(trust=TrustPolicy.everyone(Policy.USE)).start(nursery)
    diagnosis = await diagnose_in_thread(port)
    assert diagnosis.verdict is Verdict.GUESSES
    assert diagnosis.line().startswith(
        f"127.0.0.1:{port}: GUESSES: serves with or without a PROXY header "
        f"(without: plain data (answered 'HTTP/1.1 200 OK'); with v1 and v2: "
    )


def plain_http(conn: socket.socket) -> None:
    """An HTTP server without PROXY support: a header is a bad request line."""
    data = conn.recv(4096)
    status = b"200 OK" if data.startswith(b"GET ") else b"400 Bad Request"
    conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")


def test_a_port_expecting_no_header() -> None:
    with fake_target(plain_http) as port:
        diagnosis = diagnose(config(port))
    assert diagnosis.verdict is Verdict.NOT_EXPECTED
    assert diagnosis.line() == (
        f"127.0.0.1:{port}: expects no PROXY header: serves plain data (answered "
        f"'HTTP/1.1 200 OK') without one, and refuses one (v1: HTTP 400, v2: "
        f"HTTP 400); whoever sends PROXY headers to this port must stop, or the "
        f"port must enable PROXY"
    )


def test_a_port_refusing_everything_is_undetermined() -> None:
    with fake_target(close_at_once) as port:
        diagnosis = diagnose(config(port))
    assert diagnosis.verdict is Verdict.UNDETERMINED
    assert diagnosis.line().startswith(
        f"127.0.0.1:{port}: undetermined: refused every connection, with or "
        f"without a header (no header then plain: "
    )
    assert {a.judgement for a in diagnosis.attempts} == {"refused"}


def test_nothing_listening() -> None:
    port = free_port()
    diagnosis = diagnose(config(port))
    assert diagnosis.verdict is Verdict.UNREACHABLE
    assert diagnosis.line().startswith(
        f"127.0.0.1:{port}: cannot tell, a connection failed: connect to "
        f"127.0.0.1:{port}: "
    )


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxyproto", "probe", "--diagnose", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


@pytest.mark.parametrize(("behaviour", "code"), [(plain_http, 3), (close_at_once, 4)])
def test_cli_exit_codes_and_json(behaviour: object, code: int) -> None:
    with fake_target(behaviour) as port:  # type: ignore[arg-type]
        text = run_cli(f"127.0.0.1:{port}", "--wait", "0.5")
        as_json = run_cli(f"127.0.0.1:{port}", "--wait", "0.5", "--json")
    assert text.returncode == as_json.returncode == code, text.stderr
    (line,) = text.stdout.splitlines()
    result = json.loads(as_json.stdout)
    assert result["exit_code"] == code
    assert result["verdict"] == Verdict(code).name.lower()
    # The same verdict (details like "closed" or "reset" may vary by timing).
    assert result["line"].partition("(")[0] == line.partition("(")[0]
    assert len(result["attempts"]) == 6
    assert {(a["header"], a["then"]) for a in result["attempts"]} == {
        (mode, then) for mode in ("none", "v1", "v2") for then in ("plain", "tls")
    }


def test_cli_unreachable_exits_2() -> None:
    result = run_cli(f"127.0.0.1:{free_port()}", "--connect-timeout", "0.5")
    assert result.returncode == 2
    assert "cannot tell, a connection failed" in result.stdout


@pytest.mark.peers
@pytest.mark.parametrize("peer", ["haproxy", "nginx", "tlsedge"])
def test_real_servers(peer: str, tmp_path: Path) -> None:
    if peer != "tlsedge":
        require(peer)
    with running_peer(peer, tmp_path) as ports:
        found = {label: diagnose(config(port)) for label, port in ports.items()}
    proxy, proxy_tls, plain = found["proxy"], found["proxy+tls"], found["plain"]
    assert proxy.verdict is Verdict.REQUIRED, proxy.line()
    assert proxy.versions == [1, 2]
    assert "then plain data (answered 'HTTP/1.1 200 OK')" in proxy.line()
    assert proxy_tls.verdict is Verdict.REQUIRED, proxy_tls.line()
    assert proxy_tls.versions == [1, 2]
    assert ", then TLS (TLSv1." in proxy_tls.line()
    assert plain.verdict is Verdict.NOT_EXPECTED, plain.line()
    assert "refuses one (v1: HTTP 400, v2: HTTP 400)" in plain.line()
