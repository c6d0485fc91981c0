"""The scope's scheme behind a load balancer that terminated TLS (test helpers).

HAProxy's ``send-proxy-v2-ssl`` (and tlsedge) put an SSL TLV in the v2 header
when the client used TLS; the ASGI adapters then report ``https`` / ``wss``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from proxyproto import TLV, ProxyHeader, SSLClient, SSLInfo, encode_v2
from tests.peers import free_port, haproxy, require

CLIENT = ("192.0.2.10", 40000)
FRONTEND = ("198.51.100.1", 443)

WEBSOCKET_REQUEST = (
    b"GET /ws HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    b"Sec-WebSocket-Version: 13\r\n\r\n"
)


def ssl_header(client: SSLClient, *, local: bool = False) -> bytes:
    """A v2 header with an SSL TLV carrying *client* flags (as HAProxy's
    ``send-proxy-v2-ssl`` sends for a TLS client: ``SSLClient.SSL``)."""
    tlvs = (TLV.ssl(SSLInfo(client=client, verify=0, version="TLSv1.3")),)
    if local:
        return encode_v2(ProxyHeader.local(tlvs=tlvs))
    return encode_v2(ProxyHeader.from_addresses(CLIENT, FRONTEND, tlvs=tlvs))


async def websocket_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Accept a WebSocket with the scope's scheme in an ``x-scheme`` header."""
    await receive()  # websocket.connect
    scheme = scope.get("scheme", "ws")
    await send(
        {"type": "websocket.accept", "headers": [(b"x-scheme", scheme.encode())]}
    )
    await send({"type": "websocket.close"})


def websocket_scheme(sock: Any, first: bytes = b"") -> str:
    """Open a WebSocket on *sock* (after *first*); the scheme the app saw."""
    sock.sendall(first + WEBSOCKET_REQUEST)
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"closed during the WebSocket handshake: {head!r}")
        head += data
    lines = head.partition(b"\r\n\r\n")[0].split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1.1 101"), lines[0]
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"x-scheme":
            return value.strip().decode()
    raise AssertionError(f"no x-scheme header in {head!r}")


def curl_through_haproxy_tls(
    port: int, tls_files: dict[str, Any], tmp_path: Path
) -> tuple[dict[str, Any], int]:
    """curl over HTTPS to a real HAProxy that terminates TLS and sends plain
    HTTP to the app on *port* with ``send-proxy-v2-ssl`` (an SSL TLV saying
    the client used TLS). Returns what the app answered (JSON) and HAProxy's
    frontend port."""
    curl = require("curl")
    pem = tmp_path / "haproxy.pem"
    pem.write_bytes(tls_files["cert"].read_bytes() + tls_files["key"].read_bytes())
    front = free_port()
    config = (
        f"frontend fe\n    bind 127.0.0.1:{front} ssl crt {pem}\n"
        "    default_backend be\n"
        f"backend be\n    server app 127.0.0.1:{port} send-proxy-v2-ssl\n"
    )
    with haproxy(config, [front]):
        out = subprocess.run(
            [
                curl,
                "-sS",
                "--max-time",
                "10",
                "--cacert",
                str(tls_files["ca"]),
                f"https://localhost:{front}/",
            ],
            capture_output=True,
            check=True,
            timeout=30,
        )
    seen: dict[str, Any] = json.loads(out.stdout)
    return seen, front
