"""HTTP mode speed: tlsedge (mode http) vs HAProxy (mode http), X-Forwarded-For.

Run: ``python bench/http_mode.py [--quick] [--duration 10] [--reps 3] [--no-pin]``
     ``python bench/http_mode.py --profile bench/results/profile`` (py-spy on tlsedge)

Both proxies parse every request, add ``X-Forwarded-For`` (and nothing else)
and forward it over pooled keep-alive connections to the same nginx (started
as in ``edge.py``: one worker, ``return 200 "hello\\n"``, access log off). One
process / thread each, three listeners each (HTTPS and plain HTTP to nginx,
and HTTPS to a second nginx that speaks TLS):

* ``tlsedge``: ``python -m tlsedge run``, ``mode = "http"``, one worker,
  ``[listeners.tls]`` with the ECDSA P-256 certificate of ``tls.py``,
  ``[listeners.forwarded]`` with only ``x_forwarded_for`` on (HAProxy's
  ``option forwardfor`` adds nothing else), default log level: one JSON
  access-log line per *request* and one per connection, written to a file;
* ``tlsedge-nolog``: the same with ``access_log = "off"`` (no access log);
* ``trio-floor`` (only ``http-keep-alive``): `trio_floor.py`, a minimal trio
  task-per-connection proxy with tlsedge's parser and socket I/O and none of
  its features: the floor of a task-per-connection design (tlsedge's before
  its reactor);
* ``epoll-floor`` (``https-keep-alive`` and ``http-keep-alive``):
  `epoll_floor.py`, issue 24's prototype: one epoll loop in plain CPython,
  one regular expression per head, the ``X-Forwarded-For`` line spliced in,
  ``SSLObject`` over ``MemoryBIO``; no features at all: what a CPython
  process can reach per request;
* ``reactor-floor`` (``https-keep-alive`` and ``http-keep-alive``):
  `reactor_floor.py`, the same per-request work as handlers of tlsedge's
  reactor inside a trio run, as tlsedge's established connections are
  driven: the floor of tlsedge's architecture (what hosting the hot path in
  trio costs, before any engine or feature);
* ``reactor-floor-log``: the same with each request's access-log line
  (written to a file by tlsedge's writer) and its count in tlsedge's metrics:
  the floor of an engine with those two features;
* ``haproxy``: ``nbthread 1``, ``mode http``, ``option forwardfor``,
  ``bind ... ssl crt <pem>``, default ``http-reuse safe`` keep-alive to
  nginx, no logging.

Scenarios (wrk ``-t1 -c50``, 50 persistent client connections, requests/s):

* ``https-keep-alive``: ``https://`` (TLS 1.3; wrk's handshakes happen once
  per connection at the start, so this is request handling over TLS);
* ``http-keep-alive``: the same over plain HTTP;
* ``https-to-tls-backend``: HTTPS keep-alive to a backend that speaks TLS too
  (AWS ``backend-protocol: https``): a second nginx with ``listen ... ssl``
  and the same certificate (TLS 1.3), verified against the dev CA: tlsedge
  with ``protocol = "tls"``, HAProxy with ``server ... ssl verify required
  ca-file``. Both keep pooled TLS connections to it, so this measures request
  handling with a TLS record layer on both sides, not handshakes.

The proxies run interleaved (the order rotates each repetition), the tables
show medians, ratios are against HAProxy. Pinning and the per-CPU-second view
are as in ``edge.py``: the proxy on CPU 1, nginx and wrk on CPU 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _common import banner, fmt_ratio, median, render_table
from edge import (
    _ERRS,
    _RPS,
    BenchError,
    Measure,
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
LOAD_CPU = "0"
SCENARIOS = ("https-keep-alive", "http-keep-alive", "https-to-tls-backend")
ALL_PROXIES = (
    "tlsedge",
    "tlsedge-nolog",
    "haproxy",
    "trio-floor",
    "epoll-floor",
    "reactor-floor",
    "reactor-floor-log",
)
FLOOR_SCENARIOS = {
    "trio-floor": ("http-keep-alive",),
    "epoll-floor": ("https-keep-alive", "http-keep-alive"),
    "reactor-floor": ("https-keep-alive", "http-keep-alive"),
    "reactor-floor-log": ("https-keep-alive", "http-keep-alive"),
}
#: Issue 24's goals for tlsedge with its access log on: HTTPS and plain HTTP
#: keep-alive with X-Forwarded-For (issue 13's was 0.8x for HTTPS, issue 12's
#: 0.45x for both).
GOALS = {"https-keep-alive": 0.6, "http-keep-alive": 0.7}


class Proxy:
    """A proxy under test: an HTTPS, a plain HTTP and an HTTPS-to-TLS port."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.https_port = free_port()
        self.http_port = free_port()
        self.tls_backend_port = free_port()
        self.pid = 0
        #: The scenarios it serves (the floors serve only some).
        self.scenarios = FLOOR_SCENARIOS.get(name, SCENARIOS)

    def url(self, scenario: str) -> str:
        if scenario == "https-to-tls-backend":
            return f"https://127.0.0.1:{self.tls_backend_port}/"
        if scenario.startswith("https"):
            return f"https://127.0.0.1:{self.https_port}/"
        return f"http://127.0.0.1:{self.http_port}/"


