"""TOML configuration for tlsedge: the schema, the loader and the validator.

Theory of operation
-------------------
The schema is a tree of frozen, slotted, keyword-only dataclasses (`Config` at the
root).  Every dataclass field has exactly the name of its TOML key, and every
default lives in one place: the dataclass.  The loader never repeats a default;
when a key is absent it asks the dataclass field for it.

Reading goes through `_Table`, a view of one TOML table that knows its dotted path
(``listeners[0].tls``) and the dataclass it is read into.  Opening a `_Table`
refuses keys that are not fields of that dataclass (with a did-you-mean hint).
Each value then passes through a *converter*, a function ``(value, path) -> T``
that checks the type and range and raises `ConfigError` naming the path.
Converters are small and composable (`_array(_network)`, `_int_in(1, 64)`,
`_section(HealthConfig, _health)`), so reading a key is one line and there is one
place that decides what a duration or a port is.

After the tree is built, `config_from_mapping` runs the checks that span tables:
unique names, listeners naming existing backends, two sockets not bound to the
same address, what a listener cannot serve (ALPN protocols other than HTTP/1.x
in HTTP mode, offered to clients or to TLS backends; port 0 with several
workers; what a backend behind a ``mode = "udp"`` listener cannot do).
Every check that ``tlsedge run`` relies on is here, so a `Config` built
through the library API (``tlsedge.serve``) is held to the same rules.  Nothing
here touches the network or the file system beyond reading the TOML file itself:
certificate files are opened and host names resolved by `tlsedge._backends.preflight`
(``tlsedge check`` and the edge's start), so a configuration can also be checked
alone on another machine (``tlsedge check --config-only``).

Every failure, for any input, is a `ConfigError` (a `ValueError`) whose message
starts with the dotted path of the offending value, then says what was expected
and what was seen.  The CLI prints it and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias, TypeVar, cast, get_args

from proxyproto._ip import ip_text, network_text, unmap_network
from tlsedge._core.accesslog import ACCESS_LOG_OFF, format_address

__all__ = [
    "Address",
    "BackendConfig",
    "BackendTlsConfig",
    "CertificateConfig",
    "Config",
    "ConfigError",
    "ConfigFileError",
    "DiscoveryConfig",
    "EdgeConfig",
    "ForwardedConfig",
    "HealthConfig",
    "HttpConfig",
    "ListenerConfig",
    "Network",
    "ProxyProtocolConfig",
    "ServerConfig",
    "TlsConfig",
    "config_from_mapping",
    "config_warnings",
    "load_config",
    "parse_config",
    "read_config_text",
]

Network: TypeAlias = IPv4Network | IPv6Network
ListenerMode: TypeAlias = Literal["tcp", "http", "udp"]
UntrustedAction: TypeAlias = Literal["reject", "direct"]
DeniedAction: TypeAlias = Literal["close", "403"]
TlsPolicy: TypeAlias = Literal[
    "modern",
    "intermediate",
    "ELBSecurityPolicy-TLS13-1-2-2021-06",
    "ELBSecurityPolicy-TLS-1-2-2017-01",
    "ELBSecurityPolicy-2016-08",
]
ClientAuth: TypeAlias = Literal["none", "optional", "required"]
Balance: TypeAlias = Literal[
    "round-robin", "least-connections", "random-two", "source-ip"
]
SendProxy: TypeAlias = Literal["none", "v1", "v2"]
ProxyTlv: TypeAlias = Literal[
    "alpn", "authority", "ssl", "unique-id", "crc32c", "ssl-client-cert"
]
BackendProtocol: TypeAlias = Literal["tcp", "tls"]
HealthKind: TypeAlias = Literal["tcp", "http"]
LogFormat: TypeAlias = Literal["text", "json"]
DiscoveryType: TypeAlias = Literal["A", "SRV"]

LISTENER_MODES: Final[tuple[ListenerMode, ...]] = get_args(ListenerMode)
UNTRUSTED_ACTIONS: Final[tuple[UntrustedAction, ...]] = get_args(UntrustedAction)
DENIED_ACTIONS: Final[tuple[DeniedAction, ...]] = get_args(DeniedAction)
TLS_POLICIES: Final[tuple[TlsPolicy, ...]] = get_args(TlsPolicy)
CLIENT_AUTH_MODES: Final[tuple[ClientAuth, ...]] = get_args(ClientAuth)
BALANCE_ALGORITHMS: Final[tuple[Balance, ...]] = get_args(Balance)
SEND_PROXY_MODES: Final[tuple[SendProxy, ...]] = get_args(SendProxy)
PROXY_TLVS: Final[tuple[ProxyTlv, ...]] = get_args(ProxyTlv)
# Sent by default; "ssl-client-cert" (the client's whole certificate, 0x28)
# only when asked for.
DEFAULT_PROXY_TLVS: Final[tuple[ProxyTlv, ...]] = (
    "alpn",
    "authority",
    "ssl",
    "unique-id",
    "crc32c",
)
BACKEND_PROTOCOLS: Final[tuple[BackendProtocol, ...]] = get_args(BackendProtocol)
HEALTH_KINDS: Final[tuple[HealthKind, ...]] = get_args(HealthKind)
LOG_FORMATS: Final[tuple[LogFormat, ...]] = get_args(LogFormat)
DISCOVERY_TYPES: Final[tuple[DiscoveryType, ...]] = get_args(DiscoveryType)
# What an HTTP-mode listener can serve after the handshake: HTTP/1.0 and 1.1,
# and HTTP/2 (offering "h2" turns it on; docs/http2.md).
HTTP_MODE_ALPN: Final = ("h2", "http/1.1", "http/1.0")
# What the edge speaks to the servers of a backend behind an HTTP-mode listener.
HTTP_UPSTREAM_ALPN: Final = ("http/1.1", "http/1.0")
H2Cleartext: TypeAlias = Literal["off", "prior-knowledge"]
H2_CLEARTEXT_MODES: Final[tuple[H2Cleartext, ...]] = get_args(H2Cleartext)

# The PROXY spec: "the receiver ... should wait at least 3 seconds" so that a lost
# segment carrying the header can be retransmitted before we give up.
MIN_PROXY_HEADER_TIMEOUT: Final = 3.0
# More worker processes than this is a typo, not a deployment (one per core).
MAX_WORKERS: Final = 64
# HAProxy's server weights run 0..256; 0 ("drained") is not offered here.
MAX_WEIGHT: Final = 256
# [listeners.http] max_header_bytes bounds: a request line plus a few headers
# needs ~1 KiB; past 1 MiB a "header" is an attack (nginx caps 4 x 8 KiB,
# Envoy 60 KiB, HAProxy 16 KiB).
MIN_HEADER_BYTES: Final = 1024
MAX_HEADER_BYTES: Final = 1 << 20
# Envoy's and HAProxy's upper limit on header count is in the tens of thousands.
MAX_HEADER_COUNT: Final = 10000

T = TypeVar("T")
S = TypeVar("S", bound=str)
Converter: TypeAlias = Callable[[object, str], T]


class ConfigError(ValueError):
    """The configuration is invalid.

    The message starts with the dotted path of the offending value
    (``listeners[0].tls.policy: unknown policy 'x'; choose one of ...``), or with
    the file name when the file cannot be read or is not valid TOML
    (`ConfigFileError`).
    """


class ConfigFileError(ConfigError):
    """The configuration file cannot be read or is not TOML; the message
    starts with the file name (a caller that names the file itself need not
    name it again)."""


# ---------------------------------------------------------------------------
# The schema
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Address:
    """A ``host:port`` pair: an IP address literal or a host name (resolved later).

    IP literals are stored in their canonical form, so ``str()`` gives the same
    text back for canonical input: ``"[::1]:80"``, ``"0.0.0.0:8443"``.
    """

    host: str
    port: int

    @classmethod
    def parse(cls, text: str, *, min_port: int = 0) -> Address:
        """Parse ``"0.0.0.0:8443"``, ``"[::1]:80"``, ``"localhost:80"`` and the like.

        Args:
            text: The address.
            min_port: The lowest port accepted: 0 for binds (0 asks the kernel for
                an ephemeral port), 1 for addresses we connect to.

        Raises:
            ValueError: The text is not an address; the message quotes it.
        """
        if text.startswith("["):
            end = text.find("]")
            if end < 0:
                raise ValueError(f"missing ']' in {_show(text)}")
            host, rest = text[1:end], text[end + 1 :]
            try:
                host = ip_text(ipaddress.IPv6Address(host))
            except ValueError:
                raise ValueError(
                    f"{_show(text)}: brackets hold an IPv6 address, got {_show(host)}"
                ) from None
            if not rest.startswith(":"):
                raise ValueError(f"expected '[ipv6]:port', got {_show(text)}")
            port_text = rest[1:]
        else:
            host, sep, port_text = text.rpartition(":")
            if ":" in host:
                raise ValueError(
                    f"IPv6 addresses need brackets, as in '[::1]:80'; got {_show(text)}"
                )
            if not sep or not host or not port_text:
                hint = " (use 0.0.0.0 or [::] for every address)" if sep else ""
                raise ValueError(f"expected 'host:port', got {_show(text)}{hint}")
            try:
                host = str(ipaddress.IPv4Address(host))
            except ValueError:
                if not _is_hostname(host):
                    raise ValueError(
                        f"invalid host {_show(host)} in {_show(text)}: expected an IP "
                        "address or a host name"
                    ) from None
        if not re.fullmatch(r"[0-9]{1,5}", port_text):
            raise ValueError(f"invalid port {_show(port_text)} in {_show(text)}")
        port = int(port_text)
        if not min_port <= port <= 65535:
            raise ValueError(
                f"port {port} out of range {min_port}..65535 in {_show(text)}"
            )
        return cls(host=host, port=port)

    def __str__(self) -> str:
        return format_address((self.host, self.port))


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeConfig:
    """Process-wide settings (the ``[edge]`` table)."""

    workers: int = 1  # processes sharing the ports via SO_REUSEPORT
    drain_timeout: float = 30.0  # after SIGTERM, before open connections are closed
    max_connections: int = 10000
    admin: Address | None = None  # /metrics, /healthz, /readyz, /status
    log_format: LogFormat = "text"  # the process log; --log-format overrides it
    # "-" (stderr), "stdout", an absolute file path, or "off"
    access_log: str = "-"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyProtocolConfig:
    """Accepting a PROXY header from a load balancer in front (``proxy_protocol``)."""

    versions: frozenset[int] = frozenset({1, 2})
    trusted: tuple[Network, ...]  # peers that must send a header
    untrusted: UntrustedAction = "reject"  # what to do with everybody else
    timeout: float = 5.0  # the whole header must arrive within this


@dataclass(frozen=True, slots=True, kw_only=True)
class CertificateConfig:
    """One certificate chain and its private key (PEM files)."""

    cert: Path
    key: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    """TLS termination on a listener (``[listeners.tls]``)."""

    certificates: tuple[CertificateConfig, ...]  # several: chosen by SNI
    policy: TlsPolicy = "intermediate"
    alpn: tuple[str, ...] = ("http/1.1",)
    client_auth: ClientAuth = "none"
    client_ca: Path | None = None  # needed by client_auth "optional" / "required"
    handshake_timeout: float = 10.0
    strict_sni: bool = False  # refuse unknown or missing SNI (unrecognized_name)
    allow_expired: bool = False  # serve expired certificates (with a warning)


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardedConfig:
    """X-Forwarded-* and RFC 7239 ``Forwarded`` handling (http mode only).

    ``trusted_proxies`` holds its networks with their IPv4-mapped ranges as
    IPv4 (``::ffff:10.0.0.0/104`` as ``10.0.0.0/8``; ``::/0`` also as
    ``0.0.0.0/0``, `proxyproto._ip.unmap_network`), the form
    `tlsedge._core.forwarded.is_trusted_peer` brings a peer to: either form of an
    address matches either form of a network.
    """

    x_forwarded_for: bool = True
    x_forwarded_proto: bool = True
    x_forwarded_port: bool = True
    forwarded: bool = False
    trusted_proxies: tuple[Network, ...] = ()  # client-sent headers kept from these
    request_id: str = ""  # header carrying a per-request id ("" = off)

    def __post_init__(self) -> None:
        forms = (form for n in self.trusted_proxies for form in unmap_network(n))
        object.__setattr__(self, "trusted_proxies", tuple(dict.fromkeys(forms)))


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpConfig:
    """HTTP mode limits and timeouts (``[listeners.http]``, http mode only)."""

    max_header_bytes: int = 16384  # request line + headers (431 beyond); h11's 16 KiB
    max_headers: int = 100  # header fields (431 beyond); Envoy's 100
    request_header_timeout: float = 10.0  # whole request head (408 beyond)
    keepalive_timeout: float = 60.0  # idle between requests (quiet close)
    max_body_size: int = 0  # request body bytes (413 beyond); 0 = unlimited
    # A request body must keep an average of request_body_min_rate bytes/s after
    # a grace of request_body_timeout (408 beyond); Apache's body=20,MinRate=500.
    request_body_timeout: float = 20.0
    request_body_min_rate: int = 500  # bytes/s; 0 = no rate check
    response_timeout: float = 60.0  # request sent -> response head (504 beyond)
    # Request fields whose name holds "_" are dropped unless this is on (nginx's
    # underscores_in_headers): CGI/WSGI read X_Real_IP as HTTP_X_REAL_IP.
    underscores_in_headers: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Http2Config:
    """HTTP/2 to clients (``[listeners.http2]``, http mode only; docs/http2.md).

    Over TLS HTTP/2 is on when ``"h2"`` is in ``[listeners.tls] alpn``; on a
    plain listener ``cleartext = "prior-knowledge"`` serves h2c to clients that
    open with the HTTP/2 preface (others get HTTP/1.1 on the same port).
    """

    cleartext: H2Cleartext = "off"
    # HAProxy's tune.h2.fe.max-concurrent-streams; beyond: REFUSED_STREAM.
    max_concurrent_streams: int = 100
    # SETTINGS_MAX_HEADER_LIST_SIZE (decoded, RFC 9113 6.5.2), and the most
    # bytes of one header block (HEADERS + CONTINUATION); HAProxy's bufsize.
    max_header_list_size: int = 16384
    # SETTINGS_HEADER_TABLE_SIZE: the HPACK dynamic table we keep per connection.
    header_table_size: int = 4096
    # Envoy's edge recommendation: 64 KiB per stream, 1 MiB per connection.
    initial_window_size: int = 65535
    connection_window_size: int = 1048576
    # Within flood_window (beyond: GOAWAY ENHANCE_YOUR_CALM): streams the
    # client resets or we refuse (rapid reset, CVE-2023-44487; Netty's 200
    # per 30 s), PING and SETTINGS frames (Envoy's 1000 control frames).
    max_resets: int = 200
    max_control_frames: int = 1000
    flood_window: float = 30.0
    # Frames with an empty payload in a row (Envoy's 1 allows no flood).
    max_empty_frames: int = 1
    # WINDOW_UPDATE frames allowed per DATA frame we sent (Envoy's 10).
    max_window_updates_per_data_frame: int = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerConfig:
    """One listening socket (a ``[[listeners]]`` table)."""

    name: str
    bind: Address
    mode: ListenerMode = "tcp"
    backend: str
    idle_timeout: float = 60.0
    client_fin_timeout: float = 30.0  # how long a half-closed connection may linger
    max_connections: int = 10000
    # Kubernetes' loadBalancerSourceRanges, judged on the real client (the
    # trusted PROXY header's source, else the peer): admitted when in allow
    # (or allow is empty) and not in deny.
    allow: tuple[Network, ...] = ()
    deny: tuple[Network, ...] = ()
    denied: DeniedAction = "close"  # "403": answer refused HTTP clients (http mode)
    proxy_protocol: ProxyProtocolConfig | None = None
    tls: TlsConfig | None = None
    forwarded: ForwardedConfig = field(default_factory=ForwardedConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    http2: Http2Config = field(default_factory=Http2Config)

    @property
    def h2_over_tls(self) -> bool:
        """HTTP/2 is offered through ALPN."""
        return self.mode == "http" and self.tls is not None and "h2" in self.tls.alpn

    @property
    def h2_cleartext(self) -> bool:
        """h2c with prior knowledge is served (a plain HTTP-mode listener)."""
        return self.mode == "http" and self.http2.cleartext == "prior-knowledge"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """One server of a backend."""

    address: Address
    weight: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendTlsConfig:
    """TLS from the edge to a backend's servers (``[backends.tls]``).

    With no ``ca`` the system trust store is used.
    """

    ca: Path | None = None
    verify: bool = True
    sni: str | None = None
    cert: Path | None = None  # client certificate, together with key
    key: Path | None = None
    alpn: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthConfig:
    """Active health checks (``[backends.health]``); defaults are AWS CLB's."""

    kind: HealthKind = "tcp"
    path: str = "/healthz"  # with kind = "http"
    # With kind = "http": the checks' Host header (Envoy's http_health_check
    # host, HAProxy's http-check send hdr Host); None: the server's address,
    # or the backend's tls.sni.
    host: str | None = None
    # With kind = "http": the statuses that pass, as inclusive ranges
    # (HAProxy's http-check expect status, Envoy's expected_statuses).
    expect: tuple[tuple[int, int], ...] = ((200, 399),)
    # Check this port instead of each server's own (required behind a udp
    # listener: the servers' ports are UDP, checks are TCP or HTTP).
    port: int | None = None
    interval: float = 10.0
    timeout: float = 5.0
    healthy_threshold: int = 2
    unhealthy_threshold: int = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryConfig:
    """Servers found in DNS and re-resolved periodically (``discovery``).

    ``type = "A"`` looks up A and AAAA records and uses ``port``; ``"SRV"``
    takes ports and weights from the records (only the lowest priority).
    """

    name: str
    type: DiscoveryType = "A"
    port: int | None = None  # required with "A"; SRV records carry their ports
    refresh: float = 10.0
    nameserver: Address | None = None  # default: the system resolver


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendConfig:
    """A named group of servers (a ``[[backends]]`` table).

    ``tls`` is never None when ``protocol == "tls"`` (an absent table means the
    defaults); with ``protocol == "tcp"`` a ``[backends.tls]`` table is kept as
    written but not used.
    """

    name: str
    servers: tuple[ServerConfig, ...] = ()  # empty exactly when discovery is set
    discovery: DiscoveryConfig | None = None
    balance: Balance = "round-robin"
    affinity_timeout: float = 10800.0  # with "source-ip": kube-proxy's ClientIP default
    send_proxy: SendProxy = "none"
    proxy_tlvs: tuple[ProxyTlv, ...] = DEFAULT_PROXY_TLVS  # with send_proxy = "v2"
    protocol: BackendProtocol = "tcp"
    connect_timeout: float = 5.0
    retries: int = 3  # connect retries; the last one goes to another server
    server_fin_timeout: float = 30.0
    tls: BackendTlsConfig | None = None
    health: HealthConfig | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The whole configuration file."""

    edge: EdgeConfig = field(default_factory=EdgeConfig)
    listeners: tuple[ListenerConfig, ...]
    backends: tuple[BackendConfig, ...]

    def backend(self, name: str) -> BackendConfig:
        """Return the backend called *name* (``KeyError`` if there is none)."""
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise KeyError(name)


# ---------------------------------------------------------------------------
# Error helpers
# ---------------------------------------------------------------------------


def _fail(path: str, message: str) -> ConfigError:
    return ConfigError(f"{path or 'top level'}: {message}")


def _show(value: object, limit: int = 60) -> str:
    """A short repr for messages (TOML spelling for booleans)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_KINDS: Final[tuple[tuple[type | tuple[type, ...], str], ...]] = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a float"),
    (str, "a string"),
    (Mapping, "a table"),
    ((list, tuple), "an array"),
    (datetime.datetime, "a date-time"),
    (datetime.date, "a date"),
    (datetime.time, "a time"),
)


