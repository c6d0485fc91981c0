"""The floor of a pure-CPython HTTP proxy: one epoll loop, no trio
(``bench/http_mode.py --proxies ...,epoll-floor``).

Run: ``python bench/epoll_floor.py HTTP_PORT HTTPS_PORT UPSTREAM_PORT CERT_PEM``
(127.0.0.1; *CERT_PEM* holds the key and the certificate chain).

Issue 24 measured a throwaway program of this shape at 0.86x HAProxy per CPU
(HTTPS) and asked what a Python process can reach; this is that program kept
in the bench, so that the same run shows HAProxy, tlsedge and the floor. Per
request it does what tlsedge's hot path must do and nothing else: find the
end of the head, validate the whole head with one strict regular expression
(token method, a target without CTL or SP, ``HTTP/1.[01]``, field lines
``token ":" OWS value OWS CRLF``), find the framing fields with a second one,
splice the ``X-Forwarded-For`` line into the bytes and send them on the
client's own upstream connection; the response head is validated the same
way, its ``Content-Length`` found, and the response forwarded as received
once complete. TLS is an ``ssl.SSLObject`` between two ``MemoryBIO``\\ s.

It is a measuring stick, not a proxy: one request at a time per client
connection, requests without a body and responses with a ``Content-Length``
only (nginx's ``return 200`` has one), anything else closes the connection;
no timeouts, pooling, balancing, logging, metrics, error answers or
back-pressure (a send the socket does not take at once closes the
connection). The gap between it and tlsedge is what tlsedge's engine and
features cost per request; the gap between it and HAProxy is CPython's.
"""

from __future__ import annotations

import functools
import re
import select
import socket
import ssl
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

READ_SIZE = 65536
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_VCHAR = rb"[\x21-\x7e\x80-\xff]"
FIELD = _TOKEN + rb":[ \t]*(?:" + _VCHAR + rb"(?:[ \t]*" + _VCHAR + rb")*)?[ \t]*\r\n"
REQUEST_HEAD = re.compile(
    _TOKEN + rb" [\x21-\x7e]+ HTTP/1\.[01]\r\n(?:" + FIELD + rb")*\r\n"
)
RESPONSE_HEAD = re.compile(
    rb"HTTP/1\.[01] [0-9]{3} [\t\x20-\x7e\x80-\xff]*\r\n(?:" + FIELD + rb")*\r\n"
)
FRAMING = re.compile(
    rb"\r\n(content-length|transfer-encoding)[ \t]*:[ \t]*([^\r]*)", re.IGNORECASE
)


