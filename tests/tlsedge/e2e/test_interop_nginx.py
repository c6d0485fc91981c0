"""tlsedge wrapping connections in PROXY v1/v2 for a real nginx backend."""

from __future__ import annotations

import pytest
import trio

from tests.peers import free_port, nginx
from tests.tlsedge.helpers import make_config, read_all
from tlsedge._control.edge import Edge


@pytest.mark.parametrize("send_proxy", ["v1", "v2"])
async def test_nginx_backend_sees_real_client_address(send_proxy: str) -> None:
    port = free_port()
    body = (
        "http {\n"
        "  access_log off;\n"
        f"  server {{ listen 127.0.0.1:{port} proxy_protocol;\n"
        '    location / { return 200 "$proxy_protocol_addr $proxy_protocol_port '
        '$proxy_protocol_server_addr $proxy_protocol_server_port\\n"; } }\n'
        "}\n"
    )
    with nginx(body, [port]):
        config = make_config(
            [{"name": "web", "backend": "nginx"}],
            [
                {
                    "name": "nginx",
                    "servers": [f"127.0.0.1:{port}"],
                    "send_proxy": send_proxy,
                }
            ],
        )
        async with trio.open_nursery() as nursery:
            edge: Edge = await nursery.start(Edge(config).run)
            host, edge_port = edge.listen_addresses["web"][0]
            client = await trio.open_tcp_stream(host, edge_port)
            client_port = client.socket.getsockname()[1]
            await client.send_all(
                b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            response = await read_all(client)
            await client.aclose()
            edge.drain()
    assert response.startswith(b"HTTP/1.1 200")
    assert response.endswith(
        f"127.0.0.1 {client_port} 127.0.0.1 {edge_port}\n".encode()
    )