def _describe(value: object) -> str:
    """Name the TOML type of *value*, with the value itself when it is short."""
    for kind, name in _KINDS:
        if isinstance(value, kind):
            if isinstance(value, Mapping | list | tuple):
                return name
            return f"{name} ({_show(value)})"
    return f"a {type(value).__name__}"


def _choices(options: Iterable[str]) -> str:
    return ", ".join(repr(option) for option in options)


def _suggest(word: str, options: list[str], noun: str) -> str:
    matches = difflib.get_close_matches(word, options, n=1)
    if matches:
        return f" (did you mean {matches[0]!r}?)"
    return f"; {noun}: {_choices(options)}" if options else ""


# ---------------------------------------------------------------------------
# Reading tables
# ---------------------------------------------------------------------------


class _Table:
    """One TOML table being read into the dataclass *schema*."""

    __slots__ = ("_data", "_fields", "path")

    def __init__(self, value: object, path: str, schema: type[Any]) -> None:
        if not isinstance(value, Mapping):
            raise _fail(path, f"expected a table, got {_describe(value)}")
        self._fields = {spec.name: spec for spec in dataclasses.fields(schema)}
        known = list(self._fields)
        for key in value:
            if not isinstance(key, str):
                raise _fail(path, f"keys must be strings, got {_describe(key)}")
            if key not in self._fields:
                hint = _suggest(key, known, "known keys")
                raise _fail(path, f"unknown key {_show(key)}{hint}")
        self._data: Mapping[str, object] = value
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def sub(self, key: str) -> str:
        """The dotted path of *key* in this table."""
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str, convert: Converter[T]) -> T:
        """Convert *key*, or return the schema's default; required keys must exist."""
        if key in self._data:
            return convert(self._data[key], self.sub(key))
        spec = self._fields[key]
        if spec.default is not dataclasses.MISSING:
            return cast("T", spec.default)
        if spec.default_factory is not dataclasses.MISSING:
            return cast("T", spec.default_factory())
        raise _fail(self.path, f"missing required key {key!r}")

    def opt(self, key: str, convert: Converter[T]) -> T | None:
        """Convert *key* if present; None if absent."""
        return convert(self._data[key], self.sub(key)) if key in self._data else None


