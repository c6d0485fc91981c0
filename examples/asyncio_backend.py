"""An asyncio backend behind a PROXY-speaking load balancer (HAProxy, nginx, AWS NLB).

Run:  python examples/asyncio_backend.py 8000 [TRUSTED_CIDR ...]
Then: haproxy -f examples/haproxy-in-front.cfg   and   curl http://127.0.0.1:8080/

``proxyproto.asyncio.start_server`` is ``asyncio.start_server`` with a PROXY
header in front: the callback runs only after a valid header, and
``writer.get_extra_info("peername")`` is the real client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

from proxyproto import ProxyHeader, TrustPolicy
from proxyproto.asyncio import start_server


def describe(writer: asyncio.StreamWriter) -> str:
    header: ProxyHeader | None = writer.get_extra_info("proxyproto.header")
    lines = [
        f"client: {writer.get_extra_info('peername')}",  # from the header
        f"server: {writer.get_extra_info('sockname')}",
        f"proxy:  {writer.get_extra_info('proxyproto.peername')}",  # the LB
    ]
    if header is not None:
        lines.append(f"header: v{header.version} {header.command.name}")
        lines.extend(f"tlv:    0x{t.type:02x} {t.value!r}" for t in header.tlvs)
        if header.ssl is not None:  # HAProxy send-proxy-v2-ssl(-cn)
            lines.append(f"ssl:    {header.ssl.version} cn={header.ssl.cn!r}")
    return "\n".join(lines) + "\n"


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    text = describe(writer)
    print(text)
    # The bytes after the header come first. A health check may only connect.
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        await reader.readuntil(b"\r\n\r\n")
    body = text.encode()
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
    )
    writer.close()


async def main(port: int, trusted: list[str]) -> None:
    trust = TrustPolicy.from_cidrs(trusted)  # REQUIRE from these, REJECT others
    server = await start_server(
        handle, "127.0.0.1", port, trust=trust, header_timeout=5.0
    )
    print(f"listening on 127.0.0.1:{port}, trusting {trusted}")
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # bad headers are logged here
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    asyncio.run(main(port, sys.argv[2:] or ["127.0.0.1"]))
