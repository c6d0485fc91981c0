"""Prometheus metrics of one edge (``/metrics`` on the admin endpoint).

Theory of operation
-------------------
Every `Edge` owns an `EdgeMetrics`: a dedicated
:class:`prometheus_client.CollectorRegistry` (never the process-global default
one, so several edges in one process, as in the tests, do not mix) holding two
kinds of metrics:

- *Event metrics*, counters, gauges and histograms that the connection path
  updates: a connection was accepted (`EdgeMetrics.connection_opened`), a
  server's lease was taken or released and a new upstream connection made
  (`EdgeMetrics.server_leased` and friends, as the backend pool's
  `LeaseObserver`, in every mode), sent a bad PROXY header
  (`EdgeMetrics.proxy_header_error`), and ended (`EdgeMetrics.record`, which
  derives everything else from the finished `ConnectionLog`: termination
  cause, TLS outcome, bytes, duration). HTTP mode calls
  `EdgeMetrics.record_http_request` per request. A ``mode = "udp"`` flow
  counts as a connection (opened, recorded when it ends); its listener adds
  datagram counts per batch (`EdgeMetrics.udp_datagrams`) and each dropped
  datagram (`EdgeMetrics.udp_dropped`).
- *Live metrics*, read at scrape time by `LiveStateCollector` from a
  `Snapshot` of the edge (`Edge.snapshot`, passed in as a callable: this
  module never sees the `Edge`) rather than mirrored: server health
  (UP/DOWN, weight, consecutive results, the last check), listener settings
  and limits, readiness and drain state.

Several workers (``edge.workers > 1``)
--------------------------------------
Each worker is a process with its own counters. The supervisor creates a
directory and passes it to the workers as ``PROMETHEUS_MULTIPROC_DIR``;
``prometheus_client`` then keeps every event metric in memory-mapped files there
(one per process), and the registry served on ``/metrics`` holds a
:class:`prometheus_client.multiprocess.MultiProcessCollector`, which adds up the
files of every worker. Any worker answering a scrape therefore reports the
totals of all workers; counters of a worker that died stay in the total (they
are monotonic), and gauges use ``multiprocess_mode="livesum"`` so that a dead
worker's open connections drop out (the supervisor calls
`worker_exited`, i.e. ``mark_process_dead``).

The live collector cannot see other processes: its metrics describe the worker
that answered the scrape. Every worker runs the same health checks against the
same servers and drains on the same signal, so the views agree up to one check
interval; the ``tlsedge_worker_info`` gauge names the worker that answered.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    multiprocess,
    values,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tlsedge._accesslog import ConnectionLog
from tlsedge._snapshot import Snapshot
from tlsedge._termination import Termination

__all__ = [
    "MULTIPROC_ENV",
    "REFUSED_TERMINATIONS",
    "EdgeMetrics",
    "LiveStateCollector",
    "multiprocess_directory",
    "tls_failure_reason",
    "worker_exited",
]

#: The environment variable prometheus-client reads for multiprocess mode.
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

#: Termination causes of connections refused before any byte was relayed.
REFUSED_TERMINATIONS: Final = frozenset(
    {
        Termination.REJECTED,
        Termination.DENIED,
        Termination.HEADER_ERROR,
        Termination.HEADER_TIMEOUT,
        Termination.TLS_ERROR,
        Termination.TLS_HANDSHAKE_TIMEOUT,
        Termination.NO_SERVER,
        Termination.CONNECT_FAILED,
    }
)

#: Causes that mean a TLS handshake with the client was attempted and failed.
_TLS_FAILURES: Final = frozenset(
    {Termination.TLS_ERROR, Termination.TLS_HANDSHAKE_TIMEOUT}
)

#: Connection durations: from a refused client (ms) to long-lived streams (h).
CONNECTION_BUCKETS: Final = (
    0.005,
    0.025,
    0.1,
    0.5,
    1.0,
    5.0,
    30.0,
    120.0,
    600.0,
    3600.0,
)

#: HTTP request latencies (HTTP mode), the usual web-service buckets.
HTTP_BUCKETS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

_SSL_REASON: Final = re.compile(r"\[SSL: ([A-Z0-9_]+)\]")
_LABEL_SAFE: Final = re.compile(r"[^a-z0-9_]+")


def tls_failure_reason(termination: str, detail: str | None) -> str:
    """A short, bounded label for a failed client TLS handshake.

    The OpenSSL reason code from the access log's detail (``"[SSL:
    NO_SHARED_CIPHER] ..."`` gives ``"no_shared_cipher"``), ``"timeout"`` for
    ``tls_handshake_timeout``, ``"eof"`` when the client went away, else
    ``"other"``.
    """
    if termination == Termination.TLS_HANDSHAKE_TIMEOUT:
        return "timeout"
    text = detail or ""
    match = _SSL_REASON.search(text)
    if match is not None:
        return _LABEL_SAFE.sub("_", match[1].lower())[:64]
    lowered = text.lower()
    if "eof" in lowered or "closed" in lowered or "reset" in lowered:
        return "eof"
    return "other"


def _multiprocess_path() -> str | None:
    """The multiprocess directory if prometheus-client writes to it, else None.

    prometheus-client picks its value class when it is imported, so the
    variable must be in the environment before the process starts (the
    supervisor sets it for the workers).
    """
    path = os.environ.get(MULTIPROC_ENV)
    active = bool(getattr(values.ValueClass, "_multiprocess", False))
    if path and active and os.path.isdir(path):
        return path
    return None


_M = TypeVar("_M", Counter, Gauge, Histogram)


class _Children(Generic[_M]):
    """A labelled metric's children, each looked up once.

    ``labels()`` checks and converts the values and takes a lock at every call
    (~1 us); the connection path calls it a dozen times per connection. Children
    are still created by ``labels()`` on first use, as before, so the exposed
    series and values are the same.
    """

    __slots__ = ("_children", "_metric")

    _metric: _M
    _children: dict[tuple[str, ...], _M]

    def __init__(self, metric: _M) -> None:
        self._metric = metric
        self._children = {}

    def __call__(self, *values: str) -> _M:
        """The child for *values*: ``metric.labels(*values)``, cached."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


