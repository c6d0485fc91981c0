"""System calls per request: tlsedge and HAProxy under the same load, counted.

    python bench/syscalls.py                      # every scenario, 3 s each
    python bench/syscalls.py --scenarios tcp-new-conn,https-keep-alive --duration 5

For each scenario and proxy this starts the proxy and its backend as the
scenario's own benchmark does (`edge.py`, `tls.py`, `http_mode.py`: the same
configurations, nginx behind, one process, pinned), warms it up, attaches
``strace -c -f`` to the proxy for one ``wrk -t1 -c50`` run and divides the
system calls strace counted by the requests wrk completed. strace slows the
proxy down a lot, so the request rate under it means nothing; the count per
request does not depend on it (a busier proxy batches a little more per
``epoll_wait``, so a traced proxy's figure is, if anything, a little high).

Scenarios: ``tcp-keep-alive``, ``tcp-new-conn`` (``Connection: close``),
``tcp-new-conn-proxy`` (HAProxy in front adds a PROXY v2 header; its calls
are not counted), ``tls-keep-alive``, ``tls-handshakes``, ``http-keep-alive``
and ``https-keep-alive`` (HTTP mode with X-Forwarded-For). The table gives
the calls per request of each proxy and the five most frequent of tlsedge's.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import edge
import http_mode
import tls
from _common import banner, render_table
from edge import BenchError, Procs, free_port, run_client, terminate_on_sigterm

SCENARIOS = (
    "tcp-keep-alive",
    "tcp-new-conn",
    "tcp-new-conn-proxy",
    "tls-keep-alive",
    "tls-handshakes",
    "http-keep-alive",
    "https-keep-alive",
)
PROXIES = ("tlsedge", "haproxy")

_REQUESTS = re.compile(r"(\d+) requests in")
#: A line of strace -c's table: % time, seconds, usecs/call, calls, [errors,] name.
_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


class Target:
    """What one scenario's load goes to: the proxy's pid and the URL."""

    def __init__(self, pid: int, url: str, *, close: bool) -> None:
        self.pid = pid
        self.url = url
        self.close = close


def _start(procs: Procs, scenario: str, proxy: str) -> Target:
    """Start *proxy* (and what it proxies to) as *scenario*'s benchmark does."""
    family, _, kind = scenario.partition("-")
    if family == "tcp":
        nginx_port, iperf_port = free_port(), free_port()
        edge.start_nginx(procs, nginx_port)
        edge.start_iperf3_server(procs, iperf_port)
        front = edge.Proxy(proxy, free_port(), free_port())
        edge.start_proxy(procs, front, nginx_port, iperf_port)
        assert front.proc is not None
        port = front.http_port
        if kind == "new-conn-proxy":
            edge.start_front(procs, [front])
            port = front.front_port
        return Target(
            front.proc.pid, f"http://127.0.0.1:{port}/", close=kind != "keep-alive"
        )
    certs = tls.make_certificates(procs.workdir)
    if family == "tls":
        nginx_port, port = free_port(), free_port()
        edge.start_nginx(procs, nginx_port)
        pid = tls.start_proxy(procs, proxy, port, nginx_port, certs)
        return Target(pid, f"https://127.0.0.1:{port}/", close=kind == "handshakes")
    nginx_ports = (free_port(), free_port())
    edge.start_nginx(procs, nginx_ports[0])
    http_mode.start_tls_nginx(procs, nginx_ports[1], certs)
    front_http = http_mode.Proxy(proxy)
    http_mode.start_proxy(procs, front_http, nginx_ports, certs)
    return Target(front_http.pid, front_http.url(scenario), close=False)


def _wrk(procs: Procs, target: Target, duration: float) -> int:
    """Requests completed by one wrk run against *target*."""
    argv = ["wrk", "-t1", "-c50", f"-d{duration:g}s", "--timeout", "10s"]
    if target.close:
        argv += ["-H", "Connection: close"]
    out = run_client(procs, [*argv, target.url], duration, "wrk")
    match = _REQUESTS.search(out)
    if match is None:
        raise BenchError(f"wrk output without a request count:\n{out}")
    return int(match.group(1))


def count(procs: Procs, target: Target, duration: float) -> tuple[int, dict[str, int]]:
    """Requests and the system calls of *target*'s process (all threads) by name."""
    _wrk(procs, target, 1)  # warm-up
    out = procs.workdir / f"strace-{target.pid}.txt"
    tracer = subprocess.Popen(
        ["strace", "-c", "-f", "-p", str(target.pid), "-o", str(out)],
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(1.0)  # attached to every thread
        requests = _wrk(procs, target, duration)
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
    calls: dict[str, int] = {}
    for line in out.read_text().splitlines():
        match = _ROW.match(line)
        if match is not None and match.group(2) != "total":
            calls[match.group(2)] = int(match.group(1))
    return requests, calls


def run(scenarios: Sequence[str], duration: float, pin: bool) -> list[list[str]]:
    rows = []
    for scenario in scenarios:
        per_request: dict[str, float] = {}
        top = ""
        for proxy in PROXIES:
            workdir = Path(tempfile.mkdtemp(prefix="tlsedge-bench-syscalls-"))
            procs = Procs(workdir, pin)
            try:
                target = _start(procs, scenario, proxy)
                requests, calls = count(procs, target, duration)
            finally:
                procs.stop_all()
                shutil.rmtree(workdir, ignore_errors=True)
            total = sum(calls.values())
            per_request[proxy] = total / requests if requests else float("nan")
            print(
                f"  {scenario:20} {proxy:8} {requests:7} requests"
                f" {total:8} calls: {per_request[proxy]:.2f} per request",
                file=sys.stderr,
                flush=True,
            )
            if proxy == "tlsedge" and requests:
                biggest = sorted(calls.items(), key=lambda item: -item[1])[:5]
                top = ", ".join(f"{name} {n / requests:.2f}" for name, n in biggest)
        rows.append(
            [
                scenario,
                f"{per_request['tlsedge']:.2f}",
                f"{per_request['haproxy']:.2f}",
                top,
            ]
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=float, default=3.0, help="s per count")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset")
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    for scenario in scenarios:
        if scenario not in SCENARIOS:
            parser.error(
                f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}"
            )
    for tool in ("strace", "wrk", "nginx", "haproxy", "iperf3"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed")
    pin = not args.no_pin and shutil.which("taskset") is not None
    print(banner("bench/syscalls.py: system calls per request, tlsedge and HAProxy"))
    print(
        f"strace -c -f on the proxy during wrk -t1 -c50 -d{args.duration:g}s",
        flush=True,
    )
    try:
        with terminate_on_sigterm():
            rows = run(scenarios, args.duration, pin)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print()
    print(
        render_table(
            ["scenario", "tlsedge", "haproxy", "tlsedge's most frequent (per request)"],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
