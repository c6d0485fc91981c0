"""The floor of an HTTP/2 proxy built on the ``h2`` library: one epoll loop,
no trio (``bench/http2.py --proxies ...,h2-floor``).

Run: ``python bench/h2_floor.py PORT UPSTREAM_PORT CERT_PEM`` (TLS with ALPN
``h2`` on 127.0.0.1; *CERT_PEM* holds the key and the certificate chain).

Issue 24 asks for HTTP/2 at 0.2x HAProxy and notes that ``h2``, ``hpack`` and
``hyperframe`` alone cap a pure-Python path near that. This measures the cap:
per client connection an ``h2.connection.H2Connection`` configured as
`tlsedge._http.h2session.H2Session` configures it (its `H2_CONFIGURATION`:
h2's own header checks and normalisation off), TLS through an
``ssl.SSLObject`` between two ``MemoryBIO``\\ s, and one upstream connection
on which each stream's request goes out as an HTTP/1.1 head with
``X-Forwarded-For`` (pipelined: the answers come back in order, so each is
matched to the oldest stream waiting). Each answer's head is validated with
one regular expression (as `epoll_floor.py` does) and goes back as
``:status``, ``content-length`` and the body.

A measuring stick, not a proxy: answers with a ``Content-Length`` only
(nginx's ``return 200`` has one), requests without a body, no checks of the
request's fields beyond h2's own framing, no timeouts, pool, balancing,
logging, metrics, error answers, flow control beyond h2's defaults or
back-pressure (a send the socket does not take at once closes the
connection). The gap between it and HAProxy is what the ``h2`` library and
CPython cost; the gap between it and tlsedge is tlsedge's engine and features.
"""

from __future__ import annotations

import collections
import functools
import re
import socket
import ssl
import sys

import h2.connection
import h2.events
from epoll_floor import FIELD, serve
from h2.exceptions import H2Error

from tlsedge._http.h2session import H2_CONFIGURATION

READ_SIZE = 65536
RESPONSE_HEAD = re.compile(
    rb"HTTP/1\.1 ([0-9]{3}) [\t\x20-\x7e\x80-\xff]*\r\n(?:" + FIELD + rb")*\r\n"
)
CONTENT_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*([0-9]+)", re.IGNORECASE)


class Client:
    """One client connection, its HTTP/2 state and its upstream connection."""

    def __init__(
        self, sock: socket.socket, context: ssl.SSLContext, upstream_port: int
    ) -> None:
        self.sock = sock
        self.forwarded = b"X-Forwarded-For: " + sock.getpeername()[0].encode()
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.handshaken = False
        self.h2 = h2.connection.H2Connection(config=H2_CONFIGURATION)
        self.upstream = socket.create_connection(("127.0.0.1", upstream_port))
        self.upstream.setblocking(False)
        self.sock.setblocking(False)
        self.waiting: collections.deque[int] = collections.deque()
        self.response = b""

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.tls.write(data)
        data = self.outgoing.read()
        if data and self.sock.send(data) != len(data):
            raise OSError("the client did not take the data at once")

    def client_readable(self) -> None:
        data = self.sock.recv(READ_SIZE)
        if not data:
            raise EOFError
        self.incoming.write(data)
        if not self.handshaken:
            try:
                self.tls.do_handshake()
            except ssl.SSLWantReadError:
                self.flush()
                return
            self.handshaken = True
            if self.tls.selected_alpn_protocol() != "h2":
                raise OSError("the client did not choose h2")
            self.h2.initiate_connection()
        chunks = []
        try:
            while chunk := self.tls.read(READ_SIZE):
                chunks.append(chunk)
            raise EOFError  # close_notify
        except ssl.SSLWantReadError:
            pass
        requests = []
        for event in self.h2.receive_data(b"".join(chunks)):
            if isinstance(event, h2.events.RequestReceived):
                fields = dict(event.headers)
                requests.append(
                    b"%s %s HTTP/1.1\r\nHost: %s\r\n%s\r\n\r\n"
                    % (
                        fields[b":method"],
                        fields[b":path"],
                        fields[b":authority"],
                        self.forwarded,
                    )
                )
                self.waiting.append(event.stream_id)
            elif isinstance(event, h2.events.ConnectionTerminated):
                raise EOFError
        if requests:
            out = b"".join(requests)
            if self.upstream.send(out) != len(out):
                raise OSError("the upstream did not take the requests at once")
        self.flush()

    def upstream_readable(self) -> None:
        data = self.upstream.recv(READ_SIZE)
        if not data:
            raise EOFError
        response = self.response + data if self.response else data
        start = 0
        while True:
            end = response.find(b"\r\n\r\n", start)
            if end < 0:
                break
            end += 4
            head = RESPONSE_HEAD.fullmatch(response, start, end)
            if head is None:
                raise OSError("invalid response head")
            length = CONTENT_LENGTH.search(response, start, end)
            if length is None:
                raise OSError("a response without Content-Length")
            body_end = end + int(length.group(1))
            if len(response) < body_end:
                break
            stream_id = self.waiting.popleft()
            self.h2.send_headers(
                stream_id,
                [(b":status", head.group(1)), (b"content-length", length.group(1))],
            )
            self.h2.send_data(stream_id, response[end:body_end], end_stream=True)
            start = body_end
        self.response = response[start:]
        self.flush()

    def close(self) -> None:
        self.sock.close()
        self.upstream.close()


def main(port: int, upstream_port: int, cert: str) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert)
    context.set_alpn_protocols(["h2"])
    listener = socket.create_server(("127.0.0.1", port), backlog=1024)
    make = functools.partial(Client, context=context, upstream_port=upstream_port)
    serve([(listener, make)], (OSError, EOFError, ssl.SSLError, ValueError, H2Error))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
