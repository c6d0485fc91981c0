"""The PROXY header tlsedge sends to a backend (``send_proxy``).

Pure: from what the edge knows about a connection to the bytes to send. The
header always describes the real client (after any unwrap) and the address the
client connected to; a LOCAL or UNKNOWN header received from a load balancer
never travels on as an address-less header (Envoy's CVE-2024-23327): the real
socket endpoints stand in.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxyproto import TLV, ProxyHeader, SSLInfo, encode_v1, encode_v2

__all__ = ["ConnectionFacts", "build_proxy_header"]


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
