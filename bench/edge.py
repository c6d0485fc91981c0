"""TCP relay speed: tlsedge vs HAProxy vs proxy-protocol's server vs naive trio.

Run: ``python bench/edge.py [--quick] [--duration 10] [--reps 3] [--no-pin]``
     ``python bench/edge.py --profile bench/results/profile`` (py-spy on tlsedge)
     ``python bench/edge.py --workers 2 --proxies tlsedge,haproxy`` (tlsedge
     ``workers = 2`` against HAProxy ``nbthread 2``; the proxies are not pinned
     then, and their CPU counts every worker process)

Every proxy relays plain TCP (no TLS, no PROXY header) to the same backends,
started by this script on free loopback ports:

* an nginx (``worker_processes 1``, ``access_log off``, keep-alive without a
  request limit) answering every request with a fixed 6-byte body;
* an ``iperf3 -s`` for the bulk scenario.

Proxies, each a separate process with one thread/worker:

* ``tlsedge``: ``python -m tlsedge run <toml>``, mode tcp, one worker, no PROXY,
  default log level (info: one JSON access-log line per connection, written
  to a file);
* ``tlsedge-nolog``: the same with ``access_log = "off"`` (no access log), to
  show what the log line costs;
* ``haproxy``: ``nbthread 1``, ``mode tcp``, no logging;
* ``proxy-protocol``: the ``proxy-protocol`` 0.11.3 package's asyncio server
  (``python -m proxyprotocol.server.main --service SRC 'DST?pp=noop' -q``).
  Its listener never reads a PROXY header; ``?pp=noop`` makes it write an
  empty header upstream, so it is a plain relay. It still does, per
  connection: two ``uuid4()``, builds a ``ProxyResult`` (with a unique-id TLV)
  from the socket twice, runs a no-op DNSBL lookup task and a connect task,
  and copies through 256 KiB buffers. It does not half-close (a FIN from
  either side closes both);
* ``naive-trio``: a 20-line relay in this file (``trio.serve_tcp``,
  ``trio.open_tcp_stream`` per connection, two ``receive_some``/``send_all``
  loops), for reference.

Scenarios (wrk ``-t1 -c50``; every proxy gets the same duration; the order of
the proxies rotates each repetition; the table shows medians):

* ``keep-alive``: requests/s over 50 persistent connections;
* ``new-conn``: ``-H "Connection: close"``, one connection per request
  (nginx closes, the proxy must pass the FIN on);
* ``bulk``: ``iperf3 -c 127.0.0.1 -p <proxy> -t <duration>``, Gbit/s received;
* ``new-conn-proxy`` (not run by default: ``--scenarios new-conn-proxy``):
  ``new-conn`` with a PROXY v2 header on each connection, as behind a cloud
  load balancer: wrk goes through a front HAProxy (``nbthread 1``, on the
  load's CPU, ``send-proxy-v2``) to a listener of the proxy under test that
  reads the header (tlsedge ``proxy_protocol``, HAProxy ``accept-proxy``);
  proxies that cannot read one are left out of it.

Pinning (unless ``--no-pin``): the proxy under test runs on CPU 1 (``taskset
-c 1``), nginx, iperf3 and wrk on CPU 0. So on a 2-core machine the client
and backend share one core: when the proxy is fast (HAProxy) the bottleneck
can be CPU 0, which flatters the slower proxies. The "proxy CPU" columns
(CPU seconds used by the proxy process, from /proc) give the efficiency view:
requests (or Gbit) per CPU-second of the proxy, which does not depend on who
the bottleneck is.

The script cleans up every process it starts (process groups, SIGTERM then
SIGKILL), also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from _common import banner, fmt_ratio, median, render_table

REPO = Path(__file__).resolve().parent.parent
PROXY_CPU = "1"
LOAD_CPU = "0"
SCENARIOS = ("keep-alive", "new-conn", "bulk", "new-conn-proxy")
DEFAULT_SCENARIOS = ("keep-alive", "new-conn", "bulk")
ALL_PROXIES = ("tlsedge", "tlsedge-nolog", "haproxy", "proxy-protocol", "naive-trio")
# The proxies with a listener that reads a PROXY header (``new-conn-proxy``).
READS_PROXY = ("tlsedge", "tlsedge-nolog", "haproxy")
# Issue 13's goals for new connections (keep-alive and bulk: earlier ones).
GOALS = {"keep-alive": 0.9, "new-conn": 0.75, "bulk": 1.0, "new-conn-proxy": 0.75}
UNITS = {
    "keep-alive": "req/s",
    "new-conn": "req/s",
    "bulk": "Gbit/s",
    "new-conn-proxy": "req/s",
}


class BenchError(Exception):
    """Something the benchmark needs did not work."""


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago, for a server started
    next, taken below the kernel's ephemeral range (as tests/peers.py and
    campaigns/common.py do): a port in that range can go to one of wrk's
    connections before the server binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral = int(ports.read().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, ephemeral - 12000), ephemeral)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise BenchError("no free port below the ephemeral range")


#: Ports `free_port` gave this process (a server may not have bound one yet).
_HANDED_OUT: set[int] = set()


def is_listening(port: int) -> bool:
    """True if a TCP socket listens on *port* (read from /proc: connecting to
    test it would confuse iperf3, which takes any connection for a client)."""
    wanted = f":{port:04X} "
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f:
                fields = line.split()
                if (
                    len(fields) > 3
                    and fields[3] == "0A"
                    and f"{fields[1]} ".endswith(wanted)
                ):
                    return True
    return False


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode} at start")
        if is_listening(port):
            return
        time.sleep(0.05)
    raise BenchError(f"{what} did not listen on port {port} within 15 s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of *pid*, its reaped children and its live
    descendants (tlsedge's workers, with ``--workers``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    total = ticks / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        total += sum(cpu_seconds(int(child)) for child in children)
    return total


# -- process management ------------------------------------------------------


@dataclass
class Procs:
    """Every process this script started, for cleanup."""

    workdir: Path
    pin: bool
    running: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(
        self, name: str, argv: Sequence[str], *, cpu: str | None, log: str
    ) -> subprocess.Popen[bytes]:
        if self.pin and cpu is not None:
            argv = ["taskset", "-c", cpu, *argv]
        with (self.workdir / log).open("ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, for cleanup
                cwd=self.workdir,
                # This checkout's code, whatever `pip install -e` points at.
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        self.running.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        else:
            # The leader is gone; children of its group may not be.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self.running = [(n, p) for n, p in self.running if p is not proc]

    def stop_all(self) -> None:
        for _, proc in reversed(self.running):
            self.stop(proc)


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks run."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


# -- backends ----------------------------------------------------------------


def start_nginx(procs: Procs, port: int) -> None:
    conf = procs.workdir / "nginx.conf"
    tmp = procs.workdir / "nginx-tmp"
    tmp.mkdir(exist_ok=True)
    conf.write_text(
        textwrap.dedent(f"""\
        daemon off;
        worker_processes 1;
        pid {procs.workdir}/nginx.pid;
        error_log {procs.workdir}/nginx-error.log warn;
        events {{ worker_connections 8192; }}
        http {{
            access_log off;
            client_body_temp_path {tmp}/body;
            proxy_temp_path {tmp}/proxy;
            fastcgi_temp_path {tmp}/fastcgi;
            uwsgi_temp_path {tmp}/uwsgi;
            scgi_temp_path {tmp}/scgi;
            keepalive_requests 100000000;
            keepalive_timeout 300s;
            server {{
                listen 127.0.0.1:{port} backlog=4096;
                location / {{
                    default_type text/plain;
                    return 200 "hello\\n";
                }}
            }}
        }}
        """)
    )
    proc = procs.start(
        "nginx",
        ["nginx", "-c", str(conf), "-p", str(procs.workdir)],
        cpu=LOAD_CPU,
        log="nginx.out",
    )
    wait_port(port, proc, "nginx")


def start_iperf3_server(procs: Procs, port: int) -> None:
    proc = procs.start(
        "iperf3-server",
        ["iperf3", "-s", "-p", str(port)],
        cpu=LOAD_CPU,
        log="iperf3.out",
    )
    wait_port(port, proc, "iperf3 -s")


# -- proxies -----------------------------------------------------------------


@dataclass
class Proxy:
    """A proxy under test: one listening port per backend, and for
    ``new-conn-proxy`` one reading a PROXY header (to nginx) and the front
    HAProxy's port that sends it there."""

    name: str
    http_port: int
    bulk_port: int
    proc: subprocess.Popen[bytes] | None = None
    proxied_port: int = field(default_factory=free_port)
    front_port: int = field(default_factory=free_port)


