"""The PROXY header tlsedge sends to a backend (``send_proxy``).

Pure: from what the edge knows about a connection to the bytes to send. The
header always describes the real client (after any unwrap) and the address the
client connected to; a LOCAL or UNKNOWN header received from a load balancer
never travels on as an address-less header (Envoy's CVE-2024-23327): the real
socket endpoints stand in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxyproto import TLV, ProxyHeader, SSLClient, SSLInfo, encode_v1, encode_v2

if TYPE_CHECKING:
    from tlsedge._core.downstream import Downstream, SSLFacts

__all__ = ["ConnectionFacts", "build_proxy_header", "proxy_header_for"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionFacts:
    """What the edge knows about a client connection, for the header."""

    client: tuple[str, int]
    destination: tuple[str, int]
    unique_id: bytes | None = None
    authority: str | None = None
    alpn: bytes | None = None
    ssl: SSLInfo | None = None


def build_proxy_header(
    send_proxy: str, tlv_names: tuple[str, ...], facts: ConnectionFacts
) -> bytes:
    """The header bytes for ``send_proxy`` ("v1" or "v2") with the configured TLVs.

    TLVs whose facts are unknown (no TLS, so no SNI, ALPN or SSL details) are
    left out rather than sent empty.
    """
    if send_proxy == "v1":
        return encode_v1(
            ProxyHeader.from_addresses(facts.client, facts.destination, version=1)
        )
    tlvs: list[TLV] = []
    for name in tlv_names:
        if name == "alpn" and facts.alpn:
            tlvs.append(TLV.alpn(facts.alpn))
        elif name == "authority" and facts.authority:
            tlvs.append(TLV.authority(facts.authority))
        elif name == "unique-id" and facts.unique_id is not None:
            tlvs.append(TLV.unique_id(facts.unique_id))
        elif name == "ssl" and facts.ssl is not None:
            tlvs.append(TLV.ssl(facts.ssl))
    header = ProxyHeader.from_addresses(
        facts.client, facts.destination, version=2, tlvs=tuple(tlvs)
    )
    return encode_v2(header, crc32c="crc32c" in tlv_names)


def proxy_header_for(
    downstream: Downstream, send_proxy: str, tlv_names: tuple[str, ...]
) -> bytes | None:
    """The header to send upstream for *downstream*, or None (``send_proxy =
    "none"``, or the client's or destination's address is unknown)."""
    if send_proxy == "none" or downstream.client is None:
        return None
    if downstream.destination is None:
        return None
    facts = _facts(downstream.client, downstream.destination, downstream, tlv_names)
    return build_proxy_header(send_proxy, tlv_names, facts)


def _facts(
    client: tuple[str, int],
    destination: tuple[str, int],
    downstream: Downstream,
    tlv_names: tuple[str, ...],
) -> ConnectionFacts:
    unique_id = downstream.id.encode()
    tls = downstream.tls
    if tls is None:
        return ConnectionFacts(
            client=client, destination=destination, unique_id=unique_id
        )
    return ConnectionFacts(
        client=client,
        destination=destination,
        unique_id=unique_id,
        authority=tls.server_name,
        alpn=tls.alpn.encode() if tls.alpn else None,
        ssl=_ssl_info(tls, tlv_names),
    )


def _ssl_info(tls: SSLFacts, tlv_names: tuple[str, ...]) -> SSLInfo:
    flags = SSLClient.SSL
    if tls.client_cert_der is not None:
        flags |= SSLClient.CERT_CONN | SSLClient.CERT_SESS
    return SSLInfo(
        client=flags,
        verify=0 if tls.verified else 1,
        version=tls.version,
        cn=tls.client_cn,
        cipher=tls.cipher,
        sig_alg=tls.sig_alg,
        key_alg=tls.key_alg,
        group=tls.group,
        sig_scheme=tls.sig_scheme,
        client_cert=tls.client_cert_der if "ssl-client-cert" in tlv_names else None,
    )
