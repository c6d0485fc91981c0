"""Tests for tlsedge._tls.certs: loading, checking and making certificates."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from tlsedge._tls.certs import (
    CertificateError,
    LoadedCertificate,
    load_certificate,
    make_dev_certificates,
)

NOW = datetime.datetime.now(datetime.UTC)
DAY = datetime.timedelta(days=1)

Key = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


def write_issued(
    directory: Path, issued: trustme.LeafCert, name: str = "site"
) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    issued.cert_chain_pems[0].write_to_path(cert)
    for pem in issued.cert_chain_pems[1:]:
        pem.write_to_path(cert, append=True)
    issued.private_key_pem.write_to_path(key)
    return cert, key


# --- cryptography helpers for the odd cases trustme does not make -------------


def name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_cert(
    key: Key,
    *,
    subject: str,
    issuer: str | None = None,
    issuer_key: Key | None = None,
    sans: Sequence[str] | None = ("site.example",),
    not_before: datetime.datetime = NOW - DAY,
    not_after: datetime.datetime = NOW + 365 * DAY,
    ca: bool = False,
) -> x509.Certificate:
    signer = issuer_key or key
    builder = (
        x509.CertificateBuilder()
        .subject_name(name(subject))
        .issuer_name(name(issuer or subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(s) for s in sans]), False
        )
    algorithm = (
        None if isinstance(signer, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    )
    return builder.sign(signer, algorithm)


def write(
    directory: Path, certs: Sequence[x509.Certificate], key: Key
) -> tuple[Path, Path]:
    cert_path, key_path = directory / "c.pem", directory / "c.key"
    cert_path.write_bytes(
        b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)
    )
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


# --- loading good certificates ------------------------------------------------


def test_load_ecdsa_leaf(tmp_path: Path, ca: trustme.CA) -> None:
    issued = ca.issue_cert("Site.Example", "*.site.example", "127.0.0.1")
    cert_path, key_path = write_issued(tmp_path, issued)
    loaded = load_certificate(cert_path, key_path)
    assert isinstance(loaded, LoadedCertificate)
    assert loaded.cert_path == cert_path
    assert loaded.key_path == key_path
    assert loaded.names == ("site.example", "*.site.example")  # no IP, lowercased
    assert loaded.key_type == "EC"
    assert loaded.key_size == 256
    assert loaded.curve == "secp256r1"
    assert loaded.key_alg == "EC256"
    assert loaded.sig_alg == "ecdsa-with-SHA256"  # trustme's CA key is ECDSA
    assert loaded.chain == ()
    assert loaded.serial_number == loaded.leaf.serial_number
    assert loaded.not_before < NOW < loaded.not_after


def test_load_rsa_leaf_with_intermediate(tmp_path: Path) -> None:
    root = trustme.CA(key_type=trustme.KeyType.RSA)
    intermediate = root.create_child_ca(key_type=trustme.KeyType.RSA)
    issued = intermediate.issue_cert("rsa.example", key_type=trustme.KeyType.RSA)
    loaded = load_certificate(*write_issued(tmp_path, issued))
    assert loaded.key_type == "RSA"
    assert loaded.key_size == 2048
    assert loaded.curve is None
    assert loaded.key_alg == "RSA2048"
    assert loaded.sig_alg == "RSA-SHA256"
    assert len(loaded.chain) == 1
    assert loaded.chain[0].subject == loaded.leaf.issuer


def test_load_ed25519(tmp_path: Path) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    loaded = load_certificate(*write(tmp_path, [make_cert(key, subject="ed")], key))
    assert (loaded.key_type, loaded.key_alg, loaded.sig_alg) == (
        "Ed25519",
        "Ed25519",
        "ED25519",
    )


def test_cn_fallback_only_without_san(
    tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey
) -> None:
    no_san = make_cert(ec_key, subject="Legacy.Example", sans=None)
    assert load_certificate(*write(tmp_path, [no_san], ec_key)).names == (
        "legacy.example",
    )
    with_san = make_cert(ec_key, subject="cn.example", sans=["san.example"])
    assert load_certificate(*write(tmp_path, [with_san], ec_key)).names == (
        "san.example",
    )


# --- refusals -------------------------------------------------------------------


def test_missing_files(tmp_path: Path, ca: trustme.CA) -> None:
    cert_path, key_path = write_issued(tmp_path, ca.issue_cert("a.example"))
    with pytest.raises(CertificateError, match=r"nope\.pem: cannot read the certif"):
        load_certificate(tmp_path / "nope.pem", key_path)
    with pytest.raises(CertificateError, match=r"nope\.key: cannot read the private"):
        load_certificate(cert_path, tmp_path / "nope.key")


def test_pem_garbage(tmp_path: Path, ca: trustme.CA) -> None:
    cert_path, key_path = write_issued(tmp_path, ca.issue_cert("a.example"))
    bad = tmp_path / "bad.pem"
    bad.write_text("hello\n")
    with pytest.raises(CertificateError, match=r"bad\.pem: no PEM certificate"):
        load_certificate(bad, key_path)
    bad.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(CertificateError, match=r"bad\.pem: invalid PEM certificate"):
        load_certificate(bad, key_path)
    with pytest.raises(CertificateError, match=r"bad\.pem: invalid PEM private key"):
        load_certificate(cert_path, bad)


def test_encrypted_key(tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    cert_path, key_path = write(tmp_path, [make_cert(ec_key, subject="e")], ec_key)
    key_path.write_bytes(
        ec_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(CertificateError, match=r"c\.key: the private key is encrypted"):
        load_certificate(cert_path, key_path)


def test_wrong_key(tmp_path: Path, ca: trustme.CA) -> None:
    cert_path, _ = write_issued(tmp_path, ca.issue_cert("a.example"), "a")
    _, other_key = write_issued(tmp_path, ca.issue_cert("a.example"), "b")
    with pytest.raises(CertificateError) as info:
        load_certificate(cert_path, other_key)
    assert str(info.value).startswith(f"{other_key}: the private key does not match")
    assert str(cert_path) in str(info.value)


def test_chain_out_of_order(tmp_path: Path) -> None:
    root = trustme.CA()
    intermediate = root.create_child_ca()
    issued = intermediate.issue_cert("a.example")
    cert_path, key_path = write_issued(tmp_path, issued)
    assert len(load_certificate(cert_path, key_path).chain) == 1
    pems = [pem.bytes() for pem in issued.cert_chain_pems]
    cert_path.write_bytes(pems[0] + root.cert_pem.bytes() + pems[1])
    with pytest.raises(CertificateError, match=r"site\.pem: chain out of order"):
        load_certificate(cert_path, key_path)


def test_chain_bad_signature(
    tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey
) -> None:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    impostor_key = ec.generate_private_key(ec.SECP256R1())
    leaf = make_cert(ec_key, subject="leaf", issuer="The CA", issuer_key=ca_key)
    impostor = make_cert(impostor_key, subject="The CA", ca=True)  # same name
    with pytest.raises(CertificateError, match="is not signed by certificate 1"):
        load_certificate(*write(tmp_path, [leaf, impostor], ec_key))
    real = make_cert(ca_key, subject="The CA", ca=True)
    load_certificate(*write(tmp_path, [leaf, real], ec_key))


def test_expired(
    tmp_path: Path,
    ec_key: ec.EllipticCurvePrivateKey,
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = make_cert(
        ec_key, subject="old", not_before=NOW - 90 * DAY, not_after=NOW - DAY
    )
    paths = write(tmp_path, [old], ec_key)
    with pytest.raises(
        CertificateError, match=r"c\.pem: certificate CN=old expired on"
    ):
        load_certificate(*paths)
    with caplog.at_level(logging.WARNING, logger="tlsedge.tls"):
        loaded = load_certificate(*paths, allow_expired=True)
    assert loaded.not_after < NOW
    assert "expired on" in caplog.text
    assert "allow_expired" in caplog.text


def test_not_yet_valid(tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    future = make_cert(ec_key, subject="f", not_before=NOW + DAY)
    with pytest.raises(CertificateError, match="is not valid before"):
        load_certificate(*write(tmp_path, [future], ec_key), allow_expired=True)


def test_expiring_soon_warns(
    tmp_path: Path,
    ec_key: ec.EllipticCurvePrivateKey,
    caplog: pytest.LogCaptureFixture,
) -> None:
    end = NOW + 10 * DAY
    soon = make_cert(ec_key, subject="soon", not_after=end)
    with caplog.at_level(logging.WARNING, logger="tlsedge.tls"):
        load_certificate(*write(tmp_path, [soon], ec_key))
    (record,) = caplog.records
    assert record.name == "tlsedge.tls"
    assert record.levelno == logging.WARNING
    assert f"expires on {end:%Y-%m-%d}" in record.getMessage()
    assert "in 9 days" in record.getMessage() or "in 10 days" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tlsedge.tls"):
        load_certificate(*write(tmp_path, [make_cert(ec_key, subject="ok")], ec_key))
    assert not caplog.records


def test_explicit_now(tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    paths = write(tmp_path, [make_cert(ec_key, subject="x")], ec_key)
    with pytest.raises(CertificateError, match="expired"):
        load_certificate(*paths, now=NOW + 400 * DAY)
    with pytest.raises(CertificateError, match="not valid before"):
        load_certificate(*paths, now=NOW - 2 * DAY)


# --- make_dev_certificates ------------------------------------------------------


def test_make_dev_certificates(tmp_path: Path) -> None:
    out = tmp_path / "dev"
    files = make_dev_certificates(
        out, names=["edge.test", "127.0.0.1", "::1"], days=30, client_cn="alice"
    )
    assert files.cert == out / "server.pem"
    assert files.client_cert == out / "client.pem"
    assert files.client_key == out / "client.key"
    for secret in (files.key, files.ca_key, files.client_key):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(files.cert.stat().st_mode) == 0o644

    server = load_certificate(files.cert, files.key)
    assert server.names == ("edge.test",)
    assert server.key_alg == "EC256"
    assert server.sig_alg == "ecdsa-with-SHA256"
    assert server.not_after - server.not_before > 30 * DAY
    san = server.leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server.leaf.verify_directly_issued_by(ca)
    client = load_certificate(files.client_cert, files.client_key)
    assert client.names == ("alice",)  # no SAN: the CN
    client.leaf.verify_directly_issued_by(ca)

    # OpenSSL agrees: a client trusting ca.pem verifies server.pem for both names.
    context = ssl.create_default_context(cafile=str(files.ca_cert))
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(files.cert, files.key)
    for hostname in ("edge.test", "127.0.0.1"):
        c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
        client_obj = context.wrap_bio(c_in, c_out, server_hostname=hostname)
        server_obj = server_context.wrap_bio(s_in, s_out, server_side=True)
        done = [False, False]
        for _ in range(10):
            for index, (obj, out_bio, in_bio) in enumerate(
                ((client_obj, c_out, s_in), (server_obj, s_out, c_in))
            ):
                if not done[index]:
                    try:
                        obj.do_handshake()
                        done[index] = True
                    except ssl.SSLWantReadError:
                        pass
                in_bio.write(out_bio.read())
        assert done == [True, True]


def test_make_dev_certificates_rsa_and_overwrite(tmp_path: Path) -> None:
    (tmp_path / "server.key").write_text("old")
    (tmp_path / "server.key").chmod(0o644)
    files = make_dev_certificates(tmp_path, key_type="rsa2048")
    assert files.client_cert is None
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    loaded = load_certificate(files.cert, files.key)
    assert loaded.key_alg == "RSA2048"
    assert loaded.sig_alg == "RSA-SHA256"
    assert loaded.names == ("localhost",)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"names": []}, "at least one"),
        ({"names": [""]}, "at least one"),
        ({"days": 0}, "days must be at least 1"),
        ({"key_type": "dsa"}, "unknown key type"),
    ],
)
def test_make_dev_certificates_refuses(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_dev_certificates(tmp_path, **kwargs)  # type: ignore[arg-type]
