"""Certificates: loading and checking PEM files, and making dev certificates.

Theory of operation
-------------------
`load_certificate` reads a certificate chain and its private key with
`cryptography` and refuses, with a message naming the file, everything that would
otherwise surface as an opaque ``ssl.SSLError`` from ``load_cert_chain`` or, worse,
as a handshake failure on a client far away: unparsable PEM, a key that does not
belong to the leaf, a chain in the wrong order or with a bad signature, a leaf that
has expired or is not valid yet.  A leaf that expires within
`EXPIRY_WARNING_DAYS` is accepted with a warning on the ``tlsedge.tls`` logger.
The result, `LoadedCertificate`, carries what the TLS layer needs later: the DNS
names (for SNI selection) and HAProxy-style ``key_alg``/``sig_alg`` texts (for the
PROXY v2 SSL TLV).

`make_dev_certificates` makes a development CA, a server certificate signed by it
and optionally a client certificate, with `cryptography` only (``tlsedge cert``).
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, TypeAlias

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "EXPIRY_WARNING_DAYS",
    "CertificateError",
    "DevCertificates",
    "DevKeyType",
    "KeyType",
    "LoadedCertificate",
    "load_certificate",
    "make_dev_certificates",
]

LOGGER = logging.getLogger("tlsedge.tls")

# Let's Encrypt renews 30 days before expiry; a certificate closer than that to
# its end has missed at least one renewal.
EXPIRY_WARNING_DAYS: Final = 30

KeyType: TypeAlias = Literal["RSA", "EC", "Ed25519"]
DevKeyType: TypeAlias = Literal["rsa2048", "ecdsa-p256"]
PrivateKey: TypeAlias = (
    rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
)

# HAProxy's SIG_ALG texts name the hash the way OpenSSL's short names do.
_HASH_NAMES: Final = {
    "sha1": "SHA1",
    "sha224": "SHA224",
    "sha256": "SHA256",
    "sha384": "SHA384",
    "sha512": "SHA512",
}


class CertificateError(ValueError):
    """A certificate or key file is unusable; the message names the file.

    Attributes:
        file: The file at fault, when one is (the message starts with it), so
            that callers can name the configuration key that gave it.
    """

    def __init__(self, message: str, *, file: Path | None = None) -> None:
        super().__init__(message)
        self.file = file


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedCertificate:
    """A checked certificate chain with its key.

    Attributes:
        cert_path: The PEM file holding the leaf and then its intermediates.
        key_path: The PEM file holding the private key.
        leaf: The certificate presented to clients.
        chain: The intermediates after the leaf, in file order (leaf's issuer first).
        key_type: ``"RSA"``, ``"EC"`` or ``"Ed25519"``.
        key_size: Bits: the modulus for RSA, the curve's size for EC, 256 for Ed25519.
        curve: The EC curve's name (``"secp256r1"``), None for other key types.
        names: The leaf's DNS subjectAltNames, lowercased, in certificate order;
            the subject CN only when the leaf has no subjectAltName extension.
        not_before: Start of validity (UTC).
        not_after: End of validity (UTC).
        key_alg: HAProxy's KEY_ALG text: ``"RSA2048"``, ``"EC256"``, ``"Ed25519"``.
        sig_alg: How the issuer signed the leaf, in OpenSSL's short names as
            HAProxy sends them: ``"RSA-SHA256"``, ``"ecdsa-with-SHA384"``,
            ``"RSASSA-PSS"``, ``"ED25519"``.
    """

    cert_path: Path
    key_path: Path
    leaf: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    key_type: KeyType
    key_size: int
    curve: str | None
    names: tuple[str, ...]
    not_before: datetime.datetime
    not_after: datetime.datetime
    key_alg: str
    sig_alg: str

    @property
    def serial_number(self) -> int:
        """The leaf's serial number."""
        return self.leaf.serial_number


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CertificateError(
            f"{path}: cannot read the {what}: {exc.strerror or exc}", file=path
        ) from None


def _load_chain(path: Path) -> list[x509.Certificate]:
    data = _read(path, "certificate")
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise CertificateError(
            f"{path}: no PEM certificate (BEGIN CERTIFICATE) found", file=path
        )
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise CertificateError(
            f"{path}: invalid PEM certificate: {exc}", file=path
        ) from None


def _load_key(path: Path) -> PrivateKey:
    data = _read(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # cryptography: "Password was not given but ... encrypted"
        raise CertificateError(
            f"{path}: the private key is encrypted; tlsedge needs an unencrypted key "
            "(openssl pkey -in KEY -out KEY.plain)",
            file=path,
        ) from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CertificateError(
            f"{path}: invalid PEM private key: {exc}", file=path
        ) from None
    if not isinstance(
        key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
    ):
        raise CertificateError(
            f"{path}: unsupported key type {type(key).__name__}; "
            "use an RSA, ECDSA or Ed25519 key",
            file=path,
        )
    return key


def _spki(key: object) -> bytes:
    assert isinstance(
        key, rsa.RSAPublicKey | ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
    )
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _key_facts(key: PrivateKey) -> tuple[KeyType, int, str | None, str]:
    """(key type, size, curve, HAProxy KEY_ALG text) of *key*."""
    if isinstance(key, rsa.RSAPrivateKey):
        return "RSA", key.key_size, None, f"RSA{key.key_size}"
    if isinstance(key, ec.EllipticCurvePrivateKey):
        size = key.curve.key_size
        return "EC", size, key.curve.name, f"EC{size}"
    return "Ed25519", 256, None, "Ed25519"


def _sig_alg(cert: x509.Certificate) -> str:
    """The leaf's signature algorithm in OpenSSL's short-name spelling, as
    HAProxy sends it in SIG_ALG: ``"RSA-SHA256"``, ``"ecdsa-with-SHA256"``,
    ``"RSASSA-PSS"``, ``"ED25519"``."""
    params = cert.signature_algorithm_parameters
    hash_alg = cert.signature_hash_algorithm
    digest = _HASH_NAMES.get(hash_alg.name, hash_alg.name.upper()) if hash_alg else ""
    if isinstance(params, ec.ECDSA):
        return f"ecdsa-with-{digest}"
    if isinstance(params, padding.PSS):
        return "RSASSA-PSS"
    if isinstance(params, padding.PKCS1v15):
        return f"RSA-{digest}"
    # Ed25519 / Ed448 signatures have no separate hash.
    oid = cert.signature_algorithm_oid
    return {"1.3.101.112": "ED25519", "1.3.101.113": "ED448"}.get(
        oid.dotted_string, oid.dotted_string
    )


def _names(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        common = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return tuple(
            str(attr.value).lower() for attr in common if isinstance(attr.value, str)
        )
    names: list[str] = []
    for name in san.value.get_values_for_type(x509.DNSName):
        lowered = name.lower().rstrip(".")
        if lowered not in names:
            names.append(lowered)
    return tuple(names)


def _check_chain(path: Path, certs: list[x509.Certificate]) -> None:
    for index, (cert, issuer) in enumerate(itertools.pairwise(certs)):
        if cert.issuer != issuer.subject:
            raise CertificateError(
                f"{path}: chain out of order: certificate {index} "
                f"({cert.subject.rfc4514_string()}) was issued by "
                f"{cert.issuer.rfc4514_string()}, but certificate {index + 1} is "
                f"{issuer.subject.rfc4514_string()}; put the leaf first, then each "
                "certificate's issuer",
                file=path,
            )
        try:
            cert.verify_directly_issued_by(issuer)
        except InvalidSignature:
            raise CertificateError(
                f"{path}: certificate {index} ({cert.subject.rfc4514_string()}) "
                f"is not signed by certificate {index + 1}'s key",
                file=path,
            ) from None
        except (ValueError, TypeError, UnsupportedAlgorithm):
            # An algorithm cryptography cannot verify: names matched, OpenSSL
            # checks the rest when a client verifies.
            LOGGER.debug(
                "%s: cannot verify the signature of certificate %d", path, index
            )


def load_certificate(
    cert_path: str | os.PathLike[str],
    key_path: str | os.PathLike[str],
    *,
    allow_expired: bool = False,
    now: datetime.datetime | None = None,
) -> LoadedCertificate:
    """Load and check a PEM certificate chain and its private key.

    Args:
        cert_path: The leaf certificate followed by its intermediates (PEM).
        key_path: The leaf's private key (unencrypted PEM).
        allow_expired: Accept a leaf whose validity has ended (logged as a warning).
        now: The time to check validity against (default: the current time).

    Returns:
        The checked certificate.

    Raises:
        CertificateError: A file cannot be read or parsed, the key does not match
            the leaf, the chain is out of order or badly signed, the leaf has
            expired (unless *allow_expired*) or is not valid yet.  The message
            starts with the file name.
    """
    cert_file, key_file = Path(cert_path), Path(key_path)
    certs = _load_chain(cert_file)
    key = _load_key(key_file)
    leaf = certs[0]
    try:
        leaf_public = leaf.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CertificateError(
            f"{cert_file}: unsupported public key: {exc}", file=cert_file
        ) from None
    if _spki(key.public_key()) != _spki(leaf_public):
        raise CertificateError(
            f"{key_file}: the private key does not match the certificate "
            f"{leaf.subject.rfc4514_string()} in {cert_file}",
            file=key_file,
        )
    _check_chain(cert_file, certs)
    when = now or datetime.datetime.now(datetime.UTC)
    not_before, not_after = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    subject = leaf.subject.rfc4514_string()
    if when < not_before:
        raise CertificateError(
            f"{cert_file}: certificate {subject} is not valid before "
            f"{not_before:%Y-%m-%d %H:%M:%S} UTC",
            file=cert_file,
        )
    if when > not_after:
        if not allow_expired:
            raise CertificateError(
                f"{cert_file}: certificate {subject} expired on "
                f"{not_after:%Y-%m-%d %H:%M:%S} UTC (allow_expired = true serves it "
                "anyway)",
                file=cert_file,
            )
        LOGGER.warning(
            "%s: certificate %s expired on %s UTC; serving it (allow_expired)",
            cert_file,
            subject,
            f"{not_after:%Y-%m-%d}",
        )
    elif not_after - when < datetime.timedelta(days=EXPIRY_WARNING_DAYS):
        LOGGER.warning(
            "%s: certificate %s expires on %s UTC, in %d days",
            cert_file,
            subject,
            f"{not_after:%Y-%m-%d}",
            (not_after - when).days,
        )
    key_type, key_size, curve, key_alg = _key_facts(key)
    return LoadedCertificate(
        cert_path=cert_file,
        key_path=key_file,
        leaf=leaf,
        chain=tuple(certs[1:]),
        key_type=key_type,
        key_size=key_size,
        curve=curve,
        names=_names(leaf),
        not_before=not_before,
        not_after=not_after,
        key_alg=key_alg,
        sig_alg=_sig_alg(leaf),
    )


# ---------------------------------------------------------------------------
# Development certificates
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DevCertificates:
    """The files written by `make_dev_certificates`."""

    ca_cert: Path
    ca_key: Path
    cert: Path
    key: Path
    client_cert: Path | None = None
    client_key: Path | None = None


def _new_key(key_type: DevKeyType) -> rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey:
    if key_type == "rsa2048":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if key_type == "ecdsa-p256":
        return ec.generate_private_key(ec.SECP256R1())
    raise ValueError(f"unknown key type {key_type!r}; use 'rsa2048' or 'ecdsa-p256'")


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return x509.DNSName(name)


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    mode = 0o600 if secret else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as stream:
        os.fchmod(stream.fileno(), mode)  # an existing file keeps its mode otherwise
        stream.write(data)


def _key_pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _issue(
    *,
    subject: x509.Name,
    key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey,
    days: int,
    now: datetime.datetime,
    ca: bool,
    sans: Sequence[x509.GeneralName] = (),
    usage: Sequence[x509.ObjectIdentifier] = (),
) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clock skew
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.BasicConstraints(ca=ca, path_length=0 if ca else None), True
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False
        )
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            False,
        ).add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=isinstance(key, rsa.RSAPrivateKey),
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_dev_certificates(
    directory: str | os.PathLike[str],
    *,
    names: Sequence[str] = ("localhost", "127.0.0.1", "::1"),
    key_type: DevKeyType = "ecdsa-p256",
    days: int = 90,
    client_cn: str | None = None,
    ca_name: str = "tlsedge development CA",
    now: datetime.datetime | None = None,
) -> DevCertificates:
    """Make a development CA and a server certificate (and a client certificate).

    Files written into *directory* (created if needed): ``ca.pem``, ``ca.key``,
    ``server.pem``, ``server.key`` and, with *client_cn*, ``client.pem`` and
    ``client.key``.  Keys are written with mode 0600.  The CA's validity is *days*
    plus a year, so re-issuing leaves with the same CA is possible.

    Args:
        directory: Where to write the files; existing files are overwritten.
        names: The server's names: DNS names and IP addresses (subjectAltNames);
            the first is also the subject CN.
        key_type: ``"rsa2048"`` or ``"ecdsa-p256"`` (for every key made).
        days: Validity of the server and client certificates.
        client_cn: Make a client certificate with this subject CN.
        ca_name: The CA's subject CN.
        now: Start of validity (default: the current time).

    Returns:
        The paths of the files written.

    Raises:
        ValueError: No names, an empty name, *days* < 1 or an unknown *key_type*.
        OSError: The files cannot be written.
    """
    if not names or not all(names):
        raise ValueError("give at least one non-empty server name")
    if days < 1:
        raise ValueError(f"days must be at least 1, got {days}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    start = now or datetime.datetime.now(datetime.UTC)
    ca_key = _new_key(key_type)
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = _issue(
        subject=ca_subject,
        key=ca_key,
        issuer=ca_subject,
        issuer_key=ca_key,
        days=days + 365,
        now=start,
        ca=True,
    )
    server_key = _new_key(key_type)
    server_cert = _issue(
        subject=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]),
        key=server_key,
        issuer=ca_subject,
        issuer_key=ca_key,
        days=days,
        now=start,
        ca=False,
        sans=[_san(name) for name in names],
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
    )
    pem = serialization.Encoding.PEM
    result = DevCertificates(
        ca_cert=out / "ca.pem",
        ca_key=out / "ca.key",
        cert=out / "server.pem",
        key=out / "server.key",
    )
    _write(result.ca_cert, ca_cert.public_bytes(pem), secret=False)
    _write(result.ca_key, _key_pem(ca_key), secret=True)
    _write(result.cert, server_cert.public_bytes(pem), secret=False)
    _write(result.key, _key_pem(server_key), secret=True)
    if client_cn is None:
        return result
    client_key = _new_key(key_type)
    client_cert = _issue(
        subject=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, client_cn)]),
        key=client_key,
        issuer=ca_subject,
        issuer_key=ca_key,
        days=days,
        now=start,
        ca=False,
        usage=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    client_pem, client_key_pem = out / "client.pem", out / "client.key"
    _write(client_pem, client_cert.public_bytes(pem), secret=False)
    _write(client_key_pem, _key_pem(client_key), secret=True)
    return DevCertificates(
        ca_cert=result.ca_cert,
        ca_key=result.ca_key,
        cert=result.cert,
        key=result.key,
        client_cert=client_pem,
        client_key=client_key_pem,
    )
