from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
import trustme

from proxyproto import ProxyHeader, parse
from tests.peers import free_port, nginx
from tests.tlsedge.helpers import (
    address_of,
    exchange,
    make_config,
    running_edge,
    wait_until,
)
from tlsedge._backends.health import (
    HISTORY_LENGTH,
    MAX_STATUS_LINE,
    PASSIVE_DOWN_TIME,
    HealthState,
    ServerHealth,
    run_health_checks,
)
from tlsedge._backends.upstream import BackendPool
from tlsedge._core.balancer import Balancer, Server
from tlsedge._core.config import Config
from tlsedge._tls.stream import TLSStream

INTERVAL = 10.0
TIMEOUT = 5.0


def up(thing: Server | HealthState) -> bool:
    """``thing.healthy``, read through a call so mypy does not narrow it."""
    return thing.healthy


def down_until(thing: Server | HealthState) -> float | None:
    """``thing.down_until``, read through a call so mypy does not narrow it."""
    return thing.down_until


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- HealthState: pure transitions ---------------------------------------------


def test_starts_healthy_and_goes_down_at_unhealthy_threshold() -> None:
    state = HealthState(healthy_threshold=2, unhealthy_threshold=3, active_checks=True)
    assert up(state)
    assert not state.record_failure(1.0, "connection refused")
    assert not state.record_failure(2.0, "connection refused")
    assert up(state)
    assert state.record_failure(3.0, "connection refused")  # the change
    assert not up(state)
    assert down_until(state) is None  # active mode: checks bring it back
    assert not state.record_failure(4.0, "connection refused")  # no new change
    assert state.failures == 4


def test_success_resets_consecutive_failures() -> None:
    state = HealthState(unhealthy_threshold=3)
    for t in range(10):
        state.record_failure(float(t), "timeout")
        state.record_failure(float(t), "timeout")
        assert not state.record_success(float(t))
    assert up(state)
    state.record_failure(20.0, "x")
    state.record_failure(21.0, "x")
    assert not state.record_connect_success(22.0)  # real traffic resets too
    assert state.failures == 0
    assert not state.record_failure(23.0, "x")
    assert up(state)


def test_up_again_after_healthy_threshold_consecutive_passes() -> None:
    state = HealthState(healthy_threshold=3, unhealthy_threshold=1, active_checks=True)
    assert state.record_failure(0.0, "HTTP 500")
    assert not state.record_success(1.0)
    assert not state.record_success(2.0)
    assert not state.record_failure(3.0, "HTTP 500")  # breaks the streak
    assert not state.record_success(4.0)
    assert not state.record_success(5.0)
    assert state.record_success(6.0)
    assert up(state)
    assert state.successes == 3


def test_first_check_decides_outright() -> None:
    state = HealthState(unhealthy_threshold=6, active_checks=True)
    assert state.record_first_check(1.0, False, "connection refused")
    assert not up(state)
    again = HealthState(unhealthy_threshold=6, active_checks=True)
    assert not again.record_first_check(1.0, True, "connected")
    assert up(again)
    down = HealthState(unhealthy_threshold=1, active_checks=True)
    down.record_failure(0.0, "x")
    assert down.record_first_check(1.0, True, "HTTP 200")
    assert up(down)


def test_history_is_bounded_and_timestamped() -> None:
    state = HealthState()
    for t in range(25):
        state.record_success(float(t), "HTTP 200")
    state.record_connect_failure(30.0, "connection reset")
    state.record_connect_success(31.0)  # not recorded: too frequent to keep
    assert len(state.history) == HISTORY_LENGTH
    assert state.history[-1] == (30.0, False, "connection reset", "traffic")
    assert state.history[-2] == (24.0, True, "HTTP 200", "check")
    assert state.last_detail == "connection reset"
    assert HealthState().last_detail == ""
    assert "healthy=True" in repr(state)


def test_rejects_bad_thresholds() -> None:
    with pytest.raises(ValueError, match="thresholds"):
        HealthState(healthy_threshold=0)
    with pytest.raises(ValueError, match="thresholds"):
        HealthState(unhealthy_threshold=0)
    with pytest.raises(ValueError, match="passive_down_time"):
        HealthState(passive_down_time=-1.0)


# -- passive marking -------------------------------------------------------------


def test_passive_down_then_trial_after_cool_down() -> None:
    state = HealthState(unhealthy_threshold=3)
    assert not state.record_connect_failure(100.0, "connection refused")
    assert not state.record_connect_failure(101.0, "connection refused")
    assert state.record_connect_failure(102.0, "connection refused")
    assert not up(state)
    assert state.down_until == 102.0 + PASSIVE_DOWN_TIME
    assert not state.is_available(102.0 + PASSIVE_DOWN_TIME - 0.1)
    assert state.is_available(102.0 + PASSIVE_DOWN_TIME)
    # A failed trial restarts the cool-down.
    assert not state.record_connect_failure(140.0, "connection refused")
    assert state.down_until == 140.0 + PASSIVE_DOWN_TIME
    # A successful trial brings it back.
    assert state.record_connect_success(171.0)
    assert up(state)
    assert down_until(state) is None
    assert state.failures == 0


