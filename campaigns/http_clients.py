"""Hostile HTTP clients against one tlsedge worker in HTTP mode: slowloris heads,
slow and stalled bodies, oversized heads and request smuggling, all at once,
while a normal keep-alive client measures its latency.

The edge (``mode = "http"``, ``request_header_timeout = 3``, ``idle_timeout =
2``, ``max_header_bytes = 4096``) runs in front of a real HTTP/1.1 backend (h11
on trio, this script's ``--backend`` mode) that logs every request it parses.
Shares, each of N clients, all running for the duration:

- ``slowloris``: a request head, one byte per second, never complete; the
  client connects again once answered (so N stay pending). Goal: each gets a
  408 from the edge at ``request_header_timeout`` (edge log:
  ``request_header_timeout``), none early, none later than timeout + 3 s.
- ``stalled-body``: a complete head with ``Content-Length: 1000000``, then a
  body byte every 3 s (longer than ``idle_timeout``). Goal: 408 at
  ``idle_timeout``, which limits the time *between* reads (edge log:
  ``bad_request``, "request body stalled for idle_timeout").
- ``slow-body`` (N/10): the same head, then a byte every second, never idle
  for ``idle_timeout``. Goal: 408 once the body falls behind
  ``request_body_min_rate`` (500 bytes/s) after the ``request_body_timeout``
  grace (4 s), i.e. at about 4 s (edge log: ``bad_request``, "request body
  slower than request_body_min_rate").
- ``oversized``: heads beyond ``max_header_bytes`` (a 64 KiB field) or
  ``max_headers`` (101 fields), sent at once, a connection per client every
  ``--pause`` seconds. Goal: 431 and a close for each; the edge's RSS levels off
  (second half of the run grows less than 16 MiB).
- ``smuggling``: the request-smuggling vectors (CL+TE, duplicate and malformed
  Content-Length, chunk sizes ``0x10``/``-1``/17 digits, obs-fold, bare LF,
  header injection through X-Forwarded-For/Forwarded, a request glued behind a
  chunk or into the trailers), most with a ``GET /smuggled`` behind them, some
  sending the body after the head (so the head reaches the backend first),
  plus valid controls (a GET, two pipelined requests), a connection every
  ``--pause`` seconds. Goal: 400 and a close for every vector, the controls
  answered, and the backend parses exactly the requests expected: no
  ``/smuggled``, no complete vector request, every normal and control request
  once.

The normal client is a separate process (``http.client``, one keep-alive
connection, GET every 50 ms): its median latency during the load is within 2x
of its unloaded median, with 0 errors. Afterwards the edge's file descriptors
come back to their resting count, and its log holds no internal error.

    python campaigns/http_clients.py             # 1,000 clients per share for 20 s
    python campaigns/http_clients.py --quick     # 40 per share for 5 s
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import h11
import trio
from common import (
    Procs,
    banner,
    cpu_seconds,
    fd_count,
    free_port,
    out,
    raise_nofile,
    render_table,
    rss_kib,
    run_probe,
    terminate_on_sigterm,
    wait_port,
    write_json,
)

SCRIPT = Path(__file__).resolve()
HEADER_TIMEOUT = 3.0  # [listeners.http] request_header_timeout
IDLE_TIMEOUT = 2.0  # listener idle_timeout: the longest pause inside a body
LATE = 3.0  # how late a close may come on a shared machine
MAX_HEADER_BYTES = 4096  # [listeners.http] max_header_bytes
MAX_HEADERS = 100  # [listeners.http] max_headers (the default)
STALL_GAP = IDLE_TIMEOUT + 1.0  # stalled-body: seconds between body bytes
BODY_GRACE = 4.0  # [listeners.http] request_body_timeout (min rate: default 500)
RSS_GROWTH_KIB = 16 * 1024  # allowed RSS growth over the second half of the run
BODY = b"ok\n"  # what the backend answers
HOST = b"Host: edge.test\r\n"
SMUGGLED = b"GET /smuggled HTTP/1.1\r\n" + HOST + b"\r\n"
CHUNKED = b"Transfer-Encoding: chunked\r\n"


def _post(name: str, fields: bytes, body: bytes = b"") -> bytes:
    return b"POST /vector/%s HTTP/1.1\r\n%s%s\r\n%s" % (
        name.encode(),
        HOST,
        fields,
        body,
    )


def _get(name: str, fields: bytes) -> bytes:
    return b"GET /vector/%s HTTP/1.1\r\n%s%s\r\n" % (name.encode(), HOST, fields)


@dataclass(frozen=True)
class Vector:
    """One request (or pipeline) sent on its own connection."""

    name: str
    data: bytes
    expect: tuple[int, ...]  # statuses, in order
    later: bytes = b""  # sent 0.1 s after *data* (the head reaches the backend)

    @property
    def refused(self) -> bool:
        return self.expect == (400,)


_CL = b"Content-Length: %d\r\n"
VECTORS: tuple[Vector, ...] = (
    Vector(
        "cl-te",
        _post("cl-te", _CL % (5 + len(SMUGGLED)) + CHUNKED, b"0\r\n\r\n" + SMUGGLED),
        (400,),
    ),
    Vector("te-cl", _post("te-cl", CHUNKED + _CL % 4, b"0\r\n\r\n" + SMUGGLED), (400,)),
    Vector("cl-cl", _post("cl-cl", _CL % 0 + _CL % len(SMUGGLED), SMUGGLED), (400,)),
    Vector(
        "cl-list",
        _post("cl-list", b"Content-Length: 0, %d\r\n" % len(SMUGGLED), SMUGGLED),
        (400,),
    ),
    Vector(
        "cl-plus",
        _post("cl-plus", b"Content-Length: +%d\r\n" % len(SMUGGLED), SMUGGLED),
        (400,),
    ),
    Vector(
        "cl-hex",
        _post("cl-hex", b"Content-Length: 0x%x\r\n" % len(SMUGGLED), SMUGGLED),
        (400,),
    ),
    Vector(
        "chunk-0x",
        _post(
            "chunk-0x", CHUNKED, b"0x10\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n" + SMUGGLED
        ),
        (400,),
    ),
    Vector(
        "chunk-negative",
        _post("chunk-negative", CHUNKED, b"-1\r\na\r\n0\r\n\r\n" + SMUGGLED),
        (400,),
    ),
    Vector(
        "chunk-overflow",
        _post(
            "chunk-overflow",
            CHUNKED,
            b"1" + b"0" * 16 + b"\r\n" + SMUGGLED + b"\r\n0\r\n\r\n",
        ),
        (400,),
    ),
    Vector(
        "chunk-0x-later",
        _post("chunk-0x-later", CHUNKED),
        (400,),
        later=b"0x10\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n" + SMUGGLED,
    ),
    Vector(
        "chunk-overflow-later",
        _post("chunk-overflow-later", CHUNKED),
        (400,),
        later=b"ffffffffffffffff1\r\n" + SMUGGLED + b"\r\n0\r\n\r\n",
    ),
    Vector("obs-fold", _get("obs-fold", b"X-A: a\r\n " + SMUGGLED[:-2]), (400,)),
    Vector(
        "obs-fold-te",
        _post("obs-fold-te", b"Transfer-Encoding:\r\n chunked\r\n", b"0\r\n\r\n"),
        (400,),
    ),
    Vector("bare-lf", b"GET /vector/bare-lf HTTP/1.1\nHost: edge.test\n\n", (400,)),
    Vector(
        "bare-lf-chunk",
        _post("bare-lf-chunk", CHUNKED, b"5\nhello\r\n0\r\n\r\n" + SMUGGLED),
        (400,),
    ),
    Vector(
        "xff-cr",
        _get("xff-cr", b"X-Forwarded-For: 203.0.113.9\rX-Injected: 1\r\n"),
        (400,),
    ),
    Vector(
        "xff-lf",
        _post(
            "xff-lf",
            b"X-Forwarded-For: 203.0.113.9\n" + _CL % len(SMUGGLED),
            SMUGGLED,
        ),
        (400,),
    ),
    Vector(
        "forwarded-nul",
        _get("forwarded-nul", b"Forwarded: for=203.0.113.9\x00;host=evil\r\n"),
        (400,),
    ),
    Vector(
        "glued-after-chunk",
        _post("glued-after-chunk", CHUNKED, b"5\r\nhello" + SMUGGLED),
        (400,),
    ),
    Vector(
        "glued-in-trailer",
        _post("glued-in-trailer", CHUNKED, b"0\r\n" + SMUGGLED),
        (400,),
    ),
    Vector("control", b"GET /control HTTP/1.1\r\n" + HOST + b"\r\n", (200,)),
    Vector(
        "pipelined",
        b"POST /control HTTP/1.1\r\n"
        + HOST
        + _CL % 5
        + b"\r\nhelloGET /control HTTP/1.1\r\n"
        + HOST
        + b"\r\n",
        (200, 200),
    ),
)
SLOWLORIS_HEAD = b"GET /slowloris HTTP/1.1\r\n" + HOST + b"X-Slow: " + b"a" * 4000
BODY_HEAD = b"POST /%s HTTP/1.1\r\n" + HOST + _CL % 1_000_000 + b"\r\n"
HUGE_HEAD = (
    b"GET /oversized HTTP/1.1\r\n" + HOST + b"X-Big: " + b"b" * 65536 + b"\r\n\r\n"
)
MANY_HEAD = (
    b"GET /oversized HTTP/1.1\r\n"
    + HOST
    + b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    + b"\r\n"
)


# -- responses --------------------------------------------------------------------


def parse_responses(buffer: bytes) -> list[int]:
    """Statuses of the complete responses at the start of *buffer* (the edge
    always frames its responses with Content-Length)."""
    statuses: list[int] = []
    pos = 0
    while (end := buffer.find(b"\r\n\r\n", pos)) >= 0:
        lines = buffer[pos:end].split(b"\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(buffer) < end + 4 + length:
            break
        statuses.append(int(lines[0].split()[1]))
        pos = end + 4 + length
    return statuses


@dataclass
class Reply:
    statuses: list[int] = field(default_factory=list)
    seconds: float | None = None  # until the first response byte
    closed: bool = False  # EOF (or reset) from the edge after the responses
    timed_out: bool = False  # neither in time


async def read_replies(
    stream: trio.SocketStream,
    start: float,
    want: int,
    *,
    wait_close: bool,
    limit: float = 30.0,
) -> Reply:
    """Read until *want* responses arrived (and then EOF, with *wait_close*),
    for at most *limit* seconds."""
    reply = Reply()
    buffer = b""
    with trio.move_on_after(limit) as scope:
        try:
            while chunk := await stream.receive_some(65536):
                if reply.seconds is None:
                    reply.seconds = trio.current_time() - start
                buffer += chunk
                if len(parse_responses(buffer)) >= want and not wait_close:
                    break
            else:
                reply.closed = True
        except trio.BrokenResourceError:  # a reset is a close too
            reply.closed = True
    reply.timed_out = scope.cancelled_caught
    reply.statuses = parse_responses(buffer)
    return reply


# -- the shares -------------------------------------------------------------------


@dataclass
class Share:
    name: str
    statuses: Counter[int] = field(default_factory=Counter)  # 0: closed, none
    seconds: list[float] = field(default_factory=list)  # client side, to response
    not_closed: int = 0  # answered but the connection stayed open
    early: int = 0  # answered before the timeout: wrong
    errors: int = 0  # could not connect, or a reset before any answer

    @property
    def total(self) -> int:
        return sum(self.statuses.values()) + self.errors

    def count(self, reply: Reply, start_ok: float | None) -> None:
        status = reply.statuses[0] if reply.statuses else 0
        self.statuses[status] += 1
        if reply.seconds is not None:
            self.seconds.append(reply.seconds)
            if start_ok is not None and reply.seconds < start_ok:
                self.early += 1
        if not reply.closed:
            self.not_closed += 1


@dataclass
class VectorResult:
    sent: int = 0
    wrong: Counter[str] = field(default_factory=Counter)  # "statuses closed"

    def count(self, vector: Vector, reply: Reply) -> None:
        self.sent += 1
        closed = reply.closed or not vector.refused
        if tuple(reply.statuses) != vector.expect or not closed:
            self.wrong[
                f"{reply.statuses} closed={reply.closed} timeout={reply.timed_out}"
            ] += 1


async def connect(port: int) -> trio.SocketStream | None:
    try:
        return await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return None


@dataclass(frozen=True)
class Trickle:
    """A slow client: *first* at once, then *rest* a byte every *gap* seconds;
    it connects again once answered, so N stay pending."""

    first: bytes
    rest: bytes
    gap: float
    timeout: float  # when the edge must answer it


TRICKLES: dict[str, Trickle] = {
    "slowloris": Trickle(b"", SLOWLORIS_HEAD, 1.0, HEADER_TIMEOUT),
    "stalled-body": Trickle(
        BODY_HEAD % b"stalled-body" + b"x", b"x" * 1000, STALL_GAP, IDLE_TIMEOUT
    ),
    "slow-body": Trickle(BODY_HEAD % b"slow-body" + b"x", b"x" * 1000, 1.0, BODY_GRACE),
}


async def trickler(share: Share, port: int, spec: Trickle, until: float) -> None:
    """Run one slow client until *until* (see `Trickle`)."""
    while trio.current_time() < until:
        stream = await connect(port)
        if stream is None:
            share.errors += 1
            await trio.sleep(1)
            continue
        start = trio.current_time()
        async with stream, trio.open_nursery() as nursery:

            async def trickle(stream: trio.SocketStream = stream) -> None:
                with contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError
                ):
                    await stream.send_all(spec.first)
                    for i in range(len(spec.rest)):
                        await trio.sleep(spec.gap)
                        await stream.send_all(spec.rest[i : i + 1])

            nursery.start_soon(trickle)
            reply = await read_replies(
                stream,
                start,
                1,
                wait_close=True,
                limit=60.0,
            )
            nursery.cancel_scope.cancel()
        share.count(reply, spec.timeout - 0.1)


async def flooder(
    share: Share,
    port: int,
    heads: tuple[bytes, ...],
    pause: float,
    until: float,
) -> None:
    """A connection every *pause* s sending an oversized head at once."""
    i = 0
    while trio.current_time() < until:
        stream = await connect(port)
        if stream is None:
            share.errors += 1
        else:
            start = trio.current_time()
            async with stream:
                try:
                    await stream.send_all(heads[i % len(heads)])
                    reply = await read_replies(stream, start, 1, wait_close=True)
                    share.count(reply, None)
                except trio.BrokenResourceError:
                    share.errors += 1
        i += 1
        await trio.sleep(pause)


async def smuggler(
    results: dict[str, VectorResult],
    share: Share,
    port: int,
    until: float,
    *,
    offset: int,
    pause: float,
) -> None:
    """Cycle through the vectors, a connection every *pause* s."""
    i = offset
    while trio.current_time() < until:
        vector = VECTORS[i % len(VECTORS)]
        i += 1
        stream = await connect(port)
        if stream is None:
            share.errors += 1
            await trio.sleep(pause)
            continue
        start = trio.current_time()
        async with stream:
            try:
                await stream.send_all(vector.data)
                if vector.later:
                    await trio.sleep(0.1)
                    await stream.send_all(vector.later)
                reply = await read_replies(
                    stream, start, len(vector.expect), wait_close=vector.refused
                )
                results[vector.name].count(vector, reply)
                share.count(reply, None)
            except trio.BrokenResourceError:
                share.errors += 1
        await trio.sleep(pause)


# -- the normal client and the backend (own processes) ----------------------------


def probe(port: int, count: int) -> dict[str, Any]:
    """The normal client: *count* keep-alive GETs; latencies (s) and errors."""
    samples: list[float] = []
    errors: list[str] = []
    connections = 1
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for _ in range(count):
        start = time.perf_counter()
        try:
            conn.request("GET", "/normal")
            response = conn.getresponse()
            body = response.read()
            if response.status != 200 or body != BODY:
                raise ValueError(f"{response.status} {body[:80]!r}")
            if response.will_close:
                connections += 1
        except (OSError, http.client.HTTPException, ValueError) as exc:
            errors.append(repr(exc))
            conn.close()
            connections += 1
        else:
            samples.append(time.perf_counter() - start)
        time.sleep(0.05)
    conn.close()
    return {"samples": samples, "errors": errors, "connections": connections}


async def _backend_connection(stream: trio.SocketStream) -> None:
    """Answer every request with 200 once its body is read; log what was parsed:
    ``head TARGET``, ``done TARGET`` or ``broken TARGET: error``."""
    conn = h11.Connection(h11.SERVER)
    target = "-"
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        async with stream:
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    out(f"broken {target}: {exc}")
                    return
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    target = event.target.decode("latin-1")
                    out(f"head {target}")
                elif isinstance(event, h11.EndOfMessage):
                    out(f"done {target}")
                    response = h11.Response(
                        status_code=200,
                        headers=[(b"Content-Length", b"%d" % len(BODY))],
                    )
                    await stream.send_all(
                        conn.send(response)
                        + conn.send(h11.Data(data=BODY))
                        + conn.send(h11.EndOfMessage())
                    )
                    if (conn.our_state, conn.their_state) != (h11.DONE, h11.DONE):
                        return
                    conn.start_next_cycle()
                    target = "-"
                elif isinstance(event, h11.ConnectionClosed):
                    return


async def _serve_backend(port: int) -> None:
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1", backlog=65535)
    await trio.serve_listeners(_backend_connection, listeners)


def backend_counts(log: str) -> dict[str, Counter[str]]:
    """``{"head"|"done"|"broken": Counter(target)}`` from the backend's log."""
    counts: dict[str, Counter[str]] = {k: Counter() for k in ("head", "done", "broken")}
    for line in log.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in counts:
            counts[kind][rest.partition(":")[0]] += 1
    return counts