def start_tls_nginx(procs: Procs, port: int, certs: tuple[Path, Path, Path]) -> None:
    """A second nginx, the same answer over TLS (``listen ... ssl``)."""
    cert, key, _ = certs
    wd = procs.workdir
    tmp = wd / "nginx-tls-tmp"
    tmp.mkdir(exist_ok=True)
    conf = wd / "nginx-tls.conf"
    temp_paths = "".join(
        f"{kind}_temp_path {tmp}/{kind}; "
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf.write_text(
        f"daemon off; worker_processes 1; pid {wd}/nginx-tls.pid;\n"
        f"error_log {wd}/nginx-tls-error.log warn;\n"
        "events { worker_connections 8192; }\n"
        f"http {{ access_log off; {temp_paths}\n"
        "keepalive_requests 100000000; keepalive_timeout 300s;\n"
        f"ssl_certificate {cert}; ssl_certificate_key {key};\n"
        f"server {{ listen 127.0.0.1:{port} ssl backlog=4096;\n"
        'location / { default_type text/plain; return 200 "hello\\n"; } } }\n'
    )
    proc = procs.start(
        "nginx-tls",
        ["nginx", "-c", str(conf), "-p", str(wd)],
        cpu=LOAD_CPU,
        log="nginx-tls.out",
    )
    wait_port(port, proc, "nginx-tls")


def start_proxy(
    procs: Procs,
    proxy: Proxy,
    nginx_ports: tuple[int, int],
    certs: tuple[Path, Path, Path],
) -> None:
    cert, key, combined = certs
    ca = cert.parent / "ca.pem"  # make_dev_certificates' CA
    nginx_port, tls_nginx_port = nginx_ports
    wd = procs.workdir
    argv: list[str]
    if proxy.name.startswith("tlsedge"):
        toml = wd / f"{proxy.name}.toml"
        listeners = []
        for name, port, backend in (
            ("https", proxy.https_port, "nginx"),
            ("http", proxy.http_port, "nginx"),
            ("https-tls", proxy.tls_backend_port, "nginx-tls"),
        ):
            text = (
                f'[[listeners]]\nname = "{name}"\nbind = "127.0.0.1:{port}"\n'
                f'mode = "http"\nbackend = "{backend}"\nmax_connections = 20000\n'
                "[listeners.forwarded]\nx_forwarded_for = true\n"
                "x_forwarded_proto = false\nx_forwarded_port = false\n"
            )
            if name.startswith("https"):
                text += (
                    "[listeners.tls]\n"
                    f'certificates = [{{ cert = "{cert}", key = "{key}" }}]\n'
                )
            listeners.append(text)
        toml.write_text(
            "[edge]\nworkers = 1\ndrain_timeout = 1.0\nmax_connections = 20000\n"
            + ('access_log = "off"\n' if proxy.name == "tlsedge-nolog" else "")
            + "".join(listeners)
            + f'[[backends]]\nname = "nginx"\nservers = ["127.0.0.1:{nginx_port}"]\n'
            + f'[[backends]]\nname = "nginx-tls"\nprotocol = "tls"\n'
            f'servers = ["127.0.0.1:{tls_nginx_port}"]\n'
            f'[backends.tls]\nca = "{ca}"\n'
        )
        argv = [sys.executable, "-m", "tlsedge", "run", str(toml)]
    elif proxy.name == "trio-floor":
        floor = Path(__file__).with_name("trio_floor.py")
        argv = [sys.executable, str(floor), str(proxy.http_port), str(nginx_port)]
    elif proxy.name in ("epoll-floor", "reactor-floor", "reactor-floor-log"):
        script = "epoll_floor.py" if proxy.name == "epoll-floor" else "reactor_floor.py"
        argv = [
            sys.executable,
            str(Path(__file__).with_name(script)),
            str(proxy.http_port),
            str(proxy.https_port),
            str(nginx_port),
            str(combined),
        ]
        if proxy.name == "reactor-floor-log":
            argv.append(str(wd / "reactor-floor-access.log"))
    elif proxy.name == "haproxy":
        cfg = wd / "haproxy.cfg"
        cfg.write_text(
            "global\n    nbthread 1\n    maxconn 9000\n"
            "defaults\n    mode http\n    option forwardfor\n"
            "    timeout connect 5s\n    timeout client 60s\n"
            "    timeout server 60s\n    timeout http-keep-alive 60s\n"
            "frontend fe\n"
            f"    bind 127.0.0.1:{proxy.https_port} ssl crt {combined}\n"
            f"    bind 127.0.0.1:{proxy.http_port}\n"
            "    default_backend nginx\n"
            "frontend fe-tls\n"
            f"    bind 127.0.0.1:{proxy.tls_backend_port} ssl crt {combined}\n"
            "    default_backend nginx-tls\n"
            f"backend nginx\n    server s1 127.0.0.1:{nginx_port}\n"
            "backend nginx-tls\n"
            f"    server s1 127.0.0.1:{tls_nginx_port} ssl verify required"
            f" ca-file {ca}\n"
        )
        argv = ["haproxy", "-db", "-f", str(cfg)]
    else:
        raise BenchError(f"unknown proxy {proxy.name}")
    proc = procs.start(proxy.name, argv, cpu=PROXY_CPU, log=f"{proxy.name}.log")
    proxy.pid = proc.pid
    for scenario in proxy.scenarios:
        wait_port(port_of(proxy, scenario), proc, proxy.name)


def port_of(proxy: Proxy, scenario: str) -> int:
    if scenario == "https-to-tls-backend":
        return proxy.tls_backend_port
    return proxy.https_port if scenario.startswith("https") else proxy.http_port


def check_forwarding(procs: Procs, proxy: Proxy) -> None:
    """One request through each listener must answer nginx's 'hello'."""
    for scenario in proxy.scenarios:
        argv = ["curl", "-sSk", "--max-time", "5", proxy.url(scenario)]
        out = run_client(procs, argv, 5, "curl")
        if out != "hello\n":
            raise BenchError(f"{proxy.name} {scenario}: unexpected answer {out!r}")


def run_wrk(procs: Procs, proxy: Proxy, scenario: str, duration: float) -> Measure:
    argv = ["wrk", "-t1", "-c50", f"-d{duration:g}s", "--timeout", "5s"]
    argv.append(proxy.url(scenario))
    before = cpu_seconds(proxy.pid)
    out = run_client(procs, argv, duration, "wrk")
    cpu = cpu_seconds(proxy.pid) - before
    match = _RPS.search(out)
    if match is None:
        raise BenchError(f"wrk output without Requests/sec:\n{out}")
    errors = "; ".join(m.group(0) for m in _ERRS.finditer(out))
    return Measure(float(match.group(1)), cpu, errors)


def profile_tlsedge(
    procs: Procs,
    args: argparse.Namespace,
    out_dir: Path,
    nginx_ports: tuple[int, int],
    certs: tuple[Path, Path, Path],
) -> None:
    """py-spy record tlsedge (the first tlsedge variant of ``--proxies``)
    under each scenario's load (raw + svg)."""
    if shutil.which("py-spy") is None:
        raise BenchError("py-spy is not installed (pip install py-spy)")
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = [name for name in args.proxies if name.startswith("tlsedge")]
    proxy = Proxy(variants[0] if variants else "tlsedge")
    start_proxy(procs, proxy, nginx_ports, certs)
    for scenario in args.scenarios:
        raw = out_dir / f"http-{scenario}.txt"
        for fmt, target in (("raw", raw), ("flamegraph", raw.with_suffix(".svg"))):
            spy = procs.start(
                "py-spy",
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(proxy.pid),
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
            result = run_wrk(procs, proxy, scenario, args.duration)
            spy.wait(args.duration + 30)
            procs.stop(spy)
            print(f"tlsedge {scenario} ({fmt}): {result.value:.0f} req/s -> {target}")
        summarize_profile(raw)


def run_benchmark(
    procs: Procs,
    args: argparse.Namespace,
    nginx_ports: tuple[int, int],
    certs: tuple[Path, Path, Path],
) -> None:
    proxies = [Proxy(name) for name in args.proxies]
    for proxy in proxies:
        start_proxy(procs, proxy, nginx_ports, certs)
        check_forwarding(procs, proxy)
    for proxy in proxies:  # warm-up
        for scenario in args.scenarios:
            if scenario in proxy.scenarios:
                run_wrk(procs, proxy, scenario, 1)
    results: dict[tuple[str, str], list[Measure]] = {}
    for rep in range(args.reps):
        for scenario in args.scenarios:
            shift = rep % len(proxies)
            for proxy in proxies[shift:] + proxies[:shift]:
                if scenario not in proxy.scenarios:
                    continue
                m = run_wrk(procs, proxy, scenario, args.duration)
                results.setdefault((proxy.name, scenario), []).append(m)
                extra = f"  [{m.errors}]" if m.errors else ""
                print(
                    f"  rep {rep + 1}/{args.reps} {scenario:16} {proxy.name:13} "
                    f"{m.value:10.0f} req/s  proxy CPU {m.cpu:5.2f} s{extra}",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(args.pause)
    print_tables(args, [p.name for p in proxies], results)


def print_tables(
    args: argparse.Namespace,
    names: Sequence[str],
    results: dict[tuple[str, str], list[Measure]],
) -> None:
    def med(name: str, scenario: str) -> float:
        return median([m.value for m in results.get((name, scenario), [])])

    def eff(name: str, scenario: str) -> float:
        return median(
            [m.value * args.duration / m.cpu for m in results.get((name, scenario), [])]
        )

    def cpu(name: str, scenario: str) -> float:
        return median(
            [100 * m.cpu / args.duration for m in results.get((name, scenario), [])]
        )

    has_ha = "haproxy" in names
    ratio_names = [n for n in names if n != "haproxy"] if has_ha else []
    headers = ["scenario", *names, *(f"{n}/haproxy" for n in ratio_names)]
    goal = has_ha and "tlsedge" in names
    rows = []
    for scenario in args.scenarios:
        row = [f"{scenario} (req/s)", *(fmt_number(med(n, scenario)) for n in names)]
        if has_ha:
            ha = med("haproxy", scenario)
            row += [fmt_ratio(med(n, scenario) / ha) for n in ratio_names]
            if goal and scenario in GOALS:
                ok = med("tlsedge", scenario) / ha >= GOALS[scenario]
                row += [f">= {GOALS[scenario]:.2f}x", "yes" if ok else "NO"]
            elif goal:
                row += ["-", "-"]
        rows.append(row)
    print(f"\nThroughput (median of {args.reps} runs of {args.duration:g} s each):")
    print(render_table([*headers, *(["goal", "met?"] if goal else [])], rows))

    rows = [
        [scenario, *(fmt_number(cpu(n, scenario), "%") for n in names)]
        for scenario in args.scenarios
    ]
    print("\nProxy CPU use (median, % of one core; the proxy is pinned to one core):")
    print(render_table(["scenario", *names], rows))

    rows = []
    for scenario in args.scenarios:
        row = [
            f"{scenario} (req/CPU-s)",
            *(fmt_number(eff(n, scenario)) for n in names),
        ]
        if has_ha:
            ha = eff("haproxy", scenario)
            row += [fmt_ratio(eff(n, scenario) / ha) for n in ratio_names]
        rows.append(row)
    print("\nEfficiency: requests per CPU-second of the proxy process (median):")
    print(render_table(headers, rows))

    rows = [
        [scenario, *(fmt_number(1e6 / eff(n, scenario)) for n in names)]
        for scenario in args.scenarios
    ]
    print("\nCPU per request: µs of the proxy process's CPU time (user + system):")
    print(render_table(["scenario", *names], rows))
    errors = [
        f"{name} {scenario}: {m.errors}"
        for (name, scenario), ms in results.items()
        for m in ms
        if m.errors
    ]
    if errors:
        print("\nwrk reported errors:\n  " + "\n  ".join(errors))


def fmt_number(value: float, unit: str = "") -> str:
    """``123`` (and *unit*), or ``-`` where a proxy did not run the scenario."""
    return "-" if value != value else f"{value:.0f}{unit}"  # noqa: PLR0124


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="s per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pause", type=float, default=1.0, help="s between runs")
    parser.add_argument("--quick", action="store_true", help="2 s runs, 1 rep")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset")
    parser.add_argument("--proxies", default=",".join(ALL_PROXIES))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument(
        "--profile", metavar="DIR", help="py-spy record tlsedge instead of comparing"
    )
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args(argv)
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
    for tool in ("nginx", "haproxy", "wrk", "curl"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not installed")
    pin = not args.no_pin and shutil.which("taskset") is not None
    pin = pin and (os.cpu_count() or 1) >= 2
    workdir = Path(tempfile.mkdtemp(prefix="tlsedge-bench-http-"))
    procs = Procs(workdir, pin)
    title = "bench/http_mode.py: HTTP mode (X-Forwarded-For), side by side"
    print(banner(title, tools=True))
    print(
        f"pinning: {'proxy on CPU 1, nginx/wrk on CPU 0' if pin else 'none'}; "
        f"wrk -t1 -c50 -d{args.duration:g}s; {args.reps} reps, rotating order"
    )
    print(f"workdir: {workdir}", flush=True)
    try:
        with terminate_on_sigterm():
            certs = make_certificates(workdir)
            nginx_ports = (free_port(), free_port())
            start_nginx(procs, nginx_ports[0])
            start_tls_nginx(procs, nginx_ports[1], certs)
            if args.profile:
                profile_tlsedge(procs, args, Path(args.profile), nginx_ports, certs)
            else:
                run_benchmark(procs, args, nginx_ports, certs)
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