class Client:
    """One client connection and its upstream connection."""

    def __init__(
        self, sock: socket.socket, context: ssl.SSLContext | None, upstream_port: int
    ) -> None:
        self.sock = sock
        self.forwarded = (
            b"X-Forwarded-For: " + sock.getpeername()[0].encode() + b"\r\n\r\n"
        )
        self.tls: ssl.SSLObject | None = None
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.handshaken = context is None
        if context is not None:
            self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.upstream = socket.create_connection(("127.0.0.1", upstream_port))
        self.upstream.setblocking(False)
        self.sock.setblocking(False)
        self.request = b""
        self.response = b""
        self.response_end = -1

    def send_client(self, data: bytes) -> None:
        if self.tls is not None:
            self.tls.write(data)
            data = self.outgoing.read()
        if self.sock.send(data) != len(data):
            raise OSError("the client did not take the answer at once")

    def client_readable(self) -> None:
        data = self.sock.recv(READ_SIZE)
        if not data:
            raise EOFError
        tls = self.tls
        if tls is not None:
            self.incoming.write(data)
            if not self.handshaken:
                try:
                    tls.do_handshake()
                    self.handshaken = True
                except ssl.SSLWantReadError:
                    pass
                self.sock.send(self.outgoing.read())
                if not self.handshaken:
                    return
            chunks = []
            try:
                while chunk := tls.read(READ_SIZE):
                    chunks.append(chunk)
                raise EOFError  # close_notify: read returns b"" from now on
            except ssl.SSLWantReadError:
                pass
            data = b"".join(chunks)
            if not data:
                return
        request = self.request + data if self.request else data
        end = request.find(b"\r\n\r\n")
        if end < 0:
            self.request = request
            return
        end += 4
        if end != len(request):
            raise OSError("pipelined or body bytes: not handled by the floor")
        if REQUEST_HEAD.fullmatch(request) is None:
            raise OSError("invalid request head")
        for name, value in FRAMING.findall(request):
            if name.lower() == b"transfer-encoding" or value.strip() != b"0":
                raise OSError("a request with a body: not handled by the floor")
        self.request = b""
        self.send_upstream(request[:-2] + self.forwarded)

    def send_upstream(self, head: bytes) -> None:
        if self.upstream.send(head) != len(head):
            raise OSError("the upstream did not take the request at once")

    def upstream_readable(self) -> None:
        data = self.upstream.recv(READ_SIZE)
        if not data:
            raise EOFError
        response = self.response + data if self.response else data
        if self.response_end < 0:
            end = response.find(b"\r\n\r\n")
            if end < 0:
                self.response = response
                return
            end += 4
            if RESPONSE_HEAD.fullmatch(response, 0, end) is None:
                raise OSError("invalid response head")
            length = -1
            for name, value in FRAMING.findall(response, 0, end):
                if name.lower() == b"transfer-encoding":
                    raise OSError("a chunked response: not handled by the floor")
                length = int(value)
            if length < 0:
                raise OSError("a response without Content-Length")
            self.response_end = end + length
        if len(response) < self.response_end:
            self.response = response
            return
        self.response, self.response_end = b"", -1
        self.send_client(response)

    def close(self) -> None:
        self.sock.close()
        self.upstream.close()


class Connection(Protocol):
    """What `serve` drives: a client connection and its upstream connection."""

    sock: socket.socket
    upstream: socket.socket

    def client_readable(self) -> None: ...
    def upstream_readable(self) -> None: ...
    def close(self) -> None: ...


def serve(
    listeners: Sequence[tuple[socket.socket, Callable[[socket.socket], Connection]]],
    errors: tuple[type[Exception], ...] = (OSError, EOFError, ssl.SSLError, ValueError),
) -> None:
    """Accept on *listeners* (each with what makes a connection of an accepted
    socket) and drive every connection in one epoll loop; a connection that
    raises one of *errors* is closed."""
    epoll = select.epoll()
    makers: dict[int, tuple[socket.socket, Callable[[socket.socket], Connection]]] = {}
    for listener, make in listeners:
        listener.setblocking(False)
        makers[listener.fileno()] = (listener, make)
        epoll.register(listener.fileno(), select.EPOLLIN)
    handlers: dict[int, tuple[Connection, bool]] = {}
    while True:
        for fd, _ in epoll.poll():
            if fd in makers:
                listener, make = makers[fd]
                try:
                    sock, _ = listener.accept()
                except BlockingIOError:
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client = make(sock)
                handlers[sock.fileno()] = (client, True)
                handlers[client.upstream.fileno()] = (client, False)
                epoll.register(sock.fileno(), select.EPOLLIN)
                epoll.register(client.upstream.fileno(), select.EPOLLIN)
                continue
            entry = handlers.get(fd)
            if entry is None:
                continue
            client, from_client = entry
            try:
                if from_client:
                    client.client_readable()
                else:
                    client.upstream_readable()
            except errors:
                for sock in (client.sock, client.upstream):
                    handlers.pop(sock.fileno(), None)
                    epoll.unregister(sock.fileno())
                client.close()


def main(http_port: int, https_port: int, upstream_port: int, cert: str) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert)
    serve(
        [
            (
                socket.create_server(("127.0.0.1", port), backlog=1024),
                functools.partial(Client, context=tls, upstream_port=upstream_port),
            )
            for port, tls in ((http_port, None), (https_port, context))
        ]
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