def start_proxy(
    procs: Procs, proxy: Proxy, nginx_port: int, iperf_port: int, workers: int = 1
) -> None:
    wd = procs.workdir
    pairs = [(proxy.http_port, nginx_port), (proxy.bulk_port, iperf_port)]
    if proxy.name.startswith("tlsedge"):
        toml = wd / f"{proxy.name}.toml"
        parts = [
            f"[edge]\nworkers = {workers}\ndrain_timeout = 1.0\n"
            "max_connections = 20000\n"
            + ('access_log = "off"\n' if proxy.name == "tlsedge-nolog" else "")
        ]
        for i, (listen, target) in enumerate(pairs):
            parts.append(
                f'[[listeners]]\nname = "l{i}"\nbind = "127.0.0.1:{listen}"\n'
                f'mode = "tcp"\nbackend = "b{i}"\nmax_connections = 20000\n'
                f'[[backends]]\nname = "b{i}"\nservers = ["127.0.0.1:{target}"]\n'
            )
        parts.append(
            f'[[listeners]]\nname = "proxied"\nbind = "127.0.0.1:{proxy.proxied_port}"'
            '\nmode = "tcp"\nbackend = "b0"\nmax_connections = 20000\n'
            'proxy_protocol = { trusted = ["127.0.0.1/32"] }\n'
        )
        toml.write_text("".join(parts))
        argv = [sys.executable, "-m", "tlsedge", "run", str(toml)]
    elif proxy.name == "haproxy":
        cfg = wd / "haproxy.cfg"
        listens = "".join(
            f"listen l{i}\n    bind 127.0.0.1:{listen}\n"
            f"    server s{i} 127.0.0.1:{target}\n"
            for i, (listen, target) in enumerate(pairs)
        )
        listens += (
            f"listen proxied\n    bind 127.0.0.1:{proxy.proxied_port} accept-proxy\n"
            f"    server s 127.0.0.1:{nginx_port}\n"
        )
        cfg.write_text(
            f"global\n    nbthread {workers}\n    maxconn 9000\n"
            "defaults\n    mode tcp\n    timeout connect 5s\n"
            "    timeout client 60s\n    timeout server 60s\n" + listens
        )
        argv = ["haproxy", "-db", "-f", str(cfg)]
    elif proxy.name == "proxy-protocol":
        argv = [sys.executable, "-m", "proxyprotocol.server.main", "-q"]
        for listen, target in pairs:
            argv += ["--service", f"127.0.0.1:{listen}", f"127.0.0.1:{target}?pp=noop"]
    elif proxy.name == "naive-trio":
        spec = ",".join(f"{listen}:{target}" for listen, target in pairs)
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve-naive", spec]
    else:
        raise BenchError(f"unknown proxy {proxy.name}")
    env_note = f"{proxy.name}.log"
    # Several workers/threads get both cores (and share them with the load).
    cpu = PROXY_CPU if workers == 1 else None
    proxy.proc = procs.start(proxy.name, argv, cpu=cpu, log=env_note)
    for listen, _ in pairs:
        wait_port(listen, proxy.proc, proxy.name)


