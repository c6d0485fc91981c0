"""Tests for tlsedge._tls.contexts: policies, SNI selection, client auth, reload, facts.

Handshakes run two ways: in memory (a client and a server ``SSLObject`` joined
by ``MemoryBIO`` pairs) and over loopback against a blocking ``ssl`` server in a
thread, with ``openssl s_client`` and Python clients.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import socket
import ssl
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from cryptography import x509

from tests.peers import require
from tlsedge._core.config import (
    TLS_POLICIES,
    BackendTlsConfig,
    CertificateConfig,
    TlsConfig,
)
from tlsedge._core.downstream import SSLFacts
from tlsedge._tls.certs import CertificateError, make_dev_certificates
from tlsedge._tls.contexts import (
    POLICIES,
    ServerTLS,
    backend_server_hostname,
    build_client_context,
    build_server_contexts,
    ssl_facts,
    watch_certificates,
)

RSA = trustme.KeyType.RSA
ECDSA = trustme.KeyType.ECDSA


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def other_ca() -> trustme.CA:
    return trustme.CA()


def write_cert(
    directory: Path, issued: trustme.LeafCert, name: str
) -> CertificateConfig:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    issued.cert_chain_pems[0].write_to_path(cert)
    for pem in issued.cert_chain_pems[1:]:
        pem.write_to_path(cert, append=True)
    issued.private_key_pem.write_to_path(key)
    return CertificateConfig(cert=cert, key=key)


def serial_of(issued: trustme.LeafCert) -> int:
    return x509.load_pem_x509_certificate(
        issued.cert_chain_pems[0].bytes()
    ).serial_number


def client_context(
    ca: trustme.CA | None = None,
    *,
    alpn: Sequence[str] = (),
    cert: trustme.LeafCert | None = None,
) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        ca.configure_trust(context)
    if alpn:
        context.set_alpn_protocols(list(alpn))
    if cert is not None:
        cert.configure_cert(context)
    return context


class HandshakeFailed(Exception):
    def __init__(
        self, server: ssl.SSLError | None, client: ssl.SSLError | None
    ) -> None:
        super().__init__(f"server: {server!r}, client: {client!r}")
        self.server = server
        self.client = client


def start(
    server_context: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    server_hostname: str | None = None,
) -> tuple[ssl.SSLObject, ssl.SSLObject, list[ssl.MemoryBIO]]:
    bios = [ssl.MemoryBIO() for _ in range(4)]
    client = client_ctx.wrap_bio(bios[0], bios[1], server_hostname=server_hostname)
    server = server_context.wrap_bio(bios[2], bios[3], server_side=True)
    return client, server, bios


def finish(
    client: ssl.SSLObject, server: ssl.SSLObject, bios: list[ssl.MemoryBIO]
) -> None:
    """Drive both sides until done; HandshakeFailed carries both sides' errors."""
    c_in, c_out, s_in, s_out = bios
    sides = (("client", client, c_out, s_in), ("server", server, s_out, c_in))
    done = {"client": False, "server": False}
    errors: dict[str, ssl.SSLError | None] = {"client": None, "server": None}

    def step(side: str, obj: ssl.SSLObject) -> None:
        try:
            if done[side]:
                # TLS 1.3: the server checks the client's certificate after the
                # client considers the handshake done; reading shows the alert.
                obj.read(1)
            else:
                obj.do_handshake()
                done[side] = True
        except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
            pass
        except ssl.SSLError as exc:
            errors[side] = exc

    for _ in range(20):
        for side, obj, out_bio, peer_in in sides:
            if errors[side] is None:
                step(side, obj)
            peer_in.write(out_bio.read())
        if errors["client"] or errors["server"]:
            for side, obj, out_bio, peer_in in sides:  # let the other side see it
                if errors[side] is None:
                    step(side, obj)
                peer_in.write(out_bio.read())
            raise HandshakeFailed(errors["server"], errors["client"])
        if all(done.values()):
            step("client", client)  # a late alert from the server (TLS 1.3)
            if errors["client"]:
                raise HandshakeFailed(None, errors["client"])
            return
    raise AssertionError("handshake did not finish")


def handshake(
    server_context: ssl.SSLContext,
    client_ctx: ssl.SSLContext,
    server_hostname: str | None = None,
) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    client, server, bios = start(server_context, client_ctx, server_hostname)
    finish(client, server, bios)
    return client, server


