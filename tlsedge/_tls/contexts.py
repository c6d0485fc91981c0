"""TLS contexts: policies, SNI certificate selection, reload, backend contexts.

Theory of operation
-------------------
A listener's ``[listeners.tls]`` table becomes a `ServerTLS`.  Its certificates
are loaded and checked by `tlsedge._tls.certs.load_certificate`, then grouped: the
certificates whose DNS name sets are identical share one ``ssl.SSLContext`` (so an
RSA and an ECDSA certificate for the same names are both loaded into one context,
and OpenSSL picks the one the client can verify).  Every context of a listener is
configured identically (policy, options, ALPN, client authentication); only the
certificates differ.

The first group's context is the *default context*: `ServerTLS.context`, the one
the server wraps every accepted connection with.  Its ``sni_callback`` runs
during the ClientHello, looks the client's server_name up (exact names first,
then ``*.example.com`` wildcards, which match exactly one label, then the default
group), switches ``ssl_object.context`` to the chosen group's context, and
records the name and the group for the connection in a ``WeakKeyDictionary``
keyed by the ``SSLObject`` (`ServerTLS.server_name`, `ServerTLS.certificate_for`
read it back).  With ``strict_sni`` an unknown or missing name is refused with
an ``unrecognized_name`` alert.

The contexts, the name tables and the callback form one immutable *generation*.
`ServerTLS.reload` builds a complete new generation from the same files and
swaps a single reference: handshakes that start afterwards use the new
generation, handshakes in flight keep the one their callback belongs to.  If any
file is bad the old generation stays and `CertificateError` says why.
`watch_certificates` polls the files and calls `reload` when they change.

What Python's ``ssl`` (3.11, OpenSSL 3.0) cannot do is listed in docs/tls.md:
no key exchange group or signature scheme after a handshake, no way to ask which
of several certificates in one context was sent (inferred from the cipher for
TLS 1.2, OpenSSL's preference for TLS 1.3), no session-ticket-key API (tickets do
not survive a reload), no OCSP stapling.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, TypeAlias

import trio
from cryptography import x509
from cryptography.x509.oid import NameOID

from tlsedge._core.downstream import SSLFacts
from tlsedge._tls.certs import (
    CertificateError,
    KeyType,
    LoadedCertificate,
    load_certificate,
)

if TYPE_CHECKING:
    from tlsedge._core.config import BackendTlsConfig, TlsConfig

__all__ = [
    "POLICIES",
    "WATCH_INTERVAL",
    "CertificateError",
    "ServerTLS",
    "TlsPolicyInfo",
    "backend_server_hostname",
    "build_client_context",
    "build_server_contexts",
    "ssl_facts",
    "watch_certificates",
]

LOGGER = logging.getLogger("tlsedge.tls")

TLSObject: TypeAlias = ssl.SSLObject | ssl.SSLSocket
_SniCallback: TypeAlias = Callable[[TLSObject, str | None, ssl.SSLContext], int | None]

# How often `watch_certificates` looks at the files: cert-manager and certbot
# replace them at most a few times a day, and a stat() per file is cheap.
WATCH_INTERVAL: Final = 5.0

_V = ssl.TLSVersion


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsPolicyInfo:
    """One ``policy`` value: protocol versions and TLS 1.2 (and older) ciphers.

    TLS 1.3 suites are OpenSSL's defaults (TLS_AES_256_GCM_SHA384,
    TLS_CHACHA20_POLY1305_SHA256, TLS_AES_128_GCM_SHA256): Python has no API to
    change them, and every policy here allows exactly those.

    Attributes:
        name: The policy's name as written in the configuration.
        minimum_version: Lowest protocol version accepted.
        maximum_version: Highest protocol version accepted.
        ciphers: OpenSSL cipher names for TLS 1.2 and older, in server preference
            order; empty for TLS 1.3-only policies.
        security_level: An OpenSSL ``@SECLEVEL`` to force, or None for the
            system default (Debian: 2).
    """

    name: str
    minimum_version: ssl.TLSVersion
    maximum_version: ssl.TLSVersion
    ciphers: tuple[str, ...]
    security_level: int | None = None

    @property
    def cipher_string(self) -> str:
        """The ``set_ciphers`` argument ("" when TLS 1.2 is not allowed)."""
        text = ":".join(self.ciphers)
        if text and self.security_level is not None:
            text += f":@SECLEVEL={self.security_level}"
        return text


# Mozilla's "intermediate" configuration (v5.7) without its DHE suites: forward
# secrecy through ECDHE and AEAD ciphers only.
_MOZILLA_INTERMEDIATE: Final = (
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
    "ECDHE-RSA-CHACHA20-POLY1305",
)
# The AWS ELB security policies' TLS 1.2 cipher lists, in AWS's order (AWS
# documentation, "Security policies for your Network/Classic Load Balancer").
_ELB_TLS13_1_2_2021_06: Final = (
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES128-SHA256",
    "ECDHE-RSA-AES128-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-AES256-SHA384",
    "ECDHE-RSA-AES256-SHA384",
)
_ELB_TLS_1_2_2017_01: Final = (
    *_ELB_TLS13_1_2_2021_06,
    "AES128-GCM-SHA256",
    "AES128-SHA256",
    "AES256-GCM-SHA384",
    "AES256-SHA256",
)
_ELB_2016_08: Final = (
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES128-SHA256",
    "ECDHE-RSA-AES128-SHA256",
    "ECDHE-ECDSA-AES128-SHA",
    "ECDHE-RSA-AES128-SHA",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-AES256-SHA384",
    "ECDHE-RSA-AES256-SHA384",
    "ECDHE-RSA-AES256-SHA",
    "ECDHE-ECDSA-AES256-SHA",
    "AES128-GCM-SHA256",
    "AES128-SHA256",
    "AES128-SHA",
    "AES256-GCM-SHA384",
    "AES256-SHA256",
    "AES256-SHA",
)

POLICIES: Final[Mapping[str, TlsPolicyInfo]] = MappingProxyType(
    {
        policy.name: policy
        for policy in (
            TlsPolicyInfo(
                name="modern",
                minimum_version=_V.TLSv1_3,
                maximum_version=_V.TLSv1_3,
                ciphers=(),
            ),
            TlsPolicyInfo(
                name="intermediate",
                minimum_version=_V.TLSv1_2,
                maximum_version=_V.TLSv1_3,
                ciphers=_MOZILLA_INTERMEDIATE,
            ),
            TlsPolicyInfo(
                name="ELBSecurityPolicy-TLS13-1-2-2021-06",
                minimum_version=_V.TLSv1_2,
                maximum_version=_V.TLSv1_3,
                ciphers=_ELB_TLS13_1_2_2021_06,
            ),
            TlsPolicyInfo(
                name="ELBSecurityPolicy-TLS-1-2-2017-01",
                minimum_version=_V.TLSv1_2,
                maximum_version=_V.TLSv1_2,
                ciphers=_ELB_TLS_1_2_2017_01,
            ),
            # OpenSSL 3 refuses TLS 1.0/1.1 (their handshake signs with SHA-1 or
            # MD5+SHA-1) and SHA-1 cipher MACs above security level 0, so this
            # policy alone runs at @SECLEVEL=0.  See docs/tls.md for the cost.
            TlsPolicyInfo(
                name="ELBSecurityPolicy-2016-08",
                minimum_version=_V.TLSv1,
                maximum_version=_V.TLSv1_2,
                ciphers=_ELB_2016_08,
                security_level=0,
            ),
        )
    }
)

# Options on every server context: no TLS compression (CRIME), no renegotiation
# (client-initiated renegotiation is a cheap CPU DoS and TLS 1.3 has none), our
# cipher order wins (the policies list the strongest first).
_SERVER_OPTIONS: Final = (
    ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION | ssl.OP_CIPHER_SERVER_PREFERENCE
)
_CLIENT_AUTH_MODES: Final = {
    "none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL,
    "required": ssl.CERT_REQUIRED,
}


def _apply_policy(context: ssl.SSLContext, policy: TlsPolicyInfo) -> None:
    with warnings.catch_warnings():
        # Python deprecates TLSVersion.TLSv1/TLSv1_1; ELBSecurityPolicy-2016-08
        # allows them on purpose (AWS's default policy, for old clients).
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = policy.minimum_version
        context.maximum_version = policy.maximum_version
    if policy.cipher_string:
        context.set_ciphers(policy.cipher_string)


# ---------------------------------------------------------------------------
# Server contexts
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class _Group:
    """Certificates with the same names, loaded into one context."""

    names: frozenset[str]
    certificates: tuple[LoadedCertificate, ...]
    context: ssl.SSLContext


@dataclass(frozen=True, slots=True, eq=False)
class _Connection:
    server_name: str | None
    group: _Group


@dataclass(frozen=True, slots=True, eq=False)
class _Generation:
    """One complete, immutable set of contexts (swapped whole by reload)."""

    groups: tuple[_Group, ...]
    exact: Mapping[str, _Group]
    wildcard: Mapping[str, _Group]  # "example.com" for "*.example.com"
    certificates: tuple[LoadedCertificate, ...]

    @property
    def default(self) -> _Group:
        return self.groups[0]

    def lookup(self, server_name: str | None) -> _Group | None:
        """The group for *server_name*, or None when no name matches."""
        if not server_name:
            return None
        name = server_name.lower().rstrip(".")
        group = self.exact.get(name)
        if group is None:
            _, dot, parent = name.partition(".")
            if dot and parent:
                group = self.wildcard.get(parent)
        return group


def _load_verify(context: ssl.SSLContext, path: Path, what: str) -> None:
    try:
        context.load_verify_locations(cafile=os.fspath(path))
    except FileNotFoundError:
        raise CertificateError(
            f"{path}: cannot read the {what}: file not found", file=path
        ) from None
    except OSError as exc:  # ssl.SSLError is an OSError
        reason = getattr(exc, "reason", None) or exc.strerror or str(exc)
        raise CertificateError(f"{path}: invalid {what}: {reason}", file=path) from None


def _load_chain_into(context: ssl.SSLContext, cert: LoadedCertificate) -> None:
    try:
        context.load_cert_chain(os.fspath(cert.cert_path), os.fspath(cert.key_path))
    except OSError as exc:  # the files changed since they were checked
        reason = getattr(exc, "reason", None) or exc.strerror or str(exc)
        raise CertificateError(
            f"{cert.cert_path}: OpenSSL refused the certificate or key "
            f"{cert.key_path}: {reason}"
        ) from None


def _server_context(
    config: TlsConfig, certificates: Sequence[LoadedCertificate]
) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.options |= _SERVER_OPTIONS
    _apply_policy(context, POLICIES[config.policy])
    for cert in certificates:
        _load_chain_into(context, cert)
    if config.alpn:
        context.set_alpn_protocols(list(config.alpn))
    context.verify_mode = _CLIENT_AUTH_MODES[config.client_auth]
    if config.client_auth != "none":
        if config.client_ca is None:  # the config loader refuses this already
            raise CertificateError(
                f"client_auth {config.client_auth!r} needs client_ca"
            )
        _load_verify(context, config.client_ca, "client CA bundle")
    return context


class ServerTLS:
    """The TLS contexts of one listener, selected by SNI, reloadable.

    Build it with `build_server_contexts`.  Wrap accepted connections with
    `context` (read it per connection: `reload` replaces it).  After the
    handshake, `server_name` and `certificate_for` tell what the client asked for
    and what it got; `ssl_facts` collects everything for PROXY v2's SSL TLV.

    Thread safety: `reload` may run in a worker thread while handshakes run
    elsewhere; the swap is one reference assignment and reloads are serialised.
    """

    def __init__(self, config: TlsConfig) -> None:
        """Load every certificate of *config* and build the contexts.

        Raises:
            CertificateError: A certificate, key or CA file is unusable.
        """
        self.config = config
        self._connections: weakref.WeakKeyDictionary[TLSObject, _Connection] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._generation = self._build()

    # -- building -------------------------------------------------------------

    def _build(self) -> _Generation:
        config = self.config
        allow_expired = config.allow_expired
        loaded = [
            load_certificate(item.cert, item.key, allow_expired=allow_expired)
            for item in config.certificates
        ]
        by_names: dict[frozenset[str], list[LoadedCertificate]] = {}
        for cert in loaded:
            by_names.setdefault(frozenset(cert.names), []).append(cert)
        for names, certs in by_names.items():
            kinds = [cert.key_type for cert in certs]
            if len(set(kinds)) != len(kinds):
                shown = ", ".join(sorted(names)) or "(no DNS names)"
                raise CertificateError(
                    f"{certs[-1].cert_path}: two {kinds[-1]} certificates for the "
                    f"same names ({shown}); one context holds at most one "
                    "certificate per key type (RSA, EC, Ed25519)"
                )
        groups = tuple(
            _Group(
                names=names,
                certificates=tuple(certs),
                context=_server_context(config, certs),
            )
            for names, certs in by_names.items()
        )
        exact: dict[str, _Group] = {}
        wildcard: dict[str, _Group] = {}
        for group in groups:  # file order: the first certificate for a name wins
            for name in sorted(group.names):
                if name.startswith("*."):
                    wildcard.setdefault(name[2:], group)
                else:
                    exact.setdefault(name, group)
        generation = _Generation(
            groups=groups,
            exact=MappingProxyType(exact),
            wildcard=MappingProxyType(wildcard),
            certificates=tuple(loaded),
        )
        groups[0].context.sni_callback = self._sni_callback(generation)
        return generation

    def _sni_callback(self, generation: _Generation) -> _SniCallback:
        strict = self.config.strict_sni
        connections = self._connections

        def select(
            ssl_object: TLSObject, server_name: str | None, context: ssl.SSLContext
        ) -> int | None:
            del context  # always generation.default.context
            group = generation.lookup(server_name)
            if group is None:
                if strict:
                    LOGGER.info(
                        "TLS handshake refused (strict_sni): %s",
                        f"unknown server name {server_name!r}"
                        if server_name
                        else "the client sent no server name",
                    )
                    return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
                group = generation.default
            connections[ssl_object] = _Connection(server_name=server_name, group=group)
            if group is not generation.default:
                ssl_object.context = group.context
            return None

        return select

    # -- public API -----------------------------------------------------------

    @property
    def context(self) -> ssl.SSLContext:
        """The context to wrap new connections with (changes on `reload`)."""
        return self._generation.default.context

    @property
    def certificates(self) -> tuple[LoadedCertificate, ...]:
        """The certificates in use, in configuration order."""
        return self._generation.certificates

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file the contexts are built from (what `watch_certificates` polls)."""
        paths: list[Path] = []
        for item in self.config.certificates:
            paths.extend((item.cert, item.key))
        if self.config.client_auth != "none" and self.config.client_ca is not None:
            paths.append(self.config.client_ca)
        return tuple(dict.fromkeys(paths))

    def server_name(self, ssl_object: TLSObject) -> str | None:
        """The SNI *ssl_object*'s client sent (as sent: an IDNA A-label), or None."""
        connection = self._connections.get(ssl_object)
        return connection.server_name if connection else None

    def certificate_for(self, ssl_object: TLSObject) -> LoadedCertificate:
        """The certificate served on *ssl_object* (after its handshake).

        When one context holds several certificates (RSA and ECDSA for the same
        names), OpenSSL does not say which it sent.  For TLS 1.2 and older the
        cipher tells (``ECDHE-ECDSA-*`` needs an EC or Ed25519 key, every other
        suite an RSA key); for TLS 1.3 this returns the certificate OpenSSL
        prefers, the EC one, which it sends to every client that offers ECDSA
        signatures (all mainstream clients do).
        """
        connection = self._connections.get(ssl_object)
        group = connection.group if connection else self._group_of(ssl_object.context)
        certs = group.certificates
        if len(certs) == 1:
            return certs[0]
        cipher = ssl_object.cipher()
        version = ssl_object.version()
        order: tuple[KeyType, ...]
        if cipher is not None and version not in (None, "TLSv1.3"):
            order = ("EC", "Ed25519") if "-ECDSA-" in f"-{cipher[0]}" else ("RSA",)
        else:
            order = ("EC", "Ed25519", "RSA")  # OpenSSL's default sigalg order
        for key_type in order:
            for cert in certs:
                if cert.key_type == key_type:
                    return cert
        return certs[0]

    def _group_of(self, context: ssl.SSLContext) -> _Group:
        generation = self._generation
        for group in generation.groups:
            if group.context is context:
                return group
        return generation.default

    def reload(self) -> tuple[LoadedCertificate, ...]:
        """Build new contexts from the same files and switch to them.

        Handshakes that start afterwards use the new contexts; connections and
        handshakes in flight keep the old ones.  Session tickets issued before
        the reload no longer resume (Python offers no ticket-key API).

        Returns:
            The certificates now in use.

        Raises:
            CertificateError: A file is unusable; the old contexts stay in use.
        """
        with self._lock:
            generation = self._build()
            self._generation = generation
        return generation.certificates


