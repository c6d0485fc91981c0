"""HTTP/2 to clients: tlsedge vs HAProxy 2.6, ``h2load -c50 -m10`` over TLS.

Run: ``python bench/http2.py [--quick] [--duration 5] [--reps 3] [--no-pin]``
     ``python bench/http2.py --profile bench/results/profile`` (py-spy on tlsedge)
     ``-c``/``-m``: h2load's connections and streams per connection (50, 10)

Both proxies terminate TLS (the ECDSA P-256 certificate of ``tls.py``, TLS 1.3,
ALPN ``h2,http/1.1``), take HTTP/2 from ``h2load`` (50 connections, 10
concurrent streams each) and forward each stream as an HTTP/1.1 request over
pooled keep-alive connections to the same nginx (started as in ``edge.py``:
one worker, ``return 200 "hello\\n"``, access log off), adding
``X-Forwarded-For``:

* ``tlsedge``: ``python -m tlsedge run``, ``mode = "http"``, one worker,
  ``alpn = ["h2", "http/1.1"]``, a JSON access-log line per stream (and per
  connection) to a file;
* ``tlsedge-nolog``: the same with ``access_log = "off"`` (no access log);
* ``haproxy``: ``nbthread 1``, ``mode http``, ``option forwardfor``,
  ``bind ... ssl crt <pem> alpn h2,http/1.1``, no logging;
* ``h2-floor``: `h2_floor.py`, the ``h2`` library in one epoll loop with
  none of tlsedge's features (one pipelined upstream connection per client
  connection): what a pure-Python HTTP/2 proxy on ``h2`` can reach.

The proxies run interleaved (the order rotates each repetition); the table
shows medians, the ratio is against HAProxy, and the CPU per request is the
proxy process's user + system time over the run divided by the requests it
completed. The proxy is pinned to CPU 1, nginx and h2load to CPU 0 (as in
``edge.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import banner, fmt_ratio, median, render_table
from edge import (
    LOAD_CPU,
    BenchError,
    Procs,
    cpu_seconds,
    free_port,
    run_client,
    start_nginx,
    summarize_profile,
    terminate_on_sigterm,
    wait_port,
)
from tls import make_certificates

PROXY_CPU = "1"
ALL_PROXIES = ("tlsedge", "tlsedge-nolog", "haproxy", "h2-floor")
GOAL = 0.5  # issue 14: at least half HAProxy's requests/s

_FINISHED = re.compile(r"finished in [^,]+, ([\d.]+) req/s")
_REQUESTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
    r"(\d+) failed, (\d+) errored, (\d+) timeout"
)


@dataclass(frozen=True, slots=True)
class Run:
    rps: float
    succeeded: int
    failed: int
    cpu: float  # proxy CPU seconds during the run

    @property
    def cpu_us_per_request(self) -> float:
        return 1e6 * self.cpu / self.succeeded if self.succeeded else float("nan")


def start_proxy(
    procs: Procs, name: str, port: int, nginx_port: int, certs: tuple[Path, Path, Path]
) -> int:
    """Start *name* listening on *port* (TLS, h2); its pid."""
    cert, key, combined = certs
    wd = procs.workdir
    if name.startswith("tlsedge"):
        toml = wd / f"{name}.toml"
        toml.write_text(
            "[edge]\nworkers = 1\ndrain_timeout = 1.0\nmax_connections = 20000\n"
            + ('access_log = "off"\n' if name == "tlsedge-nolog" else "")
            + f'[[listeners]]\nname = "h2"\nbind = "127.0.0.1:{port}"\n'
            'mode = "http"\nbackend = "nginx"\nmax_connections = 20000\n'
            "[listeners.forwarded]\nx_forwarded_for = true\n"
            "x_forwarded_proto = false\nx_forwarded_port = false\n"
            "[listeners.tls]\n"
            f'certificates = [{{ cert = "{cert}", key = "{key}" }}]\n'
            'alpn = ["h2", "http/1.1"]\n'
            f'[[backends]]\nname = "nginx"\nservers = ["127.0.0.1:{nginx_port}"]\n'
        )
        argv = [sys.executable, "-m", "tlsedge", "run", str(toml)]
    elif name == "h2-floor":
        floor = Path(__file__).with_name("h2_floor.py")
        argv = [sys.executable, str(floor), str(port), str(nginx_port), str(combined)]
    else:
        cfg = wd / "haproxy.cfg"
        cfg.write_text(
            "global\n    nbthread 1\n    maxconn 9000\n"
            "defaults\n    mode http\n    option forwardfor\n"
            "    timeout connect 5s\n    timeout client 60s\n"
            "    timeout server 60s\n    timeout http-keep-alive 60s\n"
            "frontend fe\n"
            f"    bind 127.0.0.1:{port} ssl crt {combined} alpn h2,http/1.1\n"
            "    default_backend nginx\n"
            f"backend nginx\n    server s1 127.0.0.1:{nginx_port}\n"
        )
        argv = ["haproxy", "-db", "-f", str(cfg)]
    proc = procs.start(name, argv, cpu=PROXY_CPU, log=f"{name}.log")
    wait_port(port, proc, name)
    return proc.pid


@dataclass(frozen=True, slots=True)
class Load:
    """h2load's shape: *clients* connections, *streams* concurrent on each."""

    clients: int = 50
    streams: int = 10

    def __str__(self) -> str:
        return f"h2load -c{self.clients} -m{self.streams}"


