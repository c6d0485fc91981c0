"""Backend and resource faults against tlsedge, with a summary table.

Scenarios (real loopback sockets; the edge runs in this process except for the
file-descriptor one, which needs its own RLIMIT_NOFILE):

- refuse: one of two servers refuses; every request is served (retry elsewhere).
- reset: the server resets mid-transfer; the client sees a reset, never a clean EOF.
- blackhole: one server's connects hang (full accept queue); requests are
  served by the other after ``connect_timeout``.
- stall: the server stops mid-response; ``idle_timeout`` resets the connection.
- flap: one server goes down and up every second while clients keep going;
  active health checks steer traffic, no client sees an error.
- emfile: the edge (a ``tlsedge run`` process with 64 fds) runs out of file
  descriptors; it keeps running, logs the accept failure, serves again after.

    python campaigns/faults.py            # flap for 10 s, 60 clients for emfile
    python campaigns/faults.py --quick    # flap for 3 s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import struct
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from common import (
    Procs,
    banner,
    free_port,
    out,
    raise_nofile,
    render_table,
    terminate_on_sigterm,
    wait_port,
    write_json,
)

from tlsedge._control.edge import Edge
from tlsedge._core.config import Config, config_from_mapping

Handler = Callable[[trio.SocketStream], Awaitable[None]]


@dataclass
class Result:
    scenario: str
    expected: str
    observed: str
    ok: bool


class AccessLog(logging.Handler):
    """Collects the edge's access-log lines (JSON)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(json.loads(record.getMessage()))

    def causes(self) -> Counter[str]:
        return Counter(r["termination"] for r in self.records)


ACCESS = AccessLog()


class Server:
    """A trio TCP server on 127.0.0.1 that can be stopped and restarted."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.port = free_port()
        self.scope: trio.CancelScope | None = None
        self.stopped = trio.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self._run)

    async def stop(self) -> None:
        """Close the listener and every connection; return once they are closed."""
        if self.scope is not None:
            self.scope.cancel()
            self.scope = None
            await self.stopped.wait()

    async def _run(self, *, task_status: trio.TaskStatus[None]) -> None:
        self.stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                self.scope = scope
                listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
                task_status.started()
                await trio.serve_listeners(self._handle, listeners)
        finally:
            self.stopped.set()

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            with contextlib.suppress(
                trio.BrokenResourceError, trio.ClosedResourceError
            ):
                await self.handler(stream)


def tag(name: bytes) -> Handler:
    async def handler(stream: trio.SocketStream) -> None:
        await stream.send_all(name)

    return handler


def make_config(servers: list[str], **options: Any) -> Config:
    listener: dict[str, Any] = {"name": "in", "bind": "127.0.0.1:0", "backend": "b"}
    if "idle_timeout" in options:
        listener["idle_timeout"] = options.pop("idle_timeout")
    return config_from_mapping(
        {
            "listeners": [listener],
            "backends": [{"name": "b", "servers": servers, **options}],
        },
        base_dir=Path.cwd(),
    )


@contextlib.asynccontextmanager
async def edge_for(config: Config) -> Any:
    async with trio.open_nursery() as nursery:
        edge: Edge = await nursery.start(Edge(config).run)
        try:
            yield edge.listen_addresses["in"][0]
        finally:
            edge.stop()


async def request(address: tuple[str, int]) -> tuple[str, bytes]:
    """Connect, half-close, read to the end: ("eof" | "reset", data)."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        data = b""
        try:
            await stream.send_eof()
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    data += chunk
        except trio.BrokenResourceError:
            return "reset", data
        return "eof", data


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(listener.getsockname())
            fillers.append(filler)
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


# -- scenarios ---------------------------------------------------------------------