def peer_serial(client: ssl.SSLObject | ssl.SSLSocket) -> int:
    der = client.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


@pytest.fixture
def sites(tmp_path: Path, ca: trustme.CA) -> dict[str, trustme.LeafCert]:
    """Three certificate groups: default (first), exact names, a wildcard."""
    return {
        "default": ca.issue_cert("default.example"),
        "exact": ca.issue_cert("a.example", "B.example"),
        "wild": ca.issue_cert("*.w.example"),
    }


def sites_config(
    tmp_path: Path, sites: dict[str, trustme.LeafCert], **kw: Any
) -> TlsConfig:
    certs = tuple(write_cert(tmp_path, issued, key) for key, issued in sites.items())
    return TlsConfig(certificates=certs, **kw)


# --- policies -------------------------------------------------------------------


def test_policy_table_matches_config() -> None:
    assert tuple(POLICIES) == TLS_POLICIES
    assert POLICIES["modern"].minimum_version == ssl.TLSVersion.TLSv1_3
    assert POLICIES["modern"].ciphers == ()
    intermediate = POLICIES["intermediate"]
    assert intermediate.minimum_version == ssl.TLSVersion.TLSv1_2
    assert intermediate.maximum_version == ssl.TLSVersion.TLSv1_3
    assert all(c.startswith("ECDHE-") for c in intermediate.ciphers)
    assert all("GCM" in c or "CHACHA20" in c for c in intermediate.ciphers)
    assert POLICIES["ELBSecurityPolicy-TLS-1-2-2017-01"].maximum_version == (
        ssl.TLSVersion.TLSv1_2
    )
    old = POLICIES["ELBSecurityPolicy-2016-08"]
    assert old.minimum_version == ssl.TLSVersion.TLSv1
    assert old.cipher_string.endswith(":@SECLEVEL=0")


@pytest.mark.parametrize("policy", TLS_POLICIES)
def test_policy_cipher_names_are_openssl_names(policy: str) -> None:
    info = POLICIES[policy]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if not info.cipher_string:  # TLS 1.3 only: the TLS 1.2 list is unused
        assert info.minimum_version == ssl.TLSVersion.TLSv1_3
        return
    context.set_ciphers(info.cipher_string)
    names = [
        c["name"] for c in context.get_ciphers() if not c["name"].startswith("TLS_")
    ]
    assert names == list(info.ciphers)  # every name known, order kept


def test_server_context_options(
    tmp_path: Path, sites: dict[str, trustme.LeafCert]
) -> None:
    server_tls = build_server_contexts(sites_config(tmp_path, sites))
    context = server_tls.context
    for option in (
        ssl.OP_NO_COMPRESSION,
        ssl.OP_NO_RENEGOTIATION,
        ssl.OP_CIPHER_SERVER_PREFERENCE,
    ):
        assert option in context.options
    assert ssl.OP_NO_TICKET not in context.options
    assert context.num_tickets == 2
    assert context.verify_mode == ssl.CERT_NONE
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.sni_callback is not None


# --- SNI selection (in memory) --------------------------------------------------


@pytest.mark.parametrize(
    ("sni", "expected"),
    [
        ("a.example", "exact"),
        ("b.example", "exact"),  # SANs are matched case-insensitively
        ("A.EXAMPLE", "exact"),
        ("a.example.", "exact"),
        ("x.w.example", "wild"),
        ("x.y.w.example", "default"),  # a wildcard matches exactly one label
        ("w.example", "default"),
        ("default.example", "default"),
        ("unknown.example", "default"),
        (None, "default"),
    ],
)
def test_sni_selection(
    tmp_path: Path,
    ca: trustme.CA,
    sites: dict[str, trustme.LeafCert],
    sni: str | None,
    expected: str,
) -> None:
    server_tls = build_server_contexts(sites_config(tmp_path, sites))
    client, server = handshake(server_tls.context, client_context(), sni)
    assert peer_serial(client) == serial_of(sites[expected])
    assert server_tls.server_name(server) == sni
    assert server_tls.certificate_for(server).serial_number == serial_of(
        sites[expected]
    )
    assert server_tls.server_name(client) is None  # not one of ours


