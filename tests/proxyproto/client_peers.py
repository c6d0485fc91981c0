"""PROXY receivers for the client tests (httpx, requests, ``send``, ``probe
--diagnose``): proxyproto's trio adapter, HAProxy and a tlsedge edge.

Each answers an HTTP/1.1 request with what it learned from the header, so a
test reads back what the client sent:

- ``TrioReceiver``: ``proxyproto.trio.open_proxy_listener`` (optionally TLS
  after the header), answering JSON describing its connection's header; it
  keeps every connection's header in ``headers``, in accept order.
- ``haproxy_receiver``: HAProxy with ``accept-proxy`` (plain and TLS ports),
  answering ``SRC SRC_PORT DST DST_PORT AUTHORITY SSL`` as text.
- ``running_tlsedge``: a tlsedge HTTP listener with
  ``[listeners.proxy_protocol]`` (optionally TLS) in front of a backend
  answering JSON with the request's X-Forwarded-* fields.
"""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio
import trustme

from proxyproto import InetAddress, Policy, ProxyHeader, TrustPolicy
from proxyproto.trio import ProxyStream, open_proxy_listener
from tests.peers import free_port, haproxy
from tests.tlsedge.helpers import make_config, running_edge

__all__ = [
    "HAProxyPorts",
    "TlsFiles",
    "TrioReceiver",
    "describe",
    "haproxy_receiver",
    "http_answer",
    "running_tlsedge",
    "tls_files",
]


def describe(header: ProxyHeader | None) -> dict[str, Any]:
    """A header as JSON-able data (what the receivers report)."""
    if header is None:
        return {"header": None}

    def inet(address: object) -> list[Any] | None:
        if isinstance(address, InetAddress):
            return [str(address.host), address.port]
        return None

    return {
        "version": header.version,
        "command": header.command.name,
        "source": inet(header.source),
        "destination": inet(header.destination),
        "authority": header.authority,
        "crc32c": header.crc32c is not None,
        "tlv_types": [tlv.type for tlv in header.tlvs],
    }


def http_answer(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
        % (content_type, len(body))
        + body
    )


async def _requests(stream: trio.abc.Stream) -> AsyncIterator[bytes]:
    """The heads of the HTTP/1.1 requests on *stream* (no bodies), until EOF."""
    buffer = b""
    while True:
        while b"\r\n\r\n" not in buffer:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            buffer += chunk
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        yield head


@dataclass
class TlsFiles:
    """A trustme CA and a certificate for localhost and 127.0.0.1, with the
    files HAProxy, nginx and tlsedge read."""

    ca: trustme.CA
    cert: trustme.LeafCert
    ca_pem: Path
    cert_pem: Path
    key_pem: Path
    chain_and_key_pem: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.cert.configure_cert(context)
        return context

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context


def tls_files(directory: Path) -> TlsFiles:
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    files = TlsFiles(
        ca=ca,
        cert=cert,
        ca_pem=directory / "ca.pem",
        cert_pem=directory / "cert.pem",
        key_pem=directory / "key.pem",
        chain_and_key_pem=directory / "site.pem",
    )
    ca.cert_pem.write_to_path(str(files.ca_pem))
    cert.cert_chain_pems[0].write_to_path(str(files.cert_pem))
    cert.private_key_pem.write_to_path(str(files.key_pem))
    cert.private_key_and_cert_chain_pem.write_to_path(str(files.chain_and_key_pem))
    return files