# -- the campaign ---------------------------------------------------------------------


def edge_config(port: int, backend: int) -> str:
    return (
        "[edge]\nmax_connections = 50000\n\n"
        f'[[listeners]]\nname = "http"\nbind = "127.0.0.1:{port}"\nmode = "http"\n'
        f'backend = "app"\nmax_connections = 50000\nidle_timeout = {IDLE_TIMEOUT}\n'
        "[listeners.http]\n"
        f"request_header_timeout = {HEADER_TIMEOUT}\n"
        f"request_body_timeout = {BODY_GRACE}\n"
        f"keepalive_timeout = {HEADER_TIMEOUT}\n"
        f"max_header_bytes = {MAX_HEADER_BYTES}\nmax_headers = {MAX_HEADERS}\n"
        "response_timeout = 10.0\n\n"
        f'[[backends]]\nname = "app"\nservers = ["127.0.0.1:{backend}"]\n'
    )


def edge_requests(log: str) -> list[dict[str, Any]]:
    """The edge's per-request access-log lines."""
    found = []
    for line in log.splitlines():
        if line.startswith('{"type":"http"'):
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


@dataclass
class Run:
    shares: dict[str, Share]
    vectors: dict[str, VectorResult]
    unloaded: dict[str, Any]
    loaded: dict[str, Any]
    fds_base: int
    fds_after: int
    rss: dict[str, int]  # KiB: rest, half, end (of the load), after
    rss_peak: int
    cpu: dict[str, float]  # share of one core during the load: edge, clients
    edge_log: str = ""
    backend_log: str = ""