def test_first_certificate_for_a_name_wins(tmp_path: Path, ca: trustme.CA) -> None:
    first, second = ca.issue_cert("dup.example"), ca.issue_cert("*.example")
    third = ca.issue_cert("dup.example", "other.example")
    config = TlsConfig(
        certificates=(
            write_cert(tmp_path, first, "1"),
            write_cert(tmp_path, second, "2"),
            write_cert(tmp_path, third, "3"),
        )
    )
    server_tls = build_server_contexts(config)
    client, _ = handshake(server_tls.context, client_context(), "dup.example")
    assert peer_serial(client) == serial_of(first)
    client, _ = handshake(server_tls.context, client_context(), "other.example")
    assert peer_serial(client) == serial_of(third)
    client, _ = handshake(server_tls.context, client_context(), "x.example")
    assert peer_serial(client) == serial_of(second)


@pytest.mark.parametrize("sni", ["unknown.example", "x.y.w.example", None])
def test_strict_sni_refuses(
    tmp_path: Path, sites: dict[str, trustme.LeafCert], sni: str | None
) -> None:
    server_tls = build_server_contexts(sites_config(tmp_path, sites, strict_sni=True))
    with pytest.raises(HandshakeFailed) as info:
        handshake(server_tls.context, client_context(), sni)
    assert info.value.client is not None
    assert "UNRECOGNIZED_NAME" in str(info.value.client)
    # Known names still work.
    client, _ = handshake(server_tls.context, client_context(), "x.w.example")
    assert peer_serial(client) == serial_of(sites["wild"])


def test_verified_by_python_client(
    tmp_path: Path, ca: trustme.CA, sites: dict[str, trustme.LeafCert]
) -> None:
    server_tls = build_server_contexts(sites_config(tmp_path, sites))
    client, _ = handshake(server_tls.context, client_context(ca), "x.w.example")
    assert client.version() == "TLSv1.3"


def test_two_certificates_of_one_key_type_for_same_names(
    tmp_path: Path, ca: trustme.CA
) -> None:
    config = TlsConfig(
        certificates=(
            write_cert(tmp_path, ca.issue_cert("a.example"), "1"),
            write_cert(tmp_path, ca.issue_cert("a.example"), "2"),
        )
    )
    with pytest.raises(CertificateError, match="two EC certificates for the same"):
        build_server_contexts(config)


# --- ALPN -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server", "client", "expected"),
    [
        (("http/1.1",), ("h2", "http/1.1"), "http/1.1"),
        (("h2", "http/1.1"), ("http/1.1", "h2"), "h2"),  # server preference
        (("h2", "http/1.1"), (), None),
        ((), ("h2",), None),
    ],
)
def test_alpn(
    tmp_path: Path,
    sites: dict[str, trustme.LeafCert],
    server: tuple[str, ...],
    client: tuple[str, ...],
    expected: str | None,
) -> None:
    server_tls = build_server_contexts(sites_config(tmp_path, sites, alpn=server))
    for sni in ("a.example", "x.w.example", None):  # every group's context
        client_obj, server_obj = handshake(
            server_tls.context, client_context(alpn=client), sni
        )
        assert server_obj.selected_alpn_protocol() == expected
        assert client_obj.selected_alpn_protocol() == expected


def test_alpn_without_overlap_continues_without_alpn(
    tmp_path: Path, sites: dict[str, trustme.LeafCert]
) -> None:
    # Python's ALPN callback answers "no overlap" with SSL_TLSEXT_ERR_NOACK: the
    # handshake goes on without ALPN rather than failing (see docs/tls.md).
    server_tls = build_server_contexts(sites_config(tmp_path, sites, alpn=("h2",)))
    client, server = handshake(
        server_tls.context, client_context(alpn=["http/1.1"]), "a.example"
    )
    assert client.selected_alpn_protocol() is None
    assert ssl_facts(server, server_tls).alpn is None


# --- client authentication --------------------------------------------------------


@pytest.fixture
def client_auth_setup(
    tmp_path: Path, ca: trustme.CA, other_ca: trustme.CA
) -> dict[str, Any]:
    client_ca = tmp_path / "clients-ca.pem"
    ca.cert_pem.write_to_path(client_ca)
    return {
        "server": write_cert(tmp_path, ca.issue_cert("a.example"), "server"),
        "client_ca": client_ca,
        "good": ca.issue_cert("alice@example", common_name="alice"),
        "wrong": other_ca.issue_cert("mallory@example", common_name="mallory"),
    }