def start_front(procs: Procs, proxies: Sequence[Proxy]) -> None:
    """The load balancer of ``new-conn-proxy``: a HAProxy on the load's CPU
    sending a PROXY v2 header to each proxy's PROXY listener."""
    cfg = procs.workdir / "front.cfg"
    listens = "".join(
        f"listen front-{proxy.name}\n    bind 127.0.0.1:{proxy.front_port}\n"
        f"    server s 127.0.0.1:{proxy.proxied_port} send-proxy-v2\n"
        for proxy in proxies
    )
    cfg.write_text(
        "global\n    nbthread 1\n    maxconn 9000\n"
        "defaults\n    mode tcp\n    timeout connect 5s\n"
        "    timeout client 60s\n    timeout server 60s\n" + listens
    )
    proc = procs.start(
        "front", ["haproxy", "-db", "-f", str(cfg)], cpu=LOAD_CPU, log="front.log"
    )
    for proxy in proxies:
        wait_port(proxy.front_port, proc, "front haproxy")


# -- the naive trio relay (runs in a child process) ----------------------------


def serve_naive(spec: str) -> None:
    import functools

    import trio

    async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        while data := await src.receive_some(65536):
            await dst.send_all(data)
        await dst.send_eof()

    async def handle(target: int, client: trio.SocketStream) -> None:
        async with client:
            try:
                server = await trio.open_tcp_stream("127.0.0.1", target)
            except OSError:
                return
            async with server:
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(pump, client, server)
                        nursery.start_soon(pump, server, client)
                except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for pair in spec.split(","):
                listen, target = (int(x) for x in pair.split(":"))
                nursery.start_soon(
                    functools.partial(
                        trio.serve_tcp,
                        functools.partial(handle, target),
                        listen,
                        host="127.0.0.1",
                        backlog=4096,
                    )
                )

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main)


