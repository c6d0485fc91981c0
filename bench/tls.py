"""TLS termination speed: tlsedge vs HAProxy vs proxy-protocol's server.

Run: ``python bench/tls.py [--quick] [--duration 10] [--reps 3] [--no-pin]``
     ``python bench/tls.py --profile bench/results/profile`` (py-spy on tlsedge)

Each proxy terminates TLS with the same ECDSA P-256 certificate (made with
``tlsedge._tls.certs.make_dev_certificates`` in a temporary directory) and relays
plain TCP to the same nginx (started as in ``edge.py``: one worker, fixed
6-byte answer). One process / thread each:

* ``tlsedge``: ``python -m tlsedge run``, one listener, mode tcp, ``[listeners.tls]``
  with the default ``intermediate`` policy, no PROXY header, default log level
  (one access-log line per connection);
* ``haproxy``: ``nbthread 1``, ``mode tcp``, ``bind ... ssl crt <pem>`` with
  Debian's default ciphers (TLS 1.3 negotiated, like the others), no logging;
* ``proxy-protocol``: the ``proxy-protocol`` 0.11.3 package's asyncio server
  (``--service 'ssl://HOST:PORT?cert=..&key=..' 'HOST:PORT?pp=noop'``): its
  source addresses accept ``ssl://`` with a certificate, so it can terminate
  TLS (``asyncio``'s SSL transport over ``ssl.SSLObject``).

Scenarios (wrk ``-t1 -c50`` over https; wrk's OpenSSL negotiates TLS 1.3 with
TLS_AES_256_GCM_SHA384, and does not resume sessions, so every connection is
a full handshake with an ECDHE key exchange and an ECDSA signature):

* ``keep-alive``: requests/s over 50 persistent TLS connections;
* ``handshakes``: ``-H "Connection: close"``: one new TLS connection per
  request, so requests/s = full handshakes/s.

Pinning (unless ``--no-pin``): the proxy on CPU 1, nginx and wrk on CPU 0 (see
``edge.py``). The proxies run interleaved (the order rotates each repetition)
and the table shows medians; ratios are against HAProxy.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _common import banner, fmt_ratio, median, render_table
from edge import (
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tlsedge._tls.certs import make_dev_certificates  # noqa: E402

PROXY_CPU = "1"
LOAD_CPU = "0"
SCENARIOS = ("keep-alive", "handshakes")
ALL_PROXIES = ("tlsedge", "haproxy", "proxy-protocol")
# Issue 13's goals (TLS keep-alive >= 0.75x is judged per CPU-second there).
GOALS = {"keep-alive": 0.6, "handshakes": 0.85}


def make_certificates(workdir: Path) -> tuple[Path, Path, Path]:
    """(cert, key, cert+key for HAProxy): ECDSA P-256 for 127.0.0.1."""
    made = make_dev_certificates(
        workdir / "certs", names=("127.0.0.1", "localhost"), key_type="ecdsa-p256"
    )
    combined = workdir / "certs" / "haproxy.pem"
    combined.write_bytes(Path(made.cert).read_bytes() + Path(made.key).read_bytes())
    return Path(made.cert), Path(made.key), combined


def start_proxy(
    procs: Procs,
    name: str,
    port: int,
    nginx_port: int,
    certs: tuple[Path, Path, Path],
) -> int:
    """Start one proxy; returns its pid."""
    cert, key, combined = certs
    wd = procs.workdir
    argv: list[str]
    if name == "tlsedge":
        toml = wd / "tlsedge.toml"
        toml.write_text(
            "[edge]\nworkers = 1\ndrain_timeout = 1.0\nmax_connections = 20000\n"
            f'[[listeners]]\nname = "tls"\nbind = "127.0.0.1:{port}"\n'
            'mode = "tcp"\nbackend = "nginx"\nmax_connections = 20000\n'
            f'[listeners.tls]\ncertificates = [{{ cert = "{cert}", key = "{key}" }}]\n'
            f'[[backends]]\nname = "nginx"\nservers = ["127.0.0.1:{nginx_port}"]\n'
        )
        argv = [sys.executable, "-m", "tlsedge", "run", str(toml)]
    elif name == "haproxy":
        cfg = wd / "haproxy.cfg"
        cfg.write_text(
            "global\n    nbthread 1\n    maxconn 9000\n"
            "defaults\n    mode tcp\n    timeout connect 5s\n"
            "    timeout client 60s\n    timeout server 60s\n"
            f"listen tls\n    bind 127.0.0.1:{port} ssl crt {combined}\n"
            f"    server s1 127.0.0.1:{nginx_port}\n"
        )
        argv = ["haproxy", "-db", "-f", str(cfg)]
    elif name == "proxy-protocol":
        argv = [
            sys.executable,
            "-m",
            "proxyprotocol.server.main",
            "-q",
            "--service",
            f"ssl://127.0.0.1:{port}?cert={cert}&key={key}",
            f"127.0.0.1:{nginx_port}?pp=noop",
        ]
    else:
        raise BenchError(f"unknown proxy {name}")
    proc = procs.start(name, argv, cpu=PROXY_CPU, log=f"{name}.log")
    wait_port(port, proc, name)
    return proc.pid


_RPS = re.compile(r"Requests/sec:\s+([\d.]+)")
_ERRS = re.compile(r"Socket errors: (.*)|Non-2xx or 3xx responses: (\d+)")


def measure(
    procs: Procs, port: int, pid: int, scenario: str, duration: float
) -> Measure:
    """wrk over https against *port*; the CPU time *pid* used meanwhile."""
    argv = ["wrk", "-t1", "-c50", f"-d{duration:g}s", "--timeout", "5s"]
    if scenario == "handshakes":
        argv += ["-H", "Connection: close"]
    argv.append(f"https://127.0.0.1:{port}/")
    before = cpu_seconds(pid)
    out = run_client(procs, argv, duration, "wrk")
    cpu = cpu_seconds(pid) - before
    match = _RPS.search(out)
    if match is None:
        raise BenchError(f"wrk output without Requests/sec:\n{out}")
    errors = "; ".join(m.group(0) for m in _ERRS.finditer(out))
    return Measure(float(match.group(1)), cpu, errors)


def run_benchmark(procs: Procs, args: argparse.Namespace) -> None:
    certs = make_certificates(procs.workdir)
    nginx_port = free_port()
    start_nginx(procs, nginx_port)
    proxies = [p for p in args.proxies.split(",") if p]
    ports = {name: free_port() for name in proxies}
    pids = {
        name: start_proxy(procs, name, ports[name], nginx_port, certs)
        for name in proxies
    }
    results: dict[tuple[str, str], list[Measure]] = {}
    for rep in range(args.reps):
        order = proxies[rep % len(proxies) :] + proxies[: rep % len(proxies)]
        for scenario in args.scenarios.split(","):
            for name in order:
                time.sleep(args.pause)
                result = measure(
                    procs, ports[name], pids[name], scenario, args.duration
                )
                results.setdefault((name, scenario), []).append(result)
                print(
                    f"rep {rep + 1} {scenario:10} {name:15} {result.value:9.0f} req/s"
                    f"  proxy CPU {result.cpu:5.2f} s"
                    + (f"  errors: {result.errors}" if result.errors else ""),
                    flush=True,
                )
    print_tables(args, proxies, results)


def print_tables(
    args: argparse.Namespace,
    proxies: Sequence[str],
    results: dict[tuple[str, str], list[Measure]],
) -> None:
    def med(name: str, scenario: str) -> float:
        return median([m.value for m in results.get((name, scenario), [])])

    def per_cpu(name: str, scenario: str) -> float:
        return median(
            [
                m.value * args.duration / m.cpu
                for m in results.get((name, scenario), [])
                if m.cpu > 0
            ]
        )

    scenarios = args.scenarios.split(",")
    rows = []
    for name in proxies:
        row = [name]
        for scenario in scenarios:
            ratio = med(name, scenario) / med("haproxy", scenario)
            row += [f"{med(name, scenario):.0f}", fmt_ratio(ratio)]
        rows.append(row)
    headers = ["proxy"]
    for scenario in scenarios:
        headers += [f"{scenario} req/s", "vs haproxy"]
    print(f"\nmedians of {args.reps} x {args.duration:g} s, wrk -t1 -c50 over https")
    print(render_table(headers, rows))
    rows = []
    for name in proxies:
        row = [name]
        for scenario in scenarios:
            ratio = per_cpu(name, scenario) / per_cpu("haproxy", scenario)
            row += [f"{per_cpu(name, scenario):.0f}", fmt_ratio(ratio)]
        rows.append(row)
    headers = ["proxy"]
    for scenario in scenarios:
        headers += [f"{scenario} req/CPU-s", "vs haproxy"]
    print("\nper CPU-second of the proxy process (independent of the bottleneck)")
    print(render_table(headers, rows))
    print("\ngoals (tlsedge / haproxy, req/s):")
    for scenario in scenarios:
        if "tlsedge" in proxies and "haproxy" in proxies:
            ratio = med("tlsedge", scenario) / med("haproxy", scenario)
            goal = GOALS.get(scenario, 0.0)
            verdict = "met" if ratio >= goal else "NOT met"
            print(f"  {scenario}: {fmt_ratio(ratio)} (goal >= {goal:.2f}x): {verdict}")


def profile_tlsedge(procs: Procs, args: argparse.Namespace, out_dir: Path) -> None:
    """py-spy record tlsedge under the handshake load (raw + svg)."""
    if shutil.which("py-spy") is None:
        raise BenchError("py-spy is not installed (pip install py-spy)")
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    certs = make_certificates(procs.workdir)
    nginx_port, port = free_port(), free_port()
    start_nginx(procs, nginx_port)
    pid = start_proxy(procs, "tlsedge", port, nginx_port, certs)
    for scenario in ("handshakes", "keep-alive"):
        target = out_dir / f"tlsedge-tls-{scenario}.txt"
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
                "raw",
                "--output",
                str(target),
            ],
            cpu=LOAD_CPU,
            log="py-spy.out",
        )
        time.sleep(0.5)
        result = measure(procs, port, pid, scenario, args.duration)
        spy.wait(args.duration + 30)
        procs.stop(spy)
        print(f"tlsedge {scenario}: {result.value:.0f} req/s -> {target}")
        summarize_profile(target)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="s per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pause", type=float, default=1.0, help="s between runs")
    parser.add_argument("--quick", action="store_true", help="3 s runs, 1 rep")
    parser.add_argument("--no-pin", action="store_true", help="do not use taskset")
    parser.add_argument("--proxies", default=",".join(ALL_PROXIES))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--profile", metavar="DIR", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.reps = 3.0, 1
    for tool in ("wrk", "nginx", "haproxy"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            print(f"tls.py: {tool} is not installed", file=sys.stderr)
            return 2
    print(banner("bench/tls.py: TLS termination", tools=True))
    print(f"pinning: {'off' if args.no_pin else 'proxy on CPU 1, nginx/wrk on CPU 0'}")
    with (
        tempfile.TemporaryDirectory(prefix="tlsedge-bench-tls-") as tmp,
        terminate_on_sigterm(),
    ):
        procs = Procs(Path(tmp), pin=not args.no_pin)
        try:
            if args.profile is not None:
                profile_tlsedge(procs, args, args.profile)
            else:
                run_benchmark(procs, args)
        except BenchError as exc:
            print(f"tls.py: {exc}", file=sys.stderr)
            return 1
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
