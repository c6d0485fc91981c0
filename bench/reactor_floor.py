"""The floor of tlsedge's reactor design: `epoll_floor.py`'s per-request work,
run as handlers of tlsedge's reactor inside a trio run
(``bench/http_mode.py --proxies ...,reactor-floor``).

Run: ``python bench/reactor_floor.py HTTP_PORT HTTPS_PORT UPSTREAM_PORT CERT_PEM``

The same `epoll_floor.Client` (one regular expression per head, the
``X-Forwarded-For`` line spliced in, ``SSLObject`` over ``MemoryBIO``), but
its sockets are registered with `tlsedge._reactor.loop.Reactor`, whose task
wakes through trio's ``wait_readable`` on the reactor's epoll, as tlsedge's
established connections do; connections are accepted by a trio task. The gap
between it and `epoll_floor.py` is what hosting the hot path in trio's run
loop costs; the gap between it and tlsedge is tlsedge's engine and features.
"""

from __future__ import annotations

import socket
import ssl
import sys

import trio
from epoll_floor import Client

from tlsedge._reactor.loop import READABLE, current_reactor


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
    listener: socket.socket, tls: ssl.SSLContext | None, upstream_port: int
) -> None:
    reactor = current_reactor()
    while True:
        await trio.lowlevel.wait_readable(listener)
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handler = FloorHandler(Client(sock, tls, upstream_port))
        reactor.register(handler.client_fd, READABLE, handler)
        reactor.register(handler.upstream_fd, READABLE, handler)


async def main(http_port: int, https_port: int, upstream_port: int, cert: str) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert)
    async with trio.open_nursery() as nursery:
        for port, tls in ((http_port, None), (https_port, context)):
            listener = socket.create_server(("127.0.0.1", port), backlog=1024)
            listener.setblocking(False)
            nursery.start_soon(accept_loop, listener, tls, upstream_port)


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