@dataclass(frozen=True, slots=True)
class _Counters:
    """The event metrics (see ``docs/operations.md`` for each one), each
    called with its label values to get the child."""

    accepted: _Children[Counter]
    active: _Children[Gauge]
    closed: _Children[Counter]
    refused: _Children[Counter]
    duration: _Children[Histogram]
    bytes_received: _Children[Counter]
    bytes_sent: _Children[Counter]
    proxy_errors: _Children[Counter]
    tls_handshakes: _Children[Counter]
    tls_failures: _Children[Counter]
    server_connections: _Children[Counter]
    server_active: _Children[Gauge]
    server_bytes_sent: _Children[Counter]
    server_bytes_received: _Children[Counter]
    connect_failures: _Children[Counter]
    no_server: _Children[Counter]
    retries: _Children[Counter]
    http_requests: _Children[Counter]
    http_duration: _Children[Histogram]
    udp_datagrams: _Children[Counter]
    udp_dropped: _Children[Counter]


def _make_counters(registry: CollectorRegistry | None) -> _Counters:
    r = registry
    listener = ("listener",)
    server = ("backend", "server")
    return _Counters(
        accepted=_Children(
            Counter(
                "tlsedge_connections",
                "Client connections accepted.",
                listener,
                registry=r,
            ),
        ),
        active=_Children(
            Gauge(
                "tlsedge_connections_active",
                "Client connections open now.",
                listener,
                registry=r,
                multiprocess_mode="livesum",
            ),
        ),
        closed=_Children(
            Counter(
                "tlsedge_connections_closed",
                "Client connections ended, by termination cause (access log).",
                ("listener", "termination"),
                registry=r,
            ),
        ),
        refused=_Children(
            Counter(
                "tlsedge_connections_refused",
                "Client connections closed before anything was relayed, by reason.",
                ("listener", "reason"),
                registry=r,
            ),
        ),
        duration=_Children(
            Histogram(
                "tlsedge_connection_duration_seconds",
                "How long client connections lasted.",
                listener,
                registry=r,
                buckets=CONNECTION_BUCKETS,
            ),
        ),
        bytes_received=_Children(
            Counter(
                "tlsedge_client_bytes_received",
                "Bytes received from clients (after PROXY and TLS unwrapping).",
                listener,
                registry=r,
            ),
        ),
        bytes_sent=_Children(
            Counter(
                "tlsedge_client_bytes_sent",
                "Bytes sent to clients (before TLS).",
                listener,
                registry=r,
            ),
        ),
        proxy_errors=_Children(
            Counter(
                "tlsedge_proxy_header_errors",
                "PROXY protocol headers refused, by reason.",
                ("listener", "reason"),
                registry=r,
            ),
        ),
        tls_handshakes=_Children(
            Counter(
                "tlsedge_tls_handshakes",
                "Completed TLS handshakes with clients, by protocol version.",
                ("listener", "version"),
                registry=r,
            ),
        ),
        tls_failures=_Children(
            Counter(
                "tlsedge_tls_handshake_failures",
                "Failed TLS handshakes with clients, by reason.",
                ("listener", "reason"),
                registry=r,
            ),
        ),
        server_connections=_Children(
            Counter(
                "tlsedge_server_connections",
                "Upstream connections made to a backend server.",
                server,
                registry=r,
            ),
        ),
        server_active=_Children(
            Gauge(
                "tlsedge_server_active_connections",
                "Upstream connections in use to a backend server now.",
                server,
                registry=r,
                multiprocess_mode="livesum",
            ),
        ),
        server_bytes_sent=_Children(
            Counter(
                "tlsedge_server_bytes_sent",
                "Bytes forwarded to a backend server (client data, no PROXY header).",
                server,
                registry=r,
            ),
        ),
        server_bytes_received=_Children(
            Counter(
                "tlsedge_server_bytes_received",
                "Bytes received from a backend server.",
                server,
                registry=r,
            ),
        ),
        connect_failures=_Children(
            Counter(
                "tlsedge_backend_connect_failures",
                "Client connections dropped because every connect attempt failed.",
                ("backend",),
                registry=r,
            ),
        ),
        no_server=_Children(
            Counter(
                "tlsedge_backend_no_server",
                "Client connections dropped because no server was healthy.",
                ("backend",),
                registry=r,
            ),
        ),
        retries=_Children(
            Counter(
                "tlsedge_backend_retries",
                "Extra connect attempts made by connections that reached a server.",
                ("backend",),
                registry=r,
            ),
        ),
        http_requests=_Children(
            Counter(
                "tlsedge_http_requests",
                "HTTP requests (HTTP mode), by response status class.",
                ("listener", "backend", "code"),
                registry=r,
            ),
        ),
        http_duration=_Children(
            Histogram(
                "tlsedge_http_request_duration_seconds",
                "HTTP request latency (HTTP mode): request head in to response done.",
                ("listener", "backend"),
                registry=r,
                buckets=HTTP_BUCKETS,
            ),
        ),
        udp_datagrams=_Children(
            Counter(
                "tlsedge_udp_datagrams",
                "Datagrams relayed by udp listeners, by direction "
                "(from_client, from_server); flows count as connections.",
                ("listener", "direction"),
                registry=r,
            ),
        ),
        udp_dropped=_Children(
            Counter(
                "tlsedge_udp_datagrams_dropped",
                "Datagrams udp listeners dropped, by reason (flow_cap, denied, "
                "no_server, draining, rejected, header_error, ...).",
                ("listener", "reason"),
                registry=r,
            ),
        ),
    )


