"""The floor of a trio task-per-connection HTTP proxy: what tlsedge's design costs
before any of its features (``bench/http_mode.py --proxies ...,trio-floor``).

Run: ``python bench/trio_floor.py PORT UPSTREAM_PORT`` (plain HTTP on 127.0.0.1).

One task per client connection and one upstream connection per client
connection, kept open; each request head is parsed by tlsedge's parser, gets
``X-Forwarded-For`` and goes upstream through `tlsedge._tls.sockio`; the response
must have a Content-Length (nginx's ``return 200`` has one) and is relayed as
it came. No timeouts, no pool, no balancing, no logging, no metrics, no
hop-by-hop or forwarding rules, no bodies, no error answers: it is a
measuring stick, not a proxy. The gap between it and tlsedge is what
tlsedge's features cost per request; the gap between it and HAProxy is what a
trio task and its awaits cost.
"""

from __future__ import annotations

import sys

import trio

from tlsedge._http.head import find_head_end, parse_request_head, parse_response_head
from tlsedge._tls import sockio

READ_SIZE = 65536


async def relay_requests(client: trio.SocketStream, upstream_port: int) -> None:
    upstream = await trio.open_tcp_stream("127.0.0.1", upstream_port)
    peer = client.socket.getpeername()[0].encode()
    buffer = b""
    async with upstream:
        while True:
            while (end := find_head_end(buffer)) < 0:
                data = await sockio.receive_some(client, READ_SIZE)
                if not data:
                    return
                buffer += data
            head = parse_request_head(buffer[:end], max_headers=100)
            buffer = buffer[end:]
            fields = [name + b": " + value + b"\r\n" for name, value in head.headers]
            request = b"".join(
                [
                    head.method + b" " + head.target + b" HTTP/1.1\r\n",
                    *fields,
                    b"X-Forwarded-For: " + peer + b"\r\n\r\n",
                ]
            )
            await sockio.send_all(upstream, request)
            answer = b""
            while (end := find_head_end(answer)) < 0:
                answer += await sockio.receive_some(upstream, READ_SIZE)
            response = parse_response_head(answer[:end], max_headers=100)
            whole = end + (response.content_length or 0)
            while len(answer) < whole:
                answer += await sockio.receive_some(upstream, READ_SIZE)
            await sockio.send_all(client, answer)


async def handle(client: trio.SocketStream, upstream_port: int) -> None:
    try:
        await relay_requests(client, upstream_port)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the load generator closed or reset: the next connection goes on
    finally:
        await trio.aclose_forcefully(client)


async def main(port: int, upstream_port: int) -> None:
    async def handler(client: trio.SocketStream) -> None:
        await handle(client, upstream_port)

    await trio.serve_tcp(handler, port, host="127.0.0.1")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]), int(sys.argv[2]))