# -- load generators -----------------------------------------------------------


@dataclass
class Measure:
    value: float  # req/s or Gbit/s
    cpu: float  # proxy CPU seconds during the run
    errors: str = ""


_RPS = re.compile(r"Requests/sec:\s+([\d.]+)")
_ERRS = re.compile(r"Socket errors: (.*)|Non-2xx or 3xx responses: (\d+)")


def run_client(procs: Procs, argv: Sequence[str], duration: float, name: str) -> str:
    proc = procs.start(name, argv, cpu=LOAD_CPU, log=f"{name}.out")
    try:
        proc.wait(duration + 30)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"{name} did not finish") from exc
    finally:
        procs.stop(proc)
    out = (procs.workdir / f"{name}.out").read_text()
    (procs.workdir / f"{name}.out").unlink()
    return out


def run_wrk(
    procs: Procs, port: int, duration: float, *, close: bool, proxy_pid: int
) -> Measure:
    argv = ["wrk", "-t1", "-c50", f"-d{duration:g}s", "--timeout", "5s"]
    if close:
        argv += ["-H", "Connection: close"]
    argv.append(f"http://127.0.0.1:{port}/")
    before = cpu_seconds(proxy_pid)
    out = run_client(procs, argv, duration, "wrk")
    cpu = cpu_seconds(proxy_pid) - before
    match = _RPS.search(out)
    if match is None:
        raise BenchError(f"wrk output without Requests/sec:\n{out}")
    errors = "; ".join(m.group(0) for m in _ERRS.finditer(out))
    return Measure(float(match.group(1)), cpu, errors)


def run_iperf(procs: Procs, port: int, duration: float, *, proxy_pid: int) -> Measure:
    argv = ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", f"{duration:g}", "-J"]
    before = cpu_seconds(proxy_pid)
    out = run_client(procs, argv, duration, "iperf3-client")
    cpu = cpu_seconds(proxy_pid) - before
    try:
        data = json.loads(out)
        bps = float(data["end"]["sum_received"]["bits_per_second"])
    except (ValueError, KeyError) as exc:
        raise BenchError(f"iperf3 output unreadable: {out[:500]}") from exc
    return Measure(bps / 1e9, cpu)


def measure(procs: Procs, proxy: Proxy, scenario: str, duration: float) -> Measure:
    assert proxy.proc is not None
    pid = proxy.proc.pid
    if scenario == "bulk":
        return run_iperf(procs, proxy.bulk_port, duration, proxy_pid=pid)
    if scenario == "new-conn-proxy":
        return run_wrk(procs, proxy.front_port, duration, close=True, proxy_pid=pid)
    return run_wrk(
        procs, proxy.http_port, duration, close=scenario == "new-conn", proxy_pid=pid
    )


# -- profiling -----------------------------------------------------------------