@pytest.mark.parametrize("version", ["TLSv1_2", "TLSv1_3"])
@pytest.mark.parametrize(
    ("mode", "cert", "outcome"),
    [
        ("none", None, "anonymous"),
        ("none", "good", "anonymous"),  # not asked: not sent
        ("optional", None, "anonymous"),
        ("optional", "good", "verified"),
        ("optional", "wrong", "refused"),
        ("required", None, "refused"),
        ("required", "good", "verified"),
        ("required", "wrong", "refused"),
    ],
)
def test_client_auth(
    client_auth_setup: dict[str, Any],
    mode: str,
    cert: str | None,
    outcome: str,
    version: str,
) -> None:
    setup = client_auth_setup
    config = TlsConfig(
        certificates=(setup["server"],),
        client_auth=mode,  # type: ignore[arg-type]
        client_ca=setup["client_ca"] if mode != "none" else None,
    )
    server_tls = build_server_contexts(config)
    client_ctx = client_context(cert=setup[cert] if cert else None)
    client_ctx.maximum_version = ssl.TLSVersion[version]
    if outcome == "refused":
        with pytest.raises(HandshakeFailed) as info:
            handshake(server_tls.context, client_ctx, "a.example")
        assert info.value.server is not None
        return
    _, server = handshake(server_tls.context, client_ctx, "a.example")
    facts = ssl_facts(server, server_tls)
    if outcome == "verified":
        assert facts.verified
        assert facts.client_cn == "alice"
        assert facts.client_cert_der == setup["good"].cert_chain_pems[0].bytes() or (
            facts.client_cert_der is not None
            and x509.load_der_x509_certificate(facts.client_cert_der).serial_number
            == serial_of(setup["good"])
        )
    else:
        assert not facts.verified
        assert facts.client_cn is None
        assert facts.client_cert_der is None


def test_client_auth_bad_ca_file(tmp_path: Path, ca: trustme.CA) -> None:
    bad = tmp_path / "bad-ca.pem"
    bad.write_text("not a certificate\n")
    config = TlsConfig(
        certificates=(write_cert(tmp_path, ca.issue_cert("a.example"), "s"),),
        client_auth="required",
        client_ca=bad,
    )
    with pytest.raises(CertificateError, match=r"bad-ca\.pem: invalid client CA"):
        build_server_contexts(config)
    config = replace(config, client_ca=tmp_path / "missing.pem")
    with pytest.raises(CertificateError, match=r"missing\.pem: cannot read"):
        build_server_contexts(config)


# --- ssl_facts ----------------------------------------------------------------------


def test_ssl_facts(tmp_path: Path, ca: trustme.CA) -> None:
    root = trustme.CA(key_type=RSA)
    config = TlsConfig(
        certificates=(
            write_cert(tmp_path, root.issue_cert("a.example", key_type=RSA), "r"),
        ),
        alpn=("h2", "http/1.1"),
    )
    server_tls = build_server_contexts(config)
    client, server, bios = start(
        server_tls.context, client_context(alpn=["h2"]), "a.example"
    )
    with pytest.raises(ValueError, match="not completed"):
        ssl_facts(server, server_tls)
    finish(client, server, bios)
    facts = ssl_facts(server, server_tls)
    assert facts == SSLFacts(
        version="TLSv1.3",
        cipher="TLS_AES_256_GCM_SHA384",
        alpn="h2",
        server_name="a.example",
        client_cert_der=None,
        client_cn=None,
        verified=False,
        sig_alg="RSA-SHA256",
        key_alg="RSA2048",
        group=None,
        sig_scheme=None,
    )
    # Nothing on this Python's SSLObject names the group or signature scheme.
    assert not [
        name
        for name in dir(server)
        if any(word in name.lower() for word in ("group", "sigalg", "curve"))
    ]


# --- reload and the watcher ---------------------------------------------------------


def test_reload_swaps_certificates(tmp_path: Path, ca: trustme.CA) -> None:
    first = ca.issue_cert("a.example")
    config = TlsConfig(certificates=(write_cert(tmp_path, first, "site"),))
    server_tls = build_server_contexts(config)
    old_context = server_tls.context

    # A handshake in flight: the server has answered the ClientHello.
    inflight_client, inflight_server, bios = start(
        old_context, client_context(), "a.example"
    )
    with contextlib.suppress(ssl.SSLWantReadError):
        inflight_client.do_handshake()
    bios[2].write(bios[1].read())
    with contextlib.suppress(ssl.SSLWantReadError):
        inflight_server.do_handshake()

    second = ca.issue_cert("a.example")
    write_cert(tmp_path, second, "site")
    (loaded,) = server_tls.reload()
    assert loaded.serial_number == serial_of(second)
    assert server_tls.context is not old_context

    client, server = handshake(server_tls.context, client_context(), "a.example")
    assert peer_serial(client) == serial_of(second)
    assert server_tls.certificate_for(server).serial_number == serial_of(second)

    finish(inflight_client, inflight_server, bios)
    assert peer_serial(inflight_client) == serial_of(first)
    assert server_tls.certificate_for(inflight_server).serial_number == serial_of(first)
    assert server_tls.server_name(inflight_server) == "a.example"


