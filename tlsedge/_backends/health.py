"""Backend health: active checks (trio) and passive marking from real traffic.

Theory of operation
-------------------
Each server has a `HealthState` (pure bookkeeping) next to its `Server` (the state
the balancer reads). Results flow in from two places and both count as
*consecutive* results:

- Active checks: `run_health_checks` probes the server every ``interval`` seconds
  (a TCP connect, or an HTTP GET whose status must be one of ``expect``,
  2xx/3xx by default) and records a pass or a failure. A check speaks what
  the server expects from the edge: the backend's PROXY header version (a
  header for no client) and TLS with the backend's own client context, so a
  server that needs either is not marked down for a check it could never
  pass; an HTTP check sends the ``host`` it is given (an app that checks its
  Host header, as Django's ``ALLOWED_HOSTS`` does, answers 400 to any other).
- Passive results: the relay reports every upstream connect. A failed connect
  counts as a failure toward ``unhealthy_threshold``; a successful one resets the
  consecutive failure count.

A server starts healthy, so traffic flows at startup and with no checks at all.
The first active check result then decides the initial state outright
(`HealthState.record_first_check`; HAProxy's ``init-state up``): a backend that
refuses the very first probe should not receive traffic for another
``unhealthy_threshold * interval`` seconds (a minute with AWS defaults).
After that, a healthy server goes down after ``unhealthy_threshold``
consecutive failures, and a down server comes back after ``healthy_threshold``
consecutive active passes.

Without active checks nothing would ever bring a passively marked server back, so
then it is down for `PASSIVE_DOWN_TIME` (Envoy's base ejection time) and the
balancer offers it traffic again afterwards (`Server.down_until`, a half-open
trial): the first successful connect brings it back, the next failed one ejects it
for another cool-down. `run_health_checks` switches its `HealthState` to active
mode while it runs and back to passive mode when it stops (on reload), so a
server never stays down with nobody to bring it back.

Every change of ``HealthState`` goes through a helper here that copies it to the
`Server` and logs UP/DOWN transitions at WARNING on ``tlsedge.health``.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import re
import socket
import ssl
import time
from collections.abc import Callable
from typing import Final, NamedTuple, NoReturn

import trio

from proxyproto import ProxyHeader, encode_v1, encode_v2
from tlsedge._core.balancer import Server
from tlsedge._tls.stream import TLSStream

__all__ = [
    "DEFAULT_EXPECT",
    "DEFAULT_HEALTHY_THRESHOLD",
    "DEFAULT_INTERVAL",
    "DEFAULT_TIMEOUT",
    "DEFAULT_UNHEALTHY_THRESHOLD",
    "HEALTH_CHECK_KINDS",
    "HISTORY_LENGTH",
    "MAX_STATUS_LINE",
    "PASSIVE_DOWN_TIME",
    "CheckResult",
    "HealthState",
    "ServerHealth",
    "run_health_checks",
]

LOGGER = logging.getLogger("tlsedge.health")

# Defaults are the AWS Classic Load Balancer health-check defaults (the seeds'
# `aws-load-balancer-healthcheck-*` annotations): interval 10 s, timeout 5 s,
# healthy threshold 2, unhealthy threshold 6.
DEFAULT_INTERVAL: Final = 10.0
DEFAULT_TIMEOUT: Final = 5.0
DEFAULT_HEALTHY_THRESHOLD: Final = 2
DEFAULT_UNHEALTHY_THRESHOLD: Final = 6

#: How long a server marked down by failed real traffic stays out when no active
#: check runs: Envoy outlier detection's ``base_ejection_time`` default (30 s).
PASSIVE_DOWN_TIME: Final = 30.0

#: Results kept per server for the status page.
HISTORY_LENGTH: Final = 10

#: Bytes read at most while waiting for an HTTP check's status line. A status
#: line is ~20 bytes; 4 KiB leaves room for odd servers without letting a
#: misbehaving one make us buffer much.
MAX_STATUS_LINE: Final = 4096

#: The ``kind`` values of ``[backends.health]``.
HEALTH_CHECK_KINDS: Final = ("tcp", "http")

#: The statuses an HTTP check passes on unless told (``expect``): 2xx and 3xx,
#: as HAProxy's ``option httpchk`` and Kubernetes' httpGet probes.
DEFAULT_EXPECT: Final = ((200, 399),)

# What a check sends first, by the backend's ``send_proxy``: a header that
# describes no client (v2 LOCAL, v1 UNKNOWN), as HAProxy's
# ``check-send-proxy`` does. Receivers then use the connection's own
# addresses, and the check is not taken for a client.
_CHECK_PROXY_HEADERS: Final = {
    "none": b"",
    "v1": encode_v1(ProxyHeader.unknown()),
    "v2": encode_v2(ProxyHeader.local()),
}

_USER_AGENT: Final = "tlsedge-health"

# ALPN outcomes an HTTP/1.1 check can talk over (None: no ALPN negotiated).
_HTTP1_ALPN: Final = (None, "http/1.1", "http/1.0")

# "HTTP/1.x NNN" then a space (reason phrase) or the end of the line.
_STATUS_LINE: Final = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?:[ \t][^\r\n]*)?\r?\n")

# Characters that would let a config value inject headers into the check request.
_FORBIDDEN_IN_REQUEST: Final = re.compile(r"[\x00-\x20\x7f]")


class CheckResult(NamedTuple):
    """One entry of `HealthState.history`."""

    #: Caller-supplied timestamp.
    time: float
    #: Whether it counted as a pass.
    ok: bool
    #: What happened ("HTTP 200", "connection refused", "timeout after 5 s").
    detail: str
    #: "check" for active checks, "traffic" for real connections.
    source: str


class HealthState:
    """Consecutive-result bookkeeping for one server. Pure: no I/O, no clock.

    Callers pass the current time (the same monotonic clock the `Balancer`
    uses) to every ``record_*`` method; each returns whether the server's
    healthy/down state changed.

    Args:
        healthy_threshold: Consecutive active passes that bring a down server up.
        unhealthy_threshold: Consecutive failures (active or from traffic) that
            take a healthy server down.
        active_checks: Whether an active checker runs for this server.
            `run_health_checks` sets this itself while it runs.
        passive_down_time: Cool-down before a passively marked server gets trial
            traffic, when no active checks run.

    Attributes:
        healthy: Current state; starts True so traffic flows at startup.
        successes: Consecutive active passes.
        failures: Consecutive failures.
        down_until: When a passive-mode down server may get trial traffic (copied
            to `Server.down_until`); None while healthy or in active mode.
        history: The last `HISTORY_LENGTH` active results and traffic failures
            (successful real connections are too frequent to be worth keeping).

    Raises:
        ValueError: a threshold below 1 or a negative passive_down_time.
    """

    __slots__ = (
        "active_checks",
        "down_until",
        "failures",
        "healthy",
        "healthy_threshold",
        "history",
        "passive_down_time",
        "successes",
        "unhealthy_threshold",
    )

    def __init__(
        self,
        *,
        healthy_threshold: int = DEFAULT_HEALTHY_THRESHOLD,
        unhealthy_threshold: int = DEFAULT_UNHEALTHY_THRESHOLD,
        active_checks: bool = False,
        passive_down_time: float = PASSIVE_DOWN_TIME,
    ) -> None:
        """Create a healthy state; see the class docstring for the arguments."""
        if healthy_threshold < 1 or unhealthy_threshold < 1:
            raise ValueError(
                "thresholds must be at least 1, got "
                f"healthy={healthy_threshold} unhealthy={unhealthy_threshold}"
            )
        if passive_down_time < 0:
            raise ValueError(f"passive_down_time must be >= 0: {passive_down_time}")
        self.healthy_threshold = healthy_threshold
        self.unhealthy_threshold = unhealthy_threshold
        self.active_checks = active_checks
        self.passive_down_time = passive_down_time
        self.healthy = True
        self.successes = 0
        self.failures = 0
        self.down_until: float | None = None
        self.history: collections.deque[CheckResult] = collections.deque(
            maxlen=HISTORY_LENGTH
        )

    def __repr__(self) -> str:
        return (
            f"HealthState(healthy={self.healthy}, successes={self.successes}, "
            f"failures={self.failures}, down_until={self.down_until})"
        )

    @property
    def last_detail(self) -> str:
        """The detail of the most recent recorded result ("" if none)."""
        return self.history[-1].detail if self.history else ""

    def is_available(self, now: float) -> bool:
        """Whether the balancer may use the server at ``now`` (healthy or trial)."""
        return self.healthy or (self.down_until is not None and now >= self.down_until)

    def record_success(self, now: float, detail: str = "ok") -> bool:
        """Record a passed active check.

        Returns:
            True if this brought the server up.
        """
        self.history.append(CheckResult(now, True, detail, "check"))
        self.failures = 0
        self.successes += 1
        if not self.healthy and self.successes >= self.healthy_threshold:
            self._mark_up()
            return True
        return False

    def record_failure(self, now: float, detail: str) -> bool:
        """Record a failed active check.

        Returns:
            True if this took the server down.
        """
        self.history.append(CheckResult(now, False, detail, "check"))
        self.successes = 0
        self.failures += 1
        if self.healthy and self.failures >= self.unhealthy_threshold:
            self._mark_down(now)
            return True
        return False

    def record_first_check(self, now: float, ok: bool, detail: str) -> bool:
        """Record the first active check, which sets the state outright.

        Returns:
            True if the state changed.
        """
        self.history.append(CheckResult(now, ok, detail, "check"))
        if ok:
            self.failures = 0
            self.successes = 1
            if not self.healthy:
                self._mark_up()
                return True
            return False
        self.successes = 0
        self.failures += 1
        if self.healthy:
            self._mark_down(now)
            return True
        return False

    def record_connect_success(self, now: float) -> bool:
        """Record a successful upstream connect from real traffic.

        Resets the consecutive failure count. In passive mode it also ends a
        passive ejection (the half-open trial succeeded); in active mode only
        active checks bring a server back.

        Returns:
            True if this brought the server up.
        """
        self.failures = 0
        if not self.healthy and not self.active_checks:
            self._mark_up()
            return True
        return False

    def record_connect_failure(self, now: float, detail: str) -> bool:
        """Record a failed upstream connect from real traffic.

        Counts toward ``unhealthy_threshold``. In passive mode, a failure while
        already down (a failed trial) restarts the cool-down.

        Returns:
            True if this took the server down.
        """
        self.history.append(CheckResult(now, False, detail, "traffic"))
        self.successes = 0
        self.failures += 1
        if self.healthy:
            if self.failures >= self.unhealthy_threshold:
                self._mark_down(now)
                return True
            return False
        if not self.active_checks:
            self.down_until = now + self.passive_down_time
        return False

    def start_active_checks(self) -> None:
        """Switch to active mode: only active passes bring a down server back."""
        self.active_checks = True
        self.down_until = None

    def stop_active_checks(self, now: float) -> None:
        """Switch to passive mode; a down server gets a trial after the cool-down."""
        self.active_checks = False
        if not self.healthy and self.down_until is None:
            self.down_until = now + self.passive_down_time

    def _mark_up(self) -> None:
        self.healthy = True
        self.down_until = None

    def _mark_down(self, now: float) -> None:
        self.healthy = False
        self.successes = 0
        self.down_until = None if self.active_checks else now + self.passive_down_time


def _sync(server: Server, state: HealthState) -> None:
    server.healthy = state.healthy
    server.down_until = state.down_until


def _log_transition(
    backend: str, server: Server, state: HealthState, what: str
) -> None:
    """Log an UP/DOWN change at WARNING. ``what`` is "check" or "connect"."""
    if state.healthy:
        if what == "connect":
            LOGGER.warning(
                "backend %s server %s is UP (trial connection succeeded)",
                backend,
                server,
            )
        else:
            LOGGER.warning(
                "backend %s server %s is UP after %d passed %s%s",
                backend,
                server,
                state.successes,
                what,
                "" if state.successes == 1 else "s",
            )
    elif state.down_until is not None:
        LOGGER.warning(
            "backend %s server %s is DOWN after %d failed %s%s (last: %s); "
            "trial traffic in %g s",
            backend,
            server,
            state.failures,
            what,
            "" if state.failures == 1 else "s",
            state.last_detail,
            state.passive_down_time,
        )
    else:
        LOGGER.warning(
            "backend %s server %s is DOWN after %d failed %s%s (last: %s)",
            backend,
            server,
            state.failures,
            what,
            "" if state.failures == 1 else "s",
            state.last_detail,
        )


class ServerHealth:
    """A `Server` with its `HealthState`: what the relay reports connects to.

    Args:
        server: The shared server state the balancer reads.
        state: Its health bookkeeping (a fresh passive-mode one by default).
        backend: Backend name for log lines.
        clock: Must be the `Balancer`'s clock (default `time.monotonic`), since
            it sets `Server.down_until`, which the balancer compares against.
    """

    __slots__ = ("backend", "clock", "server", "state")

    def __init__(
        self,
        server: Server,
        state: HealthState | None = None,
        *,
        backend: str = "-",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Bundle a server and its state; see the class docstring."""
        self.server = server
        self.state = state if state is not None else HealthState()
        self.backend = backend
        self.clock = clock

    def connect_succeeded(self) -> None:
        """Report a successful upstream connect from real traffic."""
        if self.state.record_connect_success(self.clock()):
            _sync(self.server, self.state)
            _log_transition(self.backend, self.server, self.state, "connect")

    def connect_failed(self, detail: str) -> None:
        """Report a failed upstream connect (refused, reset, timed out)."""
        state = self.state
        was_down = not state.healthy
        changed = state.record_connect_failure(self.clock(), detail)
        _sync(self.server, state)
        if changed:
            _log_transition(self.backend, self.server, state, "connect")
        elif was_down and state.down_until is not None:
            LOGGER.info(
                "backend %s server %s trial connection failed (%s); next trial in %g s",
                self.backend,
                self.server,
                detail,
                state.passive_down_time,
            )

    async def run_checks(
        self,
        *,
        kind: str = "tcp",
        path: str = "/",
        interval: float = DEFAULT_INTERVAL,
        timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (per check, see below)
        host_header: str = "",
        expect: tuple[tuple[int, int], ...] = DEFAULT_EXPECT,
        send_proxy: str = "none",
        tls_context: ssl.SSLContext | None = None,
        server_hostname: str = "",
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> NoReturn:
        """`run_health_checks` for this server, state, backend name and clock."""
        await run_health_checks(
            self.server,
            self.state,
            kind=kind,
            path=path,
            interval=interval,
            timeout=timeout,
            host_header=host_header,
            expect=expect,
            send_proxy=send_proxy,
            tls_context=tls_context,
            server_hostname=server_hostname,
            backend=self.backend,
            clock=self.clock,
            task_status=task_status,
        )


def _describe_error(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    return (exc.strerror or type(exc).__name__).lower()


class _CheckTransport(trio.abc.Stream):
    """A check's TCP stream that notes whether and how the server ended it.

    A server that ends the connection after our PROXY header without a byte
    of reply refused the header; `_check_once` says so.
    """

    __slots__ = ("ended", "replied", "stream")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        #: Whether any byte came from the server.
        self.replied = False
        #: How the server ended the connection ("connection closed",
        #: "connection reset"), or None while it has not.
        self.ended: str | None = None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.stream.send_all(data)
        except trio.BrokenResourceError as exc:
            self._broke(exc)
            raise

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            data = await self.stream.receive_some(max_bytes)
        except trio.BrokenResourceError as exc:
            self._broke(exc)
            raise
        if data:
            self.replied = True
        else:
            self.ended = "connection closed"
        return bytes(data)

    async def aclose(self) -> None:
        await self.stream.aclose()

    def _broke(self, exc: trio.BrokenResourceError) -> None:
        cause = exc.__cause__
        self.ended = (
            _describe_error(cause) if isinstance(cause, OSError) else "connection lost"
        )


def _describe_broken(exc: BaseException, transport: _CheckTransport) -> str:
    """Why a check's stream broke, in words for the log: the innermost cause."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLEOFError):
        return (exc.reason or str(exc)).replace("_", " ").lower()
    if transport.ended is not None:
        return transport.ended
    return str(exc) or type(exc).__name__


class _Probe(NamedTuple):
    """What every check of one server does; built once by `run_health_checks`."""

    family: int
    address: tuple[str, int]
    #: Sent first (b"" with ``send_proxy = "none"``); see `_CHECK_PROXY_HEADERS`.
    proxy_header: bytes
    #: The backend's client context with ``protocol = "tls"``, else None.
    tls_context: ssl.SSLContext | None
    #: SNI and the name the certificate must match (with ``tls_context``).
    server_hostname: str
    #: The HTTP request (``kind = "http"``), or None (``kind = "tcp"``).
    request: bytes | None
    #: The statuses that pass an HTTP check: inclusive ranges.
    expect: tuple[tuple[int, int], ...]


def _statuses(ranges: tuple[tuple[int, int], ...]) -> str:
    """``"200, 204, 300-399"``: statuses and ranges as the configuration has them."""
    return ", ".join(
        str(low) if low == high else f"{low}-{high}" for low, high in ranges
    )


async def _read_status_line(
    stream: trio.abc.ReceiveStream, expect: tuple[tuple[int, int], ...]
) -> tuple[bool, str]:
    """Read up to `MAX_STATUS_LINE` bytes until the first line; judge the
    status against *expect*."""
    buffer = bytearray()
    while b"\n" not in buffer:
        if len(buffer) >= MAX_STATUS_LINE:
            return False, f"no status line in the first {MAX_STATUS_LINE} bytes"
        chunk = await stream.receive_some(MAX_STATUS_LINE - len(buffer))
        if not chunk:
            return False, "connection closed before the status line"
        buffer += chunk
    match = _STATUS_LINE.match(buffer)
    if match is None:
        line = bytes(buffer[: buffer.index(b"\n")]).rstrip(b"\r")
        return False, f"bad status line {line[:80]!r}"
    status = int(match[1])
    if any(low <= status <= high for low, high in expect):
        return True, f"HTTP {status}"
    return False, f"HTTP {status} (expected {_statuses(expect)})"


async def _converse(probe: _Probe, transport: _CheckTransport) -> tuple[bool, str]:
    """The check on a connected transport, in the data path's order: PROXY
    header, TLS handshake, then with a request the request and its status line.

    Raises:
        trio.BrokenResourceError: the connection failed (other than in the TLS
            handshake, whose failure is a result).
    """
    if probe.proxy_header:
        await transport.send_all(probe.proxy_header)
    if probe.tls_context is None:
        stream: trio.abc.Stream = transport
        done = "connected"
    else:
        tls = TLSStream(
            transport,
            probe.tls_context,
            server_side=False,
            server_hostname=probe.server_hostname,
        )
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            return False, f"TLS handshake failed: {_describe_broken(exc, transport)}"
        stream = tls
        done = f"TLS handshake completed ({tls.ssl_object.version()})"
        alpn = tls.ssl_object.selected_alpn_protocol()
        if probe.request is not None and alpn not in _HTTP1_ALPN:
            # The backend's `alpn` let the server choose a protocol (h2)
            # that the GET below is not: say so rather than "bad status line".
            return False, f"the server chose ALPN {alpn!r}; http checks speak HTTP/1.1"
    if probe.request is None:
        return True, done
    await stream.send_all(probe.request)
    return await _read_status_line(stream, probe.expect)


async def _check_once(probe: _Probe) -> tuple[bool, str]:
    """One check: connect, then `_converse`.

    The caller bounds it with the ``timeout`` scope; the socket is closed on
    every path, cancellation included.
    """
    sock = trio.socket.socket(probe.family, socket.SOCK_STREAM)
    try:
        try:
            # Numeric address: trio converts it without a resolver thread.
            await sock.connect(probe.address)
        except OSError as exc:
            return False, _describe_error(exc)
        transport = _CheckTransport(trio.SocketStream(sock))
        try:
            ok, detail = await _converse(probe, transport)
        except trio.BrokenResourceError as exc:
            ok, detail = False, _describe_broken(exc, transport)
        if not ok and probe.proxy_header and transport.ended and not transport.replied:
            # Ended right after our header, without a byte of reply.
            detail = f"PROXY header refused: {transport.ended}"
        return ok, detail
    finally:
        sock.close()


async def _timed_check(probe: _Probe, limit: float) -> tuple[bool, str]:
    """`_check_once` within the health ``timeout`` (passed here as ``limit``)."""
    with trio.move_on_after(limit) as timeout:
        return await _check_once(probe)
    assert timeout.cancelled_caught
    return False, f"timeout after {limit:g} s"


async def run_health_checks(
    server: Server,
    state: HealthState,
    *,
    kind: str = "tcp",
    path: str = "/",
    port: int | None = None,
    interval: float = DEFAULT_INTERVAL,
    # Not this function's deadline (it runs forever) but each check's: the
    # `[backends.health] timeout` field, applied as a move_on_after scope.
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    host_header: str = "",
    expect: tuple[tuple[int, int], ...] = DEFAULT_EXPECT,
    send_proxy: str = "none",
    tls_context: ssl.SSLContext | None = None,
    server_hostname: str = "",
    backend: str = "-",
    clock: Callable[[], float] = time.monotonic,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Check ``server`` every ``interval`` seconds until cancelled.

    A check speaks what the server expects from the edge's own connections,
    in the same order: first the PROXY header of ``send_proxy`` (one that
    describes no client, `_CHECK_PROXY_HEADERS`, as HAProxy's
    ``check-send-proxy`` sends), then with ``tls_context`` a TLS handshake
    (SNI and certificate name ``server_hostname``), then:

    - ``"tcp"``: nothing more: the connect (and the handshake) succeeded, and
      the socket is closed right away;
    - ``"http"``: send ``GET {path} HTTP/1.1`` with ``Host: {host_header}``
      and ``Connection: close``, and read the status line (at most
      `MAX_STATUS_LINE` bytes): a status in ``expect`` passes, anything
      else (another status, garbage, EOF, reset, timeout) fails.

    All of it must finish within ``timeout`` (a `trio.move_on_after` scope).
    A failed check's detail says what failed: "connection refused", "TLS
    handshake failed: certificate verify failed: ...", "PROXY header refused:
    connection closed" (the server ended the connection after the header
    without a byte of reply), "HTTP 503 (expected 200-399)", "timeout after
    5 s".

    The first result sets the initial state outright; see the module docstring.
    Results update ``state`` and are copied to ``server``; UP/DOWN transitions
    are logged at WARNING. While running, ``state`` is in active mode; when
    cancelled it returns to passive mode, so a down server gets trial traffic
    after the passive cool-down rather than staying down forever.

    Checks are spaced ``interval`` apart start to start; a check that overruns
    the interval is followed by the next one at once.

    Args:
        server: The server to check (its numeric ``address`` is used as is).
        state: Its health state.
        kind: "tcp" or "http".
        path: Request target for "http".
        port: Check this port of the server's host instead of its own port
            (``[backends.health] port``: a service answering for servers whose
            port the check cannot reach, UDP servers). Such a check goes to
            another service than the edge's connections, so it sends no PROXY
            header.
        interval: Seconds between check starts.
        timeout: Seconds one check may take.
        host_header: Host header for "http" (default: ``server_hostname`` when
            it is a name, else the server's address).
        expect: The statuses that pass an "http" check, as inclusive
            ``(low, high)`` ranges (``[backends.health] expect``).
        send_proxy: "none", "v1" or "v2": the backend's ``send_proxy``.
        tls_context: The backend's client context (``protocol = "tls"``), the
            one its connections use; None for plain TCP.
        server_hostname: With ``tls_context``: the name sent as SNI and
            checked against the certificate (default: the server's IP).
        backend: Backend name for log lines.
        clock: Clock for `HealthState` timestamps; the `Balancer`'s clock.
        task_status: Started (with None) after the first check has completed,
            so that startup knows the initial state.

    Raises:
        ValueError: unknown kind or send_proxy, non-positive interval or
            timeout, a path or host_header that is empty or has spaces or
            control characters, or no status in ``expect``.
    """
    if kind not in HEALTH_CHECK_KINDS:
        raise ValueError(
            f"unknown health check kind {kind!r}; "
            f"choose one of {', '.join(HEALTH_CHECK_KINDS)}"
        )
    if send_proxy not in _CHECK_PROXY_HEADERS:
        raise ValueError(
            f"unknown send_proxy {send_proxy!r}; "
            f"choose one of {', '.join(_CHECK_PROXY_HEADERS)}"
        )
    if not (interval > 0 and timeout > 0):
        raise ValueError(f"interval and timeout must be > 0: {interval}, {timeout}")
    if not any(low <= high for low, high in expect):
        raise ValueError(f"no status would pass: expect = {expect!r}")
    address = server.address if port is None else (server.address[0], port)
    if port is not None:
        send_proxy = "none"
    server_hostname = server_hostname or address[0]
    request: bytes | None = None
    if kind == "http":
        host = host_header or (
            server_hostname
            if tls_context is not None and server_hostname != address[0]
            else str(Server(address))
        )
        if not path.startswith("/") or _FORBIDDEN_IN_REQUEST.search(path):
            raise ValueError(f"bad health check path {path!r}")
        if _FORBIDDEN_IN_REQUEST.search(host):
            raise ValueError(f"bad health check host_header {host!r}")
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
            f"User-Agent: {_USER_AGENT}\r\n\r\n"
        ).encode("ascii")
    probe = _Probe(
        family=socket.AF_INET6
        if ipaddress.ip_address(address[0]).version == 6
        else socket.AF_INET,
        address=address,
        proxy_header=_CHECK_PROXY_HEADERS[send_proxy],
        tls_context=tls_context,
        server_hostname=server_hostname,
        request=request,
        expect=expect,
    )

    state.start_active_checks()
    _sync(server, state)
    try:
        next_check = trio.current_time()
        ok, detail = await _timed_check(probe, timeout)
        changed = state.record_first_check(clock(), ok, detail)
        _sync(server, state)
        if changed:
            _log_transition(backend, server, state, "check")
        task_status.started()
        while True:
            next_check = max(next_check + interval, trio.current_time())
            await trio.sleep_until(next_check)
            ok, detail = await _timed_check(probe, timeout)
            if ok:
                changed = state.record_success(clock(), detail)
            else:
                changed = state.record_failure(clock(), detail)
                LOGGER.debug(
                    "backend %s server %s check failed: %s", backend, server, detail
                )
            _sync(server, state)
            if changed:
                _log_transition(backend, server, state, "check")
    finally:
        state.stop_active_checks(clock())
        _sync(server, state)
