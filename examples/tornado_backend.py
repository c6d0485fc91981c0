"""A Tornado app behind a PROXY-protocol load balancer (HAProxy, nginx, AWS NLB).

Needs ``pip install 'tlsedge[tornado]'``.

Run:  python examples/tornado_backend.py 8000 [TRUSTED_CIDR ...]
Then: haproxy -f examples/haproxy-in-front.cfg   and   curl http://127.0.0.1:8080/

Or without a load balancer::

    printf 'PROXY TCP4 192.0.2.1 192.0.2.2 4242 80\\r\\nGET / HTTP/1.0\\r\\n\\r\\n' \\
        | nc 127.0.0.1 8000

``proxyproto.tornado.ProxyHTTPServer`` is ``HTTPServer`` with a PROXY header
read on every connection: ``self.request.remote_ip`` is the real client,
``self.request.protocol`` is ``https`` when the load balancer terminated TLS
and said so in the header's SSL TLV (HAProxy ``send-proxy-v2-ssl``, tlsedge
``send_proxy``), and ``proxy_connection(self.request)`` has the header.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import tornado.web

from proxyproto.tornado import ProxyHTTPServer, proxy_connection


class Hello(tornado.web.RequestHandler):
    def get(self) -> None:
        connection = proxy_connection(self.request)
        header = connection.header if connection else None
        lines = [
            f"client:   {self.request.remote_ip}",  # from the header
            f"protocol: {self.request.protocol}",  # https if TLS to the LB
            f"url:      {self.request.full_url()}",
            # The load balancer itself (the TCP peer).
            f"proxy:    {connection.peer_address if connection else None}",
        ]
        if header is not None:
            lines.append(f"header:   v{header.version} {header.command.name}")
            lines.extend(f"tlv:      0x{t.type:02x} {t.value!r}" for t in header.tlvs)
            if header.ssl is not None:  # HAProxy send-proxy-v2-ssl(-cn), tlsedge
                lines.append(f"ssl:      {header.ssl.version} cn={header.ssl.cn!r}")
        self.set_header("Content-Type", "text/plain")
        self.write("\n".join(lines) + "\n")


async def main(port: int, trusted: list[str]) -> None:
    app = tornado.web.Application([("/", Hello)])
    # REQUIRE a header from these load balancers, REJECT everyone else.
    server = ProxyHTTPServer(app, trusted=trusted, header_timeout=5.0)
    server.listen(port, "127.0.0.1")
    print(f"listening on 127.0.0.1:{port}, trusting {trusted}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    server.stop()  # no new connections; those still sending a header close
    await server.close_all_connections()
    print("stopped")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # refused connections are logged
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    asyncio.run(main(port, sys.argv[2:] or ["127.0.0.1"]))