def test_passive_with_active_checks_needs_active_passes() -> None:
    state = HealthState(healthy_threshold=2, unhealthy_threshold=2, active_checks=True)
    state.record_connect_failure(0.0, "connection refused")
    assert state.record_connect_failure(1.0, "connection refused")
    assert not up(state)
    assert down_until(state) is None  # no cool-down: the checker decides
    assert not state.record_connect_success(2.0)
    assert not up(state)
    assert not state.record_success(3.0)
    assert state.record_success(4.0)


def test_active_and_passive_failures_add_up() -> None:
    state = HealthState(unhealthy_threshold=4, active_checks=True)
    state.record_failure(0.0, "timeout after 5 s")
    state.record_connect_failure(1.0, "connection refused")
    state.record_failure(2.0, "timeout after 5 s")
    assert state.record_connect_failure(3.0, "connection refused")


def test_stop_active_checks_gives_a_down_server_a_trial() -> None:
    state = HealthState(unhealthy_threshold=1, active_checks=True)
    state.record_failure(0.0, "HTTP 503")
    assert down_until(state) is None
    state.stop_active_checks(50.0)
    assert not state.active_checks
    assert down_until(state) == 50.0 + PASSIVE_DOWN_TIME
    healthy = HealthState(active_checks=True)
    healthy.stop_active_checks(50.0)
    assert down_until(healthy) is None


def test_start_active_checks_ends_passive_cool_down() -> None:
    state = HealthState(unhealthy_threshold=1)
    state.record_connect_failure(0.0, "connection refused")
    assert state.down_until == PASSIVE_DOWN_TIME
    state.start_active_checks()
    assert state.active_checks
    assert down_until(state) is None  # no trial traffic: the checker decides
    assert not state.is_available(1e9)
    state.record_connect_failure(1.0, "connection refused")
    assert down_until(state) is None


