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
  cause, TLS outcome, bytes, duration). HTTP mode counts each request in
  its listener's `HttpRequestCounts` (`EdgeMetrics.http_requests`: the
  site's ``on_request``). Bytes are also counted
  while a connection runs (`EdgeMetrics.metering`, below). A ``mode = "udp"`` flow
  counts as a connection (opened, recorded when it ends); its listener adds
  datagram counts per batch (`EdgeMetrics.udp_datagrams`) and each dropped
  datagram (`EdgeMetrics.udp_dropped`).
- *Live metrics*, read at scrape time by `LiveStateCollector` from a
  `Snapshot` of the edge (`Edge.snapshot`, passed in as a callable: this
  module never sees the `Edge`) rather than mirrored: server health
  (UP/DOWN, weight, consecutive results, the last check), listener settings
  and limits, readiness and drain state.

Cost: counted here, handed over at scrape time
----------------------------------------------
The event methods run on the connection path, several per connection and per
HTTP request. Each prometheus-client update takes a lock (and in multiprocess
mode writes to a memory-mapped file), so they only count, in plain dicts
keyed by label values (`_Tally`, `_Observations`: no locks, a worker is one
trio thread), and `EdgeMetrics.flush` adds the counts to the
prometheus-client metrics. Every collection of the registry flushes first
(`_FlushFirst`), so ``/metrics``, the status page and `EdgeMetrics.samples`
see every event so far. The metrics themselves (names, labels, types, help,
buckets) are prometheus-client's, unchanged, and a child is still created by
``labels()`` at its first event, so a series appears when it did before.

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

A worker writes its counts to its files when it answers a scrape, every
`FLUSH_INTERVAL` (`EdgeMetrics.flush_periodically`) and when it stops
(`Edge.run`): a scrape answered by one worker shows the others' counts as
they were at most that long ago. A worker that is killed (SIGKILL) loses
the counts of its last interval.

Bytes while connections run
---------------------------
A relayed connection can run for hours (a WebSocket, a gRPC stream, a
database session) and an HTTP keep-alive connection for thousands of
requests: bytes counted only when it ends would leave the byte counters
flat while the traffic flows. So a connection that relays registers its
`Meter` (`EdgeMetrics.metering`: a tcp relay, an HTTP connection, a udp
flow) and each flush first folds in what every registered meter counted
since the last one (`EdgeMetrics._fold_live`), then `record` adds the rest
when the connection ends. The connection path itself is unchanged: it keeps
adding to its own counters (`RelayStats`, `HttpConnectionResult`, the udp
flow's `ConnectionLog`), with no call per read; the cost is a dict entry per
connection and, per flush, a look at each open one. A server's byte counts go
to the server the connection uses at the flush (an HTTP connection's requests
may go to several), bytes before it has one to the first it gets.

Every scrape flushes, so ``/metrics`` and ``/status`` show the bytes of open
connections up to that instant; with several workers, each folds its own
connections at its periodic flush, so a scrape answered by one worker shows
the others' open connections as they were at most `FLUSH_INTERVAL` ago.

The live collector cannot see other processes: its metrics describe the worker
that answered the scrape. Every worker runs the same health checks against the
same servers and drains on the same signal, so the views agree up to one check
interval; the ``tlsedge_worker_info`` gauge names the worker that answered.

Reloads (``tlsedge_config_*``) are neither summed nor per worker: the
supervisor keeps the edge's one `ReloadRecord` and hands it to every worker
(`tlsedge._control.workers`), and `EdgeMetrics.reloads` holds the copy the answering
worker reports, the same in all of them.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Final, Protocol, TypeVar

import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    multiprocess,
    values,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tlsedge._core.accesslog import ConnectionLog
from tlsedge._core.reload import ReloadRecord, ReloadResult
from tlsedge._core.snapshot import Snapshot
from tlsedge._core.termination import Termination

__all__ = [
    "FLUSH_INTERVAL",
    "MULTIPROC_ENV",
    "REFUSED_TERMINATIONS",
    "EdgeMetrics",
    "HttpRequestCounts",
    "LiveStateCollector",
    "Meter",
    "ReloadCollector",
    "multiprocess_directory",
    "tls_failure_reason",
    "worker_exited",
]

#: The environment variable prometheus-client reads for multiprocess mode.
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

#: Seconds between two flushes of a worker's counts in multiprocess mode.
FLUSH_INTERVAL: Final = 1.0

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


#: A labelled metric's key in a `_Tally` or `_Observations`: the label value
#: itself for a metric with one label, else the tuple of values.
_K = TypeVar("_K", str, tuple[str, ...])


def _label_values(key: str | tuple[str, ...]) -> tuple[str, ...]:
    return key if isinstance(key, tuple) else (key,)


class _Tally(dict[_K, int]):
    """A labelled counter or gauge: what was added to each child since the
    last `flush`, by label values.

    The connection path adds with plain dict arithmetic
    (``tally[key] += 1``): no lock, no call into prometheus-client (each
    ``inc()`` takes a lock, and in multiprocess mode writes a memory-mapped
    file). A key's first use creates its child with ``labels()``, as an
    update did before, so the series appears on ``/metrics`` (at 0 until the
    flush) with the same ``_created`` time and, in multiprocess mode, the
    process's file is created at the first event.
    """

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: Counter | Gauge) -> None:
        super().__init__()
        self._metric = metric
        self._children: dict[_K, Counter | Gauge] = {}

    def __missing__(self, key: _K) -> int:
        self._children[key] = self._metric.labels(*_label_values(key))
        return 0

    def flush(self) -> None:
        """Add each child's pending amount to it, and start again from 0."""
        children = self._children
        for key, amount in self.items():
            if amount:
                children[key].inc(amount)
                self[key] = 0