async def refuse(nursery: trio.Nursery, n: int) -> Result:
    good = Server(tag(b"good"))
    await good.start(nursery)
    dead = f"127.0.0.1:{free_port()}"
    async with edge_for(make_config([dead, good.address], retries=1)) as address:
        answers = Counter([(await request(address))[1] for _ in range(n)])
    await good.stop()
    return Result(
        "refuse",
        f"{n}/{n} served by the other server",
        f"{answers[b'good']}/{n} served",
        answers[b"good"] == n,
    )


async def reset(nursery: trio.Nursery, n: int) -> Result:
    async def half_then_reset(stream: trio.SocketStream) -> None:
        await stream.send_all(b"x" * 100_000)
        await trio.sleep(0.05)
        stream.socket.setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )

    server = Server(half_then_reset)
    await server.start(nursery)
    async with edge_for(make_config([server.address])) as address:
        outcomes = Counter([(await request(address))[0] for _ in range(n)])
    await server.stop()
    return Result(
        "reset",
        f"{n}/{n} clients see a reset",
        f"{outcomes['reset']}/{n} reset, {outcomes['eof']} clean EOF",
        outcomes["reset"] == n,
    )


async def blackholed(nursery: trio.Nursery, n: int) -> Result:
    good = Server(tag(b"good"))
    await good.start(nursery)
    with blackhole() as hole:
        config = make_config([hole, good.address], retries=1, connect_timeout=0.5)
        async with edge_for(config) as address:
            start = trio.current_time()
            answers = Counter([(await request(address))[1] for _ in range(n)])
            elapsed = trio.current_time() - start
    await good.stop()
    return Result(
        "blackhole",
        f"{n}/{n} served; hole DOWN after 6 timeouts",
        f"{answers[b'good']}/{n} served in {elapsed:.1f} s",
        answers[b"good"] == n,
    )


async def stall(nursery: trio.Nursery) -> Result:
    async def stalled(stream: trio.SocketStream) -> None:
        await stream.send_all(b"partial")
        while await stream.receive_some(100):
            pass

    server = Server(stalled)
    await server.start(nursery)
    before = ACCESS.causes()["idle_timeout"]
    async with edge_for(make_config([server.address], idle_timeout=1.0)) as address:
        stream = await trio.open_tcp_stream(*address)
        start = trio.current_time()
        reset = False
        async with stream:
            with trio.move_on_after(10):
                try:
                    while await stream.receive_some(100):
                        pass
                except trio.BrokenResourceError:
                    reset = True
        elapsed = trio.current_time() - start
        await trio.sleep(0.2)
    await server.stop()
    logged = ACCESS.causes()["idle_timeout"] - before
    return Result(
        "stall",
        "reset (never a FIN), not before idle_timeout = 1 s, logged idle_timeout",
        f"{'reset' if reset else 'FIN'} after {elapsed:.2f} s, logged {logged}",
        reset and elapsed >= 0.9 and logged == 1,
    )


async def flap(nursery: trio.Nursery, duration: float) -> Result:
    a, b = Server(tag(b"a")), Server(tag(b"b"))
    await a.start(nursery)
    await b.start(nursery)
    health = {
        "interval": 0.2,
        "timeout": 0.1,
        "healthy_threshold": 1,
        "unhealthy_threshold": 1,
    }
    config = make_config([a.address, b.address], retries=1, health=health)
    seen: Counter[bytes] = Counter()
    errors = 0
    async with edge_for(config) as address:
        # a goes down between two requests, never under one: stopping a
        # server kills the connections it holds (and those in its accept
        # backlog), which no proxy can hide once the connection was made.
        between_requests = trio.Lock()

        async def toggle() -> None:
            while True:
                await trio.sleep(1)
                async with between_requests:
                    await a.stop()
                await trio.sleep(1)
                await a.start(nursery)

        async with trio.open_nursery() as inner:
            inner.start_soon(toggle)
            end = trio.current_time() + duration
            while trio.current_time() < end:
                async with between_requests:
                    outcome, data = await request(address)
                if outcome != "eof" or data not in {b"a", b"b"}:
                    errors += 1
                seen[data] += 1
                await trio.sleep(0.01)
            inner.cancel_scope.cancel()
    await a.stop()
    await b.stop()
    total = sum(seen.values())
    return Result(
        "flap",
        "0 client errors, traffic on both while a is up",
        f"{errors} errors in {total} requests (a {seen[b'a']}, b {seen[b'b']})",
        errors == 0 and seen[b"a"] > 0 and seen[b"b"] > 0,
    )


