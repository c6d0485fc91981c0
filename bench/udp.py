"""Datagrams per second through tlsedge's ``mode = "udp"`` and nginx ``stream``.

    python bench/udp.py                   # 3 reps x 2 proxies x 10 s
    python bench/udp.py --quick           # 1 rep of 3 s
    python bench/udp.py --clients 64 --duration 5 --no-pin

What it starts (free loopback ports, a temporary directory, each process in its
own process group, all killed on exit, Ctrl-C, SIGTERM or error):

* the backend: nginx ``stream`` with ``listen ... udp; return "pong";``, one
  worker: a C server answering every datagram with 4 bytes;
* **tlsedge**: ``python -m tlsedge run`` with one ``mode = "udp"`` listener
  (one worker, default log level: an access-log line per flow, to a file);
* **nginx**: ``stream { server { listen ... udp; proxy_pass ...;
  proxy_responses 1; } }``, ``worker_processes 1`` (nginx ends a UDP session
  after its one response, as for DNS: each request makes a session).

Two scenarios, each proxy started afresh for each run:

* ``answers``: request/answer, as DNS. The load generator is this script:
  ``--clients`` UDP sockets (so as many flows), each in a closed loop (send 32
  bytes, wait for the 4-byte answer, send the next; an answer missing for 0.2 s
  is counted lost and the socket sends again), all on one epoll, against the
  backend above through the proxy. Two datagrams per answer cross the proxy.
* ``iperf3``: ``iperf3 -u -b 0 -l 64 -t D`` through the proxy to ``iperf3
  -s``: one way, as fast as the client sends; datagrams/s is what the server
  received. The proxies also relay TCP on the same port, for iperf3's control
  connection (tlsedge: a tcp and a udp listener on one port; nginx: ``listen
  P;`` and ``listen P udp;``, no ``proxy_responses``: a session per client).

Pinning: the proxy on CPU 1, backends and load generators on CPU 0. The
proxy's CPU time (every process of its group, from ``/proc/<pid>/stat``)
gives **CPU µs per datagram** it relayed, which does not depend on who was
the bottleneck. Both proxies run in the same invocation, in rotating order,
and the table gives the same-run ratios (medians of the repetitions).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from _common import banner, fmt_ratio, median, render_table
from edge import (
    BenchError,
    Procs,
    cpu_seconds,
    free_port,
    terminate_on_sigterm,
    wait_port,
)

PROXY_CPU = "1"
LOAD_CPU = 0
PROXIES = ("tlsedge", "nginx")
SCENARIOS = ("answers", "iperf3")
STREAM_MODULE = "/usr/lib/nginx/modules/ngx_stream_module.so"
REQUEST = b"q" * 32
LOST_AFTER = 0.2


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def udp_bound(port: int) -> bool:
    wanted = f":{port:04X}"
    with contextlib.suppress(OSError), open("/proc/net/udp") as table:
        return any(line.split()[1].endswith(wanted) for line in list(table)[1:])
    return False


def wait_udp(port: int, proc: object, what: str) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if getattr(proc, "poll")() is not None:  # noqa: B009
            raise BenchError(f"{what} exited at start")
        if udp_bound(port):
            return
        time.sleep(0.05)
    raise BenchError(f"{what} did not bind UDP port {port} within 15 s")


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds of every live process in group *pgid* (nginx's worker is
    the master's child; its time shows in the master only once reaped)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # field 5, pgrp
                total += cpu_seconds(int(entry.name))
    return total


def nginx_conf(procs: Procs, name: str, server: str) -> Path:
    conf = procs.workdir / f"{name}.conf"
    conf.write_text(
        textwrap.dedent(f"""\
        load_module {STREAM_MODULE};
        daemon off;
        worker_processes 1;
        pid {procs.workdir}/{name}.pid;
        error_log {procs.workdir}/{name}-error.log crit;
        events {{ worker_connections 16384; }}
        stream {{
            server {{
        {textwrap.indent(server, " " * 8)}
            }}
        }}
        """)
    )
    return conf


def start_backend(procs: Procs, port: int) -> None:
    conf = nginx_conf(procs, "backend", f'listen 127.0.0.1:{port} udp;\nreturn "pong";')
    argv = ["nginx", "-c", str(conf), "-p", str(procs.workdir)]
    proc = procs.start("backend", argv, cpu=str(LOAD_CPU), log="backend.out")
    wait_udp(port, proc, "backend nginx")


def start_iperf3_server(procs: Procs, port: int) -> None:
    argv = ["iperf3", "-s", "-p", str(port)]
    proc = procs.start("iperf3-server", argv, cpu=str(LOAD_CPU), log="iperf3.out")
    wait_port(port, proc, "iperf3 -s")


def start_proxy(
    procs: Procs, name: str, scenario: str, targets: dict[str, int]
) -> tuple[int, int]:
    """Start *name* for *scenario*; returns its port and process group."""
    port = free_udp_port()
    if scenario == "iperf3":  # iperf3 needs its TCP control connection too
        while True:
            with contextlib.suppress(OSError), socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
                break
            port = free_udp_port()
    target = targets[scenario]
    if name == "tlsedge":
        toml = procs.workdir / "tlsedge.toml"
        text = (
            f"[edge]\nworkers = 1\ndrain_timeout = 1.0\n"
            f'access_log = "{procs.workdir}/access.log"\n'
            f'[[listeners]]\nname = "u"\nbind = "127.0.0.1:{port}"\nmode = "udp"\n'
            f'backend = "u"\nidle_timeout = 30.0\n'
            f'[[backends]]\nname = "u"\nservers = ["127.0.0.1:{target}"]\n'
        )
        if scenario == "iperf3":
            text += (
                f'[[listeners]]\nname = "t"\nbind = "127.0.0.1:{port}"\n'
                f'backend = "t"\n'
                f'[[backends]]\nname = "t"\nservers = ["127.0.0.1:{target}"]\n'
            )
        toml.write_text(text)
        argv = [sys.executable, "-m", "tlsedge", "run", str(toml)]
    else:
        if scenario == "iperf3":
            server = (
                f"listen 127.0.0.1:{port};\nlisten 127.0.0.1:{port} udp;\n"
                f"proxy_pass 127.0.0.1:{target};\nproxy_timeout 30s;"
            )
        else:
            server = (
                f"listen 127.0.0.1:{port} udp;\nproxy_pass 127.0.0.1:{target};\n"
                "proxy_responses 1;\nproxy_timeout 5s;"
            )
        conf = nginx_conf(procs, "proxy", server)
        argv = ["nginx", "-c", str(conf), "-p", str(procs.workdir)]
    proc = procs.start(name, argv, cpu=PROXY_CPU, log=f"{name}.out")
    wait_udp(port, proc, name)
    if scenario == "iperf3":
        wait_port(port, proc, name)
    return port, proc.pid


@dataclass
class Measure:
    datagrams_per_s: float  # relayed by the proxy (answers: two per answer)
    cpu: float  # proxy CPU seconds during the run
    datagrams: int
    lost: int

    @property
    def us_per_datagram(self) -> float:
        return self.cpu / self.datagrams * 1e6 if self.datagrams else float("nan")


def run_iperf3(procs: Procs, port: int, duration: float, pgid: int) -> Measure:
    """``iperf3 -u -b 0 -l 64``: one way, as fast as the client can send."""
    argv = ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-u", "-b", "0"]
    argv += ["-l", "64", "-t", f"{duration:g}", "-J"]
    before = group_cpu_seconds(pgid)
    proc = procs.start("iperf3", argv, cpu=str(LOAD_CPU), log="iperf3-client.json")
    proc.wait(duration + 30)
    cpu = group_cpu_seconds(pgid) - before
    text = (procs.workdir / "iperf3-client.json").read_text()
    (procs.workdir / "iperf3-client.json").unlink()
    summary = json.loads(text)["end"]["sum"]
    received = int(summary["packets"]) - int(summary["lost_packets"])
    return Measure(
        received / float(summary["seconds"]),
        cpu,
        received,
        int(summary["lost_packets"]),
    )


def load(port: int, clients: int, duration: float, pgid: int) -> Measure:
    """Closed-loop clients on one epoll; answers and lost requests counted."""
    target = ("127.0.0.1", port)
    sockets = []
    poller = select.epoll()
    sent_at: dict[int, float] = {}
    try:
        for _ in range(clients):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
            poller.register(sock.fileno(), select.EPOLLIN)
        by_fd = {s.fileno(): s for s in sockets}
        # Warm up: every flow open before the clock starts.
        for sock in sockets:
            sock.sendto(REQUEST, target)
            sent_at[sock.fileno()] = time.monotonic()
        answers = lost = 0
        before = group_cpu_seconds(pgid)
        start = time.monotonic()
        end = start + duration
        while (now := time.monotonic()) < end:
            for fd, _ in poller.poll(0.05):
                sock = by_fd[fd]
                while True:
                    try:
                        sock.recv(2048)
                    except BlockingIOError:
                        break
                    answers += 1
                    sock.sendto(REQUEST, target)
                    sent_at[fd] = time.monotonic()
            for fd, at in sent_at.items():
                if now - at > LOST_AFTER:
                    lost += 1
                    by_fd[fd].sendto(REQUEST, target)
                    sent_at[fd] = now
        elapsed = time.monotonic() - start
        cpu = group_cpu_seconds(pgid) - before
        return Measure(2 * answers / elapsed, cpu, 2 * answers, lost)
    finally:
        poller.close()
        for sock in sockets:
            sock.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="1 rep of 3 s")
    parser.add_argument("--no-pin", action="store_true", help="no CPU pinning")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.duration = 1, 3.0
    print(banner("bench/udp.py: datagrams/s, tlsedge udp vs nginx stream udp"))
    print(f"nginx stream module: {STREAM_MODULE}")
    print(f"clients (flows): {args.clients}, {args.reps} x {args.duration:g} s\n")
    if not args.no_pin:
        os.sched_setaffinity(0, {LOAD_CPU})
    results: dict[tuple[str, str], list[Measure]] = {
        (scenario, name): [] for scenario in SCENARIOS for name in PROXIES
    }
    with tempfile.TemporaryDirectory() as tmp, terminate_on_sigterm():
        procs = Procs(Path(tmp), pin=not args.no_pin)
        try:
            targets = {"answers": free_udp_port(), "iperf3": free_port()}
            start_backend(procs, targets["answers"])
            start_iperf3_server(procs, targets["iperf3"])
            for rep in range(args.reps):
                for scenario in SCENARIOS:
                    order = PROXIES[rep % 2 :] + PROXIES[: rep % 2]
                    for name in order:
                        port, pgid = start_proxy(procs, name, scenario, targets)
                        if scenario == "answers":
                            m = load(port, args.clients, args.duration, pgid)
                        else:
                            m = run_iperf3(procs, port, args.duration, pgid)
                        results[scenario, name].append(m)
                        print(
                            f"rep {rep + 1} {scenario:8} {name:8} "
                            f"{m.datagrams_per_s:10.0f} datagrams/s "
                            f"lost {m.lost:7d} proxy CPU {m.cpu:5.2f} s "
                            f"{m.us_per_datagram:6.2f} us/datagram",
                            flush=True,
                        )
                        procs.stop(next(p for n, p in procs.running if n == name))
        finally:
            procs.stop_all()
    rows = []
    for scenario in SCENARIOS:
        rate = {
            n: median([m.datagrams_per_s for m in results[scenario, n]])
            for n in PROXIES
        }
        cost = {
            n: median([m.us_per_datagram for m in results[scenario, n]])
            for n in PROXIES
        }
        rows.append(
            [
                scenario,
                f"{rate['tlsedge']:.0f}",
                f"{rate['nginx']:.0f}",
                fmt_ratio(rate["tlsedge"] / rate["nginx"]),
                f"{cost['tlsedge']:.2f}",
                f"{cost['nginx']:.2f}",
                fmt_ratio(cost["tlsedge"] / cost["nginx"]),
            ]
        )
    print()
    print(
        render_table(
            [
                "scenario",
                "tlsedge dgram/s",
                "nginx dgram/s",
                "ratio",
                "tlsedge CPU us/dgram",
                "nginx CPU us/dgram",
                "CPU ratio",
            ],
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