def _section(schema: type[Any], build: Callable[[_Table], T]) -> Converter[T]:
    """A converter for a sub-table read into *schema* by *build*."""

    def convert(value: object, path: str) -> T:
        return build(_Table(value, path, schema))

    return convert


# ---------------------------------------------------------------------------
# Converters: (value, dotted path) -> checked value
# ---------------------------------------------------------------------------


def _seconds(minimum: float = 0.0, why: str = "") -> Converter[float]:
    """A finite duration in seconds: > 0, or >= *minimum* when that is given."""

    def convert(value: object, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(path, f"expected a number of seconds, got {_describe(value)}")
        try:
            seconds = float(value)
        except OverflowError:  # an integer too big for a float
            seconds = math.inf
        if not math.isfinite(seconds):
            raise _fail(path, f"expected a finite duration, got {_show(value)}")
        if minimum > 0 and seconds < minimum:
            raise _fail(path, f"must be at least {minimum:g} s, got {seconds:g}{why}")
        if seconds <= 0:
            raise _fail(path, f"must be greater than 0 s, got {seconds:g}")
        return seconds

    return convert


_DURATION: Final = _seconds()


def _int_in(low: int, high: int | None = None) -> Converter[int]:
    """An integer (not a boolean, not a float) in ``low..high``."""

    def convert(value: object, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(path, f"expected an integer, got {_describe(value)}")
        if value < low or (high is not None and value > high):
            wanted = f"at least {low}" if high is None else f"between {low} and {high}"
            raise _fail(path, f"must be {wanted}, got {_show(value)}")
        return int(value)

    return convert


def _bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, f"expected true or false, got {_describe(value)}")
    return value


def _string(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise _fail(path, f"expected a string, got {_describe(value)}")
    return str(value)


def _name(value: object, path: str) -> str:
    text = _string(value, path)
    if not text or not text.isprintable():
        raise _fail(path, f"expected a non-empty printable name, got {_show(text)}")
    return text


def _one_of(options: tuple[S, ...], noun: str = "") -> Converter[S]:
    """One of the strings *options*; *noun* (default: the key) names it in errors."""

    def convert(value: object, path: str) -> S:
        if not isinstance(value, str):
            raise _fail(
                path, f"expected one of {_choices(options)}, got {_describe(value)}"
            )
        for option in options:
            if value == option:
                return option
        raise _fail(
            path,
            f"unknown {noun or path.rpartition('.')[2]} {_show(value)}; "
            f"choose one of {_choices(options)}",
        )

    return convert


def _address(min_port: int) -> Converter[Address]:
    def convert(value: object, path: str) -> Address:
        if not isinstance(value, str):
            raise _fail(path, f"expected 'host:port', got {_describe(value)}")
        try:
            return Address.parse(value, min_port=min_port)
        except ValueError as exc:
            raise _fail(path, str(exc)) from None

    return convert


_BIND: Final = _address(0)  # 0 = ephemeral port
_REMOTE: Final = _address(1)


def _network(value: object, path: str) -> Network:
    """A CIDR network or a single address; host bits must be clear."""
    if not isinstance(value, str):
        raise _fail(path, f"expected a CIDR like '10.0.0.0/8', got {_describe(value)}")
    try:
        return ipaddress.ip_network(value)
    except ValueError:
        pass
    try:
        loose = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise _fail(
            path,
            f"expected an IP address or a CIDR like '10.0.0.0/8', got {_show(value)}",
        ) from None
    raise _fail(
        path,
        f"{_show(value)} has host bits set; did you mean '{network_text(loose)}'?",
    )


def _file(base_dir: Path) -> Converter[Path]:
    """A file path; relative paths are relative to the configuration's folder."""

    def convert(value: object, path: str) -> Path:
        text = _string(value, path)
        if not text or "\0" in text:
            raise _fail(path, f"expected a file path, got {_show(text)}")
        return base_dir / text

    return convert


def _alpn_id(value: object, path: str) -> str:
    """An ALPN protocol ID: 1..255 printable ASCII characters (as ssl wants)."""
    text = _string(value, path)
    if not 1 <= len(text) <= 255 or not (text.isascii() and text.isprintable()):
        raise _fail(
            path, f"expected an ALPN protocol name such as 'h2', got {_show(text)}"
        )
    return text


def _hostname(value: object, path: str) -> str:
    text = _string(value, path)
    if not _is_hostname(text):
        raise _fail(path, f"expected a DNS host name, got {_show(text)}")
    return text


def _http_path(value: object, path: str) -> str:
    text = _string(value, path)
    if not text.startswith("/") or not text.isprintable() or " " in text:
        raise _fail(
            path, f"expected a request path starting with '/', got {_show(text)}"
        )
    return text


_HOST_HEADER_EXAMPLES: Final = "'app.example.com', 'app.example.com:8080', '[::1]:8080'"


def _host_header(value: object, path: str) -> str:
    """A Host header: a host name or IP address, with an optional port."""
    text = _string(value, path)
    has_port = text.rpartition(":")[2].isdigit() and not text.endswith("]")
    try:
        Address.parse(text if has_port else f"{text}:1", min_port=1)
    except ValueError:
        raise _fail(
            path,
            "expected a host name or IP address with an optional port, such as "
            f"{_HOST_HEADER_EXAMPLES}, got {_show(text)}",
        ) from None
    return text


#: HTTP status codes a response can carry (RFC 9110 15: three digits, 1xx-5xx).
_STATUS_CODES: Final = range(100, 600)
_STATUS_RANGE_RE: Final = re.compile(r"([0-9]{3})-([0-9]{3})")
_EXPECTED_STATUS: Final = 'a status such as 200 or a range such as "200-399"'


def _status_range(value: object, path: str) -> tuple[int, int]:
    """A status (``200``) or an inclusive range (``"200-399"``) as (low, high)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value not in _STATUS_CODES:
            raise _fail(path, f"a status is between 100 and 599, got {value}")
        return value, value
    if not isinstance(value, str):
        raise _fail(path, f"expected {_EXPECTED_STATUS}, got {_describe(value)}")
    match = _STATUS_RANGE_RE.fullmatch(value)
    if match is None:
        hint = " (a single status is an integer: 200)" if value.isdigit() else ""
        raise _fail(path, f"expected {_EXPECTED_STATUS}, got {_show(value)}{hint}")
    low, high = int(match[1]), int(match[2])
    if low not in _STATUS_CODES or high not in _STATUS_CODES or low > high:
        raise _fail(
            path,
            f"expected a range of statuses between 100 and 599, low to high, "
            f"got {_show(value)}",
        )
    return low, high


def _array(
    item: Converter[T],
    *,
    unique: bool = False,
    empty_error: str = "",
    expected: str = "an array",
) -> Converter[tuple[T, ...]]:
    """An array whose items pass *item*; *empty_error* refuses an empty one."""

    def convert(value: object, path: str) -> tuple[T, ...]:
        if not isinstance(value, list | tuple):
            raise _fail(path, f"expected {expected}, got {_describe(value)}")
        if empty_error and not value:
            raise _fail(path, empty_error)
        items: list[T] = []
        for index, raw in enumerate(value):
            converted = item(raw, f"{path}[{index}]")
            if unique and converted in items:
                raise _fail(f"{path}[{index}]", f"duplicate entry {_show(raw)}")
            items.append(converted)
        return tuple(items)

    return convert


_LABEL: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _is_hostname(text: str) -> bool:
    """RFC 1123 host names (underscores allowed, as container names use them)."""
    name = text.removesuffix(".")
    labels = name.split(".")
    return (
        0 < len(name) <= 253
        and all(_LABEL.fullmatch(label) for label in labels)
        and not labels[-1].isdigit()  # "10.0.0.300" is a bad address, not a name
    )


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------


def _edge(t: _Table, base_dir: Path) -> EdgeConfig:
    return EdgeConfig(
        workers=t.get("workers", _int_in(1, MAX_WORKERS)),
        drain_timeout=t.get("drain_timeout", _DURATION),
        max_connections=t.get("max_connections", _int_in(1)),
        admin=t.opt("admin", _BIND),
        log_format=t.get("log_format", _one_of(LOG_FORMATS)),
        access_log=t.get("access_log", _access_log(base_dir)),
    )


def _access_log(base_dir: Path) -> Converter[str]:
    """``"-"`` (stderr), ``"stdout"``, ``"off"`` or a file (relative to the
    config's folder)."""

    def convert(value: object, path: str) -> str:
        text = _string(value, path)
        if text in {"-", "stdout", ACCESS_LOG_OFF}:
            return text
        if not text or "\0" in text or not text.isprintable():
            raise _fail(
                path,
                f"expected '-', 'stdout', 'off' or a file path, got {_show(text)}",
            )
        return str(base_dir / text)

    return convert


def _nameserver(value: object, path: str) -> Address:
    """``"10.0.0.10"`` (port 53) or ``"127.0.0.1:5353"``: an IP, not a name."""
    text = _string(value, path)
    try:
        ipaddress.ip_address(text)
    except ValueError:
        address = _REMOTE(text, path)
    else:
        address = Address(host=ip_text(ipaddress.ip_address(text)), port=53)
    if _family(address.host) is None:
        raise _fail(
            path, f"expected an IP address such as '10.0.0.10:53', got {_show(text)}"
        )
    return address


def _discovery(t: _Table) -> DiscoveryConfig:
    discovery = DiscoveryConfig(
        name=t.get("name", _hostname),
        type=t.get("type", _one_of(DISCOVERY_TYPES)),
        port=t.opt("port", _int_in(1, 65535)),
        refresh=t.get("refresh", _DURATION),
        nameserver=t.opt("nameserver", _nameserver),
    )
    if discovery.type == "A" and discovery.port is None:
        raise _fail(t.path, "missing required key 'port' (with type = \"A\")")
    if discovery.type == "SRV" and discovery.port is not None:
        raise _fail(
            t.sub("port"),
            'not used with type = "SRV": the SRV records give the ports; remove it',
        )
    return discovery


def _versions(value: object, path: str) -> frozenset[int]:
    versions = _array(_int_in(1, 2), unique=True, empty_error="list 1, 2, or both")
    return frozenset(versions(value, path))


_TRUSTED_EMPTY: Final = (
    "empty, so no peer may send a PROXY header; list the addresses of the load "
    'balancers in front (e.g. ["10.0.0.0/8"]) or remove [listeners.proxy_protocol]'
)
_SPEC_TIMEOUT: Final = (
    "; the PROXY spec asks for at least 3 s to cover a TCP retransmit"
)


def _proxy_protocol(t: _Table) -> ProxyProtocolConfig:
    return ProxyProtocolConfig(
        versions=t.get("versions", _versions),
        trusted=t.get("trusted", _array(_network, empty_error=_TRUSTED_EMPTY)),
        untrusted=t.get("untrusted", _one_of(UNTRUSTED_ACTIONS)),
        timeout=t.get("timeout", _seconds(MIN_PROXY_HEADER_TIMEOUT, _SPEC_TIMEOUT)),
    )


def _certificate(t: _Table, base_dir: Path) -> CertificateConfig:
    return CertificateConfig(
        cert=t.get("cert", _file(base_dir)), key=t.get("key", _file(base_dir))
    )


def _tls(t: _Table, base_dir: Path) -> TlsConfig:
    certificate = _section(CertificateConfig, partial(_certificate, base_dir=base_dir))
    tls = TlsConfig(
        certificates=t.get(
            "certificates",
            _array(
                certificate,
                empty_error='empty; list at least one { cert = "...", key = "..." }',
            ),
        ),
        policy=t.get("policy", _one_of(TLS_POLICIES)),
        alpn=t.get("alpn", _array(_alpn_id, unique=True)),
        client_auth=t.get("client_auth", _one_of(CLIENT_AUTH_MODES)),
        client_ca=t.opt("client_ca", _file(base_dir)),
        handshake_timeout=t.get("handshake_timeout", _DURATION),
        strict_sni=t.get("strict_sni", _bool),
        allow_expired=t.get("allow_expired", _bool),
    )
    if tls.client_auth != "none" and tls.client_ca is None:
        raise _fail(
            t.sub("client_auth"),
            f"{tls.client_auth!r} needs client_ca, the CA file that signs the "
            "client certificates",
        )
    return tls


def _forwarded(t: _Table) -> ForwardedConfig:
    return ForwardedConfig(
        x_forwarded_for=t.get("x_forwarded_for", _bool),
        x_forwarded_proto=t.get("x_forwarded_proto", _bool),
        x_forwarded_port=t.get("x_forwarded_port", _bool),
        forwarded=t.get("forwarded", _bool),
        trusted_proxies=t.get("trusted_proxies", _array(_network)),
        request_id=t.get("request_id", _header_name),
    )


# RFC 9110 field names; ours must also not be one that frames or routes.
_FIELD_NAME_RE: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_RESERVED_FIELDS: Final = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "keep-alive",
        "expect",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-port",
        "x-forwarded-host",
        "x-real-ip",
        "forwarded",
    }
)


def _header_name(value: object, path: str) -> str:
    """An HTTP field name (or "" for off) that does not frame or route a request."""
    text = _string(value, path)
    if text and not _FIELD_NAME_RE.fullmatch(text):
        raise _fail(path, f"expected an HTTP header name, got {_show(text)}")
    if text.lower() in _RESERVED_FIELDS:
        raise _fail(path, f"{_show(text)} is managed by tlsedge; choose another name")
    return text


def _http(t: _Table) -> HttpConfig:
    return HttpConfig(
        max_header_bytes=t.get(
            "max_header_bytes", _int_in(MIN_HEADER_BYTES, MAX_HEADER_BYTES)
        ),
        max_headers=t.get("max_headers", _int_in(1, MAX_HEADER_COUNT)),
        request_header_timeout=t.get("request_header_timeout", _DURATION),
        keepalive_timeout=t.get("keepalive_timeout", _DURATION),
        max_body_size=t.get("max_body_size", _int_in(0)),
        request_body_timeout=t.get("request_body_timeout", _DURATION),
        request_body_min_rate=t.get("request_body_min_rate", _int_in(0)),
        response_timeout=t.get("response_timeout", _DURATION),
        underscores_in_headers=t.get("underscores_in_headers", _bool),
    )


# RFC 9113 6.5.2: a flow-control window is at most 2^31-1 bytes.
_MAX_WINDOW: Final = 2**31 - 1


def _http2(t: _Table) -> Http2Config:
    return Http2Config(
        cleartext=t.get("cleartext", _one_of(H2_CLEARTEXT_MODES)),
        max_concurrent_streams=t.get("max_concurrent_streams", _int_in(1, 10000)),
        max_header_list_size=t.get(
            "max_header_list_size", _int_in(MIN_HEADER_BYTES, MAX_HEADER_BYTES)
        ),
        header_table_size=t.get("header_table_size", _int_in(0, 65536)),
        initial_window_size=t.get("initial_window_size", _int_in(1024, _MAX_WINDOW)),
        connection_window_size=t.get(
            "connection_window_size", _int_in(65535, _MAX_WINDOW)
        ),
        max_resets=t.get("max_resets", _int_in(1)),
        flood_window=t.get("flood_window", _DURATION),
        max_control_frames=t.get("max_control_frames", _int_in(1)),
        max_empty_frames=t.get("max_empty_frames", _int_in(0)),
        max_window_updates_per_data_frame=t.get(
            "max_window_updates_per_data_frame", _int_in(1)
        ),
    )


_SCTP_REFUSED: Final = (
    "SCTP is not supported: tlsedge relays TCP streams, PROXY v2 has no SCTP "
    "transport to describe an association to the backend, and the kernels it "
    "is built on lack SCTP (EPROTONOSUPPORT), so it could not be tested; "
    "docs/sctp.md says what an SCTP listener would take"
)


def _mode(value: object, path: str) -> ListenerMode:
    """A listener mode; SCTP (a Kubernetes Service protocol) is refused with why."""
    if isinstance(value, str) and value.lower() == "sctp":
        raise _fail(path, _SCTP_REFUSED)
    return _one_of(LISTENER_MODES)(value, path)


def _listener(t: _Table, base_dir: Path) -> ListenerConfig:
    mode = t.get("mode", _mode)
    for http_only in ("forwarded", "http", "http2"):
        if mode != "http" and http_only in t:
            raise _fail(
                t.sub(http_only),
                f'only applies with mode = "http" (a {mode} listener does not '
                'read HTTP headers); remove the table or set mode = "http"',
            )
    denied = t.get("denied", _one_of(DENIED_ACTIONS))
    if denied == "403" and mode != "http":
        raise _fail(
            t.sub("denied"),
            f'"403" needs mode = "http" (a {mode} listener does not speak HTTP); '
            'use "close" or set mode = "http"',
        )
    if mode == "udp" and "tls" in t:
        raise _fail(
            t.sub("tls"),
            'a mode = "udp" listener cannot terminate TLS (DTLS is not '
            "supported); remove the table, or terminate DTLS on the servers",
        )
    proxy_protocol = t.opt(
        "proxy_protocol", _section(ProxyProtocolConfig, _proxy_protocol)
    )
    if (
        mode == "udp"
        and proxy_protocol is not None
        and 2 not in proxy_protocol.versions
    ):
        raise _fail(
            f"{t.sub('proxy_protocol')}.versions",
            "a udp listener reads only PROXY v2 headers (v1 is text for TCP "
            "streams and cannot describe a datagram); include 2",
        )
    return ListenerConfig(
        name=t.get("name", _name),
        bind=t.get("bind", _BIND),
        mode=mode,
        backend=t.get("backend", _name),
        idle_timeout=t.get("idle_timeout", _DURATION),
        client_fin_timeout=t.get("client_fin_timeout", _DURATION),
        max_connections=t.get("max_connections", _int_in(1)),
        allow=t.get("allow", _array(_network, unique=True)),
        deny=t.get("deny", _array(_network, unique=True)),
        denied=denied,
        proxy_protocol=proxy_protocol,
        tls=t.opt("tls", _section(TlsConfig, partial(_tls, base_dir=base_dir))),
        forwarded=t.get("forwarded", _section(ForwardedConfig, _forwarded)),
        http=t.get("http", _section(HttpConfig, _http)),
        http2=t.get("http2", _section(Http2Config, _http2)),
    )


def _server(value: object, path: str) -> ServerConfig:
    """``"host:port"`` or ``{ address = "host:port", weight = 2 }``."""
    if isinstance(value, str):
        return ServerConfig(address=_REMOTE(value, path))
    if isinstance(value, Mapping):
        t = _Table(value, path, ServerConfig)
        return ServerConfig(
            address=t.get("address", _REMOTE),
            weight=t.get("weight", _int_in(1, MAX_WEIGHT)),
        )
    raise _fail(
        path,
        "expected 'host:port' or { address = \"host:port\", weight = 1 }, "
        f"got {_describe(value)}",
    )


def _servers(value: object, path: str) -> tuple[ServerConfig, ...]:
    servers = _array(_server, empty_error="a backend needs at least one server")
    result = servers(value, path)
    seen: dict[Address, int] = {}
    for index, server in enumerate(result):
        first = seen.setdefault(server.address, index)
        if first != index:
            raise _fail(
                f"{path}[{index}]",
                f"duplicate server {server.address} (also {path}[{first}]); "
                "use weight to give a server more traffic",
            )
    return result


def _backend_tls(t: _Table, base_dir: Path) -> BackendTlsConfig:
    tls = BackendTlsConfig(
        ca=t.opt("ca", _file(base_dir)),
        verify=t.get("verify", _bool),
        sni=t.opt("sni", _hostname),
        cert=t.opt("cert", _file(base_dir)),
        key=t.opt("key", _file(base_dir)),
        alpn=t.get("alpn", _array(_alpn_id, unique=True)),
    )
    if (tls.cert is None) != (tls.key is None):
        raise _fail(t.path, "cert and key go together: set both or neither")
    return tls


def _health(t: _Table) -> HealthConfig:
    kind = t.get("kind", _one_of(HEALTH_KINDS))
    if kind != "http":
        for http_only in ("host", "expect"):
            if http_only in t:
                raise _fail(
                    t.sub(http_only),
                    f'only applies with kind = "http" (a {kind} check sends no '
                    'request); remove it or set kind = "http"',
                )
    health = HealthConfig(
        kind=kind,
        path=t.get("path", _http_path),
        host=t.opt("host", _host_header),
        expect=t.get(
            "expect",
            _array(
                _status_range,
                empty_error="empty, so no check could pass; list statuses or ranges, "
                'such as [200, 204] or ["200-399"]',
            ),
        ),
        port=t.opt("port", _int_in(1, 65535)),
        interval=t.get("interval", _DURATION),
        timeout=t.get("timeout", _DURATION),
        healthy_threshold=t.get("healthy_threshold", _int_in(1)),
        unhealthy_threshold=t.get("unhealthy_threshold", _int_in(1)),
    )
    if health.timeout > health.interval:
        raise _fail(
            t.sub("timeout"),
            f"must not exceed interval ({health.interval:g} s), got {health.timeout:g}",
        )
    return health


def _backend(t: _Table, base_dir: Path) -> BackendConfig:
    protocol = t.get("protocol", _one_of(BACKEND_PROTOCOLS))
    build_tls = partial(_backend_tls, base_dir=base_dir)
    tls = t.opt("tls", _section(BackendTlsConfig, build_tls))
    if protocol == "tls" and tls is None:
        tls = BackendTlsConfig()  # system trust store, verification on
    discovery = t.opt("discovery", _section(DiscoveryConfig, _discovery))
    if discovery is not None and "servers" in t:
        raise _fail(
            t.sub("discovery"),
            "servers and discovery exclude each other: list the servers or find "
            "them in DNS, not both",
        )
    if discovery is None and "servers" not in t:
        raise _fail(
            t.path,
            "missing required key 'servers' (or a discovery table to find them in DNS)",
        )
    return BackendConfig(
        name=t.get("name", _name),
        servers=t.get("servers", _servers),
        discovery=discovery,
        balance=t.get("balance", _one_of(BALANCE_ALGORITHMS)),
        affinity_timeout=t.get("affinity_timeout", _DURATION),
        send_proxy=t.get("send_proxy", _one_of(SEND_PROXY_MODES)),
        proxy_tlvs=t.get("proxy_tlvs", _array(_one_of(PROXY_TLVS, "TLV"), unique=True)),
        protocol=protocol,
        connect_timeout=t.get("connect_timeout", _DURATION),
        retries=t.get("retries", _int_in(0)),
        server_fin_timeout=t.get("server_fin_timeout", _DURATION),
        tls=tls,
        health=t.opt("health", _section(HealthConfig, _health)),
    )


# ---------------------------------------------------------------------------
# Checks across tables
# ---------------------------------------------------------------------------


def _check_unique_names(kind: str, names: list[str]) -> None:
    seen: dict[str, int] = {}
    for index, name in enumerate(names):
        if name in seen:
            raise _fail(
                f"{kind}s[{index}].name",
                f"duplicate {kind} name {name!r} (also {kind}s[{seen[name]}])",
            )
        seen[name] = index


def _family(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None  # a host name: its family is known only once resolved


def _same_socket(a: Address, b: Address) -> bool:
    """Would binding *a* and *b* collide?  Port 0 never does.

    A wildcard collides with every address of its family.  "0.0.0.0" and "::"
    do not collide: trio sets IPV6_V6ONLY on IPv6 listeners.
    """
    if a.port != b.port or a.port == 0:
        return False
    if a.host.lower() == b.host.lower():
        return True
    family = _family(a.host)
    if family is None or family != _family(b.host):
        return False
    return a.host in {"0.0.0.0", "::"} or b.host in {"0.0.0.0", "::"}


def _check_binds(config: Config) -> None:
    """Two sockets of one transport bound to the same address collide; a UDP
    and a TCP socket on one port do not (DNS serves both on port 53)."""
    binds = [
        (f"listeners[{i}].bind", x.bind, x.mode == "udp")
        for i, x in enumerate(config.listeners)
    ]
    if config.edge.admin is not None:
        binds.append(("edge.admin", config.edge.admin, False))
    for index, (path, address, udp) in enumerate(binds):
        for other_path, other, other_udp in binds[:index]:
            if udp == other_udp and _same_socket(address, other):
                raise _fail(path, f"{address} collides with {other} of {other_path}")


def _check_udp_backends(config: Config) -> None:
    """A backend behind a udp listener has UDP servers: it serves no tcp or
    http listener, speaks no TLS, sends no PROXY v1 (which cannot describe a
    datagram), and its health checks need a TCP port of their own."""
    udp_users: dict[str, int] = {}
    stream_users: dict[str, int] = {}
    for index, lst in enumerate(config.listeners):
        users = udp_users if lst.mode == "udp" else stream_users
        users.setdefault(lst.backend, index)
    for number, backend in enumerate(config.backends):
        user = udp_users.get(backend.name)
        if user is None:
            continue
        path = f"backends[{number}]"
        why = f'(it serves the mode = "udp" listener listeners[{user}])'
        other = stream_users.get(backend.name)
        if other is not None:
            raise _fail(
                f"listeners[{max(user, other)}].backend",
                f"backend {backend.name!r} serves both a udp listener "
                f"(listeners[{user}]) and a {config.listeners[other].mode} "
                f"listener (listeners[{other}]): its servers' ports are either "
                "UDP or TCP; define a backend for each",
            )
        if backend.protocol != "tcp":
            raise _fail(
                f"{path}.protocol",
                f"{backend.protocol!r} cannot carry datagrams {why}: DTLS is not "
                'supported; use "tcp" (plain datagrams)',
            )
        if backend.send_proxy == "v1":
            raise _fail(
                f"{path}.send_proxy",
                f'"v1" cannot describe a datagram {why}: PROXY v1 has only TCP '
                'transports; use "v2" (each datagram gets a DGRAM header) or "none"',
            )
        health = backend.health
        if health is not None and health.port is None:
            raise _fail(
                f"{path}.health",
                f"missing port {why}: the servers' ports are UDP, and a "
                f"{health.kind} check needs a TCP port; give the port the "
                "servers answer checks on (port = N), as cloud load balancers do",
            )


def _check_workers_ports(config: Config) -> None:
    """With several workers, port 0 would give each worker a port of its own."""
    if config.edge.workers == 1:
        return
    for index, lst in enumerate(config.listeners):
        if lst.bind.port == 0:
            raise _fail(
                f"listeners[{index}].bind",
                f"port 0 with edge.workers = {config.edge.workers}: every worker "
                "would get a port of its own; give a fixed port",
            )


def _check_http_mode(config: Config, index: int, lst: ListenerConfig) -> None:
    """Refuse what an HTTP-mode listener cannot serve: protocols other than
    HTTP/1.x and h2 in its ALPN, h2c on a TLS listener, and protocols other
    than HTTP/1.x in the ALPN of its TLS backend (the edge speaks HTTP/1.1 to
    the servers, also for HTTP/2 clients)."""
    if lst.mode != "http":
        return
    backend = config.backend(lst.backend)
    if backend.protocol == "tls" and backend.tls is not None:
        for position, protocol in enumerate(backend.tls.alpn):
            if protocol not in HTTP_UPSTREAM_ALPN:
                number = next(i for i, b in enumerate(config.backends) if b is backend)
                raise _fail(
                    f"backends[{number}].tls.alpn[{position}]",
                    f"{_show(protocol)} cannot be spoken to the servers of a "
                    f'backend behind a mode = "http" listener ({lst.name}), which '
                    f"speaks HTTP/1.1 to them: offer only "
                    f"{_choices(HTTP_UPSTREAM_ALPN)}, or nothing",
                )
    if lst.tls is None:
        return
    if lst.http2.cleartext != "off":
        raise _fail(
            f"listeners[{index}].http2.cleartext",
            f"{_show(lst.http2.cleartext)} is for plain listeners (h2c); a TLS "
            "listener offers HTTP/2 through ALPN: add 'h2' to "
            f"listeners[{index}].tls.alpn instead",
        )
    for position, protocol in enumerate(lst.tls.alpn):
        if protocol not in HTTP_MODE_ALPN:
            raise _fail(
                f"listeners[{index}].tls.alpn[{position}]",
                f'{_show(protocol)} cannot be served in mode = "http" (it is not '
                f"HTTP/1.x or HTTP/2): offer only {_choices(HTTP_MODE_ALPN)}, "
                "or nothing",
            )


def config_from_mapping(data: Mapping[str, Any], *, base_dir: Path) -> Config:
    """Validate parsed TOML (or any mapping of the same shape) into a `Config`.

    Args:
        data: The document, as `tomllib` returns it.
        base_dir: Relative file paths (certificates, CAs) are relative to this,
            normally the folder holding the configuration file.

    Raises:
        ConfigError: Anything is wrong; the message starts with the dotted path.
    """
    t = _Table(data, "", Config)
    listener = _section(ListenerConfig, partial(_listener, base_dir=base_dir))
    backend = _section(BackendConfig, partial(_backend, base_dir=base_dir))
    config = Config(
        edge=t.get("edge", _section(EdgeConfig, partial(_edge, base_dir=base_dir))),
        listeners=t.get(
            "listeners",
            _array(
                listener,
                expected="an array of tables ([[listeners]])",
                empty_error="at least one [[listeners]] table is required",
            ),
        ),
        backends=t.get(
            "backends",
            _array(backend, expected="an array of tables ([[backends]])"),
        ),
    )
    _check_unique_names("listener", [lst.name for lst in config.listeners])
    _check_unique_names("backend", [b.name for b in config.backends])
    backend_names = [b.name for b in config.backends]
    for index, lst in enumerate(config.listeners):
        if lst.backend not in backend_names:
            hint = _suggest(lst.backend, backend_names, "defined backends")
            raise _fail(
                f"listeners[{index}].backend", f"no backend named {lst.backend!r}{hint}"
            )
        _check_http_mode(config, index, lst)
    _check_udp_backends(config)
    _check_binds(config)
    _check_workers_ports(config)
    return config


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of the configuration file at *path*, as `parse_config` takes it.

    Raises:
        ConfigFileError: The file cannot be read or is not UTF-8 (the
            message starts with the file name).
    """
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigFileError(f"{file}: cannot read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(
            f"{file}: invalid TOML: not UTF-8 ({exc.reason})"
        ) from None


def parse_config(text: str, path: str | os.PathLike[str]) -> Config:
    """Validate the TOML *text* of the configuration file at *path*.

    The file itself is not read: relative paths inside *text* are resolved
    against *path*'s folder, and errors name *path*. The supervisor of
    ``edge.workers > 1`` reads the file once (`read_config_text`) and hands
    the text to every worker it starts.

    Raises:
        ConfigFileError: *text* is not TOML (the message starts with the
            file name).
        ConfigError: not a valid configuration (the message starts with the
            dotted path).
    """
    file = Path(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{file}: invalid TOML: {exc}") from None
    return config_from_mapping(data, base_dir=file.absolute().parent)


#: The port gRPC's own examples and most deployments serve on.
GRPC_PORT: Final = 50051


def _grpc_clue(backend: BackendConfig) -> str | None:
    """Why *backend* looks like a gRPC service (its name, its DNS name, gRPC's
    usual port), or None."""
    if "grpc" in backend.name.lower():
        return "by its name"
    if backend.discovery is not None and "grpc" in backend.discovery.name.lower():
        return "by its DNS name"
    if any(server.address.port == GRPC_PORT for server in backend.servers):
        return f"by its port {GRPC_PORT}"
    return None


#: The ``[backends.health]`` keys' values when unset.
_HEALTH_DEFAULTS: Final = HealthConfig()


def config_warnings(config: Config) -> list[str]:
    """What is valid but probably not meant (``tlsedge check`` and ``run``
    print them), each starting with a dotted path.

    A backend that looks like a gRPC service behind a ``mode = "http"``
    listener: the edge speaks HTTP/1.1 to backends, and a gRPC server speaks
    only HTTP/2, so every call would end in a 502. A ``kind = "tcp"`` health
    check given a ``path`` of its own: a tcp check only connects, so
    ``kind = "http"`` was probably meant (``host`` and ``expect`` are refused
    there; ``path`` is accepted because the AWS defaults, and DESIGN's example,
    spell out the default path beside ``kind = "tcp"``, which is not warned
    about).
    """
    warnings = []
    for index, backend in enumerate(config.backends):
        health = backend.health
        if (
            health is not None
            and health.kind == "tcp"
            and health.path != _HEALTH_DEFAULTS.path
        ):
            warnings.append(
                f"backends[{index}].health.path: {health.path!r} is ignored by "
                'kind = "tcp" checks, which only connect; set kind = "http" to '
                "check it"
            )
        clue = _grpc_clue(backend)
        if clue is None:
            continue
        for number, listener in enumerate(config.listeners):
            if listener.backend == backend.name and listener.mode == "http":
                warnings.append(
                    f"backends[{index}]: {backend.name!r} looks like a gRPC "
                    f'service ({clue}), behind the mode = "http" listener '
                    f"listeners[{number}]: the edge speaks HTTP/1.1 to backends "
                    "and gRPC servers only HTTP/2, so every call would get 502; "
                    'serve it from a mode = "tcp" listener (with [listeners.tls] '
                    'alpn = ["h2"] to end TLS at the edge)'
                )
    return warnings


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML configuration file.

    Relative paths inside it are resolved against the file's folder.

    Raises:
        ConfigFileError: The file cannot be read or is not TOML (the message
            starts with the file name).
        ConfigError: It is not a valid configuration (the message starts with
            the dotted path).
    """
    return parse_config(read_config_text(path), path)
