"""TLS through the edge end to end: real loopback sockets, Python ``ssl`` clients.

Certificates are made with ``trustme`` at test time and written to tmp_path.
Backends are small trio servers that decode our PROXY v2 header with
``proxyproto.trio.read_proxy_header`` (which checks the CRC32C) and record it.
The command-line clients (openssl s_client, curl) and HAProxy are in
test_interop_tls.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

import tlsedge._control.edge
from proxyproto import Policy, ProxyHeader, SSLClient, encode, encode_v2
from proxyproto.trio import read_proxy_header
from tests.peers import free_port
from tests.tlsedge.core.test_admission import connect_from
from tests.tlsedge.helpers import (
    Backend,
    address_of,
    capture_unraisable,
    client_hello,
    close_clients,
    connect,
    make_config,
    read_all,
    running_edge,
    wait_access_records,
    wait_until,
)
from tlsedge._core.config import Config, ConfigError
from tlsedge._tls.contexts import watch_certificates
from tlsedge._tls.stream import TLSStream

TLS12 = ssl.TLSVersion.TLSv1_2
TLS13 = ssl.TLSVersion.TLSv1_3
VERSIONS = [pytest.param(TLS12, id="tls12"), pytest.param(TLS13, id="tls13")]
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


# -- certificates --------------------------------------------------------------


def der_of(leaf: trustme.LeafCert) -> bytes:
    cert = x509.load_pem_x509_certificate(leaf.cert_chain_pems[0].bytes())
    return cert.public_bytes(Encoding.DER)


def serial_of(der: bytes) -> int:
    return x509.load_der_x509_certificate(der).serial_number


@dataclass
class Pki:
    """Every certificate a test needs, written to *directory*."""

    directory: Path
    ca: trustme.CA = field(default_factory=trustme.CA)
    client_ca: trustme.CA = field(default_factory=trustme.CA)
    other_ca: trustme.CA = field(default_factory=trustme.CA)
    leaves: dict[str, trustme.LeafCert] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.issue("default", "default.test")
        self.issue("a", "a.test")
        self.issue("wild", "*.wild.test")
        self.client = self.client_ca.issue_cert(
            "client@example.test", common_name="client-one"
        )
        self.stranger = self.other_ca.issue_cert(
            "client@example.test", common_name="stranger"
        )
        self.client_ca_path = self.directory / "client-ca.pem"
        self.client_ca.cert_pem.write_to_path(str(self.client_ca_path))
        self.ca_path = self.directory / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_path))
        self.client_files = self.write(self.client, "client")

    def issue(
        self, name: str, *identities: str, ca: trustme.CA | None = None
    ) -> trustme.LeafCert:
        leaf = (ca or self.ca).issue_cert(*identities)
        self.leaves[name] = leaf
        self.write(leaf, name)
        return leaf

    def write(self, leaf: trustme.LeafCert, name: str) -> tuple[Path, Path]:
        cert, key = self.directory / f"{name}.pem", self.directory / f"{name}.key"
        cert.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
        key.write_bytes(leaf.private_key_pem.bytes())
        return cert, key

    def entry(self, name: str) -> dict[str, str]:
        return {
            "cert": str(self.directory / f"{name}.pem"),
            "key": str(self.directory / f"{name}.key"),
        }


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


# -- backends ------------------------------------------------------------------


@dataclass
class Seen:
    """What a backend saw: one header and one byte string per connection."""

    headers: list[ProxyHeader] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)
    server_names: list[str | None] = field(default_factory=list)
    client_cns: list[str | None] = field(default_factory=list)


def http_answer(header: ProxyHeader) -> bytes:
    body = json.dumps(describe_ssl(header)).encode()
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
    )


def echo_backend(seen: Seen, *, proxy: bool = True) -> Callable[..., Any]:
    """Record the PROXY header; HTTP requests (curl) get the header's facts as
    JSON, everything else is echoed until EOF, then FIN."""

    async def handler(stream: trio.SocketStream) -> None:
        inner: trio.abc.Stream = stream
        if proxy:
            proxied = await read_proxy_header(stream, policy=Policy.REQUIRE)
            assert proxied.header is not None
            seen.headers.append(proxied.header)
            inner = proxied
        received: list[bytes] = []
        try:
            while data := await inner.receive_some(65536):
                received.append(bytes(data))
                if data.startswith(b"GET ") and proxy:
                    while b"\r\n\r\n" not in b"".join(received):
                        received.append(bytes(await inner.receive_some(65536)))
                    await inner.send_all(http_answer(seen.headers[-1]))
                    return
                await inner.send_all(data)
            await stream.send_eof()
        finally:
            seen.data.append(b"".join(received))

    return handler


def collect_then_answer(seen: Seen) -> Callable[..., Any]:
    """Read everything until EOF, then answer with the size and close."""

    async def handler(stream: trio.SocketStream) -> None:
        proxied = await read_proxy_header(stream, policy=Policy.REQUIRE)
        data = await read_all(proxied)
        seen.data.append(data)
        await stream.send_all(b"got %d bytes" % len(data))

    return handler


def fin_first(seen: Seen) -> Callable[..., Any]:
    """Send a greeting and FIN at once, then read what the client still sends."""

    async def handler(stream: trio.SocketStream) -> None:
        proxied = await read_proxy_header(stream, policy=Policy.REQUIRE)
        await stream.send_all(b"bye")
        await stream.send_eof()
        seen.data.append(await read_all(proxied))

    return handler


def describe_ssl(header: ProxyHeader) -> dict[str, Any]:
    """Every PROXY v2 field TLS fills in, as plain data."""
    info = header.ssl
    return {
        "alpn": None if header.alpn is None else header.alpn.decode(),
        "authority": header.authority,
        "crc32c": header.crc32c is not None,
        "unique_id": header.unique_id is not None,
        "ssl": None
        if info is None
        else {
            "client": int(info.client),
            "verify": info.verify,
            "version": info.version,
            "cipher": info.cipher,
            "cn": info.cn,
            "sig_alg": info.sig_alg,
            "key_alg": info.key_alg,
            "client_cert": info.client_cert is not None,
        },
    }


def edge_config(
    pki: Pki,
    backend: Backend,
    *,
    certs: tuple[str, ...] = ("default", "a", "wild"),
    tls: dict[str, Any] | None = None,
    listener: dict[str, Any] | None = None,
    backend_options: dict[str, Any] | None = None,
) -> Config:
    return make_config(
        [
            {
                "name": "in",
                "backend": "b",
                "tls": {
                    "certificates": [pki.entry(name) for name in certs],
                    **(tls or {}),
                },
                **(listener or {}),
            }
        ],
        [
            {
                "name": "b",
                "servers": [backend.address],
                "send_proxy": "v2",
                **(backend_options or {}),
            }
        ],
    )


# -- clients -------------------------------------------------------------------


def client_context(
    pki: Pki,
    *,
    version: ssl.TLSVersion | None = None,
    cert: trustme.LeafCert | None = None,
    alpn: list[str] | None = None,
) -> ssl.SSLContext:
    context = ssl.create_default_context()
    pki.ca.configure_trust(context)
    context.check_hostname = False  # the SNI tests ask for names not in the cert
    if version is not None:
        context.minimum_version = context.maximum_version = version
    if cert is not None:
        cert.configure_cert(context)
    if alpn:
        context.set_alpn_protocols(alpn)
    return context


async def tls_connect(
    address: tuple[str, int],
    context: ssl.SSLContext,
    server_name: str | None = "a.test",
) -> TLSStream:
    """A Python ``ssl`` client (SSLObject) over a TCP connection, handshaken."""
    tcp = await connect(address)
    client = TLSStream(tcp, context, server_side=False, server_hostname=server_name)
    await client.do_handshake()
    return client


async def receive_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise AssertionError(f"EOF after {len(data)} of {size} bytes")
        data += chunk
    return data


async def round_trip(client: trio.abc.Stream, payload: bytes = b"ping") -> None:
    with trio.fail_after(10):
        await client.send_all(payload)
        assert await receive_exactly(client, len(payload)) == payload


async def read_until_closed(stream: trio.abc.ReceiveStream) -> bytes:
    chunks = []
    try:
        while chunk := await stream.receive_some(65536):
            chunks.append(bytes(chunk))
    except trio.BrokenResourceError:
        pass
    return b"".join(chunks)


async def connect_and_round_trip(
    address: tuple[str, int], context: ssl.SSLContext
) -> None:
    client = await tls_connect(address, context)
    await round_trip(client)
    await client.aclose()


def peer_der(client: TLSStream) -> bytes:
    der = client.ssl_object.getpeercert(binary_form=True)
    assert der is not None
    return der


# -- the SSL TLV: every field --------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("client_auth", ["none", "optional", "required"])
async def test_every_ssl_field_reaches_the_backend(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    version: ssl.TLSVersion,
    client_auth: str,
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    tls: dict[str, Any] = {"alpn": ["h2", "http/1.1"], "client_auth": client_auth}
    if client_auth != "none":
        tls["client_ca"] = str(pki.client_ca_path)
    config = edge_config(pki, backend, tls=tls)
    with_cert = client_auth != "none"
    async with running_edge(config) as edge:
        context = client_context(
            pki, version=version, cert=pki.client, alpn=["http/1.1", "h2"]
        )
        client = await tls_connect(address_of(edge, "in"), context, "a.test")
        await round_trip(client, b"hello over TLS")
        assert peer_der(client) == der_of(pki.leaves["a"])
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    (header,) = seen.headers
    info = header.ssl
    assert info is not None
    expected_cipher = (
        "TLS_AES_256_GCM_SHA384"
        if version is TLS13
        else "ECDHE-ECDSA-AES128-GCM-SHA256"  # intermediate's first ECDSA suite
    )
    flags = SSLClient.SSL
    if with_cert:
        flags |= SSLClient.CERT_CONN | SSLClient.CERT_SESS
    assert info.client == flags
    assert info.verify == (0 if with_cert else 1)
    assert info.version == ("TLSv1.3" if version is TLS13 else "TLSv1.2")
    assert info.cipher == expected_cipher
    assert info.cn == ("client-one" if with_cert else None)
    assert info.sig_alg == "ecdsa-with-SHA256"
    assert info.key_alg == "EC256"
    assert info.client_cert is None  # "ssl-client-cert" is not in proxy_tlvs
    assert header.authority == "a.test"
    assert header.alpn == b"h2"  # the edge's preference wins
    assert header.crc32c is not None  # and read_proxy_header verified it
    assert header.unique_id is not None
    assert header.unique_id.decode() == record["id"]
    assert record["tls"] == f"{info.version} {expected_cipher}"
    assert record["sni"] == "a.test"


async def test_no_alpn_no_sni_leaves_their_tlvs_out(
    nursery: trio.Nursery, pki: Pki
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    async with running_edge(edge_config(pki, backend)) as edge:
        client = await tls_connect(address_of(edge, "in"), client_context(pki), None)
        await round_trip(client)
        await client.aclose()
    (header,) = seen.headers
    assert header.authority is None
    assert header.alpn is None
    assert header.ssl is not None
    assert header.ssl.client == SSLClient.SSL


@pytest.mark.parametrize("configured", [True, False])
async def test_client_cert_tlv_only_when_configured(
    nursery: trio.Nursery, pki: Pki, configured: bool
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    tlvs = ["ssl", "crc32c", "authority"] + (["ssl-client-cert"] if configured else [])
    config = edge_config(
        pki,
        backend,
        tls={"client_auth": "required", "client_ca": str(pki.client_ca_path)},
        backend_options={"proxy_tlvs": tlvs},
    )
    async with running_edge(config) as edge:
        context = client_context(pki, cert=pki.client)
        client = await tls_connect(address_of(edge, "in"), context)
        await round_trip(client)
        await client.aclose()
    (header,) = seen.headers
    assert header.ssl is not None
    if configured:
        assert header.ssl.client_cert == der_of(pki.client)
    else:
        assert header.ssl.client_cert is None
    assert header.unique_id is None  # not in proxy_tlvs
    assert header.alpn is None  # not in proxy_tlvs


# -- SNI -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server_name", "served"),
    [
        ("a.test", "a"),
        ("A.Test.", "a"),
        ("x.wild.test", "wild"),
        ("x.y.wild.test", "default"),  # a wildcard matches one label only
        ("wild.test", "default"),
        ("unknown.test", "default"),
        (None, "default"),
    ],
)
async def test_sni_selects_the_certificate(
    nursery: trio.Nursery, pki: Pki, server_name: str | None, served: str
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    async with running_edge(edge_config(pki, backend)) as edge:
        client = await tls_connect(
            address_of(edge, "in"), client_context(pki), server_name
        )
        assert peer_der(client) == der_of(pki.leaves[served])
        await round_trip(client)
        await client.aclose()
    assert seen.headers[0].authority == server_name


@pytest.mark.parametrize("server_name", ["unknown.test", None])
async def test_strict_sni_refuses_with_unrecognized_name(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    server_name: str | None,
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    config = edge_config(pki, backend, tls={"strict_sni": True})
    async with running_edge(config) as edge:
        address = address_of(edge, "in")
        with pytest.raises(trio.BrokenResourceError) as info:
            await tls_connect(address, client_context(pki), server_name)
        assert "UNRECOGNIZED_NAME" in str(info.value.__cause__).upper()
        (record,) = await wait_access_records(caplog)
        assert record["termination"] == "tls_error"
        # A known name is still served.
        client = await tls_connect(address, client_context(pki), "x.wild.test")
        await round_trip(client)
        await client.aclose()
    assert backend.accepted == 1
    assert "strict_sni" in caplog.text


@pytest.mark.parametrize("proxy", [False, True], ids=["socket", "after-a-proxy-header"])
async def test_a_non_ascii_server_name_is_refused_with_unrecognized_name(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    proxy: bool,
) -> None:
    # Python's ssl cannot decode such a name for the SNI callback: the edge
    # refuses the ClientHello before OpenSSL reads it. Behind a PROXY header
    # the ClientHello comes in the same segment (the header's leftover); the
    # good client after it connects directly.
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    trust = {"trusted": ["127.0.0.2/32"], "untrusted": "direct"}
    config = edge_config(pki, backend, listener={"proxy_protocol": trust})
    header = b""
    if proxy:
        header = encode_v2(
            ProxyHeader.from_addresses(("203.0.113.9", 4711), ("198.51.100.2", 443))
        )
    with capture_unraisable() as seen_by_hook:
        async with running_edge(config) as edge:
            address = address_of(edge, "in")
            source = "127.0.0.2" if proxy else "127.0.0.3"  # trusted or direct
            async with await connect_from(source, address) as client:
                await client.send_all(header + client_hello(b"\xff\xfe\xc3("))
                with trio.fail_after(5):
                    answer = await read_until_closed(client)
            (record,) = await wait_access_records(caplog)
            good = await tls_connect(address, client_context(pki))
            await round_trip(good)
            await good.aclose()
    assert answer == b"\x15\x03\x03\x00\x02\x02\x70"  # fatal unrecognized_name
    assert record["termination"] == "tls_error"
    assert record["detail"] == (
        "the ClientHello's server name is not ASCII: b'\\xff\\xfe\\xc3('"
    )
    assert seen_by_hook == []
    assert backend.accepted == 1


# -- policies ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "version", "ciphers", "accepted"),
    [
        ("intermediate", TLS13, None, True),
        ("intermediate", TLS12, None, True),
        ("intermediate", TLS12, "AES128-SHA", False),
        ("intermediate", TLS12, "ECDHE-ECDSA-AES128-SHA", False),
        ("intermediate", ssl.TLSVersion.TLSv1_1, "ALL:@SECLEVEL=0", False),
        ("modern", TLS13, None, True),
        ("modern", TLS12, None, False),
        ("ELBSecurityPolicy-TLS-1-2-2017-01", TLS13, None, False),
        ("ELBSecurityPolicy-TLS-1-2-2017-01", TLS12, "ECDHE-ECDSA-AES128-SHA256", True),
    ],
)
async def test_policy_accepts_and_refuses(  # noqa: PLR0917
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    policy: str,
    version: ssl.TLSVersion,
    ciphers: str | None,
    accepted: bool,
) -> None:
    backend = await Backend(echo_backend(Seen())).start(nursery)
    config = edge_config(pki, backend, tls={"policy": policy})
    context = client_context(pki)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLS 1.1 on purpose
        context.minimum_version = context.maximum_version = version
    if ciphers is not None:
        context.set_ciphers(ciphers)
    async with running_edge(config) as edge:
        if accepted:
            client = await tls_connect(address_of(edge, "in"), context)
            assert client.ssl_object.version() == (
                "TLSv1.3" if version is TLS13 else "TLSv1.2"
            )
            if ciphers is not None:
                cipher = client.ssl_object.cipher()
                assert cipher is not None
                assert cipher[0] == ciphers
            await round_trip(client)
            await client.aclose()
        else:
            with pytest.raises(trio.BrokenResourceError):
                await tls_connect(address_of(edge, "in"), context)
            (record,) = await wait_access_records(caplog)
            assert record["termination"] == "tls_error"
    assert backend.accepted == (1 if accepted else 0)


# -- client certificates -------------------------------------------------------


@pytest.mark.parametrize(
    ("client_auth", "cert", "accepted"),
    [
        ("none", "good", True),
        ("none", "missing", True),
        ("none", "stranger", True),
        ("optional", "good", True),
        ("optional", "missing", True),
        ("optional", "stranger", False),
        ("required", "good", True),
        ("required", "missing", False),
        ("required", "stranger", False),
    ],
)
@pytest.mark.parametrize("version", VERSIONS)
async def test_client_auth(  # noqa: PLR0917
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    client_auth: str,
    cert: str,
    accepted: bool,
    version: ssl.TLSVersion,
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    tls: dict[str, Any] = {"client_auth": client_auth}
    if client_auth != "none":
        tls["client_ca"] = str(pki.client_ca_path)
    leaf = {"good": pki.client, "stranger": pki.stranger, "missing": None}[cert]
    context = client_context(pki, version=version, cert=leaf)
    async with running_edge(edge_config(pki, backend, tls=tls)) as edge:
        address = address_of(edge, "in")
        if accepted:
            client = await tls_connect(address, context)
            await round_trip(client)
            await client.aclose()
        else:
            # TLS 1.3: the client's handshake is done before the server has
            # checked its certificate; the alert comes with the first read.
            with pytest.raises(trio.BrokenResourceError) as info:
                await connect_and_round_trip(address, context)
            assert isinstance(info.value.__cause__, ssl.SSLError)
        (record,) = await wait_access_records(caplog)
    if not accepted:
        assert record["termination"] == "tls_error"
        assert backend.accepted == 0
        return
    (header,) = seen.headers
    assert header.ssl is not None
    presented = client_auth != "none" and leaf is not None
    assert header.ssl.verify == (0 if presented else 1)
    assert header.ssl.cn == ("client-one" if presented else None)
    assert bool(header.ssl.client & SSLClient.CERT_CONN) is presented


# -- PROXY then TLS ------------------------------------------------------------


class PrefixFirstSend(trio.abc.Stream):
    """Sends *prefix* together with the first bytes (the ClientHello) in one
    ``send_all``: one segment on loopback."""

    def __init__(self, stream: trio.SocketStream, prefix: bytes) -> None:
        self.stream = stream
        self.prefix = prefix
        self.first_send: bytes | None = None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.first_send is None:
            self.first_send = self.prefix + bytes(data)
            await self.stream.send_all(self.first_send)
        else:
            await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()


@pytest.mark.parametrize("version", [1, 2])
async def test_proxy_header_and_client_hello_in_one_segment(
    nursery: trio.Nursery, pki: Pki, version: int
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    config = edge_config(
        pki, backend, listener={"proxy_protocol": {"trusted": ["127.0.0.1/32"]}}
    )
    header = encode(
        ProxyHeader.from_addresses(
            ("203.0.113.9", 4711), ("198.51.100.2", 443), version=version
        )
    )
    async with running_edge(config) as edge:
        tcp = await connect(address_of(edge, "in"))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        transport = PrefixFirstSend(tcp, header)
        client = TLSStream(
            transport, client_context(pki), server_side=False, server_hostname="a.test"
        )
        with trio.fail_after(10):
            await client.do_handshake()
        assert transport.first_send is not None
        assert transport.first_send.startswith(header)
        assert transport.first_send[len(header)] == 0x16  # a TLS handshake record
        await round_trip(client)
        await client.aclose()
    (received,) = seen.headers
    assert received.source is not None
    assert str(received.source.host) == "203.0.113.9"  # type: ignore[union-attr]
    assert received.authority == "a.test"


# -- reload --------------------------------------------------------------------


async def test_reload_swaps_the_certificate_for_new_handshakes(
    nursery: trio.Nursery, pki: Pki
) -> None:
    backend = await Backend(echo_backend(Seen())).start(nursery)
    old = pki.leaves["a"]
    new = pki.issue("a-new", "a.test")
    async with running_edge(edge_config(pki, backend, certs=("a",))) as edge:
        address = address_of(edge, "in")
        context = client_context(pki)
        before = await tls_connect(address, context)
        await round_trip(before, b"before")
        await edge.reload(edge_config(pki, backend, certs=("a-new",)))
        assert address_of(edge, "in") == address
        await round_trip(before, b"still works after the reload")
        assert peer_der(before) == der_of(old)
        after = await tls_connect(address, context)
        assert serial_of(peer_der(after)) == serial_of(der_of(new))
        assert serial_of(der_of(new)) != serial_of(der_of(old))
        await round_trip(after)
        # A broken certificate: refused, the running one stays.
        (pki.directory / "broken.pem").write_text("not a certificate\n")
        (pki.directory / "broken.key").write_bytes(new.private_key_pem.bytes())
        with pytest.raises(ConfigError, match=r"broken\.pem"):
            await edge.reload(edge_config(pki, backend, certs=("broken",)))
        again = await tls_connect(address, context)
        assert peer_der(again) == der_of(new)
        await round_trip(again)
        await round_trip(before, b"and after the refused one")
        for client in (before, after, again):
            await client.aclose()


async def test_file_watcher_reloads_changed_files_and_refuses_broken_ones(
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The edge starts watch_certificates with its default interval (5 s).
    monkeypatch.setattr(
        tlsedge._control.edge,
        "watch_certificates",
        partial(watch_certificates, interval=0.05),
    )
    backend = await Backend(echo_backend(Seen())).start(nursery)
    old = pki.leaves["a"]
    async with running_edge(edge_config(pki, backend, certs=("a",))) as edge:
        address = address_of(edge, "in")
        context = client_context(pki)
        held = await tls_connect(address, context)
        await round_trip(held)
        # A broken certificate file: logged, the old certificate stays.
        (pki.directory / "a.pem").write_text("garbage\n")
        await wait_until(lambda: "certificate reload refused" in caplog.text)
        probe = await tls_connect(address, context)
        assert peer_der(probe) == der_of(old)
        await round_trip(probe)
        await probe.aclose()
        # A good new certificate: picked up.
        new = pki.ca.issue_cert("a.test")
        pki.write(new, "a")

        async def serves_new() -> bool:
            client = await tls_connect(address, context)
            try:
                return peer_der(client) == der_of(new)
            finally:
                await client.aclose()

        for _ in range(200):
            if await serves_new():
                break
            await trio.sleep(0.05)
        else:
            raise AssertionError("the watcher did not load the new certificate")
        assert "certificates reloaded" in caplog.text
        await round_trip(held, b"the open connection kept working")
        assert peer_der(held) == der_of(old)
        await held.aclose()


async def wait_for_tls(
    address: tuple[str, int],
    context: ssl.SSLContext,
    process: trio.Process,
) -> TLSStream:
    """The first TLS connection to a starting ``tlsedge run``."""
    with trio.fail_after(15):
        while True:
            try:
                return await tls_connect(address, context)
            except OSError:
                assert process.poll() is None, "tlsedge run exited at start"
                await trio.sleep(0.05)


async def test_sighup_reloads_certificates_in_a_subprocess(
    nursery: trio.Nursery, pki: Pki, tmp_path: Path
) -> None:
    backend = await Backend(echo_backend(Seen())).start(nursery)
    port = free_port()
    entry = pki.entry("a")
    toml = tmp_path / "edge.toml"
    toml.write_text(
        f'[[listeners]]\nname = "in"\nbind = "127.0.0.1:{port}"\nbackend = "b"\n'
        f'[listeners.tls]\ncertificates = [{{ cert = "{entry["cert"]}", '
        f'key = "{entry["key"]}" }}]\n'
        f'[[backends]]\nname = "b"\nservers = ["{backend.address}"]\n'
        'send_proxy = "v2"\n'
    )
    log = tmp_path / "edge.log"
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tlsedge", "run", str(toml)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        address = ("127.0.0.1", port)
        context = client_context(pki)
        held = await wait_for_tls(address, context, process)
        await round_trip(held)
        old = pki.leaves["a"]
        new = pki.ca.issue_cert("a.test")
        # A broken file first: refused, logged, old certificate kept.
        (pki.directory / "a.pem").write_text("garbage\n")
        process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "reload refused" in log.read_text())
        probe = await tls_connect(address, context)
        assert peer_der(probe) == der_of(old)
        await probe.aclose()
        pki.write(new, "a")
        process.send_signal(signal.SIGHUP)
        await wait_until(lambda: "configuration reloaded" in log.read_text())
        probe = await tls_connect(address, context)
        assert serial_of(peer_der(probe)) == serial_of(der_of(new))
        await round_trip(probe)
        await probe.aclose()
        await round_trip(held, b"the open connection survived SIGHUP")
        await held.aclose()
    finally:
        process.terminate()  # SIGTERM: drain, exit 0
        with trio.move_on_after(15):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, log.read_text()


# -- failing handshakes --------------------------------------------------------


async def test_silent_client_hits_the_handshake_timeout(
    nursery: trio.Nursery, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(echo_backend(Seen())).start(nursery)
    config = edge_config(pki, backend, tls={"handshake_timeout": 0.3})
    async with running_edge(config) as edge:
        client = await connect(address_of(edge, "in"))
        started = trio.current_time()
        with trio.fail_after(5):
            assert await read_until_closed(client) == b""
        assert trio.current_time() - started >= 0.25
        (record,) = await wait_access_records(caplog)
    assert record["termination"] == "tls_handshake_timeout"
    assert backend.accepted == 0


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n",
        b"\x16\x03\x01\x00\x05hello-this-is-not-tls",
        b"\x00" * 4096,
    ],
)
async def test_garbage_instead_of_client_hello(
    nursery: trio.Nursery, pki: Pki, caplog: pytest.LogCaptureFixture, garbage: bytes
) -> None:
    backend = await Backend(echo_backend(Seen())).start(nursery)
    async with running_edge(edge_config(pki, backend)) as edge:
        address = address_of(edge, "in")
        client = await connect(address)
        await client.send_all(garbage)
        with trio.fail_after(5):
            answer = await read_until_closed(client)
        assert b"HTTP" not in answer
        (record,) = await wait_access_records(caplog)
        assert record["termination"] == "tls_error"
        assert record["detail"]
        # The edge is fine: the next client is served.
        good = await tls_connect(address, client_context(pki))
        await round_trip(good)
        await good.aclose()
    assert backend.accepted == 1


async def test_client_reset_mid_handshake(
    nursery: trio.Nursery, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(echo_backend(Seen())).start(nursery)
    # A real ClientHello, cut in half.
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello_obj = client_context(pki).wrap_bio(
        incoming, outgoing, server_hostname="a.test"
    )
    with pytest.raises(ssl.SSLWantReadError):
        hello_obj.do_handshake()
    hello = outgoing.read()
    async with running_edge(edge_config(pki, backend)) as edge:
        address = address_of(edge, "in")
        client = await connect(address)
        await client.send_all(hello[: len(hello) // 2])
        await trio.sleep(0.05)  # let the edge read the first half
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()  # SO_LINGER 0: an RST
        (record,) = await wait_access_records(caplog)
        assert record["termination"] == "tls_error"
        good = await tls_connect(address, client_context(pki))
        await round_trip(good)
        await good.aclose()


# -- half-close -----------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
async def test_client_close_notify_reaches_the_backend_as_fin(
    nursery: trio.Nursery, pki: Pki, version: ssl.TLSVersion
) -> None:
    seen = Seen()
    backend = await Backend(collect_then_answer(seen)).start(nursery)
    async with running_edge(edge_config(pki, backend)) as edge:
        client = await tls_connect(
            address_of(edge, "in"), client_context(pki, version=version)
        )
        payload = os.urandom(200_000)
        with trio.fail_after(10):
            await client.send_all(payload)
            await client.send_eof()  # close_notify; we keep reading
            answer = await read_all(client)
        assert answer == b"got 200000 bytes"
        assert not client.ragged_eof  # the edge sent close_notify after it
        await client.aclose()
    assert seen.data == [payload]


@pytest.mark.parametrize("version", VERSIONS)
async def test_backend_fin_reaches_the_client_as_close_notify(
    nursery: trio.Nursery, pki: Pki, version: ssl.TLSVersion
) -> None:
    """The backend closes first; the client reads close_notify (EOF) and can
    still send. Python's SSLObject and OpenSSL do this for TLS 1.2 as well;
    RFC 5246 tells a TLS 1.2 peer to answer close_notify by closing, so most
    TLS 1.2 clients end the connection here instead (see _tls_stream.py)."""
    seen = Seen()
    backend = await Backend(fin_first(seen)).start(nursery)
    async with running_edge(edge_config(pki, backend)) as edge:
        client = await tls_connect(
            address_of(edge, "in"), client_context(pki, version=version)
        )
        with trio.fail_after(10):
            assert await read_all(client) == b"bye"
            assert not client.ragged_eof
            await client.send_all(b"late words")
            await client.send_eof()
            await wait_until(lambda: bool(seen.data))
        await client.aclose()
    assert seen.data == [b"late words"]


async def test_python_ssl_unwrap_half_closes(nursery: trio.Nursery, pki: Pki) -> None:
    seen = Seen()
    backend = await Backend(collect_then_answer(seen)).start(nursery)
    async with running_edge(edge_config(pki, backend)) as edge:
        address = address_of(edge, "in")
        context = client_context(pki, version=TLS13)
        payload = os.urandom(100_000)
        result: list[BaseException | bytes] = []

        def client() -> None:
            with socket.create_connection(address, timeout=10) as raw:
                tls = context.wrap_socket(raw, server_hostname="a.test")
                tls.sendall(payload)
                # SSL_shutdown: our close_notify goes out; the second call waits
                # for the peer's and fails on the application data before it.
                try:
                    tls.unwrap()
                except ssl.SSLError as exc:
                    result.append(exc)
                tls.close()

        await trio.to_thread.run_sync(client)
        await wait_until(lambda: bool(seen.data))
    # The backend got every byte and then EOF: that is what it answered to.
    assert seen.data == [payload]
    (outcome,) = result
    assert isinstance(outcome, ssl.SSLError)
    assert "APPLICATION_DATA_AFTER_CLOSE_NOTIFY" in str(outcome)


# -- bulk ----------------------------------------------------------------------


async def test_sixteen_mib_both_ways(nursery: trio.Nursery, pki: Pki) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    size = 16 * 1024 * 1024
    payload = os.urandom(size)
    async with running_edge(edge_config(pki, backend)) as edge:
        client = await tls_connect(address_of(edge, "in"), client_context(pki))
        received = hashlib.sha256()
        count = 0

        async def reader() -> None:
            nonlocal count
            while chunk := await client.receive_some(1 << 20):
                received.update(chunk)
                count += len(chunk)

        with trio.fail_after(60):
            async with trio.open_nursery() as inner:
                inner.start_soon(reader)
                view = memoryview(payload)
                for start in range(0, size, 1 << 20):
                    await client.send_all(view[start : start + (1 << 20)])
                await client.send_eof()
        await client.aclose()
    assert count == size
    assert received.hexdigest() == hashlib.sha256(payload).hexdigest()
    assert hashlib.sha256(seen.data[0]).digest() == hashlib.sha256(payload).digest()


# -- re-encryption to a TLS backend --------------------------------------------


def tls_backend(
    seen: Seen,
    context: ssl.SSLContext,
    *,
    proxy: bool,
) -> Callable[..., Any]:
    """A TLS server: optional cleartext PROXY header first, then TLS; records
    the SNI and the client certificate's CN, echoes until EOF."""

    def remember_sni(
        obj: ssl.SSLObject | ssl.SSLSocket, name: str | None, ctx: ssl.SSLContext
    ) -> None:
        seen.server_names.append(name)

    context.sni_callback = remember_sni

    async def handler(stream: trio.SocketStream) -> None:
        leftover = b""
        if proxy:
            proxied = await read_proxy_header(stream, policy=Policy.REQUIRE)
            assert proxied.header is not None
            seen.headers.append(proxied.header)
            _, leftover = proxied.detach()
        tls = TLSStream(stream, context, server_side=True, initial_data=leftover)
        await tls.do_handshake()
        der = tls.ssl_object.getpeercert(binary_form=True)
        seen.client_cns.append(
            None
            if der is None
            else str(
                x509.load_der_x509_certificate(der)
                .subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0]
                .value
            )
        )
        received = []
        while data := await tls.receive_some(65536):
            received.append(data)
            await tls.send_all(data)
        seen.data.append(b"".join(received))
        await tls.send_eof()

    return handler