async def campaign(args: argparse.Namespace, procs: Procs) -> Run:
    nofile = min(20000, 6 * args.clients + 2000)
    backend_port, port = free_port(), free_port()
    backend = procs.start(
        "backend",
        [sys.executable, str(SCRIPT), "--backend", str(backend_port)],
        nofile=nofile,
    )
    wait_port(backend_port, backend, "backend")
    edge = procs.tlsedge("tlsedge", edge_config(port, backend_port), port, nofile)
    fds_base = fd_count(edge.pid)
    unloaded = await trio.to_thread.run_sync(run_probe, SCRIPT, port, args.samples)
    rss = {"rest": rss_kib(edge.pid)}
    names = ("slowloris", "stalled-body", "slow-body", "oversized", "smuggling")
    shares = {name: Share(name) for name in names}
    vectors = {v.name: VectorResult() for v in VECTORS}
    start = trio.current_time()
    until = start + args.duration
    cpu_start = {"edge": cpu_seconds(edge.pid), "clients": cpu_seconds(os.getpid())}
    peak = 0
    loaded: dict[str, Any] = {}

    async def watch_rss() -> None:
        nonlocal peak
        while True:
            value = rss_kib(edge.pid)
            peak = max(peak, value)
            if "half" not in rss and trio.current_time() >= start + args.duration / 2:
                rss["half"] = value
            await trio.sleep(0.25)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_rss)
        async with trio.open_nursery() as clients:
            for i in range(args.clients):
                for name, spec in TRICKLES.items():
                    if name != "slow-body" or i % 10 == 0:
                        clients.start_soon(trickler, shares[name], port, spec, until)
                clients.start_soon(
                    flooder,
                    shares["oversized"],
                    port,
                    (HUGE_HEAD, MANY_HEAD) if i % 2 else (MANY_HEAD, HUGE_HEAD),
                    args.pause,
                    until,
                )
                clients.start_soon(
                    partial(
                        smuggler,
                        vectors,
                        shares["smuggling"],
                        port,
                        until,
                        offset=i,
                        pause=args.pause,
                    )
                )
                if i % 50 == 49:
                    await trio.sleep(0.1)  # ramp up instead of a SYN flood
            await trio.sleep(HEADER_TIMEOUT / 2)  # all of them under way
            loaded = await trio.to_thread.run_sync(
                run_probe, SCRIPT, port, args.samples
            )
            await trio.sleep_until(until)
            rss["end"] = rss_kib(edge.pid)
            elapsed = trio.current_time() - start
            cpu = {
                "edge": (cpu_seconds(edge.pid) - cpu_start["edge"]) / elapsed,
                "clients": (cpu_seconds(os.getpid()) - cpu_start["clients"]) / elapsed,
            }
        nursery.cancel_scope.cancel()
    with trio.move_on_after(30):
        while fd_count(edge.pid) > fds_base:  # noqa: ASYNC110
            await trio.sleep(0.2)
    rss["after"] = rss_kib(edge.pid)
    rss.setdefault("half", rss["end"])
    return Run(
        shares,
        vectors,
        unloaded,
        loaded,
        fds_base,
        fd_count(edge.pid),
        rss,
        peak,
        cpu,
    )