def run_h2load(
    procs: Procs,
    pid: int,
    port: int,
    duration: float,
    *,
    load: Load,
    requests: int | None = None,
) -> Run:
    argv = ["h2load", f"-c{load.clients}", f"-m{load.streams}"]
    argv += ["-n", str(requests)] if requests else ["-D", f"{duration:g}"]
    argv.append(f"https://127.0.0.1:{port}/")
    before = cpu_seconds(pid)
    out = run_client(procs, argv, duration, "h2load")
    cpu = cpu_seconds(pid) - before
    finished = _FINISHED.search(out)
    counts = _REQUESTS.search(out)
    if finished is None or counts is None or "Application protocol: h2" not in out:
        raise BenchError(f"unexpected h2load output:\n{out}")
    succeeded = int(counts.group(4))
    failed = sum(int(counts.group(i)) for i in (5, 6, 7))
    return Run(float(finished.group(1)), succeeded, failed, cpu)


def profile_tlsedge(
    procs: Procs,
    args: argparse.Namespace,
    *,
    load: Load,
    out_dir: Path,
    nginx_port: int,
    certs: tuple[Path, Path, Path],
) -> None:
    """py-spy record tlsedge (with its access log) under *load* (raw + svg)."""
    if shutil.which("py-spy") is None:
        raise BenchError("py-spy is not installed (pip install py-spy)")
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    pid = start_proxy(procs, "tlsedge", port, nginx_port, certs)
    run_h2load(procs, pid, port, 30, load=load, requests=500)  # check and warm up
    raw = out_dir / f"http2-c{load.clients}-m{load.streams}.txt"
    for fmt, target in (("raw", raw), ("flamegraph", raw.with_suffix(".svg"))):
        spy = procs.start(
            "py-spy",
            [
                "py-spy",
                "record",
                "--pid",
                str(pid),
                "--rate",
                "200",
                "--duration",
                f"{args.duration:g}",
                "--nonblocking",
                "--format",
                fmt,
                "--output",
                str(target),
            ],
            cpu=LOAD_CPU,
            log="py-spy.out",
        )
        time.sleep(0.5)
        run = run_h2load(procs, pid, port, args.duration, load=load)
        spy.wait(args.duration + 30)
        procs.stop(spy)
        print(f"tlsedge {load} ({fmt}): {run.rps:.0f} req/s -> {target}")
    summarize_profile(raw)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="s per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pause", type=float, default=1.0, help="s between runs")
    parser.add_argument("--quick", action="store_true", help="2 s runs, 1 rep")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset")
    parser.add_argument("--proxies", default=",".join(ALL_PROXIES))
    parser.add_argument("--keep-workdir", action="store_true")
    parser.add_argument("-c", "--clients", type=int, default=50, help="connections")
    parser.add_argument(
        "-m", "--streams", type=int, default=10, help="concurrent streams each"
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="py-spy record tlsedge instead of comparing"
    )
    args = parser.parse_args(argv)
    load = Load(args.clients, args.streams)
    if args.quick:
        args.duration, args.reps = 2.0, 1
    names = [p for p in args.proxies.split(",") if p]
    for name in names:
        if name not in ALL_PROXIES:
            parser.error(
                f"unknown proxy {name!r}; choose from {', '.join(ALL_PROXIES)}"
            )
    for tool in ("nginx", "haproxy", "h2load"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed")
    pin = not args.no_pin and shutil.which("taskset") is not None
    pin = pin and (os.cpu_count() or 1) >= 2
    workdir = Path(tempfile.mkdtemp(prefix="tlsedge-bench-h2-"))
    procs = Procs(workdir, pin)
    title = "bench/http2.py: HTTP/2 to clients over TLS, side by side"
    print(banner(title, tools=True))
    print(
        f"pinning: {'proxy on CPU 1, nginx/h2load on CPU 0' if pin else 'none'}; "
        f"{load} -D {args.duration:g}; {args.reps} reps, rotating order"
    )
    print(f"workdir: {workdir}", flush=True)
    results: dict[str, list[Run]] = {}
    try:
        with terminate_on_sigterm():
            certs = make_certificates(workdir)
            nginx_port = free_port()
            start_nginx(procs, nginx_port)
            if args.profile:
                profile_tlsedge(
                    procs,
                    args,
                    load=load,
                    out_dir=Path(args.profile),
                    nginx_port=nginx_port,
                    certs=certs,
                )
                return 0
            proxies = []
            for name in names:
                port = free_port()
                pid = start_proxy(procs, name, port, nginx_port, certs)
                run_h2load(procs, pid, port, 30, load=load, requests=500)  # warm up
                proxies.append((name, pid, port))
            for rep in range(args.reps):
                shift = rep % len(proxies)
                for name, pid, port in proxies[shift:] + proxies[:shift]:
                    run = run_h2load(procs, pid, port, args.duration, load=load)
                    results.setdefault(name, []).append(run)
                    print(
                        f"  rep {rep + 1}/{args.reps} {name:13} {run.rps:9.0f} req/s"
                        f"  {run.succeeded} ok, {run.failed} failed"
                        f"  proxy CPU {run.cpu:5.2f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    time.sleep(args.pause)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr)
        return 130
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        for log in sorted(workdir.glob("*.log")) + sorted(workdir.glob("*.out")):
            tail = log.read_text(errors="replace")[-1500:]
            print(f"--- {log.name} (tail)\n{tail}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(names, results, load)
    return 0


def print_table(
    names: Sequence[str], results: dict[str, list[Run]], load: Load
) -> None:
    ha = (
        median([r.rps for r in results.get("haproxy", [])]) if "haproxy" in names else 0
    )
    rows = []
    for name in names:
        runs = results[name]
        rps = median([r.rps for r in runs])
        rows.append(
            [
                name,
                f"{rps:.0f}",
                fmt_ratio(rps / ha) if ha else "-",
                f"{median([r.cpu_us_per_request for r in runs]):.0f}",
                str(sum(r.failed for r in runs)),
            ]
        )
    print(f"\n{load} over TLS (median of {len(results[names[0]])} runs):")
    print(
        render_table(["proxy", "req/s", "vs haproxy", "CPU µs/request", "failed"], rows)
    )
    if ha and "tlsedge-nolog" in names and load == Load():
        ratio = median([r.rps for r in results["tlsedge-nolog"]]) / ha
        print(f"goal (issue 14): tlsedge >= {GOAL}x HAProxy: {ratio:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