@pytest.mark.parametrize(
    ("options", "ok"),
    [
        pytest.param({"sni": "backend.test"}, True, id="verified"),
        pytest.param({}, True, id="ip-address-san"),
        pytest.param({"sni": "other.test"}, False, id="wrong-name"),
        pytest.param({"sni": "backend.test", "ca": "other"}, False, id="wrong-ca"),
        pytest.param(
            {"sni": "other.test", "ca": "other", "verify": False}, True, id="no-verify"
        ),
    ],
)
@pytest.mark.parametrize("send_proxy", ["v2", "none"])
async def test_reencryption_to_a_tls_backend(  # noqa: PLR0917
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    options: dict[str, Any],
    ok: bool,
    send_proxy: str,
) -> None:
    seen = Seen()
    backend_ca = trustme.CA()
    backend_leaf = backend_ca.issue_cert("backend.test", "127.0.0.1")
    backend_ca_path = pki.directory / "backend-ca.pem"
    backend_ca.cert_pem.write_to_path(str(backend_ca_path))
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    backend_leaf.configure_cert(server_context)
    backend = await Backend(
        tls_backend(seen, server_context, proxy=send_proxy == "v2")
    ).start(nursery)
    ca = pki.ca_path if options.get("ca") == "other" else backend_ca_path
    backend_tls = {**options, "ca": str(ca)}
    config = edge_config(
        pki,
        backend,
        backend_options={
            "protocol": "tls",
            "tls": backend_tls,
            "send_proxy": send_proxy,
        },
    )
    async with running_edge(config) as edge:
        client = await tls_connect(address_of(edge, "in"), client_context(pki))
        if ok:
            await round_trip(client, b"re-encrypted")
            await client.send_eof()
            with trio.fail_after(10):
                assert await read_all(client) == b""
        else:
            with trio.fail_after(10):
                await client.send_all(b"lost")
                assert await read_until_closed(client) == b""
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    if ok:
        assert record["termination"] == "client_closed"
        assert seen.data == [b"re-encrypted"]
        assert seen.server_names == [options.get("sni")]  # an IP is not sent
    else:
        # A failed handshake is a failed connect attempt: retried, counted
        # against the server, and named in the detail.
        assert record["termination"] == "connect_failed"
        assert "certificate verify failed" in record["detail"]
        assert "TLS handshake failed" in record["detail"]
        assert "backend b:" in caplog.text
        assert seen.data == []
    if send_proxy == "v2":
        # The header came in cleartext before the TLS handshake, with the
        # facts of the client's TLS (not of the edge-to-backend TLS); once
        # per connect attempt (a failed handshake is retried).
        header, *retried = seen.headers
        assert len(retried) == (0 if ok else 3)  # retries = 3 by default
        assert all(other == header for other in retried)
        assert header.authority == "a.test"
        assert header.ssl is not None
        assert header.ssl.sig_alg == "ecdsa-with-SHA256"
    else:
        assert seen.headers == []