def build_server_contexts(tls_config: TlsConfig) -> ServerTLS:
    """Load a listener's certificates and build its TLS contexts.

    Raises:
        CertificateError: A certificate, key or CA file is unusable; the message
            names the file.
    """
    return ServerTLS(tls_config)


# ---------------------------------------------------------------------------
# Watching the files
# ---------------------------------------------------------------------------

_Stamp: TypeAlias = tuple[tuple[int, int, int, int] | None, ...]


def _stamp(paths: Iterable[Path]) -> _Stamp:
    stamps: list[tuple[int, int, int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()  # follows symlinks: Kubernetes secrets swap a link
        except OSError:
            stamps.append(None)
        else:
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev))
    return tuple(stamps)


async def watch_certificates(
    server_tls: ServerTLS, interval: float = WATCH_INTERVAL
) -> None:
    """Reload *server_tls* whenever one of its files changes; runs until cancelled.

    Every *interval* seconds the certificate, key and client CA files are
    stat()ed (modification time, size, inode); on a change `ServerTLS.reload`
    runs in a worker thread.  Success is logged with the new certificates'
    expiry dates; a refusal is logged with its reason and the old certificates
    stay until the files change again.
    """
    files = server_tls.files
    seen = _stamp(files)
    while True:
        await trio.sleep(interval)
        now = _stamp(files)
        if now == seen:
            continue
        seen = now
        try:
            certs = await trio.to_thread.run_sync(server_tls.reload)
        except CertificateError as exc:
            LOGGER.error("certificate reload refused, keeping the old ones: %s", exc)
            continue
        LOGGER.info(
            "certificates reloaded: %s",
            "; ".join(
                f"{cert.cert_path} ({', '.join(cert.names) or 'no DNS names'}, "
                f"{cert.key_alg}, until {cert.not_after:%Y-%m-%d})"
                for cert in certs
            ),
        )