def test_reload_refuses_bad_files_and_keeps_old(tmp_path: Path, ca: trustme.CA) -> None:
    first = ca.issue_cert("a.example")
    site = write_cert(tmp_path, first, "site")
    server_tls = build_server_contexts(TlsConfig(certificates=(site,)))
    context = server_tls.context
    # A new certificate with the old key: the pair no longer matches.
    ca.issue_cert("a.example").cert_chain_pems[0].write_to_path(site.cert)
    with pytest.raises(CertificateError, match="does not match"):
        server_tls.reload()
    assert server_tls.context is context
    client, _ = handshake(server_tls.context, client_context(), "a.example")
    assert peer_serial(client) == serial_of(first)


async def test_watch_certificates(
    tmp_path: Path, ca: trustme.CA, caplog: pytest.LogCaptureFixture
) -> None:
    site = write_cert(tmp_path, ca.issue_cert("a.example"), "site")
    server_tls = build_server_contexts(TlsConfig(certificates=(site,)))
    caplog.set_level(logging.INFO, logger="tlsedge.tls")

    async def wait_for(predicate: Any) -> None:
        with trio.fail_after(1.5):
            while not predicate():  # noqa: ASYNC110 - state changed by a thread
                await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_certificates, server_tls, 0.05)
        await trio.sleep(0.1)
        second = ca.issue_cert("a.example", "new.example")
        write_cert(tmp_path, second, "site")
        await wait_for(
            lambda: server_tls.certificates[0].serial_number == serial_of(second)
        )
        await wait_for(lambda: "certificates reloaded" in caplog.text)
        assert "new.example" in caplog.text

        site.key.write_text("garbage\n")
        await wait_for(lambda: "certificate reload refused" in caplog.text)
        assert "invalid PEM private key" in caplog.text
        assert server_tls.certificates[0].serial_number == serial_of(second)
        nursery.cancel_scope.cancel()


# --- make_dev_certificates in a handshake --------------------------------------------


def test_dev_certificates_work(tmp_path: Path) -> None:
    files = make_dev_certificates(
        tmp_path, names=["localhost", "127.0.0.1"], client_cn="bob"
    )
    assert files.client_cert is not None
    assert files.client_key is not None
    config = TlsConfig(
        certificates=(CertificateConfig(cert=files.cert, key=files.key),),
        client_auth="required",
        client_ca=files.ca_cert,
    )
    server_tls = build_server_contexts(config)
    client_ctx = ssl.create_default_context(cafile=str(files.ca_cert))
    client_ctx.load_cert_chain(files.client_cert, files.client_key)
    for hostname in ("localhost", "127.0.0.1"):
        _, server = handshake(server_tls.context, client_ctx, hostname)
        facts = ssl_facts(server, server_tls)
        assert facts.verified
        assert facts.client_cn == "bob"
        assert facts.key_alg == "EC256"


# --- backend (client) contexts -----------------------------------------------------


