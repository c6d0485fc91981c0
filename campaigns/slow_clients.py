"""Thousands of slow clients against one tlsedge worker: every one is closed at
its timeout, and a normal client's latency stays close to its unloaded value.

Slow clients, in equal shares, each connecting again once the edge closed it
(so N are pending the whole time):

- ``proxy-trickle``: a PROXY v1 header, one byte per second, never complete
  (listener with ``proxy_protocol.timeout = 3``);
- ``tls-trickle``: a real TLS ClientHello, one byte per second
  (``tls.handshake_timeout = 3``);
- ``silent``: connects to the PROXY listener and sends nothing.

The normal client is a separate process (so the slow clients' event loop does
not slow it down): connect, PROXY header + 64 bytes, read the echo, close; its
median latency is measured before (unloaded) and during the slow clients.

    python campaigns/slow_clients.py             # 3,000 slow clients for 20 s
    python campaigns/slow_clients.py --quick     # 150 slow clients for 5 s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import ssl
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio
from common import (
    Procs,
    banner,
    fd_count,
    free_port,
    make_certificate,
    out,
    raise_nofile,
    render_table,
    run_probe,
    terminate_on_sigterm,
    write_json,
)

SCRIPT = Path(__file__).resolve()
TIMEOUT = 3.0  # proxy_protocol.timeout and tls.handshake_timeout (3 s: the minimum)
LATE = 3.0  # how late a close may come on a shared machine (reported)
KINDS = ("proxy-trickle", "tls-trickle", "silent")
PROXY_LINE = b"PROXY TCP4 203.0.113.7 198.51.100.1 40000 443"  # never a CRLF


@dataclass
class Kind:
    name: str
    closed: list[float] = field(default_factory=list)  # seconds until closed
    early: int = 0  # closed before the timeout: wrong
    errors: int = 0  # could not connect

    def row(self) -> list[str]:
        c = sorted(self.closed)
        if not c:
            return [self.name, "0", "-", "-", "-", str(self.early), str(self.errors)]
        return [
            self.name,
            str(len(c)),
            f"{c[0]:.2f}",
            f"{statistics.median(c):.2f}",
            f"{c[-1]:.2f}",
            str(self.early),
            str(self.errors),
        ]


def edge_closes(log: str) -> dict[str, list[float]]:
    """Durations of the edge's connections by termination cause, from its
    access log (the edge's own view of when it closed each one)."""
    found: dict[str, list[float]] = {}
    for line in log.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(line)
                found.setdefault(record["termination"], []).append(record["duration"])
    return found


def client_hello() -> bytes:
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="edge.test")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def slow_client(kind: Kind, port: int, data: bytes, until: float) -> None:
    """Connect, trickle *data* until the edge closes; again until *until*."""
    while trio.current_time() < until:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            kind.errors += 1
            await trio.sleep(1)
            continue
        start = trio.current_time()
        async with stream, trio.open_nursery() as nursery:

            async def trickle(stream: trio.SocketStream = stream) -> None:
                with contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError
                ):
                    for i in range(len(data)):
                        await stream.send_all(data[i : i + 1])
                        await trio.sleep(1)
                await trio.sleep_forever()

            nursery.start_soon(trickle)
            with contextlib.suppress(trio.BrokenResourceError), trio.move_on_after(60):
                while await stream.receive_some(4096):
                    pass
            nursery.cancel_scope.cancel()
        elapsed = trio.current_time() - start
        kind.closed.append(elapsed)
        if elapsed < TIMEOUT - 0.1:
            kind.early += 1


def probe(port: int, count: int) -> list[float]:
    """The normal client's latencies (s), run in its own process."""

    async def one() -> float:
        start = time.perf_counter()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(
                b"PROXY TCP4 203.0.113.7 198.51.100.1 40000 443\r\n" + b"p" * 64
            )
            got = b""
            with trio.fail_after(30):
                while len(got) < 64:
                    chunk = await stream.receive_some(64 - len(got))
                    if not chunk:
                        raise EOFError
                    got += chunk
        return time.perf_counter() - start

    async def run() -> list[float]:
        samples = []
        for _ in range(count):
            samples.append(await one())
            await trio.sleep(0.05)
        return samples

    return trio.run(run)


def edge_config(pp: int, tls: int, echo: int, cert: Path, key: Path) -> str:
    return (
        "[edge]\nmax_connections = 50000\n\n"
        f'[[listeners]]\nname = "pp"\nbind = "127.0.0.1:{pp}"\nbackend = "echo"\n'
        "max_connections = 50000\n"
        '[listeners.proxy_protocol]\ntrusted = ["127.0.0.1/32"]\n'
        f"timeout = {TIMEOUT}\n\n"
        f'[[listeners]]\nname = "tls"\nbind = "127.0.0.1:{tls}"\nbackend = "echo"\n'
        "max_connections = 50000\n"
        f'[listeners.tls]\ncertificates = [{{ cert = "{cert}", key = "{key}" }}]\n'
        f"handshake_timeout = {TIMEOUT}\n\n"
        f'[[backends]]\nname = "echo"\nservers = ["127.0.0.1:{echo}"]\n'
    )