# ---------------------------------------------------------------------------
# Backend (client) contexts
# ---------------------------------------------------------------------------


def build_client_context(backend_tls_config: BackendTlsConfig) -> ssl.SSLContext:
    """A context for re-encrypting to a backend's servers.

    Verification is on unless ``verify = false``: against ``ca``, or the system
    trust store when there is none, with host name checking.  Wrap with
    ``server_hostname=backend_server_hostname(config, host)``.  TLS 1.2 or newer.

    Raises:
        CertificateError: The CA bundle, client certificate or key is unusable.
    """
    config = backend_tls_config
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if config.verify:
        if config.ca is not None:
            _load_verify(context, config.ca, "backend CA bundle")
        else:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    else:
        # The operator turned verification off (verify = false) for backends
        # with self-signed certificates; the link is encrypted, not authenticated.
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if config.cert is not None and config.key is not None:
        _load_chain_into(context, load_certificate(config.cert, config.key))
    if config.alpn:
        context.set_alpn_protocols(list(config.alpn))
    return context


def backend_server_hostname(backend_tls_config: BackendTlsConfig, host: str) -> str:
    """The ``server_hostname`` for a backend connection: ``sni``, else *host*.

    It is sent as SNI (unless it is an IP address) and checked against the
    server's certificate (IP addresses against its IP subjectAltNames).
    """
    return backend_tls_config.sni or host