def test_build_client_context(
    tmp_path: Path, ca: trustme.CA, other_ca: trustme.CA
) -> None:
    server_tls = build_server_contexts(
        TlsConfig(
            certificates=(write_cert(tmp_path, ca.issue_cert("app.internal"), "s"),),
            alpn=("h2", "http/1.1"),
        )
    )
    good_ca, wrong_ca = tmp_path / "good.pem", tmp_path / "wrong.pem"
    ca.cert_pem.write_to_path(good_ca)
    other_ca.cert_pem.write_to_path(wrong_ca)

    config = BackendTlsConfig(ca=good_ca, sni="app.internal", alpn=("h2",))
    context = build_client_context(config)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    hostname = backend_server_hostname(config, "10.0.0.5")
    assert hostname == "app.internal"
    client, server = handshake(server_tls.context, context, hostname)
    assert client.selected_alpn_protocol() == "h2"
    assert server_tls.server_name(server) == "app.internal"

    # Wrong CA: verification fails.
    wrong = build_client_context(BackendTlsConfig(ca=wrong_ca, sni="app.internal"))
    with pytest.raises(HandshakeFailed) as info:
        handshake(server_tls.context, wrong, "app.internal")
    assert isinstance(info.value.client, ssl.SSLCertVerificationError)

    # Right CA, wrong name (no sni: the server's address is checked).
    config = BackendTlsConfig(ca=good_ca)
    assert backend_server_hostname(config, "10.0.0.5") == "10.0.0.5"
    with pytest.raises(HandshakeFailed) as info:
        handshake(server_tls.context, build_client_context(config), "10.0.0.5")
    assert isinstance(info.value.client, ssl.SSLCertVerificationError)

    # verify = false: anything goes.
    insecure = build_client_context(BackendTlsConfig(ca=wrong_ca, verify=False))
    assert insecure.verify_mode == ssl.CERT_NONE
    handshake(server_tls.context, insecure, "app.internal")


def test_build_client_context_system_store_and_mtls(
    tmp_path: Path, ca: trustme.CA
) -> None:
    system = build_client_context(BackendTlsConfig())
    assert system.verify_mode == ssl.CERT_REQUIRED
    assert system.check_hostname

    client_ca = tmp_path / "clients.pem"
    ca.cert_pem.write_to_path(client_ca)
    server_tls = build_server_contexts(
        TlsConfig(
            certificates=(write_cert(tmp_path, ca.issue_cert("app.internal"), "s"),),
            client_auth="required",
            client_ca=client_ca,
        )
    )
    edge = write_cert(tmp_path, ca.issue_cert("edge", common_name="edge"), "edge")
    config = BackendTlsConfig(ca=client_ca, cert=edge.cert, key=edge.key)
    _, server = handshake(
        server_tls.context, build_client_context(config), "app.internal"
    )
    assert ssl_facts(server, server_tls).client_cn == "edge"

    with pytest.raises(CertificateError, match="does not match"):
        build_client_context(
            BackendTlsConfig(ca=client_ca, cert=edge.cert, key=tmp_path / "s.key")
        )
    with pytest.raises(CertificateError, match="backend CA"):
        build_client_context(BackendTlsConfig(ca=tmp_path / "missing.pem"))


# --- over loopback: openssl s_client and Python clients ---------------------------


class ThreadedServer:
    """A blocking TLS server in a thread; one result (facts or error) per client."""

    def __init__(self, server_tls: ServerTLS) -> None:
        self.server_tls = server_tls
        self.results: queue.Queue[SSLFacts | Exception] = queue.Queue()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port: int = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            with sock:
                sock.settimeout(5)
                try:
                    with self.server_tls.context.wrap_socket(
                        sock, server_side=True
                    ) as tls:
                        self.results.put(ssl_facts(tls, self.server_tls))
                        tls.sendall(b"ok")
                        with contextlib.suppress(OSError):
                            tls.unwrap()
                except (OSError, ValueError) as exc:
                    self.results.put(exc)

    def result(self) -> SSLFacts | Exception:
        return self.results.get(timeout=10)

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.listener.close()


def s_client(port: int, *args: str) -> tuple[int | None, str]:
    """Run ``openssl s_client``; (serial of the certificate it got, its stdout)."""
    openssl = require("openssl")
    proc = subprocess.run(
        [openssl, "s_client", "-connect", f"127.0.0.1:{port}", *args],
        input=b"",
        capture_output=True,
        timeout=20,
        check=False,
    )
    out = proc.stdout.decode(errors="replace")
    match = re.search(
        r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", out, re.DOTALL
    )
    if match is None:
        return None, out
    cert = x509.load_pem_x509_certificate(match.group(0).encode())
    return cert.serial_number, out


@pytest.fixture
def dual(tmp_path: Path, ca: trustme.CA) -> dict[str, trustme.LeafCert]:
    """An ECDSA and an RSA certificate for the same name, plus another site."""
    return {
        "ecdsa": ca.issue_cert("dual.example", key_type=ECDSA),
        "rsa": ca.issue_cert("dual.example", key_type=RSA),
        "other": ca.issue_cert("other.example", "*.w.example"),
    }


