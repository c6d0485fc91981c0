"""Load-balancer health checks as the ASGI adapters meet them (test helpers).

HAProxy's ``check`` on a ``send-proxy-v2`` server connects, sends a v2
``LOCAL`` header and resets the connection (SO_LINGER 0); AWS NLB sends
``LOCAL`` and closes. Sent before the server accepts, the reset leaves a
connection in the accept queue whose peer is already gone (``getpeername()``
fails): the case that used to be logged as a refused peer.
"""

from __future__ import annotations

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