async def campaign(
    args: argparse.Namespace, procs: Procs
) -> tuple[dict[str, Kind], list[float], list[float], int, int]:
    nofile = 4 * args.clients + 2000
    _, cert, key = make_certificate(procs.workdir)
    echo, pp, tls = free_port(), free_port(), free_port()
    procs.echo_backend(echo, nofile)
    edge = procs.tlsedge("tlsedge", edge_config(pp, tls, echo, cert, key), pp, nofile)
    fds_base = fd_count(edge.pid)
    samples = args.samples
    unloaded = await trio.to_thread.run_sync(run_probe, SCRIPT, pp, samples)
    kinds = {name: Kind(name) for name in KINDS}
    payload = {
        "proxy-trickle": PROXY_LINE,
        "tls-trickle": client_hello(),
        "silent": b"",
    }
    ports = {"proxy-trickle": pp, "tls-trickle": tls, "silent": pp}
    until = trio.current_time() + args.duration
    loaded: list[float] = []
    async with trio.open_nursery() as nursery:
        for i in range(args.clients):
            name = KINDS[i % len(KINDS)]
            nursery.start_soon(
                slow_client, kinds[name], ports[name], payload[name], until
            )
            if i % 100 == 99:
                await trio.sleep(0.05)  # ramp up instead of a SYN flood
        await trio.sleep(TIMEOUT / 2)  # all of them pending
        loaded = await trio.to_thread.run_sync(run_probe, SCRIPT, pp, samples)
    with trio.move_on_after(15):
        while fd_count(edge.pid) > fds_base + 4:  # noqa: ASYNC110
            await trio.sleep(0.2)
    return kinds, unloaded, loaded, fds_base, fd_count(edge.pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="150 clients for 5 s")
    parser.add_argument(
        "--max-ratio",
        type=float,
        default=2.0,
        help="latency goal: loaded median / unloaded median",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--probe", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        out(json.dumps(probe(*args.probe)))
        return 0
    if args.quick:
        args.clients, args.duration, args.samples = 150, 5.0, 20
    banner(
        f"slow clients: {args.clients} for {args.duration:g} s, timeouts {TIMEOUT:g} s"
    )
    raise_nofile(4 * args.clients + 2000)
    with tempfile.TemporaryDirectory(prefix="tlsedge-slow-") as tmp:
        procs = Procs(Path(tmp))
        try:
            with terminate_on_sigterm():
                kinds, unloaded, loaded, fds_base, fds_after = trio.run(
                    campaign, args, procs
                )
            edge_side = edge_closes(procs.log("tlsedge"))
        finally:
            procs.stop_all()
    out(
        "",
        render_table(
            ["slow client", "closed", "min s", "median s", "max s", "early", "errors"],
            [k.row() for k in kinds.values()],
        ),
    )
    base, during = statistics.median(unloaded), statistics.median(loaded)
    ratio = during / base
    timeouts = edge_side.get("header_timeout", []) + edge_side.get(
        "tls_handshake_timeout", []
    )
    late = sum(1 for d in timeouts if d > TIMEOUT + LATE)
    early = sum(1 for d in timeouts if d < TIMEOUT - 0.05)
    client_late = sum(1 for k in kinds.values() for c in k.closed if c > TIMEOUT + LATE)
    out(
        "",
        "edge side (access log durations), by termination:",
        render_table(
            ["termination", "count", "min s", "median s", "max s"],
            [
                [
                    cause,
                    str(len(d)),
                    f"{min(d):.2f}",
                    f"{statistics.median(d):.2f}",
                    f"{max(d):.2f}",
                ]
                for cause, d in sorted(edge_side.items())
            ],
        ),
    )
    out(
        "",
        f"normal client latency, median of {len(unloaded)}: "
        f"unloaded {base * 1000:.2f} ms,"
        f" during slow clients {during * 1000:.2f} ms ({ratio:.2f}x;"
        f" goal <= {args.max_ratio:g}x)",
        f"edge closes later than timeout + {LATE:g} s: {late}, earlier: {early}",
        f"client noticed later than timeout + {LATE:g} s: {client_late}"
        " (the client process is loaded too; informational)",
        f"edge fds: {fds_base} at rest, {fds_after} after",
    )
    closed_ok = all(k.closed and not k.early and not k.errors for k in kinds.values())
    closed_ok = closed_ok and early == 0 and len(timeouts) > 0
    ok = (
        closed_ok
        and late == 0
        and fds_after <= fds_base + 4
        and ratio <= args.max_ratio
    )
    write_json(
        args.json,
        {
            "kinds": {
                k.name: {
                    "closed": len(k.closed),
                    "early": k.early,
                    "errors": k.errors,
                    "max": max(k.closed, default=0.0),
                }
                for k in kinds.values()
            },
            "late": late,
            "early_edge": early,
            "client_late": client_late,
            "edge_timeouts": len(timeouts),
            "latency_unloaded_ms": base * 1000,
            "latency_loaded_ms": during * 1000,
            "ratio": ratio,
            "fds_base": fds_base,
            "fds_after": fds_after,
            "closed_ok": closed_ok,
            "ok": ok,
        },
    )
    out("", "goals met" if ok else "GOALS NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