class _Pending:
    """One histogram child's observations since the last flush: a count per
    bucket (not cumulative; the last one is ``+Inf``) and their sum."""

    __slots__ = ("child", "counts", "sum")

    def __init__(self, child: Histogram, buckets: int) -> None:
        self.child = child
        self.counts = [0] * buckets
        self.sum = 0.0

    def flush(self) -> None:
        """Add the observations to the child's bucket and sum values.

        ``Histogram`` has no public way to add many observations at once, so
        this adds to the values ``Histogram.observe`` adds to (``_buckets``,
        ``_sum``; prometheus-client is pinned to 0.26 in pyproject.toml).
        """
        counts = self.counts
        if not any(counts):
            return
        child = self.child
        for index, count in enumerate(counts):
            if count:
                child._buckets[index].inc(count)
                counts[index] = 0
        child._sum.inc(self.sum)
        self.sum = 0.0


class _Observations(dict[_K, _Pending]):
    """A labelled histogram: each child's `_Pending` observations, by label
    values (see `_Tally`)."""

    __slots__ = ("_bounds", "_metric")

    def __init__(self, metric: Histogram, buckets: tuple[float, ...]) -> None:
        super().__init__()
        self._metric = metric
        self._bounds = buckets

    def __missing__(self, key: _K) -> _Pending:
        pending = self[key] = _Pending(
            self._metric.labels(*_label_values(key)), len(self._bounds) + 1
        )
        return pending

    def observe(self, key: _K, amount: float) -> None:
        """``metric.labels(*key).observe(amount)``, counted here until the
        flush: the bucket is the first whose upper bound is >= *amount*, as
        in ``Histogram.observe``."""
        pending = self[key]
        pending.counts[bisect_left(self._bounds, amount)] += 1
        pending.sum += amount

    def flush(self) -> None:
        """Hand every child's observations to it."""
        for pending in self.values():
            pending.flush()


class Meter(Protocol):
    """A running connection's own byte counts, read at each flush (see
    "Bytes while connections run" above)."""

    def traffic(self) -> tuple[int, int, str | None]:
        """Bytes received from the client and sent to it so far (they only
        grow), and the server the connection uses now (None: none yet)."""
        ...


class _Metered:
    """A connection registered with `EdgeMetrics.metering`: its meter, and
    how much of its counts the counters hold already."""

    __slots__ = (
        "log",
        "meter",
        "received",
        "sent",
        "server_received",
        "server_sent",
    )

    def __init__(self, log: ConnectionLog, meter: Meter) -> None:
        self.log = log
        self.meter = meter
        #: Bytes from and to the client in the listener's counters.
        self.received = 0
        self.sent = 0
        #: The same in the servers' counters (they lag while the connection
        #: has no server yet).
        self.server_received = 0
        self.server_sent = 0


