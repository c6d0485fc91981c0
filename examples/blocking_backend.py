"""A threaded socketserver backend behind a PROXY-speaking load balancer.

Run:  python examples/blocking_backend.py 8000 [TRUSTED_CIDR ...]
Then: haproxy -f examples/haproxy-in-front.cfg   and   curl http://127.0.0.1:8080/

``ProxyProtocolMixin`` reads the header in the handling thread (never in the
accept loop) and builds the handler with the real client as
``client_address``; ``ProxyRequestHandlerMixin`` adds ``self.proxy``.
"""

from __future__ import annotations

import logging
import socketserver
import sys

from proxyproto import TrustPolicy
from proxyproto.sockets import ProxyProtocolMixin, ProxyRequestHandlerMixin


class Handler(ProxyRequestHandlerMixin, socketserver.StreamRequestHandler):
    def handle(self) -> None:
        info = self.proxy  # header, policy, real and socket addresses
        assert info is not None
        lines = [
            f"client: {self.client_address}",  # the real client, from the header
            f"server: {info.server_address}",
            f"proxy:  {info.peer_address}",  # the load balancer
        ]
        header = info.header
        if header is not None:
            lines.append(f"header: v{header.version} {header.command.name}")
            lines.extend(f"tlv:    0x{t.type:02x} {t.value!r}" for t in header.tlvs)
        text = "\n".join(lines) + "\n"
        print(text)
        try:  # the bytes after the header are still in the socket
            while self.rfile.readline() not in (b"", b"\r\n"):
                pass
        except ConnectionError:
            return  # e.g. a health check that only connects
        body = text.encode()
        self.wfile.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )


class Server(ProxyProtocolMixin, socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # bad headers are logged here
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    trusted = sys.argv[2:] or ["127.0.0.1"]
    trust = TrustPolicy.from_cidrs(trusted)  # REQUIRE from these, REJECT others
    address = ("127.0.0.1", port)
    with Server(address, Handler, trust=trust, header_timeout=5.0) as server:
        print(f"listening on 127.0.0.1:{port}, trusting {trusted}")
        server.serve_forever()