def profile_tlsedge(procs: Procs, args: argparse.Namespace, out_dir: Path) -> None:
    """py-spy record tlsedge under keep-alive and new-conn load (raw + svg)."""
    if shutil.which("py-spy") is None:
        raise BenchError("py-spy is not installed (pip install py-spy)")
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    nginx_port, iperf_port = free_port(), free_port()
    start_nginx(procs, nginx_port)
    start_iperf3_server(procs, iperf_port)
    proxy = Proxy(args.profile_proxy, free_port(), free_port())
    start_proxy(procs, proxy, nginx_port, iperf_port)
    assert proxy.proc is not None
    for scenario in ("keep-alive", "new-conn"):
        for fmt, ext in (("raw", "txt"), ("flamegraph", "svg")):
            target = out_dir / f"{proxy.name}-{scenario}.{ext}"
            spy = procs.start(
                "py-spy",
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(proxy.proc.pid),
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
            result = measure(procs, proxy, scenario, args.duration)
            spy.wait(args.duration + 30)
            procs.stop(spy)
            print(
                f"{proxy.name} {scenario} ({fmt}): {result.value:.0f} req/s -> {target}"
            )
        summarize_profile(out_dir / f"{proxy.name}-{scenario}.txt")


def summarize_profile(path: Path, top: int = 25) -> None:
    """Print the self and inclusive share of the top functions of a raw profile."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            incl[frame] = incl.get(frame, 0) + count
    print(f"\n{path.name}: {total} samples (idle excluded)")
    print("  self%   incl%  function")
    for frame, count in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        print(
            f"  {100 * count / total:5.1f}  {100 * incl[frame] / total:6.1f}  {frame}"
        )


# -- main ----------------------------------------------------------------------


def _pinning(pin: bool, workers: int) -> str:
    if not pin:
        return "none"
    if workers == 1:
        return "proxy on CPU 1, nginx/iperf3/wrk on CPU 0"
    return "proxy on both CPUs, nginx/iperf3/wrk on CPU 0"


def run_benchmark(procs: Procs, args: argparse.Namespace) -> None:
    proxies = [Proxy(name, free_port(), free_port()) for name in args.proxies]
    nginx_port, iperf_port = free_port(), free_port()
    start_nginx(procs, nginx_port)
    start_iperf3_server(procs, iperf_port)
    for proxy in proxies:
        start_proxy(procs, proxy, nginx_port, iperf_port, args.workers)
    if "new-conn-proxy" in args.scenarios:
        start_front(procs, [p for p in proxies if p.name in READS_PROXY])
    # Warm-up: one short run through each proxy (connections, caches, JIT-less
    # but import-lazy Python code paths).
    for proxy in proxies:
        run_wrk(procs, proxy.http_port, 1, close=False, proxy_pid=proxy.proc.pid)  # type: ignore[union-attr]
    results: dict[tuple[str, str], list[Measure]] = {}
    for rep in range(args.reps):
        for scenario in args.scenarios:
            shift = rep % len(proxies)
            order = proxies[shift:] + proxies[:shift]
            for proxy in order:
                if scenario == "new-conn-proxy" and proxy.name not in READS_PROXY:
                    continue
                m = measure(procs, proxy, scenario, args.duration)
                results.setdefault((proxy.name, scenario), []).append(m)
                extra = f"  [{m.errors}]" if m.errors else ""
                print(
                    f"  rep {rep + 1}/{args.reps} {scenario:10} {proxy.name:15} "
                    f"{m.value:10.2f} {UNITS[scenario]:6} proxy CPU {m.cpu:5.2f} s"
                    f"{extra}",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(args.pause)
    print_tables(args, proxies, results)


def print_tables(
    args: argparse.Namespace,
    proxies: Sequence[Proxy],
    results: dict[tuple[str, str], list[Measure]],
) -> None:
    names = [p.name for p in proxies]
    has_ha = "haproxy" in names

    def med(name: str, scenario: str) -> float:
        return median([m.value for m in results.get((name, scenario), [])])

    def eff(name: str, scenario: str) -> float:
        # work per CPU-second of the proxy: req (or Gbit) / CPU s
        return median(
            [m.value * args.duration / m.cpu for m in results.get((name, scenario), [])]
        )

    def cpu(name: str, scenario: str) -> float:
        return median(
            [100 * m.cpu / args.duration for m in results.get((name, scenario), [])]
        )

    headers = ["scenario", *names]
    ratio_names = [n for n in names if n != "haproxy"] if has_ha else []
    headers += [f"{n}/haproxy" for n in ratio_names]
    if has_ha and "tlsedge" in names:
        headers += ["goal", "met?"]
    rows = []
    for scenario in args.scenarios:
        prec = 2 if scenario == "bulk" else 0
        row = [f"{scenario} ({UNITS[scenario]})"]
        row += [f"{med(n, scenario):.{prec}f}" for n in names]
        if has_ha:
            ha = med("haproxy", scenario)
            row += [fmt_ratio(med(n, scenario) / ha) for n in ratio_names]
            if "tlsedge" in names:
                ratio = med("tlsedge", scenario) / ha
                row += [
                    f">= {GOALS[scenario]:.2f}x",
                    "yes" if ratio >= GOALS[scenario] else "NO",
                ]
        rows.append(row)
    print(f"\nThroughput (median of {args.reps} runs of {args.duration:g} s each):")
    print(render_table(headers, rows))

    rows = []
    for scenario in args.scenarios:
        row = [scenario]
        row += [f"{cpu(n, scenario):.0f}%" for n in names]
        rows.append(row)
    where = "pinned to one core" if args.workers == 1 else "on both cores"
    print(f"\nProxy CPU use (median, % of one core; the proxy runs {where}):")
    print(render_table(["scenario", *names], rows))

    rows = []
    for scenario in args.scenarios:
        unit = "Gbit/CPU-s" if scenario == "bulk" else "req/CPU-s"
        prec = 2 if scenario == "bulk" else 0
        row = [f"{scenario} ({unit})"]
        row += [f"{eff(n, scenario):.{prec}f}" for n in names]
        if has_ha:
            ha = eff("haproxy", scenario)
            row += [fmt_ratio(eff(n, scenario) / ha) for n in ratio_names]
        rows.append(row)
    print("\nEfficiency: work per CPU-second of the proxy process (median):")
    print(render_table(headers[: 1 + len(names) + len(ratio_names)], rows))
    rows = [
        [scenario, *[f"{1e6 / eff(n, scenario):.0f}" for n in names]]
        for scenario in args.scenarios
        if scenario != "bulk"
    ]
    if rows:
        print("\nProxy CPU per request (us; new-conn*: per connection; median):")
        print(render_table(["scenario", *names], rows))
    errors = [
        f"{name} {scenario}: {m.errors}"
        for (name, scenario), ms in results.items()
        for m in ms
        if m.errors
    ]
    if errors:
        print("\nwrk reported errors:\n  " + "\n  ".join(errors))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="s per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pause", type=float, default=1.0, help="s between runs")
    parser.add_argument("--quick", action="store_true", help="2 s runs, 1 rep")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset")
    parser.add_argument(
        "--proxies", default=",".join(ALL_PROXIES), help="comma-separated subset"
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated, of {', '.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tlsedge workers = N against HAProxy nbthread N (unpinned)",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="py-spy record tlsedge instead of comparing"
    )
    parser.add_argument("--profile-proxy", default="tlsedge", help=argparse.SUPPRESS)
    parser.add_argument("--serve-naive", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args(argv)
    if args.serve_naive:
        serve_naive(args.serve_naive)
        return 0
    if args.quick:
        args.duration, args.reps = 2.0, 1
    args.proxies = [p for p in args.proxies.split(",") if p]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    for p in args.proxies:
        if p not in ALL_PROXIES:
            parser.error(f"unknown proxy {p!r}; choose from {', '.join(ALL_PROXIES)}")
    for s in args.scenarios:
        if s not in SCENARIOS:
            parser.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    if args.workers != 1 and not set(args.proxies) <= {
        "tlsedge",
        "tlsedge-nolog",
        "haproxy",
    }:
        parser.error("--workers compares tlsedge and haproxy only")
    for tool in ("nginx", "haproxy", "wrk", "iperf3"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed")
    pin = not args.no_pin and shutil.which("taskset") is not None
    pin = pin and (os.cpu_count() or 1) >= 2
    workdir = Path(tempfile.mkdtemp(prefix="tlsedge-bench-"))
    procs = Procs(workdir, pin)
    print(banner("bench/edge.py: TCP relay, side by side", tools=True))
    print(
        f"pinning: {_pinning(pin, args.workers)}; workers/threads: {args.workers}; "
        f"wrk -t1 -c50 -d{args.duration:g}s; {args.reps} reps, rotating order"
    )
    print(f"workdir: {workdir}", flush=True)
    try:
        with terminate_on_sigterm():
            if args.profile:
                profile_tlsedge(procs, args, Path(args.profile))
            else:
                run_benchmark(procs, args)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
