"""The floor of tlsedge's reactor design: `epoll_floor.py`'s per-request work,
run as handlers of tlsedge's reactor inside a trio run
(``bench/http_mode.py --proxies ...,reactor-floor``).

Run: ``python bench/reactor_floor.py HTTP_PORT HTTPS_PORT UPSTREAM_PORT CERT_PEM
[ACCESS_LOG]``

The same `epoll_floor.Client` (one regular expression per head, the
``X-Forwarded-For`` line spliced in, ``SSLObject`` over ``MemoryBIO``), but
its sockets are registered with `tlsedge._reactor.loop.Reactor`, whose task
wakes through trio's ``wait_readable`` on the reactor's epoll, as tlsedge's
established connections do; connections are accepted by a trio task. The gap
between it and `epoll_floor.py` is what hosting the hot path in trio's run
loop costs; the gap between it and tlsedge is tlsedge's engine and features.

With *ACCESS_LOG* (a file; ``bench/http_mode.py``'s ``reactor-floor-log``)
each request also gets what the edge's two costliest features cost: its
access-log record (`tlsedge._http.log.RequestLines`, its start in wall-clock
time as the edge writes it, the line made and written by the
`AccessLogWriter` that ``tlsedge run`` installs, flushed by its task) and
its count in `EdgeMetrics` (as an HTTP site's ``on_request``), with the
clock read at the start and end of each request as the edge's timers need:
the floor of an engine with those features.
"""

from __future__ import annotations

import functools
import re
import socket
import ssl
import sys
import time
from collections.abc import Callable

import trio
from epoll_floor import Client

from tlsedge._control.logs import run_access_log_flusher, setup_logging
from tlsedge._core.metrics import EdgeMetrics
from tlsedge._http.log import RequestLines, RequestLog
from tlsedge._reactor.loop import READABLE, current_reactor

REQUEST_LINE = re.compile(rb"([^ ]+) ([^ ]+) HTTP/(1\.[01])\r\n")
HOST = re.compile(rb"\r\nhost[ \t]*:[ \t]*([^\r]*)", re.IGNORECASE)
USER_AGENT = re.compile(rb"\r\nuser-agent[ \t]*:[ \t]*([^\r]*)", re.IGNORECASE)


class LoggedClient(Client):
    """`Client` with an access-log record and metrics per request."""

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext | None,
        upstream_port: int,
        *,
        lines: RequestLines,
        record: Callable[[RequestLog], None],
        now: Callable[[], float],
    ) -> None:
        super().__init__(sock, context, upstream_port)
        self.lines = lines
        self.record = record
        self.now = now
        self.server = f"127.0.0.1:{upstream_port}"
        self.started = 0.0
        self.log = lines.new(0.0)

    def send_upstream(self, head: bytes) -> None:
        self.started = self.now()
        request_line = REQUEST_LINE.match(head)
        assert request_line is not None  # validated by client_readable
        method, target, version = request_line.groups()
        host = HOST.search(head)
        agent = USER_AGENT.search(head)
        log = self.log = self.lines.new(
            time.time(),
            method.decode("ascii"),
            target.decode("ascii", "replace"),
            version.decode("ascii"),
            host=host.group(1).decode("ascii", "replace") if host else None,
            user_agent=agent.group(1).decode("ascii", "replace") if agent else None,
        )
        log.bytes_in = len(head)
        super().send_upstream(head)

    def send_client(self, data: bytes) -> None:
        super().send_client(data)
        log = self.log
        log.status = int(data[9:12])
        log.bytes_out = len(data)
        log.server = self.server
        log.total = self.now() - self.started
        self.lines.emit(log)
        self.record(log)


class FloorHandler:
    """The reactor's handler for one client connection and its upstream."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.client_fd = client.sock.fileno()
        self.upstream_fd = client.upstream.fileno()

    def ready(self, fd: int, events: int) -> None:
        try:
            if fd == self.client_fd:
                self.client.client_readable()
            else:
                self.client.upstream_readable()
        except (OSError, EOFError, ssl.SSLError, ValueError):
            self.close()

    def failed(self, exc: Exception) -> None:
        self.close()

    def close(self) -> None:
        reactor = current_reactor()
        reactor.forget(self.client_fd)
        reactor.forget(self.upstream_fd)
        self.client.close()


async def accept_loop(
    listener: socket.socket, make: Callable[[socket.socket], Client]
) -> None:
    reactor = current_reactor()
    while True:
        await trio.lowlevel.wait_readable(listener)
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handler = FloorHandler(make(sock))
        reactor.register(handler.client_fd, READABLE, handler)
        reactor.register(handler.upstream_fd, READABLE, handler)


def client_maker(
    context: ssl.SSLContext | None,
    upstream_port: int,
    access_log: str | None,
    record: Callable[[RequestLog], None],
) -> Callable[[socket.socket], Client]:
    """What makes a connection of an accepted socket (with *access_log*:
    one with the log record and metrics per request)."""
    if access_log is None:
        return functools.partial(Client, context=context, upstream_port=upstream_port)
    now = current_reactor().now

    def make(sock: socket.socket) -> Client:
        host, port = sock.getpeername()
        lines = RequestLines(
            connection="bench",
            listener="web",
            client=f"{host}:{port}",
            backend="app",
            tls="TLSv1.3" if context is not None else None,
            sni=None,
        )
        return LoggedClient(
            sock, context, upstream_port, lines=lines, record=record, now=now
        )

    return make


async def main(
    http_port: int,
    https_port: int,
    upstream_port: int,
    cert: str,
    access_log: str | None,
) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert)
    record = EdgeMetrics().http_requests("web", "app").record
    async with trio.open_nursery() as nursery:
        if access_log is not None:
            setup_logging("warning", access_log=access_log)
            nursery.start_soon(run_access_log_flusher)
        for port, tls in ((http_port, None), (https_port, context)):
            listener = socket.create_server(("127.0.0.1", port), backlog=1024)
            listener.setblocking(False)
            make = client_maker(tls, upstream_port, access_log, record)
            nursery.start_soon(accept_loop, listener, make)


if __name__ == "__main__":
    args = sys.argv[1:]
    trio.run(
        main,
        int(args[0]),
        int(args[1]),
        int(args[2]),
        args[3],
        args[4] if len(args) > 4 else None,
    )