@dataclass
class TrioReceiver:
    """proxyproto's trio adapter serving HTTP/1.1 keep-alive: each answer is
    ``describe(header)`` of its connection plus ``connection`` (accept order)
    and ``request`` (1 for a connection's first request). *trust* and
    *versions* go to ``open_proxy_listener``."""

    tls: ssl.SSLContext | None = None
    trust: TrustPolicy = field(
        default_factory=lambda: TrustPolicy.everyone(Policy.REQUIRE)
    )
    versions: frozenset[int] = frozenset({1, 2})
    headers: list[ProxyHeader | None] = field(default_factory=list)

    async def start(self, nursery: trio.Nursery) -> int:
        """Serve in *nursery*; the port."""
        port: int = await nursery.start(self._run)
        return port

    async def _run(self, *, task_status: trio.TaskStatus[int]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with open_proxy_listener(
            listeners[0], trust=self.trust, versions=self.versions
        ) as listener:
            task_status.started(int(listeners[0].socket.getsockname()[1]))
            await trio.serve_listeners(self._handle, [listener])

    async def _handle(self, proxy_stream: ProxyStream) -> None:
        index = len(self.headers)
        self.headers.append(proxy_stream.header)
        stream: trio.abc.Stream = proxy_stream
        if self.tls is not None:
            stream = trio.SSLStream(proxy_stream, self.tls, server_side=True)
        try:
            count = 0
            async for _head in _requests(stream):
                count += 1
                body = describe(proxy_stream.header)
                body.update(connection=index, request=count)
                await stream.send_all(http_answer(json.dumps(body).encode()))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)


@dataclass(frozen=True)
class HAProxyPorts:
    plain: int
    tls: int


@contextlib.contextmanager
def haproxy_receiver(files: TlsFiles) -> Iterator[HAProxyPorts]:
    """HAProxy (mode http) with ``accept-proxy`` on a plain and a TLS port;
    the answer is ``SRC SRC_PORT DST DST_PORT AUTHORITY SSL`` (from the
    header; SSL is 1 on the TLS port)."""
    ports = HAProxyPorts(free_port(), free_port())
    config = (
        "global\n    maxconn 256\n"
        "defaults\n    mode http\n    timeout connect 5s\n    timeout client 5s\n"
        "    timeout server 5s\n    timeout http-request 5s\n"
        "frontend fe\n"
        f"    bind 127.0.0.1:{ports.plain} accept-proxy\n"
        f"    bind 127.0.0.1:{ports.tls} accept-proxy ssl crt "
        f"{files.chain_and_key_pem}\n"
        "    http-request return status 200 content-type text/plain lf-string "
        '"%[src] %[src_port] %[dst] %[dst_port] %[fc_pp_authority] %[ssl_fc]"\n'
    )
    with haproxy(config, [ports.plain, ports.tls]):
        yield ports


async def _forwarded_echo(stream: trio.SocketStream) -> None:
    """A backend answering JSON with the request's X-Forwarded-* fields."""
    try:
        async for head in _requests(stream):
            fields: dict[str, str] = {}
            for line in head.decode("latin-1").split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.lower().startswith("x-forwarded-"):
                    fields[name.lower()] = value.strip()
            await stream.send_all(http_answer(json.dumps(fields).encode()))
    except trio.BrokenResourceError:
        pass
    finally:
        await stream.aclose()


@contextlib.asynccontextmanager
async def running_tlsedge(
    nursery: trio.Nursery, files: TlsFiles | None = None
) -> AsyncIterator[int]:
    """A tlsedge HTTP listener on 127.0.0.1 requiring a PROXY header from
    127.0.0.1 (``[listeners.proxy_protocol]``), TLS after it with *files*,
    in front of ``_forwarded_echo`` (served in *nursery*); yields its port."""
    servers = await nursery.start(
        partial(trio.serve_tcp, _forwarded_echo, 0, host="127.0.0.1")
    )
    backend = int(servers[0].socket.getsockname()[1])
    listener: dict[str, Any] = {
        "name": "web",
        "backend": "app",
        "mode": "http",
        "proxy_protocol": {"trusted": ["127.0.0.1/32"]},
    }
    if files is not None:
        listener["tls"] = {
            "certificates": [{"cert": str(files.cert_pem), "key": str(files.key_pem)}]
        }
    config = make_config(
        [listener], [{"name": "app", "servers": [f"127.0.0.1:{backend}"]}]
    )
    async with running_edge(config) as edge:
        yield edge.listen_addresses["web"][0][1]