@dataclass(frozen=True, slots=True)
class _Counters:
    """The event metrics (see ``docs/operations.md`` for each one), each
    indexed by its label values: a lone value for one label, else a tuple."""

    accepted: _Tally[str]
    active: _Tally[str]
    closed: _Tally[tuple[str, ...]]
    refused: _Tally[tuple[str, ...]]
    duration: _Observations[str]
    bytes_received: _Tally[str]
    bytes_sent: _Tally[str]
    proxy_errors: _Tally[tuple[str, ...]]
    tls_handshakes: _Tally[tuple[str, ...]]
    tls_failures: _Tally[tuple[str, ...]]
    server_connections: _Tally[tuple[str, ...]]
    server_active: _Tally[tuple[str, ...]]
    server_bytes_sent: _Tally[tuple[str, ...]]
    server_bytes_received: _Tally[tuple[str, ...]]
    connect_failures: _Tally[str]
    no_server: _Tally[str]
    retries: _Tally[str]
    http_requests: _Tally[tuple[str, ...]]
    server_http_requests: _Tally[tuple[str, ...]]
    http_duration: _Observations[tuple[str, ...]]
    udp_datagrams: _Tally[tuple[str, ...]]
    udp_dropped: _Tally[tuple[str, ...]]

    def flush(self) -> None:
        """Hand every pending amount to prometheus-client."""
        for field in fields(self):
            getattr(self, field.name).flush()


def _make_counters(registry: CollectorRegistry | None) -> _Counters:
    r = registry
    listener = ("listener",)
    server = ("backend", "server")
    return _Counters(
        accepted=_Tally(
            Counter(
                "tlsedge_connections",
                "Client connections accepted.",
                listener,
                registry=r,
            ),
        ),
        active=_Tally(
            Gauge(
                "tlsedge_connections_active",
                "Client connections open now.",
                listener,
                registry=r,
                multiprocess_mode="livesum",
            ),
        ),
        closed=_Tally(
            Counter(
                "tlsedge_connections_closed",
                "Client connections ended, by termination cause (access log).",
                ("listener", "termination"),
                registry=r,
            ),
        ),
        refused=_Tally(
            Counter(
                "tlsedge_connections_refused",
                "Client connections closed before anything was relayed, by reason.",
                ("listener", "reason"),
                registry=r,
            ),
        ),
        duration=_Observations(
            Histogram(
                "tlsedge_connection_duration_seconds",
                "How long client connections lasted.",
                listener,
                registry=r,
                buckets=CONNECTION_BUCKETS,
            ),
            CONNECTION_BUCKETS,
        ),
        bytes_received=_Tally(
            Counter(
                "tlsedge_client_bytes_received",
                "Bytes received from clients (after PROXY and TLS unwrapping).",
                listener,
                registry=r,
            ),
        ),
        bytes_sent=_Tally(
            Counter(
                "tlsedge_client_bytes_sent",
                "Bytes sent to clients (before TLS).",
                listener,
                registry=r,
            ),
        ),
        proxy_errors=_Tally(
            Counter(
                "tlsedge_proxy_header_errors",
                "PROXY protocol headers refused, by reason.",
                ("listener", "reason"),
                registry=r,
            ),
        ),
        tls_handshakes=_Tally(
            Counter(
                "tlsedge_tls_handshakes",
                "Completed TLS handshakes with clients, by protocol version.",
                ("listener", "version"),
                registry=r,
            ),
        ),
        tls_failures=_Tally(
            Counter(
                "tlsedge_tls_handshake_failures",
                "Failed TLS handshakes with clients, by reason.",
                ("listener", "reason"),
                registry=r,
            ),
        ),
        server_connections=_Tally(
            Counter(
                "tlsedge_server_connections",
                "Upstream connections made to a backend server.",
                server,
                registry=r,
            ),
        ),
        server_active=_Tally(
            Gauge(
                "tlsedge_server_active_connections",
                "Upstream connections in use to a backend server now.",
                server,
                registry=r,
                multiprocess_mode="livesum",
            ),
        ),
        server_bytes_sent=_Tally(
            Counter(
                "tlsedge_server_bytes_sent",
                "Bytes forwarded to a backend server (client data, no PROXY header).",
                server,
                registry=r,
            ),
        ),
        server_bytes_received=_Tally(
            Counter(
                "tlsedge_server_bytes_received",
                "Bytes received from a backend server.",
                server,
                registry=r,
            ),
        ),
        connect_failures=_Tally(
            Counter(
                "tlsedge_backend_connect_failures",
                "Client connections dropped because every connect attempt failed.",
                ("backend",),
                registry=r,
            ),
        ),
        no_server=_Tally(
            Counter(
                "tlsedge_backend_no_server",
                "Client connections dropped because no server was healthy.",
                ("backend",),
                registry=r,
            ),
        ),
        retries=_Tally(
            Counter(
                "tlsedge_backend_retries",
                "Extra connect attempts made by connections that reached a server.",
                ("backend",),
                registry=r,
            ),
        ),
        http_requests=_Tally(
            Counter(
                "tlsedge_http_requests",
                "HTTP requests (HTTP mode), by response status class.",
                ("listener", "backend", "code"),
                registry=r,
            ),
        ),
        server_http_requests=_Tally(
            Counter(
                "tlsedge_server_http_requests",
                "HTTP requests (HTTP mode) that went to a backend server, by "
                "response status class.",
                ("backend", "server", "code"),
                registry=r,
            ),
        ),
        http_duration=_Observations(
            Histogram(
                "tlsedge_http_request_duration_seconds",
                "HTTP request latency (HTTP mode): request head in to response done.",
                ("listener", "backend"),
                registry=r,
                buckets=HTTP_BUCKETS,
            ),
            HTTP_BUCKETS,
        ),
        udp_datagrams=_Tally(
            Counter(
                "tlsedge_udp_datagrams",
                "Datagrams relayed by udp listeners, by direction "
                "(from_client, from_server); flows count as connections.",
                ("listener", "direction"),
                registry=r,
            ),
        ),
        udp_dropped=_Tally(
            Counter(
                "tlsedge_udp_datagrams_dropped",
                "Datagrams udp listeners dropped, by reason (flow_cap, denied, "
                "no_server, draining, rejected, header_error, too_large, ...).",
                ("listener", "reason"),
                registry=r,
            ),
        ),
    )


