"""Send requests behind PROXY headers, as a load balancer would (docs/client.md).

Run:  python examples/trio_backend.py 8000
Then: python examples/proxy_client.py http://127.0.0.1:8000/ [CA.pem]

Three requests reach the backend: with httpx as client 203.0.113.7 over v2
(with an AUTHORITY TLV), then as 198.51.100.9 over a connection of its own
(a request's own header), and with requests over v1 naming the connection's
real endpoints. For an https:// URL, TLS starts after the header (give the
CA file that signed the server's certificate).
"""

from __future__ import annotations

import sys

import httpx
import requests

from proxyproto import TLV, ProxyHeader
from proxyproto.httpx import PROXY_HEADER, ProxyHeaderTransport
from proxyproto.requests import ProxyHeaderAdapter


def main(url: str, ca: str | None = None) -> None:
    verify: str | bool = ca if ca is not None else True
    transport = ProxyHeaderTransport(
        source=("203.0.113.7", 5555),
        tlvs=(TLV.authority("example.com"),),
        verify=verify,
    )
    with httpx.Client(transport=transport) as client:
        print(client.get(url).text)
        other = ProxyHeader.from_addresses(("198.51.100.9", 9), ("192.0.2.1", 443))
        print(client.get(url, extensions={PROXY_HEADER: other}).text)

    with requests.Session() as session:
        session.mount(url, ProxyHeaderAdapter(version=1))
        print(session.get(url, verify=verify, timeout=10).text)


if __name__ == "__main__":
    main(*sys.argv[1:3])