async def test_mutual_tls_to_the_backend(
    nursery: trio.Nursery, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    seen = Seen()
    backend_ca = trustme.CA()
    backend_leaf = backend_ca.issue_cert("backend.test")
    backend_ca_path = pki.directory / "backend-ca.pem"
    backend_ca.cert_pem.write_to_path(str(backend_ca_path))
    edge_leaf = pki.client_ca.issue_cert("edge.test", common_name="the-edge")
    cert, key = pki.write(edge_leaf, "edge-client")
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    backend_leaf.configure_cert(server_context)
    server_context.verify_mode = ssl.CERT_REQUIRED
    pki.client_ca.configure_trust(server_context)
    backend = await Backend(tls_backend(seen, server_context, proxy=True)).start(
        nursery
    )
    tls = {"ca": str(backend_ca_path), "sni": "backend.test"}
    base = {"protocol": "tls", "send_proxy": "v2"}
    with_cert = edge_config(
        pki,
        backend,
        backend_options={**base, "tls": {**tls, "cert": str(cert), "key": str(key)}},
    )
    async with running_edge(with_cert) as edge:
        client = await tls_connect(address_of(edge, "in"), client_context(pki))
        await round_trip(client, b"mutual")
        await client.aclose()
        await wait_access_records(caplog)
    assert seen.client_cns == ["the-edge"]
    caplog.clear()
    without_cert = edge_config(pki, backend, backend_options={**base, "tls": tls})
    async with running_edge(without_cert) as edge:
        client = await tls_connect(address_of(edge, "in"), client_context(pki))
        with trio.fail_after(10):
            await client.send_all(b"refused")
            assert await read_until_closed(client) == b""
        await client.aclose()
        (record,) = await wait_access_records(caplog)
    # TLS 1.3: the edge's handshake ends before the backend checks; the
    # backend's alert then ends the relay.
    assert record["termination"] in {"connect_failed", "server_error", "server_reset"}
    assert seen.data == [b"mutual"]