# ---------------------------------------------------------------------------
# Facts about a finished handshake
# ---------------------------------------------------------------------------


def _common_name(der: bytes) -> str | None:
    try:
        cert = x509.load_der_x509_certificate(der)
        attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except ValueError:
        return None
    for attr in attrs:
        if isinstance(attr.value, str):
            return attr.value
    return None


def ssl_facts(ssl_object: TLSObject, server_tls: ServerTLS) -> SSLFacts:
    """Collect the facts of *ssl_object*'s completed handshake.

    Raises:
        ValueError: The handshake has not completed.
    """
    version, cipher = ssl_object.version(), ssl_object.cipher()
    if version is None or cipher is None:
        raise ValueError("the TLS handshake has not completed")
    der = ssl_object.getpeercert(binary_form=True)
    ours = server_tls.certificate_for(ssl_object)
    # A server only asks for a certificate with CERT_OPTIONAL/REQUIRED, and then
    # a certificate that fails verification fails the handshake: one we hold
    # after the handshake was verified.
    verified = der is not None and ssl_object.context.verify_mode != ssl.CERT_NONE
    return SSLFacts(
        version=version,
        cipher=cipher[0],
        alpn=ssl_object.selected_alpn_protocol(),
        server_name=server_tls.server_name(ssl_object),
        client_cert_der=der,
        client_cn=_common_name(der) if der is not None else None,
        verified=verified,
        sig_alg=ours.sig_alg,
        key_alg=ours.key_alg,
    )