async def emfile(procs: Procs, clients: int) -> Result:
    backend = Server(tag(b"ok"))
    port = free_port()
    async with trio.open_nursery() as nursery:
        await backend.start(nursery)
        conf = (
            f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n'
            f'[[backends]]\nname = "b"\nservers = ["{backend.address}"]\nretries = 0\n'
        )
        path = procs.workdir / "emfile.toml"
        path.write_text(conf)
        proc = procs.start(
            "emfile", [sys.executable, "-m", "tlsedge", "run", str(path)], nofile=64
        )
        await trio.to_thread.run_sync(wait_port, port, proc, "tlsedge (64 fds)")
        held = []
        for _ in range(clients):
            with contextlib.suppress(OSError):
                held.append(await trio.open_tcp_stream("127.0.0.1", port))
        with trio.move_on_after(10):
            while "accept failed" not in procs.log("emfile"):  # noqa: ASYNC110
                await trio.sleep(0.1)
        logged = "accept failed" in procs.log("emfile")
        alive_when_full = proc.poll() is None
        for stream in held:
            await trio.aclose_forcefully(stream)
        served = False
        with trio.move_on_after(20):
            while not served:
                with contextlib.suppress(
                    OSError, trio.BrokenResourceError, trio.TooSlowError
                ):
                    served = (await request(("127.0.0.1", port)))[1] == b"ok"
                await trio.sleep(0.2)
        alive = proc.poll() is None
        procs.stop(proc)
        await backend.stop()
    return Result(
        "emfile",
        "keeps running, logs accept failure, serves again",
        f"alive {alive_when_full and alive}, logged {logged}, served again {served}",
        alive_when_full and alive and logged and served,
    )


async def campaign(args: argparse.Namespace, procs: Procs) -> list[Result]:
    results = []
    async with trio.open_nursery() as nursery:
        results.append(await refuse(nursery, args.requests))
        results.append(await reset(nursery, args.requests))
        results.append(await blackholed(nursery, args.requests))
        results.append(await stall(nursery))
        results.append(await flap(nursery, args.flap))
        results.append(await emfile(procs, args.clients))
        nursery.cancel_scope.cancel()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--flap", type=float, default=10.0, help="seconds of flapping")
    parser.add_argument("--clients", type=int, default=100, help="clients for emfile")
    parser.add_argument("--quick", action="store_true", help="10 requests, 3 s flap")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.flap = 10, 3.0
    banner("faults")
    raise_nofile(8192)
    logging.getLogger("tlsedge.access").addHandler(ACCESS)
    logging.getLogger("tlsedge.access").setLevel(logging.INFO)
    logging.getLogger("tlsedge").propagate = False  # the table is the output
    logging.getLogger("tlsedge").addHandler(logging.NullHandler())
    with tempfile.TemporaryDirectory(prefix="tlsedge-faults-") as tmp:
        procs = Procs(Path(tmp))
        try:
            with terminate_on_sigterm():
                results = trio.run(campaign, args, procs)
        finally:
            procs.stop_all()
    out(
        "",
        render_table(
            ["scenario", "expected", "observed", "ok"],
            [
                [r.scenario, r.expected, r.observed, "yes" if r.ok else "NO"]
                for r in results
            ],
        ),
    )
    out("", f"termination causes logged: {dict(ACCESS.causes())}")
    ok = all(r.ok for r in results)
    write_json(args.json, {"results": [r.__dict__ for r in results], "ok": ok})
    out("", "goals met" if ok else "GOALS NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
