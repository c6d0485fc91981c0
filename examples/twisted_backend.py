"""A Twisted web backend behind a PROXY-speaking load balancer (HAProxy, nginx).

Run:  python examples/twisted_backend.py 8000 [TRUSTED_CIDR ...]
Then: haproxy -f examples/haproxy-in-front.cfg   and   curl http://127.0.0.1:8080/

``proxy_endpoint`` is Twisted's ``serverFromString`` with a PROXY header read
on every connection before anything else (``"ssl:8443:privateKey=..."``
would start TLS after it). ``request.getClientAddress()`` is the real client.
The same from a command line, for Daphne or twistd, is the endpoint string
``proxyproto:tcp:8000:interface=127.0.0.1:trusted=10.0.0.0/8``:

    daphne -e proxyproto:tcp:8000:interface=127.0.0.1 myproject.asgi:application
    twistd -n web --listen proxyproto:tcp:8000:interface=127.0.0.1 --path .
"""

from __future__ import annotations

import logging
import sys

from twisted.internet import reactor
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from proxyproto import TrustPolicy
from proxyproto.twisted import find_proxy_protocol, proxy_endpoint


class Describe(Resource):  # type: ignore[misc]  # Twisted is Any to mypy
    """Answers every GET with what the connection's PROXY header said."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        proxy = find_proxy_protocol(request.transport)
        lines = [f"client: {request.getClientAddress()}"]  # from the header
        if proxy is not None:
            lines.append(f"proxy:  {proxy.peer_address}")  # the load balancer
            lines.append(f"tls at the load balancer: {proxy.client_tls}")
            if proxy.header is not None:
                header = proxy.header
                lines.append(f"header: v{header.version} {header.command.name}")
                lines.extend(f"tlv:    0x{t.type:02x} {t.value!r}" for t in header.tlvs)
        text = "\n".join(lines) + "\n"
        print(text)
        request.setHeader(b"content-type", b"text/plain")
        return text.encode()


def main(port: int, trusted: list[str]) -> None:
    trust = TrustPolicy.from_cidrs(trusted)  # REQUIRE from these, REJECT others
    endpoint = proxy_endpoint(
        reactor, f"tcp:{port}:interface=127.0.0.1", trust=trust, header_timeout=5.0
    )
    endpoint.listen(Site(Describe()))
    print(f"listening on 127.0.0.1:{port}, trusting {trusted}")
    reactor.run()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # bad headers are logged here
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8000, sys.argv[2:] or ["127.0.0.1"])
