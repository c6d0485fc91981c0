"""The PROXY header the edge sends upstream, from a connection's facts."""

from __future__ import annotations

import pytest

from proxyproto import SSLClient, parse
from tlsedge._core.downstream import Downstream, SSLFacts
from tlsedge._core.proxy_wrap import proxy_header_for

TLVS = ("alpn", "authority", "ssl", "unique-id", "crc32c")


def downstream(**overrides: object) -> Downstream:
    fields: dict[str, object] = {
        "id": "0123456789abcdef",
        "listener": "in",
        "peer": ("10.0.0.2", 5000),
        "client": ("203.0.113.7", 40000),
        "destination": ("198.51.100.1", 443),
    }
    fields.update(overrides)
    return Downstream(**fields)  # type: ignore[arg-type]


def tls_facts(client_cert: bytes | None = None) -> SSLFacts:
    return SSLFacts(
        version="TLSv1.3",
        cipher="TLS_AES_256_GCM_SHA384",
        alpn="http/1.1",
        server_name="a.test",
        client_cert_der=client_cert,
        client_cn="client-one" if client_cert else None,
        verified=client_cert is not None,
        sig_alg="ecdsa-with-SHA256",
        key_alg="EC256",
        group=None,
        sig_scheme=None,
    )


@pytest.mark.parametrize(
    "facts",
    [
        {"client": None},
        {"destination": None},
    ],
)
def test_no_header_without_both_addresses(facts: dict[str, object]) -> None:
    assert proxy_header_for(downstream(**facts), "v2", TLVS) is None


def test_no_header_when_not_asked() -> None:
    assert proxy_header_for(downstream(), "none", TLVS) is None


def test_v1_names_the_real_client() -> None:
    data = proxy_header_for(downstream(), "v1", TLVS)
    assert data == b"PROXY TCP4 203.0.113.7 198.51.100.1 40000 443\r\n"


def test_v2_carries_the_client_tls_facts() -> None:
    data = proxy_header_for(downstream(tls=tls_facts(b"DER")), "v2", TLVS)
    assert data is not None
    header, consumed = parse(data)
    assert consumed == len(data)
    assert header.unique_id == b"0123456789abcdef"
    assert header.authority == "a.test"
    assert header.alpn == b"http/1.1"
    assert header.crc32c is not None
    assert header.ssl is not None
    assert (
        header.ssl.client == SSLClient.SSL | SSLClient.CERT_CONN | SSLClient.CERT_SESS
    )
    assert header.ssl.verify == 0
    assert header.ssl.cn == "client-one"
    assert header.ssl.client_cert is None  # only with "ssl-client-cert"


def test_v2_without_tls_has_no_tls_tlvs() -> None:
    data = proxy_header_for(downstream(), "v2", TLVS)
    assert data is not None
    header, _ = parse(data)
    assert header.ssl is None
    assert header.authority is None
    assert header.unique_id == b"0123456789abcdef"