def test_rsa_and_ecdsa_in_one_context(
    tmp_path: Path, dual: dict[str, trustme.LeafCert]
) -> None:
    server_tls = build_server_contexts(sites_config(tmp_path, dual))
    with ThreadedServer(server_tls) as server:
        cases = [
            (("-tls1_2", "-sigalgs", "ECDSA+SHA256"), "ecdsa", "ECDHE-ECDSA-"),
            (("-tls1_2", "-sigalgs", "RSA+SHA256:RSA-PSS+SHA256"), "rsa", "ECDHE-RSA-"),
            (
                ("-tls1_2", "-cipher", "ECDHE-RSA-AES128-GCM-SHA256"),
                "rsa",
                "ECDHE-RSA-",
            ),
            (
                ("-tls1_2", "-cipher", "ECDHE-ECDSA-AES256-GCM-SHA384"),
                "ecdsa",
                "ECDHE-E",
            ),
            (("-tls1_3",), "ecdsa", "TLS_"),
        ]
        for args, expected, cipher_prefix in cases:
            serial, out = s_client(server.port, "-servername", "dual.example", *args)
            facts = server.result()
            assert isinstance(facts, SSLFacts), (args, facts, out)
            assert serial == serial_of(dual[expected]), args
            assert facts.cipher.startswith(cipher_prefix), (args, facts.cipher)
            assert facts.key_alg == ("EC256" if expected == "ecdsa" else "RSA2048")
            assert facts.server_name == "dual.example"
        # TLS 1.3 with RSA-only signature algorithms: the client gets the RSA
        # certificate (certificate_for cannot tell for TLS 1.3; see docs/tls.md).
        serial, out = s_client(
            server.port,
            "-servername",
            "dual.example",
            "-tls1_3",
            "-sigalgs",
            "rsa_pss_rsae_sha256",
        )
        assert isinstance(server.result(), SSLFacts)
        assert serial == serial_of(dual["rsa"]), out


@pytest.mark.parametrize(
    ("policy", "args", "accepted"),
    [
        # intermediate: TLS 1.2+, ECDHE + AEAD only
        ("intermediate", ("-tls1_3",), True),
        ("intermediate", ("-tls1_2",), True),
        ("intermediate", ("-tls1_1", "-cipher", "DEFAULT@SECLEVEL=0"), False),
        ("intermediate", ("-tls1_2", "-cipher", "AES128-SHA"), False),
        ("intermediate", ("-tls1_2", "-cipher", "ECDHE-RSA-AES128-SHA256"), False),
        ("intermediate", ("-tls1_2", "-cipher", "ECDHE-RSA-AES128-GCM-SHA256"), True),
        ("intermediate", ("-tls1_2", "-cipher", "ECDHE-RSA-CHACHA20-POLY1305"), True),
        ("intermediate", ("-tls1_2", "-cipher", "DHE-RSA-AES128-GCM-SHA256"), False),
        # modern: TLS 1.3 only
        ("modern", ("-tls1_3",), True),
        ("modern", ("-tls1_2",), False),
        # AWS 2021-06: TLS 1.2 CBC-SHA256 yes, CHACHA20 no
        ("ELBSecurityPolicy-TLS13-1-2-2021-06", ("-tls1_3",), True),
        (
            "ELBSecurityPolicy-TLS13-1-2-2021-06",
            ("-tls1_2", "-cipher", "ECDHE-RSA-AES128-SHA256"),
            True,
        ),
        (
            "ELBSecurityPolicy-TLS13-1-2-2021-06",
            ("-tls1_2", "-cipher", "ECDHE-RSA-CHACHA20-POLY1305"),
            False,
        ),
        (
            "ELBSecurityPolicy-TLS13-1-2-2021-06",
            ("-tls1_2", "-cipher", "AES128-GCM-SHA256"),
            False,
        ),
        # AWS 2017-01: TLS 1.2 only, static RSA allowed
        ("ELBSecurityPolicy-TLS-1-2-2017-01", ("-tls1_3",), False),
        (
            "ELBSecurityPolicy-TLS-1-2-2017-01",
            ("-tls1_2", "-cipher", "AES128-GCM-SHA256"),
            True,
        ),
        (
            "ELBSecurityPolicy-TLS-1-2-2017-01",
            ("-tls1_2", "-cipher", "AES128-SHA"),
            False,
        ),
        (
            "ELBSecurityPolicy-TLS-1-2-2017-01",
            ("-tls1_1", "-cipher", "DEFAULT@SECLEVEL=0"),
            False,
        ),
        # AWS 2016-08: TLS 1.0-1.2 (SECLEVEL 0), SHA-1 CBC suites
        ("ELBSecurityPolicy-2016-08", ("-tls1", "-cipher", "DEFAULT@SECLEVEL=0"), True),
        (
            "ELBSecurityPolicy-2016-08",
            ("-tls1_1", "-cipher", "AES128-SHA@SECLEVEL=0"),
            True,
        ),
        ("ELBSecurityPolicy-2016-08", ("-tls1_2", "-cipher", "AES256-SHA"), True),
        (
            "ELBSecurityPolicy-2016-08",
            ("-tls1_2", "-cipher", "ECDHE-RSA-CHACHA20-POLY1305"),
            False,
        ),
        ("ELBSecurityPolicy-2016-08", ("-tls1_3",), False),
    ],
)
def test_policies_with_openssl_client(
    tmp_path: Path,
    dual: dict[str, trustme.LeafCert],
    policy: str,
    args: tuple[str, ...],
    accepted: bool,
) -> None:
    server_tls = build_server_contexts(
        sites_config(tmp_path, dual, policy=policy)  # RSA + ECDSA: any suite fits
    )
    with ThreadedServer(server_tls) as server:
        serial, out = s_client(server.port, "-servername", "dual.example", *args)
        result = server.result()
    if accepted:
        assert isinstance(result, SSLFacts), (result, out)
        assert serial in (serial_of(dual["rsa"]), serial_of(dual["ecdsa"]))
        if "-cipher" in args:
            assert result.cipher == args[args.index("-cipher") + 1].split("@")[0] or (
                args[args.index("-cipher") + 1].startswith("DEFAULT")
            )
    else:
        assert isinstance(result, ssl.SSLError), (result, out)