def test_server_health_with_balancer_and_fake_clock(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge.health")
    clock = FakeClock()
    a = Server(("10.0.0.1", 8080))
    b = Server(("10.0.0.2", 8080))
    balancer = Balancer([a, b], clock=clock)
    health = ServerHealth(
        a, HealthState(unhealthy_threshold=2), backend="app", clock=clock
    )
    health.connect_failed("connection refused")
    assert up(a)
    health.connect_failed("connection refused")
    assert not up(a)
    assert a.down_until == clock.now + PASSIVE_DOWN_TIME
    assert caplog.messages[-1] == (
        "backend app server 10.0.0.1:8080 is DOWN after 2 failed connects "
        "(last: connection refused); trial traffic in 30 s"
    )
    assert all(balancer.pick(None) is b for _ in range(5))
    clock.now += PASSIVE_DOWN_TIME
    picks = {id(balancer.pick(None)) for _ in range(2)}
    assert picks == {id(a), id(b)}  # a gets trial traffic again
    health.connect_failed("connection reset")  # the trial fails
    assert "trial connection failed (connection reset)" in caplog.messages[-1]
    assert all(balancer.pick(None) is b for _ in range(5))
    clock.now += PASSIVE_DOWN_TIME
    health.connect_succeeded()
    assert up(a)
    assert down_until(a) is None
    assert caplog.messages[-1] == (
        "backend app server 10.0.0.1:8080 is UP (trial connection succeeded)"
    )
    health.connect_succeeded()  # no change, no log line
    assert len(caplog.messages) == 3


# -- active checks over real loopback sockets ------------------------------------


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


Handler = Callable[[trio.SocketStream], Awaitable[None]]


async def start_server(
    nursery: trio.Nursery, handler: Handler, host: str = "127.0.0.1"
) -> int:
    """Serve ``handler`` on a loopback port until the test ends; return the port."""
    listeners: list[trio.SocketListener] = await nursery.start(
        partial(trio.serve_tcp, handler, 0, host=host)
    )
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def accept_and_close(stream: trio.SocketStream) -> None:
    await stream.aclose()


async def start_checker(
    nursery: trio.Nursery, server: Server, state: HealthState, **kwargs: object
) -> None:
    await nursery.start(
        partial(
            run_health_checks,
            server,
            state,
            interval=INTERVAL,
            timeout=TIMEOUT,
            backend="app",
            clock=trio.current_time,
            **kwargs,  # type: ignore[arg-type]
        )
    )


async def test_tcp_check_passes_against_listener(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    port = await start_server(nursery, accept_and_close)
    server = Server(("127.0.0.1", port))
    state = HealthState()
    await start_checker(nursery, server, state, kind="tcp")
    assert state.active_checks
    assert state.history[-1].ok
    assert state.history[-1].detail == "connected"
    await trio.sleep(INTERVAL * 3 + 1)
    assert [r.ok for r in state.history] == [True] * 4
    times = [r.time for r in state.history]
    assert [round(b - a) for a, b in itertools.pairwise(times)] == [10] * 3
    assert up(server)


async def test_tcp_check_closed_port_is_down_at_once(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tlsedge.health")
    port = closed_port()
    server = Server(("127.0.0.1", port))
    state = HealthState(unhealthy_threshold=6)
    await start_checker(nursery, server, state, kind="tcp")
    # The first check decides the initial state; startup sees it.
    assert not up(server)
    assert state.history[-1].detail == "connection refused"
    assert caplog.messages == [
        f"backend app server 127.0.0.1:{port} is DOWN after 1 failed check "
        "(last: connection refused)"
    ]


async def test_down_after_unhealthy_threshold_then_up_again(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tlsedge.health")
    # Bound but not listening: connects are refused until listen() is called,
    # and the port stays ours throughout.
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    server = Server(("127.0.0.1", port))
    state = HealthState(healthy_threshold=2, unhealthy_threshold=6)
    try:
        await start_checker(nursery, server, state, kind="tcp")
        assert up(server)
        await trio.sleep(INTERVAL / 2)
        listener.close()
        await trio.sleep(INTERVAL * 5)  # 5 failed checks: not yet
        assert up(server)
        assert state.failures == 5
        await trio.sleep(INTERVAL)
        assert not up(server)
        assert caplog.messages == [
            f"backend app server 127.0.0.1:{port} is DOWN after 6 failed checks "
            "(last: connection refused)"
        ]
        listener = trio.socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await listener.bind(("127.0.0.1", port))
        listener.listen()
        await trio.sleep(INTERVAL)
        assert not up(server)  # one pass is not enough
        await trio.sleep(INTERVAL)
        assert up(server)
        assert caplog.messages[-1] == (
            f"backend app server 127.0.0.1:{port} is UP after 2 passed checks"
        )
    finally:
        listener.close()


def http_handler(
    responses: list[bytes], requests: list[bytes]
) -> Callable[[trio.SocketStream], Awaitable[None]]:
    """Reads one request, answers ``responses[0]`` (swap it to change state)."""

    async def handler(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some()
            if not chunk:
                return
            data += chunk
        requests.append(data)
        await stream.send_all(responses[0])

    return handler


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
ERROR = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"


async def test_http_check_transitions_200_then_500(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tlsedge.health")
    responses = [OK]
    requests: list[bytes] = []
    port = await start_server(nursery, http_handler(responses, requests))
    server = Server(("127.0.0.1", port))
    state = HealthState(healthy_threshold=2, unhealthy_threshold=3)
    await start_checker(
        nursery, server, state, kind="http", path="/healthz", host_header="app.local"
    )
    assert requests == [
        b"GET /healthz HTTP/1.1\r\nHost: app.local\r\nConnection: close\r\n"
        b"User-Agent: tlsedge-health\r\n\r\n"
    ]
    assert up(server)
    assert state.history[-1].detail == "HTTP 200"
    await trio.sleep(INTERVAL / 2)
    responses[0] = ERROR
    await trio.sleep(INTERVAL * 2)
    assert up(server)
    await trio.sleep(INTERVAL)
    assert not up(server)
    assert state.history[-1].detail == "HTTP 500 (expected 200-399)"
    assert caplog.messages[-1] == (
        f"backend app server 127.0.0.1:{port} is DOWN after 3 failed checks "
        "(last: HTTP 500 (expected 200-399))"
    )
    responses[0] = OK
    await trio.sleep(INTERVAL * 2)
    assert up(server)
    assert caplog.messages[-1] == (
        f"backend app server 127.0.0.1:{port} is UP after 2 passed checks"
    )
    assert len(requests) == 6  # t = 0, 10, 20, 30 (down), 40, 50 (up)


async def test_http_check_default_host_header(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    requests: list[bytes] = []
    port = await start_server(nursery, http_handler([OK], requests))
    await start_checker(
        nursery, Server(("127.0.0.1", port)), HealthState(), kind="http", path="/"
    )
    assert requests[0].startswith(b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port)


@pytest.mark.parametrize(
    ("reply", "ok", "detail"),
    [
        (b"HTTP/1.1 204 No Content\r\n\r\n", True, "HTTP 204"),
        (b"HTTP/1.0 302 Found\r\nLocation: /\r\n\r\n", True, "HTTP 302"),
        (b"HTTP/1.1 200\r\n\r\n", True, "HTTP 200"),  # empty reason phrase
        (b"HTTP/1.1 399 Odd\n\n", True, "HTTP 399"),
        (b"HTTP/1.1 404 Not Found\r\n\r\n", False, "HTTP 404 (expected 200-399)"),
        (
            b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
            False,
            "HTTP 101 (expected 200-399)",
        ),
        (b"HTTP/1.1 503 Busy\r\n\r\n", False, "HTTP 503 (expected 200-399)"),
        (b"hello there\r\n", False, "bad status line b'hello there'"),
        (b"HTTP/2 200\r\n\r\n", False, "bad status line b'HTTP/2 200'"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", False, "bad status line b'HTTP/1.1 2000 OK'"),
        (b"HTTP/1.1 200 OK", False, "connection closed before the status line"),
        (b"", False, "connection closed before the status line"),
        (
            b"x" * (MAX_STATUS_LINE + 100),
            False,
            f"no status line in the first {MAX_STATUS_LINE} bytes",
        ),
    ],
)
async def test_http_check_judges_status_line(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    reply: bytes,
    ok: bool,
    detail: str,
) -> None:
    port = await start_server(nursery, http_handler([reply], []))
    state = HealthState()
    await start_checker(nursery, Server(("127.0.0.1", port)), state, kind="http")
    assert state.history[-1].ok is ok
    assert state.history[-1].detail == detail


@pytest.mark.parametrize(
    ("expect", "reply", "ok", "detail"),
    [
        (((200, 200),), b"HTTP/1.1 200 OK\r\n\r\n", True, "HTTP 200"),
        (
            ((200, 200),),
            b"HTTP/1.1 204 No Content\r\n\r\n",
            False,
            "HTTP 204 (expected 200)",
        ),
        (
            ((200, 200), (401, 401)),
            b"HTTP/1.1 401 Unauthorized\r\n\r\n",
            True,
            "HTTP 401",
        ),
        (
            ((200, 299), (401, 401)),
            b"HTTP/1.1 302 Found\r\n\r\n",
            False,
            "HTTP 302 (expected 200-299, 401)",
        ),
        (((200, 299),), b"HTTP/1.1 299 Odd\r\n\r\n", True, "HTTP 299"),
    ],
)
async def test_http_check_passes_on_the_expected_statuses(  # noqa: PLR0917
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    expect: tuple[tuple[int, int], ...],
    reply: bytes,
    ok: bool,
    detail: str,
) -> None:
    port = await start_server(nursery, http_handler([reply], []))
    state = HealthState()
    await start_checker(
        nursery, Server(("127.0.0.1", port)), state, kind="http", expect=expect
    )
    assert state.history[-1].ok is ok
    assert state.history[-1].detail == detail


async def test_http_check_connection_reset(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def reset(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        # SO_LINGER 0: close sends RST instead of FIN.
        stream.socket.setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
        )
        stream.socket.close()

    port = await start_server(nursery, reset)
    state = HealthState()
    await start_checker(nursery, Server(("127.0.0.1", port)), state, kind="http")
    assert not state.history[-1].ok
    assert state.history[-1].detail in {
        "connection reset",
        "connection closed before the status line",
    }


async def test_http_check_silent_server_times_out_without_leaking(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def silent(stream: trio.SocketStream) -> None:
        # Accept, say nothing, close once the checker gives up and closes.
        while await stream.receive_some():
            pass

    port = await start_server(nursery, silent)
    server = Server(("127.0.0.1", port))
    state = HealthState(unhealthy_threshold=3)
    start = trio.current_time()
    await start_checker(nursery, server, state, kind="http")
    assert trio.current_time() - start == pytest.approx(TIMEOUT)
    assert state.history[-1].time == pytest.approx(start + TIMEOUT)
    assert state.history[-1][1:] == (False, "timeout after 5 s", "check")
    assert not up(server)  # first check decides
    fd_dir = "/proc/self/fd"
    if sys.platform == "linux":
        await trio.sleep(INTERVAL)
        before = len(os.listdir(fd_dir))
        await trio.sleep(INTERVAL * 10)
        # Ten more checks, each of which would leak its socket; at the moment
        # of either count one check may be under way (its socket and the
        # server's end of it), which is not a leak.
        assert len(os.listdir(fd_dir)) <= before + 2
    assert all(not r.ok for r in state.history)


async def test_cancelled_checker_returns_to_passive_mode(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = Server(("127.0.0.1", closed_port()))
    state = HealthState()
    async with trio.open_nursery() as nursery:
        await start_checker(nursery, server, state, kind="tcp")
        assert not up(server)
        assert down_until(server) is None
        nursery.cancel_scope.cancel()
    assert not state.active_checks
    assert server.down_until == pytest.approx(trio.current_time() + PASSIVE_DOWN_TIME)


async def test_server_health_run_checks(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    port = await start_server(nursery, accept_and_close)
    health = ServerHealth(
        Server(("127.0.0.1", port)), backend="app", clock=trio.current_time
    )
    await nursery.start(partial(health.run_checks, kind="tcp", interval=1.0))
    await trio.sleep(2.5)
    assert [r.ok for r in health.state.history] == [True, True, True]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "udp"}, "unknown health check kind 'udp'"),
        ({"send_proxy": "v3"}, "unknown send_proxy 'v3'; choose one of none, v1, v2"),
        ({"interval": 0.0}, "interval and timeout"),
        ({"timeout": -1.0}, "interval and timeout"),
        ({"kind": "http", "path": "healthz"}, "bad health check path"),
        ({"kind": "http", "path": "/a\r\nX: y"}, "bad health check path"),
        ({"kind": "http", "host_header": "a\r\nX: y"}, "bad health check host_header"),
        ({"kind": "http", "expect": ()}, "no status would pass"),
    ],
)
async def test_run_health_checks_rejects_bad_arguments(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await run_health_checks(
            Server(("127.0.0.1", 1)),
            HealthState(),
            **kwargs,  # type: ignore[arg-type]
        )


async def test_ipv6_tcp_check(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback")

    port = await start_server(nursery, accept_and_close, host="::1")
    state = HealthState()
    await start_checker(nursery, Server(("::1", port)), state, kind="tcp")
    assert state.history[-1].ok


# -- PROXY and TLS in checks: how failures read, and nothing leaks ---------------


@dataclass(frozen=True)
class TlsPeer:
    """A server context for 127.0.0.1 and a client context that trusts it."""

    server: ssl.SSLContext
    client: ssl.SSLContext


@pytest.fixture(scope="module")
def tls_peer() -> TlsPeer:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return TlsPeer(server, client)


async def hang_up(stream: trio.SocketStream) -> None:
    """Read what comes first, then close cleanly (FIN, no RST) without a word."""
    await stream.receive_some()
    await stream.send_eof()
    while await stream.receive_some():
        pass


@pytest.mark.parametrize(
    ("send_proxy", "detail"),
    [
        ("none", "TLS handshake failed: connection closed"),
        ("v1", "PROXY header refused: connection closed"),
        ("v2", "PROXY header refused: connection closed"),
    ],
)
@pytest.mark.parametrize("kind", ["tcp", "http"])
async def test_tls_check_against_a_server_that_hangs_up(  # noqa: PLR0917
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    tls_peer: TlsPeer,
    kind: str,
    send_proxy: str,
    detail: str,
) -> None:
    port = await start_server(nursery, hang_up)
    state = HealthState()
    await start_checker(
        nursery,
        Server(("127.0.0.1", port)),
        state,
        kind=kind,
        send_proxy=send_proxy,
        tls_context=tls_peer.client,
    )
    assert state.history[-1][1:] == (False, detail, "check")


async def test_plain_check_against_a_server_that_hangs_up_after_the_header(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    port = await start_server(nursery, hang_up)
    state = HealthState()
    await start_checker(
        nursery, Server(("127.0.0.1", port)), state, kind="http", send_proxy="v2"
    )
    assert state.history[-1].detail in {
        "PROXY header refused: connection closed",
        "PROXY header refused: connection reset",  # closed with the GET unread
    }
    plain = HealthState()
    await start_checker(nursery, Server(("127.0.0.1", port)), plain, kind="http")
    assert plain.history[-1].detail in {
        "connection closed before the status line",
        "connection reset",
    }


def tls_http_handler(
    context: ssl.SSLContext, headers: list[ProxyHeader | None], requests: list[bytes]
) -> Handler:
    """Reads a PROXY header if one comes, then over TLS one request; answers OK."""

    async def handler(stream: trio.SocketStream) -> None:
        first = await stream.receive_some()
        header: ProxyHeader | None = None
        if first.startswith((b"PROXY", b"\r\n\r\n")):
            header, used = parse(first)
            first = first[used:]
        headers.append(header)
        tls = TLSStream(stream, context, server_side=True, initial_data=first)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await tls.receive_some()
            if not chunk:
                return
            data += chunk
        requests.append(data)
        await tls.send_all(OK)
        await tls.aclose()

    return handler


@pytest.mark.parametrize("send_proxy", ["none", "v1", "v2"])
async def test_http_check_over_tls_after_the_proxy_header(
    nursery: trio.Nursery,
    autojump_clock: trio.testing.MockClock,
    tls_peer: TlsPeer,
    send_proxy: str,
) -> None:
    headers: list[ProxyHeader | None] = []
    requests: list[bytes] = []
    port = await start_server(
        nursery, tls_http_handler(tls_peer.server, headers, requests)
    )
    state = HealthState()
    await start_checker(
        nursery,
        Server(("127.0.0.1", port)),
        state,
        kind="http",
        path="/healthz",
        send_proxy=send_proxy,
        tls_context=tls_peer.client,
    )
    assert state.history[-1][1:] == (True, "HTTP 200", "check")
    expected = {
        "none": None,
        "v1": ProxyHeader.unknown(),
        "v2": ProxyHeader.local(),
    }[send_proxy]
    assert headers == [expected]
    # No name to send: the Host is the server's address, as without TLS.
    assert requests[0].startswith(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:%d" % port)


async def test_http_check_over_tls_refuses_an_h2_server(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, tls_peer: TlsPeer
) -> None:
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme_ca = trustme.CA()
    trustme_ca.issue_cert("127.0.0.1").configure_cert(server)
    server.set_alpn_protocols(["h2"])
    client = ssl.create_default_context()
    trustme_ca.configure_trust(client)
    client.set_alpn_protocols(["h2", "http/1.1"])
    port = await start_server(nursery, tls_http_handler(server, [], []))
    state = HealthState()
    await start_checker(
        nursery, Server(("127.0.0.1", port)), state, kind="http", tls_context=client
    )
    assert state.history[-1].detail == (
        "the server chose ALPN 'h2'; http checks speak HTTP/1.1"
    )


def task_count() -> int:
    """The tasks alive in this trio run."""
    root = trio.lowlevel.current_root_task()
    assert root is not None
    stack, count = [root], 0
    while stack:
        task = stack.pop()
        count += 1
        stack.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return count


async def test_tls_checks_of_a_silent_server_time_out_without_leaking(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock, tls_peer: TlsPeer
) -> None:
    async def silent(stream: trio.SocketStream) -> None:
        while await stream.receive_some():
            pass

    port = await start_server(nursery, silent)
    state = HealthState()
    await start_checker(
        nursery,
        Server(("127.0.0.1", port)),
        state,
        kind="http",
        send_proxy="v2",
        tls_context=tls_peer.client,
    )
    assert state.history[-1].detail == "timeout after 5 s"
    tasks = task_count()
    if sys.platform == "linux":
        await trio.sleep(INTERVAL)
        before = len(os.listdir("/proc/self/fd"))
        await trio.sleep(INTERVAL * 10)
        # One check may be under way at either count (see the plain test).
        assert len(os.listdir("/proc/self/fd")) <= before + 2
    assert task_count() == tasks
    assert len(state.history) == HISTORY_LENGTH
    assert all(r.detail == "timeout after 5 s" for r in state.history)


# -- checks that speak PROXY and TLS, against real servers -----------------------
#
# The backends are built from config mappings, as the edge builds them, so the
# checks get the backend's send_proxy and TLS context the way they do in
# production. Real clock: nginx and uvicorn run in their own processes/threads.

FAST = {"interval": 0.2, "timeout": 0.2}
# For tests that look at the first check only: it runs at once, and a loaded
# machine gets more than FAST's timeout to answer it.
FIRST_ONLY = {"interval": 5.0, "timeout": 5.0}


@dataclass(frozen=True)
class NginxBackends:
    """One nginx with a port per way of speaking, and the files to reach it."""

    proxy: int  # plain HTTP, `listen ... proxy_protocol`
    tls: int  # `listen ... ssl`: 200 for Host backend.test, else 404
    tls_proxy: int  # `listen ... ssl proxy_protocol`
    client_cert: int  # `listen ... ssl` with `ssl_verify_client on`
    ca: Path  # issued nginx's certificate (backend.test, 127.0.0.1)
    other_ca: Path  # a CA that did not
    cert: Path  # a client certificate nginx's client_cert port accepts
    key: Path


@pytest.fixture(scope="module")
def nginx_backends(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[NginxBackends]:
    directory = tmp_path_factory.mktemp("health-pki")
    ca, other_ca, client_ca = trustme.CA(), trustme.CA(), trustme.CA()
    leaf = ca.issue_cert("backend.test", "127.0.0.1")
    client = client_ca.issue_cert("edge.test")
    files = {
        "ca": ca.cert_pem,
        "other-ca": other_ca.cert_pem,
        "client-ca": client_ca.cert_pem,
        "server": leaf.cert_chain_pems[0],
        "server-key": leaf.private_key_pem,
        "client": client.cert_chain_pems[0],
        "client-key": client.private_key_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(directory / f"{name}.pem"))
    proxy, tls, tls_proxy, client_cert = (free_port() for _ in range(4))
    ssl_files = (
        f"ssl_certificate {directory}/server.pem; "
        f"ssl_certificate_key {directory}/server-key.pem; "
        "ssl_protocols TLSv1.2 TLSv1.3;"
    )
    ok = 'location / { return 200 "ok\\n"; }'
    body = (
        "http {\n  access_log off;\n"
        f"  server {{ listen 127.0.0.1:{proxy} proxy_protocol; {ok} }}\n"
        f"  server {{ listen 127.0.0.1:{tls} ssl default_server; {ssl_files}"
        " return 404; }\n"
        f"  server {{ listen 127.0.0.1:{tls} ssl; server_name backend.test;"
        f" {ssl_files} {ok} }}\n"
        f"  server {{ listen 127.0.0.1:{tls_proxy} ssl proxy_protocol;"
        f" {ssl_files} {ok} }}\n"
        f"  server {{ listen 127.0.0.1:{client_cert} ssl; {ssl_files}"
        f" ssl_verify_client on; ssl_client_certificate {directory}/client-ca.pem;"
        f" {ok} }}\n"
        "}\n"
    )
    with nginx(body, [proxy, tls, tls_proxy, client_cert]):
        yield NginxBackends(
            proxy=proxy,
            tls=tls,
            tls_proxy=tls_proxy,
            client_cert=client_cert,
            ca=directory / "ca.pem",
            other_ca=directory / "other-ca.pem",
            cert=directory / "client.pem",
            key=directory / "client-key.pem",
        )


def backend_config(port: int, health: dict[str, Any], **options: Any) -> Config:
    """A config with one backend "b" (one server, 127.0.0.1:port) and checks."""
    return make_config(
        [{"name": "in", "backend": "b"}],
        [
            {
                "name": "b",
                "servers": [f"127.0.0.1:{port}"],
                "health": {**FAST, **health},
                **options,
            }
        ],
    )


async def checked_server(
    nursery: trio.Nursery, config: Config, *, healthy: bool, checks: int = 3
) -> ServerHealth:
    """Run the backend's checks until ``checks`` ran and it is ``healthy``."""
    pool = await BackendPool.create(config.backends[0])
    await nursery.start(pool.run_health_checks)
    (health,) = pool.servers
    await wait_until(
        lambda: len(health.state.history) >= checks and health.server.healthy is healthy
    )
    return health


def details(health: ServerHealth) -> set[str]:
    return {result.detail for result in health.state.history}


def health_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tlsedge.health"]


@pytest.mark.parametrize("send_proxy", ["v1", "v2"])
async def test_http_check_sends_proxy_header_to_nginx(
    nursery: trio.Nursery, nginx_backends: NginxBackends, send_proxy: str
) -> None:
    # nginx with `listen ... proxy_protocol` closes a connection that does
    # not start with a header: without one, every check failed.
    config = backend_config(
        nginx_backends.proxy, {"kind": "http", "path": "/"}, send_proxy=send_proxy
    )
    health = await checked_server(nursery, config, healthy=True)
    assert "HTTP 200" in details(health)


async def ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that answers every request with an empty 200."""
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


@contextlib.contextmanager
def run_uvicorn(**kwargs: Any) -> Iterator[int]:
    """proxyproto.uvicorn serving `ok_app` in a thread; yields its port."""
    uvicorn = pytest.importorskip("uvicorn")
    from proxyproto.uvicorn import ProxyConfig

    config = ProxyConfig(
        ok_app,
        host="127.0.0.1",
        port=0,
        lifespan="off",
        log_config=None,
        timeout_graceful_shutdown=2,
        **kwargs,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during startup"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("send_proxy", ["v1", "v2"])
async def test_http_check_sends_proxy_header_to_proxyproto_uvicorn(
    nursery: trio.Nursery, send_proxy: str
) -> None:
    # Its default trust policy requires a header from 127.0.0.1.
    with run_uvicorn() as port:
        config = backend_config(
            port, {"kind": "http", "path": "/"}, send_proxy=send_proxy
        )
        health = await checked_server(nursery, config, healthy=True)
        assert "HTTP 200" in details(health)
        nursery.cancel_scope.cancel()


async def test_refused_proxy_header_is_named_in_the_down_line(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tlsedge.health")
    # This uvicorn takes only v2 headers: it closes at once on a v1 one.
    with run_uvicorn(proxy_options={"versions": {2}}) as port:
        config = backend_config(
            port, {**FIRST_ONLY, "kind": "http", "path": "/"}, send_proxy="v1"
        )
        health = await checked_server(nursery, config, healthy=False, checks=1)
        nursery.cancel_scope.cancel()
    assert health.state.last_detail in {
        "PROXY header refused: connection closed",
        "PROXY header refused: connection reset",
    }
    assert health_lines(caplog)[0] == (
        f"backend b server 127.0.0.1:{port} is DOWN after 1 failed check "
        f"(last: {health.state.history[0].detail})"
    )


@pytest.mark.parametrize(
    ("kind", "detail"),
    [("tcp", "TLS handshake completed (TLSv1.3)"), ("http", "HTTP 200")],
)
@pytest.mark.parametrize("send_proxy", ["none", "v2"])
async def test_check_of_a_tls_backend(
    nursery: trio.Nursery,
    nginx_backends: NginxBackends,
    kind: str,
    detail: str,
    send_proxy: str,
) -> None:
    # The http check's Host is the SNI name: nginx's default server for
    # other names answers 404. With v2, the header comes before the handshake.
    port = nginx_backends.tls if send_proxy == "none" else nginx_backends.tls_proxy
    config = backend_config(
        port,
        {"kind": kind, "path": "/"},
        protocol="tls",
        send_proxy=send_proxy,
        tls={"ca": str(nginx_backends.ca), "sni": "backend.test"},
    )
    health = await checked_server(nursery, config, healthy=True)
    assert detail in details(health)


@pytest.mark.parametrize("kind", ["tcp", "http"])
@pytest.mark.parametrize(
    ("tls", "reason"),
    [
        (
            {"ca": "other"},
            "certificate verify failed: unable to get local issuer certificate",
        ),
        (
            {"sni": "elsewhere.test"},
            "certificate verify failed: Hostname mismatch, certificate is not "
            "valid for 'elsewhere.test'.",
        ),
    ],
    ids=["wrong-ca", "wrong-name"],
)
async def test_tls_verification_failure_takes_the_server_down(  # noqa: PLR0917
    nursery: trio.Nursery,
    nginx_backends: NginxBackends,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    tls: dict[str, str],
    reason: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="tlsedge.health")
    ca = nginx_backends.other_ca if tls.get("ca") == "other" else nginx_backends.ca
    config = backend_config(
        nginx_backends.tls,
        {**FIRST_ONLY, "kind": kind, "path": "/"},
        protocol="tls",
        tls={**tls, "ca": str(ca)},
    )
    health = await checked_server(nursery, config, healthy=False, checks=1)
    assert health.state.history[0].detail == f"TLS handshake failed: {reason}"
    assert health_lines(caplog)[0] == (
        f"backend b server 127.0.0.1:{nginx_backends.tls} is DOWN after 1 failed "
        f"check (last: TLS handshake failed: {reason})"
    )


async def test_check_sends_the_backends_client_certificate(
    nursery: trio.Nursery, nginx_backends: NginxBackends
) -> None:
    # nginx answers 400 to a request without a client certificate.
    config = backend_config(
        nginx_backends.client_cert,
        {"kind": "http", "path": "/"},
        protocol="tls",
        tls={
            "ca": str(nginx_backends.ca),
            "cert": str(nginx_backends.cert),
            "key": str(nginx_backends.key),
        },
    )
    health = await checked_server(nursery, config, healthy=True)
    assert "HTTP 200" in details(health)


async def test_edge_serves_requests_to_a_proxy_protocol_backend(
    nginx_backends: NginxBackends,
) -> None:
    # The issue's setup: HTTP mode, send_proxy = "v2" to nginx `proxy_protocol`,
    # http checks. The checks used to take the server down: every request 503.
    config = make_config(
        [{"name": "in", "backend": "b", "mode": "http"}],
        [
            {
                "name": "b",
                "servers": [f"127.0.0.1:{nginx_backends.proxy}"],
                "send_proxy": "v2",
                "health": {**FAST, "kind": "http", "path": "/"},
            }
        ],
    )
    async with running_edge(config) as edge:
        (health,) = edge._pools["b"].servers
        await wait_until(
            lambda: len(health.state.history) >= 2 and health.server.healthy
        )
        response = await exchange(
            address_of(edge, "in"),
            b"GET / HTTP/1.1\r\nHost: app.test\r\nConnection: close\r\n\r\n",
        )
    assert response.startswith(b"HTTP/1.1 200 "), response
    assert response.endswith(b"\r\n\r\nok\n")


# -- an app that checks the Host header ------------------------------------------

#: A stand-in for a Django app with ``ALLOWED_HOSTS = ["app.example.com"]``:
#: Python's http.server in a process of its own. A request for another Host
#: gets 400, as Django answers a DisallowedHost; ``/healthz`` answers 200,
#: ``/private`` redirects to a login page (``@login_required``).
_HOST_CHECKING_APP = """
import http.server
import sys

ALLOWED_HOSTS = {"app.example.com"}


class App(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        host = self.headers.get("Host", "").partition(":")[0]
        if host not in ALLOWED_HOSTS:
            self.answer(400, b"Bad Request (400)")
        elif self.path == "/private":
            self.answer(302, b"", [("Location", "/login/?next=/private")])
        else:
            self.answer(200, b"ok")

    def answer(self, status, body, headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), App)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@contextlib.asynccontextmanager
async def host_checking_app() -> AsyncIterator[int]:
    """Run `_HOST_CHECKING_APP`; yields its port."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", _HOST_CHECKING_APP], stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    try:
        said = b""
        with trio.fail_after(20):
            while not said.endswith(b"\n"):
                chunk = await process.stdout.receive_some()
                assert chunk, "the app exited before it said its port"
                said += chunk
        yield int(said)
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
        await process.stdout.aclose()


async def test_http_checks_send_the_host_the_app_allows() -> None:
    # The issue's setup: an HTTP-mode edge in front of an app that refuses
    # Hosts it does not serve. Checks with the server's address as Host got
    # 400, the server went DOWN and every request got 503; with
    # [backends.health] host it stays UP and requests get through.
    check = {**FAST, "kind": "http", "path": "/healthz"}
    async with host_checking_app() as port:
        server = f"127.0.0.1:{port}"
        config = make_config(
            [
                {"name": "by-address", "backend": "by-address", "mode": "http"},
                {"name": "by-name", "backend": "by-name", "mode": "http"},
            ],
            [
                {"name": "by-address", "servers": [server], "health": check},
                {
                    "name": "by-name",
                    "servers": [server],
                    "health": {**check, "host": "app.example.com"},
                },
            ],
        )
        request = (
            b"GET /healthz HTTP/1.1\r\nHost: app.example.com\r\n"
            b"Connection: close\r\n\r\n"
        )
        async with running_edge(config) as edge:
            (by_address,) = edge._pools["by-address"].servers
            (by_name,) = edge._pools["by-name"].servers
            await wait_until(
                lambda: (
                    len(by_address.state.history) >= 2
                    and len(by_name.state.history) >= 2
                )
            )
            assert not by_address.server.healthy
            assert details(by_address) == {"HTTP 400 (expected 200-399)"}
            refused = await exchange(address_of(edge, "by-address"), request)
            assert refused.startswith(b"HTTP/1.1 503 "), refused
            assert by_name.server.healthy
            assert details(by_name) == {"HTTP 200"}
            served = await exchange(address_of(edge, "by-name"), request)
            assert served.startswith(b"HTTP/1.1 200 "), served
            assert served.endswith(b"\r\n\r\nok")


async def test_http_checks_pass_only_on_the_expected_statuses() -> None:
    # A check of a page behind a login: the app redirects (302) to its login
    # page, which the default 2xx/3xx takes for healthy; expect = [200] does not.
    check = {**FAST, "kind": "http", "path": "/private", "host": "app.example.com"}
    async with host_checking_app() as port, trio.open_nursery() as nursery:
        server = f"127.0.0.1:{port}"
        default = await checked_server(
            nursery, backend_config(port, check), healthy=True
        )
        assert details(default) == {"HTTP 302"}
        strict = await checked_server(
            nursery, backend_config(port, {**check, "expect": [200]}), healthy=False
        )
        assert details(strict) == {"HTTP 302 (expected 200)"}
        assert str(strict.server) == server
        nursery.cancel_scope.cancel()
