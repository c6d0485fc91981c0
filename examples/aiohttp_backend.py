"""An aiohttp.web app behind a PROXY-protocol load balancer (HAProxy, nginx, AWS NLB).

Needs ``pip install 'tlsedge[aiohttp]'``.

Run:  python examples/aiohttp_backend.py 8000 [TRUSTED_CIDR ...]
Then: haproxy -f examples/haproxy-in-front.cfg   and   curl http://127.0.0.1:8080/

Or without a load balancer::

    printf 'PROXY TCP4 192.0.2.1 192.0.2.2 4242 80\\r\\nGET / HTTP/1.0\\r\\n\\r\\n' \\
        | nc 127.0.0.1 8000

``proxyproto.aiohttp.run_app`` is ``web.run_app`` with a PROXY header read on
every connection: ``request.remote`` is the real client, ``request.scheme``
is ``https`` when the load balancer terminated TLS and said so in the
header's SSL TLV (HAProxy ``send-proxy-v2-ssl``, tlsedge ``send_proxy``), and
``proxy_connection(request)`` has the header.
"""

from __future__ import annotations

import logging
import sys

from aiohttp import web

from proxyproto.aiohttp import proxy_connection, run_app


async def hello(request: web.Request) -> web.Response:
    connection = proxy_connection(request)
    header = connection.header if connection else None
    lines = [
        f"client:  {request.remote}",  # from the header
        f"scheme:  {request.scheme}",  # https if the client used TLS to the LB
        f"url:     {request.url}",
        # The load balancer itself (the TCP peer).
        f"proxy:   {connection.peer_address if connection else None}",
    ]
    if header is not None:
        lines.append(f"header:  v{header.version} {header.command.name}")
        lines.extend(f"tlv:     0x{t.type:02x} {t.value!r}" for t in header.tlvs)
        if header.ssl is not None:  # HAProxy send-proxy-v2-ssl(-cn), tlsedge
            lines.append(f"ssl:     {header.ssl.version} cn={header.ssl.cn!r}")
    return web.Response(text="\n".join(lines) + "\n")


async def cleaned_up(app: web.Application) -> None:
    print("cleaned up")  # SIGTERM / CTRL+C: aiohttp's shutdown ran


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_get("/", hello)
    app.on_cleanup.append(cleaned_up)
    return app


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # refused connections are logged
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    # REQUIRE a header from these load balancers, REJECT everyone else.
    run_app(
        make_app(), host="127.0.0.1", port=port, trusted=sys.argv[2:] or ["127.0.0.1"]
    )
