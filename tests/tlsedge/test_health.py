from __future__ import annotations

import itertools
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing

from tlsedge._balancer import Balancer, Server
from tlsedge._health import (
    HISTORY_LENGTH,
    MAX_STATUS_LINE,
    PASSIVE_DOWN_TIME,
    HealthState,
    ServerHealth,
    run_health_checks,
)

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
    assert state.history[-1].detail == "HTTP 500"
    assert caplog.messages[-1] == (
        f"backend app server 127.0.0.1:{port} is DOWN after 3 failed checks "
        "(last: HTTP 500)"
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
        (b"HTTP/1.1 404 Not Found\r\n\r\n", False, "HTTP 404"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", False, "HTTP 101"),
        (b"HTTP/1.1 503 Busy\r\n\r\n", False, "HTTP 503"),
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
        ({"interval": 0.0}, "interval and timeout"),
        ({"timeout": -1.0}, "interval and timeout"),
        ({"kind": "http", "path": "healthz"}, "bad health check path"),
        ({"kind": "http", "path": "/a\r\nX: y"}, "bad health check path"),
        ({"kind": "http", "host_header": "a\r\nX: y"}, "bad health check host_header"),
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
