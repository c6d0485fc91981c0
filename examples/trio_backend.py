"""A trio backend behind a PROXY-speaking load balancer (HAProxy, nginx, AWS NLB).

Run:  python examples/trio_backend.py 8000 [TRUSTED_CIDR ...]
Then: haproxy -f examples/haproxy-in-front.cfg   and   curl http://127.0.0.1:8080/

Only peers in the trusted CIDRs (default: 127.0.0.1) may connect, and they must
send a PROXY v1 or v2 header within 5 seconds; anyone else is closed and
logged. Each connection prints the real client and the header's TLVs, and gets
a small HTTP answer saying what the backend learned.
"""

from __future__ import annotations

import logging
import sys

import trio

from proxyproto import TrustPolicy
from proxyproto.trio import ProxyStream, open_proxy_listener


def describe(stream: ProxyStream) -> str:
    header = stream.header
    lines = [
        f"client: {stream.client_address}",  # the real client, from the header
        f"server: {stream.server_address}",  # the address the client connected to
        f"proxy:  {stream.peer_address}",  # the load balancer itself
    ]
    if header is not None:
        lines.append(f"header: v{header.version} {header.command.name}")
        lines.extend(f"tlv:    0x{t.type:02x} {t.value!r}" for t in header.tlvs)
        if header.ssl is not None:  # HAProxy send-proxy-v2-ssl(-cn)
            lines.append(f"ssl:    {header.ssl.version} cn={header.ssl.cn!r}")
    return "\n".join(lines) + "\n"


async def handler(stream: ProxyStream) -> None:
    # Only connections with a complete, valid header get here.
    text = describe(stream)
    print(text)
    request = b""
    while b"\r\n\r\n" not in request:  # the bytes after the header come first
        chunk = await stream.receive_some()
        if not chunk:
            break
        request += chunk
    body = text.encode()
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
    )
    await stream.aclose()


async def main(port: int, trusted: list[str]) -> None:
    # REQUIRE from the trusted peers, REJECT (close) everyone else.
    trust = TrustPolicy.from_cidrs(trusted)
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    async with open_proxy_listener(
        listeners[0], trust=trust, header_timeout=5.0
    ) as listener:
        print(f"listening on 127.0.0.1:{port}, trusting {trusted}")
        await trio.serve_listeners(handler, [listener])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # bad headers are logged here
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    trio.run(main, port, sys.argv[2:] or ["127.0.0.1"])