#: The ``code`` label of each valid status (``"2xx"``); any other is ``"other"``.
_STATUS_CLASSES: Final = {status: f"{status // 100}xx" for status in range(100, 600)}


class _AnsweredRequest(Protocol):
    """What `HttpRequestCounts.record` reads of a request's access-log record
    (`tlsedge._http.log.RequestLog`)."""

    @property
    def status(self) -> int | None: ...
    @property
    def total(self) -> float: ...
    @property
    def server(self) -> str | None: ...


class HttpRequestCounts:
    """The request metrics of one HTTP listener and its backend.

    Per request, what `EdgeMetrics.record_http_request` documents, with what
    the listener's requests share looked up once: the label tuple of each
    status (its class included) is made at the status's first request.
    """

    __slots__ = ("_backend", "_keys", "_listener", "_m", "_pair")

    def __init__(self, counters: _Counters, listener: str, backend: str) -> None:
        self._m = counters
        self._listener = listener
        self._backend = backend
        #: ``(listener, backend, code)`` by status.
        self._keys: dict[int, tuple[str, str, str]] = {}
        self._pair = (listener, backend)

    def record(self, log: _AnsweredRequest) -> None:
        """Count the request of *log* (none without a status: never answered)."""
        status = log.status
        if status is not None:
            self.count(status, log.total, log.server)

    def count(self, status: int, seconds: float, server: str | None) -> None:
        """Count a request answered with *status* after *seconds*, by
        *server* (None: by no server)."""
        m = self._m
        key = self._keys.get(status)
        if key is None:
            code = _STATUS_CLASSES.get(status, "other")
            key = self._keys[status] = (self._listener, self._backend, code)
        m.http_requests[key] += 1
        if server is not None:
            m.server_http_requests[self._backend, server, key[2]] += 1
        m.http_duration.observe(self._pair, seconds)