def test_strict_sni_with_openssl_client(
    tmp_path: Path, sites: dict[str, trustme.LeafCert]
) -> None:
    server_tls = build_server_contexts(sites_config(tmp_path, sites, strict_sni=True))
    with ThreadedServer(server_tls) as server:
        serial, out = s_client(server.port, "-servername", "nope.example")
        assert serial is None
        assert isinstance(server.result(), ssl.SSLError)
        serial, _ = s_client(server.port, "-noservername")
        assert serial is None
        assert isinstance(server.result(), ssl.SSLError)
        serial, out = s_client(server.port, "-servername", "q.w.example")
        assert serial == serial_of(sites["wild"]), out
        facts = server.result()
        assert isinstance(facts, SSLFacts)
        assert facts.server_name == "q.w.example"


def test_client_auth_with_openssl_client(
    tmp_path: Path, ca: trustme.CA, other_ca: trustme.CA
) -> None:
    client_ca = tmp_path / "clients.pem"
    ca.cert_pem.write_to_path(client_ca)
    server_tls = build_server_contexts(
        TlsConfig(
            certificates=(write_cert(tmp_path, ca.issue_cert("a.example"), "s"),),
            client_auth="required",
            client_ca=client_ca,
        )
    )
    good = write_cert(tmp_path, ca.issue_cert("c", common_name="carol"), "good")
    wrong = write_cert(tmp_path, other_ca.issue_cert("m", common_name="m"), "wrong")
    with ThreadedServer(server_tls) as server:
        s_client(server.port, "-cert", str(good.cert), "-key", str(good.key))
        facts = server.result()
        assert isinstance(facts, SSLFacts)
        assert (facts.verified, facts.client_cn) == (True, "carol")
        s_client(server.port)
        assert isinstance(server.result(), ssl.SSLError)
        s_client(server.port, "-cert", str(wrong.cert), "-key", str(wrong.key))
        assert isinstance(server.result(), ssl.SSLError)


def test_python_clients_over_loopback(
    tmp_path: Path, ca: trustme.CA, sites: dict[str, trustme.LeafCert]
) -> None:
    server_tls = build_server_contexts(sites_config(tmp_path, sites, alpn=("h2",)))
    context = client_context(ca, alpn=["h2"])
    with ThreadedServer(server_tls) as server:
        for sni, expected in (("b.example", "exact"), ("z.w.example", "wild")):
            with (
                socket.create_connection(("127.0.0.1", server.port)) as sock,
                context.wrap_socket(sock, server_hostname=sni) as tls,
            ):
                assert peer_serial(tls) == serial_of(sites[expected])
                assert tls.recv(2) == b"ok"
            facts = server.result()
            assert isinstance(facts, SSLFacts)
            assert (facts.server_name, facts.alpn) == (sni, "h2")
