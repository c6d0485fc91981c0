"""Load-balancer health checks as the ASGI adapters meet them (test helpers).

HAProxy's ``check`` on a ``send-proxy-v2`` server connects, sends a v2
``LOCAL`` header and resets the connection (SO_LINGER 0); AWS NLB sends
``LOCAL`` and closes. Sent before the server accepts, the reset leaves a
connection in the accept queue whose peer is already gone (``getpeername()``
fails): the case that used to be logged as a refused peer. A plain TCP check
(Kubernetes ``tcpSocket``, a HAProxy ``tcp-check`` cut short when HAProxy
stops, a port scan) connects and closes without a byte: INFO too, unlike a
peer that closes after part of a header (`CLOSED_BEFORE_HEADER`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import time

import pytest

from tests.peers import free_port, haproxy

#: HAProxy's two kinds of check, for ``pytest.mark.parametrize("check", ...)``.
HAPROXY_CHECKS = [
    pytest.param("", id="tcp-check"),
    pytest.param("    option httpchk GET /\n", id="httpchk"),
]

#: A v2 LOCAL header with no address block (HAProxy's health checks).
LOCAL_V2 = bytes.fromhex("0d0a0d0a000d0a515549540a20000000")

#: In every INFO line about a peer that left before its header was complete.
BEFORE_HEADER = "before its header"


#: What a peer sends before it closes (FIN) with its header incomplete; the
#: level of the one line logged about it, and a text in that line. Nothing
#: at all is a TCP health check or a port scan (INFO); part of a header is a
#: broken sender (WARNING).
CLOSED_BEFORE_HEADER = [
    pytest.param(b"", "INFO", "without sending a byte", id="no-byte"),
    pytest.param(
        b"PROXY TCP4 192.0.2.1 ",
        "WARNING",
        "connection closed after 21 bytes, before a complete PROXY header",
        id="half-header",
    ),
]


def close_before_header(port: int, data: bytes) -> int:
    """Connect, send *data*, close (FIN), and wait until the server has
    closed too; the client's port (in every line logged about it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        client_port: int = sock.getsockname()[1]
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1) == b""
    return client_port


def assert_logged_once(
    caplog: pytest.LogCaptureFixture,
    client_port: int,
    logger: str,
    level: str,
    text: str,
) -> None:
    """Exactly one record about the client on *client_port*, on *logger* at
    *level* and containing *text*; none at WARNING anywhere for an INFO."""
    about = [r for r in caplog.records if f", {client_port})" in r.getMessage()]
    assert [(r.name, r.levelname) for r in about] == [(logger, level)], [
        f"{r.name} {r.levelname}: {r.getMessage()}" for r in caplog.records
    ]
    assert text in about[0].getMessage()
    if level == "INFO":
        assert_no_warnings(caplog)


def reset_after(port: int, data: bytes) -> None:
    """Connect, send *data*, and reset the connection (SO_LINGER 0)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if data:
            sock.sendall(data)


def close_after(port: int, data: bytes) -> None:
    """Connect, send *data*, and close the connection (FIN)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)


def queue_health_checks(port: int) -> None:
    """Health checks that reset before the server accepts them (call while
    the port listens but the server does not accept yet)."""
    reset_after(port, LOCAL_V2)
    reset_after(port, b"")


def send_health_checks(port: int) -> None:
    """Health checks against a running server: LOCAL then a reset, a bare
    reset, LOCAL then a close."""
    reset_after(port, LOCAL_V2)
    reset_after(port, b"")
    close_after(port, LOCAL_V2)


def assert_no_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """No record at WARNING or above, from any logger."""
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [f"{r.name}: {r.getMessage()}" for r in loud]


def run_haproxy_checks(port: int, check: str) -> None:
    """Let a real HAProxy check the server on *port* (``send-proxy-v2``, every
    50 ms, *check* one of `HAPROXY_CHECKS`) for about 20 checks."""
    front = free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front}\n    default_backend be\n"
        f"backend be\n{check}"
        f"    server app 127.0.0.1:{port} send-proxy-v2 check inter 50ms\n"
    )
    with haproxy(config, [front]):
        time.sleep(1)
