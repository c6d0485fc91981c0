"""TLS through the edge with real peers: openssl s_client, curl, and HAProxy
terminating TLS (``send-proxy-v2-ssl-cn``) as the reference for the SSL TLV."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.peers import free_port, haproxy, require
from tests.tlsedge.e2e.test_tls_edge import (
    Pki,
    Seen,
    client_context,
    der_of,
    describe_ssl,
    echo_backend,
    edge_config,
    peer_der,
    round_trip,
    tls_connect,
)
from tests.tlsedge.helpers import (
    Backend,
    address_of,
    close_clients,
    running_edge,
    wait_access_records,
    wait_until,
)

pytestmark = pytest.mark.peers


@pytest.fixture(autouse=True)
def _access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tlsedge")


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    await close_clients()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


async def run(argv: list[str], stdin: bytes = b"") -> tuple[int, str]:
    """Run a peer program; returns its exit status and stdout + stderr."""
    with trio.fail_after(30):
        result = await trio.run_process(
            argv,
            stdin=stdin,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    return result.returncode, (result.stdout + result.stderr).decode(errors="replace")


async def s_client(
    pki: Pki, port: int, *args: str, stdin: bytes = b""
) -> tuple[int, str]:
    openssl = require("openssl")
    return await run(
        [
            openssl,
            "s_client",
            "-connect",
            f"127.0.0.1:{port}",
            "-CAfile",
            str(pki.ca_path),
            "-verify_return_error",
            *args,
        ],
        stdin,
    )


def served_pem(output: str) -> str:
    match = re.search(
        r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----\n", output, re.DOTALL
    )
    assert match is not None, output
    return match.group(0)


# -- openssl s_client ---------------------------------------------------------


@pytest.mark.parametrize(
    ("server_name", "served"),
    [("a.test", "a"), ("b.wild.test", "wild"), ("elsewhere.test", "default")],
)
async def test_openssl_sni(
    nursery: trio.Nursery, pki: Pki, server_name: str, served: str
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    async with running_edge(edge_config(pki, backend)) as edge:
        _, port = address_of(edge, "in")
        status, output = await s_client(
            pki, port, "-servername", server_name, stdin=b"hello\n"
        )
        await wait_until(lambda: bool(seen.headers))
    assert status == 0, output
    assert served_pem(output) == pki.leaves[served].cert_chain_pems[0].bytes().decode()
    assert seen.headers[0].authority == server_name


@pytest.mark.parametrize(
    ("version_flag", "version", "cipher"),
    [
        ("-tls1_3", "TLSv1.3", "TLS_AES_256_GCM_SHA384"),
        ("-tls1_2", "TLSv1.2", "ECDHE-ECDSA-AES128-GCM-SHA256"),
    ],
)
async def test_openssl_versions_and_alpn(
    nursery: trio.Nursery, pki: Pki, version_flag: str, version: str, cipher: str
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    config = edge_config(pki, backend, tls={"alpn": ["h2", "http/1.1"]})
    async with running_edge(config) as edge:
        _, port = address_of(edge, "in")
        status, output = await s_client(
            pki, port, version_flag, "-servername", "a.test", "-alpn", "http/1.1,h2"
        )
        await wait_until(lambda: bool(seen.headers))
    assert status == 0, output
    assert "ALPN protocol: h2" in output
    assert f"New, {version}, Cipher is {cipher}" in output
    (header,) = seen.headers
    assert header.alpn == b"h2"
    assert header.ssl is not None
    assert header.ssl.version == version
    assert header.ssl.cipher == cipher


@pytest.mark.parametrize(
    ("policy", "args", "refusal"),
    [
        ("intermediate", ["-tls1_1", "-cipher", "DEFAULT@SECLEVEL=0"], "version"),
        ("intermediate", ["-tls1_2", "-cipher", "AES128-SHA"], "handshake failure"),
        ("modern", ["-tls1_2"], "version"),
    ],
)
async def test_openssl_policy_refusals(  # noqa: PLR0917
    nursery: trio.Nursery,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    policy: str,
    args: list[str],
    refusal: str,
) -> None:
    backend = await Backend(echo_backend(Seen())).start(nursery)
    config = edge_config(pki, backend, tls={"policy": policy})
    async with running_edge(config) as edge:
        _, port = address_of(edge, "in")
        status, output = await s_client(pki, port, "-servername", "a.test", *args)
        (record,) = await wait_access_records(caplog)
        # The same client without the restriction is served.
        ok_status, ok_output = await s_client(pki, port, "-servername", "a.test")
    assert status != 0, output
    assert refusal in output.lower(), output
    assert record["termination"] == "tls_error"
    assert ok_status == 0, ok_output
    assert backend.accepted == 1


async def test_openssl_strict_sni_alert(
    nursery: trio.Nursery, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await Backend(echo_backend(Seen())).start(nursery)
    config = edge_config(pki, backend, tls={"strict_sni": True})
    async with running_edge(config) as edge:
        _, port = address_of(edge, "in")
        status, output = await s_client(pki, port, "-servername", "nope.test")
        await wait_access_records(caplog)
    assert status != 0
    assert "unrecognized name" in output, output
    assert backend.accepted == 0


@pytest.mark.parametrize("present", [True, False])
async def test_openssl_client_certificate(
    nursery: trio.Nursery, pki: Pki, present: bool
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    config = edge_config(
        pki,
        backend,
        tls={"client_auth": "required", "client_ca": str(pki.client_ca_path)},
    )
    cert, key = pki.client_files
    # -ign_eof: wait for the server's answer (TLS 1.3: the refusal comes
    # after the client's side of the handshake is done).
    args = ["-servername", "a.test"]
    if present:
        args += ["-cert", str(cert), "-key", str(key)]
    else:
        args += ["-ign_eof"]
    async with running_edge(config) as edge:
        _, port = address_of(edge, "in")
        status, output = await s_client(pki, port, *args, stdin=b"ping\n")
        if present:
            await wait_until(lambda: bool(seen.headers))
    if present:
        assert status == 0, output
        info = seen.headers[0].ssl
        assert info is not None
        assert (info.cn, info.verify, int(info.client)) == ("client-one", 0, 0x07)
    else:
        assert "certificate required" in output, output
        assert backend.accepted == 0


# -- curl ---------------------------------------------------------------------


async def curl(pki: Pki, port: int, *args: str) -> tuple[int, str]:
    binary = require("curl")
    return await run(
        [
            binary,
            "-sS",
            "--max-time",
            "20",
            "--cacert",
            str(pki.ca_path),
            "--resolve",
            f"a.test:{port}:127.0.0.1",
            *args,
            f"https://a.test:{port}/",
        ]
    )


@pytest.mark.parametrize("with_cert", [False, True])
async def test_curl_https_shows_the_backend_every_ssl_field(
    nursery: trio.Nursery, pki: Pki, with_cert: bool
) -> None:
    backend = await Backend(echo_backend(Seen())).start(nursery)
    tls: dict[str, Any] = {}
    args: list[str] = []
    if with_cert:
        tls = {"client_auth": "optional", "client_ca": str(pki.client_ca_path)}
        cert, key = pki.client_files
        args = ["--cert", str(cert), "--key", str(key)]
    async with running_edge(edge_config(pki, backend, tls=tls)) as edge:
        _, port = address_of(edge, "in")
        status, output = await curl(pki, port, *args)
    assert status == 0, output
    facts = json.loads(output)
    assert facts == {
        "alpn": "http/1.1",
        "authority": "a.test",
        "crc32c": True,
        "unique_id": True,
        "ssl": {
            "client": 0x07 if with_cert else 0x01,
            "verify": 0 if with_cert else 1,
            "version": "TLSv1.3",
            "cipher": "TLS_AES_256_GCM_SHA384",
            "cn": "client-one" if with_cert else None,
            "sig_alg": "ecdsa-with-SHA256",
            "key_alg": "EC256",
            "client_cert": False,
        },
    }


async def test_curl_haproxy_protocol_then_tls(
    nursery: trio.Nursery, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    seen = Seen()
    backend = await Backend(echo_backend(seen)).start(nursery)
    config = edge_config(
        pki, backend, listener={"proxy_protocol": {"trusted": ["127.0.0.1/32"]}}
    )
    async with running_edge(config) as edge:
        _, port = address_of(edge, "in")
        status, output = await curl(pki, port, "--haproxy-protocol")
        (record,) = await wait_access_records(caplog)
        # Without the header the same listener refuses (PROXY is required).
        refused, _ = await curl(pki, port)
    assert status == 0, output
    assert json.loads(output)["authority"] == "a.test"
    (header,) = seen.headers
    assert header.source is not None
    # curl's PROXY v1 header named its own address; the edge passed it on.
    assert record["client"] == f"127.0.0.1:{header.source.port}"  # type: ignore[union-attr]
    assert record["tls"] == "TLSv1.3 TLS_AES_256_GCM_SHA384"
    assert refused != 0


# -- HAProxy as the reference for the SSL TLV ---------------------------------


async def test_ssl_tlv_shape_matches_haproxy(
    nursery: trio.Nursery, pki: Pki, tmp_path: Path
) -> None:
    """HAProxy 2.6 terminating TLS with a client certificate, in front of the
    same proxyproto backend, next to tlsedge: the SSL TLV must agree."""
    seen_haproxy, seen_edge = Seen(), Seen()
    via_haproxy = await Backend(echo_backend(seen_haproxy)).start(nursery)
    via_edge = await Backend(echo_backend(seen_edge)).start(nursery)
    crt = tmp_path / "haproxy-a.pem"
    leaf = pki.leaves["a"]
    crt.write_bytes(
        b"".join(b.bytes() for b in leaf.cert_chain_pems) + leaf.private_key_pem.bytes()
    )
    front = free_port()
    haproxy_config = (
        f"frontend fe\n    bind 127.0.0.1:{front} ssl crt {crt} "
        f"ca-file {pki.client_ca_path} verify required alpn h2,http/1.1\n"
        "    default_backend be\n"
        f"backend be\n    server s1 {via_haproxy.address} send-proxy-v2-ssl-cn "
        "proxy-v2-options ssl-cipher,cert-sig,cert-key,authority,crc32c,unique-id\n"
    )
    config = edge_config(
        pki,
        via_edge,
        tls={
            "client_auth": "required",
            "client_ca": str(pki.client_ca_path),
            "alpn": ["h2", "http/1.1"],
        },
    )
    context = client_context(pki, cert=pki.client, alpn=["h2", "http/1.1"])
    with haproxy(haproxy_config, [front]):
        for address in [("127.0.0.1", front)]:
            client = await tls_connect(address, context, "a.test")
            assert peer_der(client) == der_of(leaf)
            await round_trip(client)
            await client.aclose()
    async with running_edge(config) as edge:
        client = await tls_connect(address_of(edge, "in"), context, "a.test")
        await round_trip(client)
        await client.aclose()
    (reference,) = seen_haproxy.headers
    (ours,) = seen_edge.headers
    theirs, mine = describe_ssl(reference), describe_ssl(ours)
    # HAProxy's unique-id is empty without a unique-id-format; ours is the
    # connection id of the access log.
    assert reference.unique_id == b""
    assert ours.unique_id
    # The one difference: SIG_ALG of an ECDSA-signed certificate. HAProxy sends
    # Both use OpenSSL's short name (OBJ_nid2sn).
    assert theirs["ssl"]["sig_alg"] == mine["ssl"]["sig_alg"] == "ecdsa-with-SHA256"
    theirs["ssl"]["sig_alg"] = mine["ssl"]["sig_alg"]
    assert mine == theirs, f"haproxy: {theirs}\ntlsedge: {mine}"
    # The same TLV types; the order differs and does not matter (HAProxy puts
    # CRC32C first and SSL last; tlsedge follows proxy_tlvs' order, CRC32C last).
    assert [t.type for t in reference.tlvs] == [0x03, 0x01, 0x02, 0x05, 0x20]
    assert [t.type for t in ours.tlvs] == [0x01, 0x02, 0x20, 0x05, 0x03]