def _status_class(status: int) -> str:
    if 100 <= status <= 599:
        return f"{status // 100}xx"
    return "other"


class EdgeMetrics:
    """The metrics of one edge: event counters plus the live-state collector.

    Args:
        snapshot: Gives the edge's live state at scrape time (`Edge.snapshot`;
            None: event metrics only, for tests of this module).

    Attributes:
        registry: What ``/metrics`` serves. In multiprocess mode it holds only
            the `MultiProcessCollector` and the live collector; the event
            metrics write to the shared directory instead.
        multiprocess_dir: The shared directory, or None in single-process mode.
    """

    def __init__(self, snapshot: Callable[[], Snapshot] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess_dir = _multiprocess_path()
        if self.multiprocess_dir is not None:
            multiprocess.MultiProcessCollector(  # type: ignore[no-untyped-call]
                self.registry, path=self.multiprocess_dir
            )
            self._m = _make_counters(None)
        else:
            self._m = _make_counters(self.registry)
        if snapshot is not None:
            self.registry.register(LiveStateCollector(snapshot))

    # -- connection path --------------------------------------------------

    def connection_opened(self, listener: str) -> None:
        """A client connection was accepted on *listener*."""
        self._m.accepted(listener).inc()
        self._m.active(listener).inc()

    def server_leased(self, backend: str, server: str) -> None:
        """A connection to *server* is opening or in use (a `ServerLease`)."""
        self._m.server_active(backend, server).inc()

    def server_released(self, backend: str, server: str) -> None:
        """The lease of `server_leased` was given back."""
        self._m.server_active(backend, server).dec()

    def server_connection_opened(
        self, backend: str, server: str, attempts: int
    ) -> None:
        """A new upstream connection to *server* was made after *attempts* tries."""
        self._m.server_connections(backend, server).inc()
        if attempts > 1:
            self._m.retries(backend).inc(attempts - 1)

    def proxy_header_error(self, listener: str, reason: str) -> None:
        """A PROXY header was refused; *reason* is ``RemoteProtocolError.reason``."""
        self._m.proxy_errors(listener, reason).inc()

    def record(self, log: ConnectionLog) -> None:
        """Account for a finished connection (call once, next to ``log.emit()``)."""
        m = self._m
        listener = log.listener
        m.active(listener).dec()
        m.closed(listener, log.termination).inc()
        if log.termination in REFUSED_TERMINATIONS:
            m.refused(listener, log.termination).inc()
        m.duration(listener).observe(log.duration)
        if log.bytes_from_client:
            m.bytes_received(listener).inc(log.bytes_from_client)
        if log.bytes_from_server:
            m.bytes_sent(listener).inc(log.bytes_from_server)
        if log.tls is not None:
            m.tls_handshakes(listener, log.tls.split(" ", 1)[0]).inc()
        elif log.termination in _TLS_FAILURES:
            reason = tls_failure_reason(log.termination, log.detail)
            m.tls_failures(listener, reason).inc()
        backend = log.backend or ""
        if log.server is not None:
            server = log.server
            if log.bytes_from_client:
                m.server_bytes_sent(backend, server).inc(log.bytes_from_client)
            if log.bytes_from_server:
                m.server_bytes_received(backend, server).inc(log.bytes_from_server)
        elif log.termination == Termination.CONNECT_FAILED:
            m.connect_failures(backend).inc()
        elif log.termination == Termination.NO_SERVER:
            m.no_server(backend).inc()

    def record_http_request(
        self, listener: str, backend: str, status: int, seconds: float
    ) -> None:
        """Account for one HTTP request (HTTP mode).

        Args:
            listener: The listener's name.
            backend: The backend's name.
            status: The response status sent to the client (502 and 504 for
                answers the edge made itself); counted by class, ``"2xx"``.
            seconds: From the complete request head to the last response byte.
        """
        self._m.http_requests(listener, backend, _status_class(status)).inc()
        self._m.http_duration(listener, backend).observe(seconds)

    def udp_datagrams(self, listener: str, direction: str, count: int) -> None:
        """*count* datagrams relayed on a udp *listener* (a batch at a time);
        *direction* is ``"from_client"`` or ``"from_server"``."""
        self._m.udp_datagrams(listener, direction).inc(count)

    def udp_dropped(self, listener: str, reason: str) -> None:
        """A datagram a udp *listener* dropped, and why (`tlsedge._udp_mode`)."""
        self._m.udp_dropped(listener, reason).inc()

    # -- exposition -------------------------------------------------------

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The ``/metrics`` body and its content type (negotiated from *accept*)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """Every sample the registry holds now: ``(name, labels, value)``."""
        for family in self.registry.collect():
            for sample in family.samples:
                yield sample.name, sample.labels, sample.value


class LiveStateCollector(Collector):
    """Reports the edge's state at scrape time (see the module docstring).

    Args:
        snapshot: Called once per scrape; the edge's `Edge.snapshot`.
    """

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        """The live metrics, built afresh for each scrape."""
        snapshot = self._snapshot()
        info = GaugeMetricFamily(
            "tlsedge_worker_info",
            "The worker (process) that answered this scrape; value 1.",
            labels=("version", "pid", "workers"),
        )
        info.add_metric((snapshot.version, str(snapshot.pid), str(snapshot.workers)), 1)
        yield info
        yield GaugeMetricFamily(
            "tlsedge_start_time_seconds",
            "When this worker started (seconds since the epoch).",
            value=snapshot.started,
        )
        yield GaugeMetricFamily(
            "tlsedge_ready",
            "1 while listeners are up and the edge is not draining (/readyz).",
            value=1 if snapshot.ready and not snapshot.draining else 0,
        )
        yield GaugeMetricFamily(
            "tlsedge_draining",
            "1 once draining started (SIGTERM): no new connections are accepted.",
            value=1 if snapshot.draining else 0,
        )
        yield from self._listeners(snapshot)
        yield from self._servers(snapshot)

    @staticmethod
    def _listeners(snapshot: Snapshot) -> Iterator[Metric]:
        listener_info = GaugeMetricFamily(
            "tlsedge_listener_info",
            "A configured listener and its settings; value 1.",
            labels=("listener", "bind", "mode", "tls", "proxy_protocol", "backend"),
        )
        limit = GaugeMetricFamily(
            "tlsedge_listener_max_connections",
            "The listener's max_connections.",
            labels=("listener",),
        )
        for listener in snapshot.listeners:
            pp = listener.proxy_protocol
            listener_info.add_metric(
                (
                    listener.name,
                    listener.bind,
                    listener.mode,
                    listener.tls.policy if listener.tls is not None else "off",
                    "off"
                    if pp is None
                    else "v" + "+v".join(str(v) for v in pp.versions),
                    listener.backend,
                ),
                1,
            )
            limit.add_metric((listener.name,), listener.max_connections)
        yield listener_info
        yield limit

    @staticmethod
    def _servers(snapshot: Snapshot) -> Iterator[Metric]:
        labels = ("backend", "server")
        up = GaugeMetricFamily(
            "tlsedge_server_up",
            "1 while the backend server is healthy (UP), 0 while DOWN.",
            labels=labels,
        )
        weight = GaugeMetricFamily(
            "tlsedge_server_weight", "The server's balancing weight.", labels=labels
        )
        failures = GaugeMetricFamily(
            "tlsedge_server_check_consecutive_failures",
            "Consecutive failed checks and connects (toward unhealthy_threshold).",
            labels=labels,
        )
        successes = GaugeMetricFamily(
            "tlsedge_server_check_consecutive_successes",
            "Consecutive passed active checks (toward healthy_threshold).",
            labels=labels,
        )
        last_ok = GaugeMetricFamily(
            "tlsedge_server_last_check_success",
            "1 if the last active health check passed, 0 if it failed.",
            labels=labels,
        )
        last_age = GaugeMetricFamily(
            "tlsedge_server_last_check_age_seconds",
            "Seconds since the last active health check finished.",
            labels=labels,
        )
        for backend in snapshot.backends:
            for server in backend.servers:
                key = (backend.name, server.name)
                up.add_metric(key, 1 if server.healthy else 0)
                weight.add_metric(key, server.weight)
                failures.add_metric(key, server.failures)
                successes.add_metric(key, server.successes)
                last = server.last_check
                if last is not None:
                    last_ok.add_metric(key, 1 if last.ok else 0)
                    last_age.add_metric(key, last.age)
        yield from (up, weight, failures, successes, last_ok, last_age)


# -- the supervisor's side ---------------------------------------------------


class multiprocess_directory:
    """Context manager: the ``PROMETHEUS_MULTIPROC_DIR`` for a set of workers.

    Uses the variable's directory if the supervisor's environment has one
    (emptied of stale ``*.db`` files first: their counters belong to an earlier
    run), else makes a temporary directory and removes it on exit. Pass
    ``environment`` to the workers.
    """

    def __init__(self) -> None:
        self.path = ""
        self._owned = False

    def __enter__(self) -> multiprocess_directory:
        given = os.environ.get(MULTIPROC_ENV)
        if given:
            os.makedirs(given, exist_ok=True)
            for entry in os.listdir(given):
                if entry.endswith(".db"):
                    os.remove(os.path.join(given, entry))
            self.path = given
        else:
            self.path = tempfile.mkdtemp(prefix="tlsedge-metrics-")
            self._owned = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._owned:
            shutil.rmtree(self.path, ignore_errors=True)

    @property
    def environment(self) -> dict[str, str]:
        """``os.environ`` plus ``PROMETHEUS_MULTIPROC_DIR``, for the workers."""
        return {**os.environ, MULTIPROC_ENV: self.path}


def worker_exited(path: str, pid: int) -> None:
    """Drop the live gauges of a worker that exited (``mark_process_dead``)."""
    multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