class EdgeMetrics:
    """The metrics of one edge: event counters plus the live-state collector.

    Event methods only count in plain dicts (see "Cost" in the module
    docstring); `flush` hands the counts to prometheus-client, and every
    collection of `registry` flushes first.

    Args:
        snapshot: Gives the edge's live state at scrape time (`Edge.snapshot`;
            None: event metrics only, for tests of this module).

    Attributes:
        registry: What ``/metrics`` serves. In multiprocess mode it holds only
            the `MultiProcessCollector` and the live collector; the event
            metrics write to the shared directory instead.
        multiprocess_dir: The shared directory, or None in single-process mode.
        reloads: The edge's reloads (``tlsedge_config_*``, the status page),
            replaced by whoever reloads the edge.
    """

    def __init__(self, snapshot: Callable[[], Snapshot] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess_dir = _multiprocess_path()
        # Registered first: the registry collects in registration order.
        self.registry.register(_FlushFirst(self.flush))
        if self.multiprocess_dir is not None:
            multiprocess.MultiProcessCollector(  # type: ignore[no-untyped-call]
                self.registry, path=self.multiprocess_dir
            )
            self._m = _make_counters(None)
        else:
            self._m = _make_counters(self.registry)
        if snapshot is not None:
            self.registry.register(LiveStateCollector(snapshot))
        self.reloads = ReloadRecord(loaded=time.time())
        self.registry.register(ReloadCollector(lambda: self.reloads))
        #: The connections counted as they run, by ``id()`` of their log
        #: (which the entry keeps alive).
        self._metered: dict[int, _Metered] = {}
        self._http_requests: dict[tuple[str, str], HttpRequestCounts] = {}

    def flush(self) -> None:
        """Hand the counts since the last flush to prometheus-client (in
        multiprocess mode: write them to this process's files), the bytes of
        the connections still running included."""
        self._fold_live()
        self._m.flush()

    def _fold_live(self) -> None:
        """Count what each metered connection relayed since the last flush."""
        m = self._m
        from_clients, to_clients = m.bytes_received, m.bytes_sent
        to_servers, from_servers = m.server_bytes_sent, m.server_bytes_received
        for metered in self._metered.values():
            received, sent, server = metered.meter.traffic()
            log = metered.log
            if received != metered.received:
                from_clients[log.listener] += received - metered.received
                metered.received = received
            if sent != metered.sent:
                to_clients[log.listener] += sent - metered.sent
                metered.sent = sent
            if server is None or (
                received == metered.server_received and sent == metered.server_sent
            ):
                continue
            key = (log.backend or "", server)
            if received != metered.server_received:
                to_servers[key] += received - metered.server_received
                metered.server_received = received
            if sent != metered.server_sent:
                from_servers[key] += sent - metered.server_sent
                metered.server_sent = sent

    async def flush_periodically(self) -> None:
        """Flush every `FLUSH_INTERVAL` in multiprocess mode (`Edge.run` runs
        it), so that a scrape answered by any worker has this one's counts
        at most that old. Returns at once in single-process mode, where the
        scrape itself flushes."""
        if self.multiprocess_dir is None:
            return
        while True:
            await trio.sleep(FLUSH_INTERVAL)
            self.flush()

    # -- connection path --------------------------------------------------

    def connection_opened(self, listener: str) -> None:
        """A client connection was accepted on *listener*."""
        m = self._m
        m.accepted[listener] += 1
        m.active[listener] += 1

    def server_leased(self, backend: str, server: str) -> None:
        """A connection to *server* is opening or in use (a `ServerLease`)."""
        self._m.server_active[backend, server] += 1

    def server_released(self, backend: str, server: str) -> None:
        """The lease of `server_leased` was given back."""
        self._m.server_active[backend, server] -= 1

    def server_connection_opened(
        self, backend: str, server: str, attempts: int
    ) -> None:
        """A new upstream connection to *server* was made after *attempts* tries."""
        m = self._m
        m.server_connections[backend, server] += 1
        if attempts > 1:
            m.retries[backend] += attempts - 1

    def metering(self, log: ConnectionLog, meter: Meter) -> None:
        """Count the bytes of *log*'s connection as they flow: each flush
        reads *meter*, until `record` (*log*'s end) counts the rest.

        Call it before the connection can end: once registered, `record`
        must follow, or the entry (and the log) stays until it does.
        """
        self._metered[id(log)] = _Metered(log, meter)

    def proxy_header_error(self, listener: str, reason: str) -> None:
        """A PROXY header was refused; *reason* is ``RemoteProtocolError.reason``."""
        self._m.proxy_errors[listener, reason] += 1

    def record(self, log: ConnectionLog) -> None:
        """Account for a finished connection (call once, next to ``log.emit()``).

        Of its bytes, what `metering` counted already is left out.
        """
        m = self._m
        listener = log.listener
        termination = log.termination
        m.active[listener] -= 1
        m.closed[listener, termination] += 1
        if termination in REFUSED_TERMINATIONS:
            m.refused[listener, termination] += 1
        m.duration.observe(listener, log.duration)
        received, sent = log.bytes_from_client, log.bytes_from_server
        server_received, server_sent = received, sent
        metered = self._metered.pop(id(log), None) if self._metered else None
        if metered is not None:
            server_received -= metered.server_received
            server_sent -= metered.server_sent
            received -= metered.received
            sent -= metered.sent
        if received:
            m.bytes_received[listener] += received
        if sent:
            m.bytes_sent[listener] += sent
        if log.tls is not None:
            m.tls_handshakes[listener, log.tls.split(" ", 1)[0]] += 1
        elif termination in _TLS_FAILURES:
            reason = tls_failure_reason(termination, log.detail)
            m.tls_failures[listener, reason] += 1
        backend = log.backend or ""
        if log.server is not None:
            server = (backend, log.server)
            if server_received:
                m.server_bytes_sent[server] += server_received
            if server_sent:
                m.server_bytes_received[server] += server_sent
        elif termination == Termination.CONNECT_FAILED:
            m.connect_failures[backend] += 1
        elif termination == Termination.NO_SERVER:
            m.no_server[backend] += 1

    def record_http_request(
        self,
        listener: str,
        backend: str,
        status: int,
        seconds: float,
        *,
        server: str | None = None,
    ) -> None:
        """Account for one HTTP request (HTTP mode).

        Args:
            listener: The listener's name.
            backend: The backend's name.
            status: The response status sent to the client (502 and 504 for
                answers the edge made itself); counted by class, ``"2xx"``.
            seconds: From the complete request head to the last response byte.
            server: The server the request went to, if it went to one.
        """
        self.http_requests(listener, backend).count(status, seconds, server)

    def http_requests(self, listener: str, backend: str) -> HttpRequestCounts:
        """Where the requests of *listener* to *backend* are counted (one per
        pair: the HTTP site's ``on_request`` is its `HttpRequestCounts.record`)."""
        counts = self._http_requests.get((listener, backend))
        if counts is None:
            counts = HttpRequestCounts(self._m, listener, backend)
            self._http_requests[listener, backend] = counts
        return counts

    def udp_datagrams(self, listener: str, direction: str, count: int) -> None:
        """*count* datagrams relayed on a udp *listener* (a batch at a time);
        *direction* is ``"from_client"`` or ``"from_server"``."""
        self._m.udp_datagrams[listener, direction] += count

    def udp_dropped(self, listener: str, reason: str) -> None:
        """A datagram a udp *listener* dropped, and why (`tlsedge._pipeline.udp`)."""
        self._m.udp_dropped[listener, reason] += 1

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


class _FlushFirst(Collector):
    """Collects nothing; calls *flush* first, so that the collectors after it
    in the registry see every count (`EdgeMetrics` registers it first)."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def collect(self) -> Iterable[Metric]:
        """Flush; no metrics of its own."""
        self._flush()
        return ()


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


class ReloadCollector(Collector):
    """Reports the edge's `ReloadRecord` at scrape time.

    Args:
        record: Called once per scrape; the current record.
    """

    def __init__(self, record: Callable[[], ReloadRecord]) -> None:
        self._record = record

    def collect(self) -> Iterable[Metric]:
        """``tlsedge_config_last_reload_successful``,
        ``tlsedge_config_last_reload_timestamp_seconds`` and
        ``tlsedge_config_reloads_total{result}``."""
        record = self._record()
        yield GaugeMetricFamily(
            "tlsedge_config_last_reload_successful",
            "1 while the configuration file is in force as written (the last "
            "reload applied every key, or none happened since the start); 0 "
            "after a refused or partial reload.",
            value=1 if record.successful else 0,
        )
        yield GaugeMetricFamily(
            "tlsedge_config_last_reload_timestamp_seconds",
            "When the last reload ended, or the configuration was loaded at "
            "start (seconds since the epoch).",
            value=record.time,
        )
        reloads = CounterMetricFamily(
            "tlsedge_config_reloads",
            "Reloads (SIGHUP) by result: applied, partial (some keys wait for "
            "a restart), refused (nothing changed).",
            labels=("result",),
        )
        for result in ReloadResult:
            reloads.add_metric((result.value,), record.count(result))
        yield reloads


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
