"""``tlsedge demo``: the whole pipeline on one machine, with nothing to set up.

A fresh development CA and certificate are made in a temporary directory, and
three listeners share a built-in backend:

- ``PORT``: TLS, clients connect directly;
- ``PORT+1``: TLS behind a "load balancer": clients must start with a PROXY
  header (``curl --haproxy-protocol`` sends one) before the ClientHello;
- ``PORT+2``: plain TCP.

The edge wraps every connection in a PROXY v2 header for the backend (with
the TLS details in its SSL TLV), and the backend answers with what it learned:
the header, the client address, the TLVs. It speaks just enough HTTP for curl
and a browser, and plain text otherwise.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from functools import partial
from pathlib import Path

import trio

from proxyproto import ProxyHeader, RemoteProtocolError, TLVType
from proxyproto.trio import ProxyStream, read_proxy_header
from tlsedge._control.edge import Edge
from tlsedge._control.run import run_edge
from tlsedge._core.accesslog import format_address
from tlsedge._core.config import config_from_mapping
from tlsedge._tls.certs import DevCertificates, make_dev_certificates

__all__ = ["describe_header", "run_demo"]

LOGGER = logging.getLogger("tlsedge.demo")

# The backend reads at most this much of a request before answering.
_MAX_REQUEST_HEAD = 16384
_REQUEST_TIMEOUT = 5.0
_HTTP_METHODS = (
    b"GET ",
    b"HEAD ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"OPTIONS ",
    b"PATCH ",
)


def describe_header(header: ProxyHeader | None) -> list[str]:
    """Human-readable lines describing a PROXY header."""
    if header is None:
        return ["PROXY header:  none"]
    lines = [
        f"PROXY header:  v{header.version} {header.command.name} "
        f"{header.family.name}/{header.transport.name}",
        f"  source:      {header.source}",
        f"  destination: {header.destination}",
    ]
    ssl_info = header.ssl
    if ssl_info is not None:
        lines.append(
            f"  TLS (SSL TLV): {ssl_info.version} {ssl_info.cipher}, client cert: "
            f"{ssl_info.cn or 'none'}, our cert: "
            f"{ssl_info.key_alg} signed {ssl_info.sig_alg}"
        )
    for tlv in header.tlvs:
        try:
            name = TLVType(tlv.type).name
        except ValueError:
            name = f"0x{tlv.type:02x}"
        value = tlv.value
        shown = (
            f"0x{int.from_bytes(value, 'big'):08x} (verified)"
            if tlv.type == TLVType.CRC32C
            else repr(value)
        )
        lines.append(f"  TLV {name}: {shown}")
    return lines


async def _read_request_head(stream: trio.abc.Stream) -> bytes:
    data = b""
    with trio.move_on_after(_REQUEST_TIMEOUT):
        while b"\r\n\r\n" not in data and len(data) < _MAX_REQUEST_HEAD:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            data += chunk
            if not data.startswith(_HTTP_METHODS[0][:1]) and not any(
                m.startswith(data[: len(m)]) for m in _HTTP_METHODS
            ):
                break
    return data


async def _demo_backend(stream: trio.SocketStream) -> None:
    try:
        proxied: ProxyStream = await read_proxy_header(stream)
    except (RemoteProtocolError, trio.BrokenResourceError) as exc:
        LOGGER.warning("demo backend: %s", exc)
        await trio.aclose_forcefully(stream)
        return
    try:
        head = await _read_request_head(proxied)
        lines = [
            "tlsedge demo backend: this is what reached me",
            "",
            f"TCP peer (the edge): {format_address(proxied.peer_address)}",
            f"real client:         {format_address(proxied.client_address)}",
            f"client connected to: {format_address(proxied.server_address)}",
            *describe_header(proxied.header),
        ]
        request_line = head.split(b"\r\n", 1)[0]
        if request_line:
            lines.append(f"first line you sent: {request_line[:200]!r}")
        body = ("\n".join(lines) + "\n").encode()
        if any(head.startswith(m) for m in _HTTP_METHODS):
            response = (
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
            )
        else:
            response = body
        await proxied.send_all(response)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(proxied)


async def run_demo(
    host: str = "127.0.0.1",
    port: int = 8443,
    *,
    task_status: trio.TaskStatus[Edge] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the demo backend and an edge in front of it until SIGTERM/SIGINT."""
    with tempfile.TemporaryDirectory(prefix="tlsedge-demo-") as tmp:
        certs = make_dev_certificates(tmp, names=("localhost", "127.0.0.1", "::1"))
        await _run_demo(host, port, certs, task_status=task_status)


async def _run_demo(
    host: str,
    port: int,
    certs: DevCertificates,
    *,
    task_status: trio.TaskStatus[Edge],
) -> None:
    async with trio.open_nursery() as nursery:
        backends = await nursery.start(
            partial(trio.serve_tcp, _demo_backend, 0, host="127.0.0.1")
        )
        backend_port = backends[0].socket.getsockname()[1]
        tls = {"certificates": [{"cert": str(certs.cert), "key": str(certs.key)}]}
        config = config_from_mapping(
            {
                "listeners": [
                    {
                        "name": "tls",
                        "bind": f"{host}:{port}",
                        "backend": "demo",
                        "tls": tls,
                    },
                    {
                        "name": "tls-behind-lb",
                        "bind": f"{host}:{port + 1 if port else 0}",
                        "backend": "demo",
                        "proxy_protocol": {"trusted": ["127.0.0.1/32", "::1/128"]},
                        "tls": tls,
                    },
                    {
                        "name": "plain",
                        "bind": f"{host}:{port + 2 if port else 0}",
                        "backend": "demo",
                    },
                ],
                "backends": [
                    {
                        "name": "demo",
                        "servers": [f"127.0.0.1:{backend_port}"],
                        "send_proxy": "v2",
                    }
                ],
            },
            base_dir=Path.cwd(),
        )

        async def edge_then_stop(*, task_status: trio.TaskStatus[Edge]) -> None:
            await run_edge(Edge(config), None, task_status=task_status)
            nursery.cancel_scope.cancel()

        edge: Edge = await nursery.start(edge_then_stop)
        addresses = {name: a[0] for name, a in edge.listen_addresses.items()}
        name = "localhost" if host in ("127.0.0.1", "::1", "localhost") else host
        resolve = f"--resolve {name}:{{port}}:{host} " if name != host else ""
        tls_port, lb_port = addresses["tls"][1], addresses["tls-behind-lb"][1]
        behind_lb = format_address(addresses["tls-behind-lb"])
        print(
            f"tlsedge demo: TLS edge on {format_address(addresses['tls'])}, TLS "
            f"behind a PROXY-sending load balancer on {behind_lb}, "
            f"plain TCP on {format_address(addresses['plain'])}; backend on "
            f"127.0.0.1:{backend_port}\n"
            f"  try: curl --cacert {certs.ca_cert} "
            f"{resolve.format(port=tls_port)}https://{name}:{tls_port}/\n"
            f"  try: curl --cacert {certs.ca_cert} --haproxy-protocol "
            f"{resolve.format(port=lb_port)}https://{name}:{lb_port}/\n"
            f"  try: curl http://{format_address(addresses['plain'])}/\n"
            f"  stop with Ctrl-C (or SIGTERM to drain)",
            file=sys.stderr,
            flush=True,
        )
        task_status.started(edge)