# -- figures and goals ------------------------------------------------------------


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f} s"


def _statuses(share: Share) -> str:
    return ", ".join(f"{n}x {s or 'none'}" for s, n in sorted(share.statuses.items()))


@dataclass
class Goal:
    scenario: str
    expected: str
    observed: str
    ok: bool


def timed_goal(
    share: Share, status: int, edge: list[float], timeout: float, cause: str
) -> Goal:
    """Every connection of *share* answered *status* at *timeout* (edge side)."""
    answered = share.statuses[status]
    early = sum(1 for d in edge if d < timeout - 0.05)
    late = sum(1 for d in edge if d > timeout + LATE)
    ok = (
        answered > 0
        and answered == share.total
        and len(edge) == answered
        and share.not_closed == 0
        and share.early == 0
        and early == late == 0
    )
    return Goal(
        share.name,
        f"{status} + close at {timeout:g} s (< {timeout + LATE:g} s), log {cause}",
        f"{answered}/{share.total} {status}, not closed {share.not_closed},"
        f" logged {len(edge)}: {spread(edge)}, early {early + share.early},"
        f" late {late}",
        ok,
    )


def evaluate(run: Run, max_ratio: float) -> tuple[list[Goal], dict[str, Any]]:
    shares = run.shares
    requests = edge_requests(run.edge_log)
    header_timeouts = [
        r["total"] for r in requests if r["termination"] == "request_header_timeout"
    ]
    stalled = [r for r in requests if r["target"] == "/stalled-body"]
    stalled_causes = Counter(f"{r['termination']}: {r['detail']}" for r in stalled)
    oversized = [r for r in requests if r["target"] == "/oversized"]
    goals = [
        timed_goal(
            shares["slowloris"],
            408,
            header_timeouts,
            HEADER_TIMEOUT,
            "request_header_timeout",
        ),
        timed_goal(
            shares["stalled-body"],
            408,
            [r["total"] for r in stalled if r["status"] == 408],
            IDLE_TIMEOUT,
            "bad_request (body stalled)",
        ),
        timed_goal(
            shares["slow-body"],
            408,
            [
                r["total"]
                for r in requests
                if r["target"] == "/slow-body" and r["status"] == 408
            ],
            BODY_GRACE,
            "bad_request (below request_body_min_rate)",
        ),
    ]
    big = shares["oversized"]
    growth = run.rss["end"] - run.rss["half"]
    goals.append(
        Goal(
            "oversized",
            f"431 + close each; RSS growth over the 2nd half < {RSS_GROWTH_KIB >> 10}"
            " MiB",
            f"{big.statuses[431]}/{big.total} 431, not closed {big.not_closed},"
            f" logged {sum(1 for r in oversized if r['status'] == 431)};"
            f" RSS {growth / 1024:+.1f} MiB",
            big.statuses[431] == big.total > 0
            and big.not_closed == 0
            and sum(1 for r in oversized if r["status"] == 431) == big.total
            and growth < RSS_GROWTH_KIB,
        )
    )
    refused = sum(
        v.sent
        for v, vec in zip(run.vectors.values(), VECTORS, strict=True)
        if vec.refused
    )
    wrong = {n: dict(v.wrong) for n, v in run.vectors.items() if v.wrong}
    unsent = [n for n, v in run.vectors.items() if not v.sent]
    smug = shares["smuggling"]
    goals.append(
        Goal(
            "smuggling",
            f"{len(VECTORS) - 2} vectors: 400 + close; controls answered",
            f"{refused} vectors, {smug.total - refused} controls; wrong {len(wrong)},"
            f" never sent {len(unsent)}, connect errors {smug.errors}",
            not wrong and not unsent and smug.errors == 0,
        )
    )
    backend = backend_counts(run.backend_log)
    done = backend["done"]
    controls = run.vectors["control"].sent + 2 * run.vectors["pipelined"].sent
    normal = len(run.unloaded["samples"]) + len(run.loaded["samples"])
    expected = {"/normal": normal, "/control": controls}
    smuggled = backend["head"]["/smuggled"]
    vector_done = sum(n for t, n in done.items() if t.startswith("/vector/"))
    broken = {
        t: n
        for t, n in backend["broken"].items()
        if not t.startswith(("/vector/", "/slow-body", "/stalled-body"))
    }
    goals.append(
        Goal(
            "backend",
            f"exactly {normal} /normal + {controls} /control; no /smuggled",
            f"{done['/normal']} /normal, {done['/control']} /control,"
            f" {smuggled} /smuggled, {vector_done} vectors complete,"
            f" other {sum(done.values()) - done['/normal'] - done['/control']}",
            done == Counter(expected) and smuggled == 0 and not broken,
        )
    )
    base = statistics.median(run.unloaded["samples"] or [0.0])
    during = statistics.median(run.loaded["samples"] or [float("inf")])
    ratio = during / base if base else float("inf")
    errors = run.unloaded["errors"] + run.loaded["errors"]
    goals.append(
        Goal(
            "normal client",
            f"0 errors, loaded median <= {max_ratio:g}x unloaded",
            f"{base * 1000:.2f} -> {during * 1000:.2f} ms ({ratio:.2f}x),"
            f" {len(errors)} errors, {run.loaded['connections']} connection(s)",
            not errors and ratio <= max_ratio,
        )
    )
    goals.append(
        Goal(
            "fds",
            "back to the resting count",
            f"{run.fds_base} at rest, {run.fds_after} after",
            run.fds_after <= run.fds_base,
        )
    )
    internal = sum(1 for r in requests if r["termination"] == "internal_error")
    tracebacks = run.edge_log.count("Traceback")
    goals.append(
        Goal(
            "edge log",
            "no internal_error, no traceback",
            f"{internal} internal_error, {tracebacks} tracebacks",
            internal == tracebacks == 0,
        )
    )
    figures = {
        "shares": {
            s.name: {
                "total": s.total,
                "statuses": {str(k): v for k, v in s.statuses.items()},
                "not_closed": s.not_closed,
                "early": s.early,
                "errors": s.errors,
                "client_seconds": [
                    min(s.seconds, default=0.0),
                    statistics.median(s.seconds) if s.seconds else 0.0,
                    max(s.seconds, default=0.0),
                ],
            }
            for s in shares.values()
        },
        "edge_header_timeouts": len(header_timeouts),
        "edge_stalled_causes": dict(stalled_causes),
        "vectors": {
            n: {"sent": v.sent, "wrong": dict(v.wrong)} for n, v in run.vectors.items()
        },
        "backend_done": dict(done),
        "backend_broken": dict(backend["broken"]),
        "backend_smuggled": smuggled,
        "latency_unloaded_ms": base * 1000,
        "latency_loaded_ms": during * 1000,
        "ratio": ratio,
        "probe_errors": errors,
        "rss_kib": run.rss,
        "rss_peak_kib": run.rss_peak,
        "cpu": run.cpu,
        "fds_base": run.fds_base,
        "fds_after": run.fds_after,
        "goals": {g.scenario: g.ok for g in goals},
    }
    return goals, figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000, help="per share")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument(
        "--pause",
        type=float,
        default=5.0,
        help="oversized and smuggling clients: seconds between connections",
    )
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="40 per share for 5 s")
    parser.add_argument(
        "--max-ratio",
        type=float,
        default=2.0,
        help="latency goal: loaded median / unloaded median",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--probe", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        out(json.dumps(probe(*args.probe)))
        return 0
    if args.backend:
        raise_nofile(200_000)
        trio.run(_serve_backend, args.backend)
        return 0
    if args.quick:
        args.clients, args.duration, args.pause, args.samples = 40, 5.0, 1.0, 20
    limit = raise_nofile(5 * args.clients + 1000)
    if 5 * args.clients + 1000 > limit:
        args.clients = (limit - 1000) // 5
        out(f"(RLIMIT_NOFILE {limit}: clamped to {args.clients} clients per share)")
    banner(
        f"HTTP clients: {args.clients} per share for {args.duration:g} s;"
        f" request_header_timeout {HEADER_TIMEOUT:g} s,"
        f" request_body_timeout {BODY_GRACE:g} s (min rate 500 bytes/s),"
        f" idle_timeout {IDLE_TIMEOUT:g} s, max_header_bytes {MAX_HEADER_BYTES}"
    )
    with tempfile.TemporaryDirectory(prefix="tlsedge-http-") as tmp:
        procs = Procs(Path(tmp))
        try:
            with terminate_on_sigterm():
                run = trio.run(campaign, args, procs)
        finally:
            procs.stop_all()
            edge_log, backend_log = procs.log("tlsedge"), procs.log("backend")
    run.edge_log, run.backend_log = edge_log, backend_log
    goals, figures = evaluate(run, args.max_ratio)
    out(
        "",
        render_table(
            [
                "client",
                "connections",
                "answered",
                "client s min/med/max",
                "errors",
            ],
            [
                [
                    s.name,
                    str(s.total),
                    _statuses(s),
                    spread(s.seconds),
                    str(s.errors),
                ]
                for s in run.shares.values()
            ],
        ),
        "",
        render_table(
            ["scenario", "expected", "observed", "ok"],
            [
                [
                    g.scenario,
                    g.expected,
                    g.observed,
                    "yes" if g.ok else "NO",
                ]
                for g in goals
            ],
        ),
        "",
        f"edge RSS: {run.rss['rest'] >> 10} MiB at rest, {run.rss['half'] >> 10}"
        f" half-way, {run.rss['end'] >> 10} at the end, peak {run.rss_peak >> 10},"
        f" {run.rss['after'] >> 10} after",
        f"CPU during the load (share of one core): edge {run.cpu['edge']:.0%},"
        f" clients {run.cpu['clients']:.0%}; load average"
        f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        "stalled-body causes (edge log): "
        + "; ".join(f"{n}x {c}" for c, n in figures["edge_stalled_causes"].items()),
    )
    for name, result in run.vectors.items():
        if result.wrong:
            out(f"vector {name}: {dict(result.wrong)}")
    if figures["probe_errors"]:
        out("normal client errors: " + "; ".join(figures["probe_errors"][:5]))
    ok = all(g.ok for g in goals)
    figures["ok"] = ok
    write_json(args.json, figures)
    out("", "goals met" if ok else "GOALS NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
