"""What counting the bytes of open connections costs (`EdgeMetrics.metering`).

Run: ``python bench/metrics_fold.py [--connections 100,1000,10000] [--flushes 50]``

Every flush of the metrics (each scrape of ``/metrics`` or ``/status``; with
``workers > 1`` also once a second in every worker) reads the counts of every
open connection and adds what moved since the last flush to the byte counters.
The connection path itself is unchanged (it adds to its own counters, with no
call per read): bench/edge.py and bench/http_mode.py give the per-request
figures. This script measures, in this process:

* ``EdgeMetrics.flush`` with N open connections, a third each of a tcp relay
  (`RelayStats` through its `_RelayEnd`), an HTTP connection
  (`HttpConnectionResult`) and a udp flow (its `ConnectionLog`), over 4
  listeners and 8 servers: ``moved`` when every connection relayed bytes
  since the last flush (the worst case), ``idle`` when none did (idle
  keep-alive connections);
* per connection, ``metering`` plus the settling in ``record`` against
  ``record`` alone (what a connection pays for it, once).

Absolute numbers on a shared machine are noise; the per-connection figures
are what to compare.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from _common import banner, render_table

from tlsedge._core.accesslog import ConnectionLog
from tlsedge._core.cleanup import Cleanup
from tlsedge._core.metrics import EdgeMetrics, Meter
from tlsedge._core.termination import RelayStats
from tlsedge._http.log import HttpConnectionResult
from tlsedge._pipeline.tcp import _RelayEnd

LISTENERS = 4
SERVERS = 8


class _Open:
    """One open connection: its log, its meter, and how to move bytes on it."""

    def __init__(self, index: int) -> None:
        server = f"10.0.0.{index % SERVERS + 1}:8080"
        self.log = ConnectionLog(
            id=str(index),
            listener=f"listener-{index % LISTENERS}",
            peer="192.0.2.1:1",
            backend="app",
            server=server,
        )
        self.meter: Meter
        self.move: Callable[[int], None]
        kind = index % 3
        if kind == 0:
            stats = RelayStats()
            self.meter = _RelayEnd(self.log, stats, Cleanup(), health_check=False)

            def move_relay(size: int) -> None:
                stats.bytes_from_client += size
                stats.bytes_from_server += size

            self.move = move_relay
        elif kind == 1:
            result = HttpConnectionResult(server=server)
            self.meter = result

            def move_http(size: int) -> None:
                result.bytes_from_client += size
                result.bytes_to_client += size

            self.move = move_http
        else:
            self.meter = log = self.log

            def move_flow(size: int) -> None:
                log.bytes_from_client += size
                log.bytes_from_server += size

            self.move = move_flow


def flush_cost(connections: int, flushes: int, *, moved: bool) -> float:
    """Seconds per `EdgeMetrics.flush` with *connections* metered."""
    metrics = EdgeMetrics()
    opened = [_Open(index) for index in range(connections)]
    for connection in opened:
        metrics.connection_opened(connection.log.listener)
        metrics.metering(connection.log, connection.meter)
    metrics.flush()
    spent = 0.0
    for _ in range(flushes):
        if moved:
            for connection in opened:
                connection.move(1000)
        started = time.perf_counter()
        metrics.flush()
        spent += time.perf_counter() - started
    return spent / flushes


def connection_cost(connections: int, *, metered: bool) -> float:
    """Seconds per connection for opening and recording it (and metering it)."""
    metrics = EdgeMetrics()
    opened = [_Open(index) for index in range(connections)]
    started = time.perf_counter()
    for connection in opened:
        log = connection.log
        metrics.connection_opened(log.listener)
        if metered:
            metrics.metering(log, connection.meter)
        log.bytes_from_client = log.bytes_from_server = 1000
        metrics.record(log)
    return (time.perf_counter() - started) / connections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--connections", default="100,1000,10000")
    parser.add_argument("--flushes", type=int, default=50)
    args = parser.parse_args()
    print(banner("bench/metrics_fold.py: bytes of open connections, per flush"))
    rows = []
    for connections in (int(n) for n in args.connections.split(",")):
        moved = flush_cost(connections, args.flushes, moved=True)
        idle = flush_cost(connections, args.flushes, moved=False)
        rows.append(
            [
                str(connections),
                f"{moved * 1e6:,.0f}",
                f"{moved / connections * 1e9:,.0f}",
                f"{idle * 1e6:,.0f}",
                f"{idle / connections * 1e9:,.0f}",
            ]
        )
    print(
        render_table(
            [
                "open connections",
                "flush, all moved (us)",
                "per connection (ns)",
                "flush, all idle (us)",
                "per connection (ns)",
            ],
            rows,
        )
    )
    count = 20000
    plain = min(connection_cost(count, metered=False) for _ in range(5))
    metered = min(connection_cost(count, metered=True) for _ in range(5))
    print(
        f"\nper connection (open + record, best of 5 x {count}): "
        f"{plain * 1e9:,.0f} ns without metering, {metered * 1e9:,.0f} ns with "
        f"(+{(metered - plain) * 1e9:,.0f} ns)"
    )


if __name__ == "__main__":
    main()
