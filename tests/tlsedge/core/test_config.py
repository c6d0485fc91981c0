from __future__ import annotations

import copy
import dataclasses
import datetime
import re
import tempfile
import tomllib
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, strategies as st

from tlsedge._core.config import (
    Address,
    BackendConfig,
    BackendTlsConfig,
    CertificateConfig,
    Config,
    ConfigError,
    DiscoveryConfig,
    EdgeConfig,
    ForwardedConfig,
    HealthConfig,
    Http2Config,
    HttpConfig,
    ListenerConfig,
    ProxyProtocolConfig,
    ServerConfig,
    TlsConfig,
    config_from_mapping,
    config_warnings,
    load_config,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
BASE = Path("/etc/tlsedge")


def parse(text: str, base_dir: Path = BASE) -> Config:
    return config_from_mapping(tomllib.loads(text), base_dir=base_dir)


# A document that sets every key to a value other than its default.
FULL = """
[edge]
workers = 4
drain_timeout = 45
max_connections = 20000
admin = "127.0.0.1:9901"
log_format = "json"
access_log = "logs/access.log"

[[listeners]]
name = "public"
bind = "0.0.0.0:8443"
mode = "http"
backend = "found"
idle_timeout = 120.5
client_fin_timeout = 15.0
max_connections = 5000
allow = ["203.0.113.0/24", "2001:db8::/32"]
deny = ["203.0.113.66"]
denied = "403"

[listeners.proxy_protocol]
versions = [2]
trusted = ["10.0.0.0/8", "192.168.1.7", "fd00::/8"]
untrusted = "direct"
timeout = 3

[listeners.tls]
certificates = [
    { cert = "site.pem", key = "site.key" },
    { cert = "/abs/other.pem", key = "keys/other.key" },
]
policy = "ELBSecurityPolicy-TLS13-1-2-2021-06"
alpn = ["http/1.1", "http/1.0"]
client_auth = "optional"
client_ca = "clients-ca.pem"
handshake_timeout = 7.5
strict_sni = true
allow_expired = true

[listeners.forwarded]
x_forwarded_for = false
x_forwarded_proto = false
x_forwarded_port = false
forwarded = true
trusted_proxies = ["172.16.0.0/12", "::1"]
request_id = "X-Request-Id"

[listeners.http]
max_header_bytes = 8192
max_headers = 50
request_header_timeout = 5
keepalive_timeout = 75.0
max_body_size = 1048576
request_body_timeout = 10
request_body_min_rate = 1000
response_timeout = 30
underscores_in_headers = true

[listeners.http2]
cleartext = "off"  # the default: "prior-knowledge" is for plain listeners
max_concurrent_streams = 64
max_header_list_size = 32768
header_table_size = 8192
initial_window_size = 131072
connection_window_size = 2097152
max_resets = 50
flood_window = 10
max_control_frames = 500
max_empty_frames = 2
max_window_updates_per_data_frame = 5

[[listeners]]
name = "relay"
bind = "[::]:5432"
backend = "app"

[[backends]]
name = "app"
servers = ["127.0.0.1:8080", { address = "10.0.0.5:8080", weight = 2 }]
balance = "source-ip"
affinity_timeout = 600
send_proxy = "v2"
proxy_tlvs = ["crc32c", "alpn"]
protocol = "tls"
connect_timeout = 2.5
retries = 0
server_fin_timeout = 10

[backends.tls]
ca = "backend-ca.pem"
verify = false
sni = "app.internal"
cert = "client.pem"
key = "client.key"
alpn = ["http/1.1"]

[backends.health]
kind = "http"
path = "/ready?full=1"
host = "app.example.com:8443"
expect = [200, 204, "300-399"]
port = 8081
interval = 5
timeout = 5
healthy_threshold = 3
unhealthy_threshold = 1

[[backends]]
name = "db"
servers = [{ address = "db.internal:5432" }]
send_proxy = "v1"
protocol = "tls"

[[backends]]
name = "found"

[backends.discovery]
name = "app.default.svc.cluster.local."
type = "A"
port = 8080
refresh = 2.5
nameserver = "127.0.0.1:5353"
"""

FULL_EXPECTED = Config(
    edge=EdgeConfig(
        workers=4,
        drain_timeout=45.0,
        max_connections=20000,
        admin=Address(host="127.0.0.1", port=9901),
        log_format="json",
        access_log=str(BASE / "logs/access.log"),
    ),
    listeners=(
        ListenerConfig(
            name="public",
            bind=Address(host="0.0.0.0", port=8443),
            mode="http",
            backend="found",
            idle_timeout=120.5,
            client_fin_timeout=15.0,
            max_connections=5000,
            allow=(ip_network("203.0.113.0/24"), ip_network("2001:db8::/32")),
            deny=(ip_network("203.0.113.66/32"),),
            denied="403",
            proxy_protocol=ProxyProtocolConfig(
                versions=frozenset({2}),
                trusted=(
                    ip_network("10.0.0.0/8"),
                    ip_network("192.168.1.7/32"),
                    ip_network("fd00::/8"),
                ),
                untrusted="direct",
                timeout=3.0,
            ),
            tls=TlsConfig(
                certificates=(
                    CertificateConfig(cert=BASE / "site.pem", key=BASE / "site.key"),
                    CertificateConfig(
                        cert=Path("/abs/other.pem"), key=BASE / "keys/other.key"
                    ),
                ),
                policy="ELBSecurityPolicy-TLS13-1-2-2021-06",
                alpn=("http/1.1", "http/1.0"),
                client_auth="optional",
                client_ca=BASE / "clients-ca.pem",
                handshake_timeout=7.5,
                strict_sni=True,
                allow_expired=True,
            ),
            forwarded=ForwardedConfig(
                x_forwarded_for=False,
                x_forwarded_proto=False,
                x_forwarded_port=False,
                forwarded=True,
                trusted_proxies=(ip_network("172.16.0.0/12"), ip_network("::1/128")),
                request_id="X-Request-Id",
            ),
            http=HttpConfig(
                max_header_bytes=8192,
                max_headers=50,
                request_header_timeout=5.0,
                keepalive_timeout=75.0,
                max_body_size=1048576,
                request_body_timeout=10.0,
                request_body_min_rate=1000,
                response_timeout=30.0,
                underscores_in_headers=True,
            ),
            http2=Http2Config(
                max_concurrent_streams=64,
                max_header_list_size=32768,
                header_table_size=8192,
                initial_window_size=131072,
                connection_window_size=2097152,
                max_resets=50,
                flood_window=10.0,
                max_control_frames=500,
                max_empty_frames=2,
                max_window_updates_per_data_frame=5,
            ),
        ),
        ListenerConfig(name="relay", bind=Address(host="::", port=5432), backend="app"),
    ),
    backends=(
        BackendConfig(
            name="app",
            servers=(
                ServerConfig(address=Address(host="127.0.0.1", port=8080)),
                ServerConfig(address=Address(host="10.0.0.5", port=8080), weight=2),
            ),
            balance="source-ip",
            affinity_timeout=600.0,
            send_proxy="v2",
            proxy_tlvs=("crc32c", "alpn"),
            protocol="tls",
            connect_timeout=2.5,
            retries=0,
            server_fin_timeout=10.0,
            tls=BackendTlsConfig(
                ca=BASE / "backend-ca.pem",
                verify=False,
                sni="app.internal",
                cert=BASE / "client.pem",
                key=BASE / "client.key",
                alpn=("http/1.1",),
            ),
            health=HealthConfig(
                kind="http",
                path="/ready?full=1",
                host="app.example.com:8443",
                expect=((200, 200), (204, 204), (300, 399)),
                port=8081,
                interval=5.0,
                timeout=5.0,
                healthy_threshold=3,
                unhealthy_threshold=1,
            ),
        ),
        BackendConfig(
            name="db",
            servers=(ServerConfig(address=Address(host="db.internal", port=5432)),),
            send_proxy="v1",
            protocol="tls",
            tls=BackendTlsConfig(),  # protocol = "tls" without a table: defaults
        ),
        BackendConfig(
            name="found",
            discovery=DiscoveryConfig(
                name="app.default.svc.cluster.local.",
                port=8080,
                refresh=2.5,
                nameserver=Address(host="127.0.0.1", port=5353),
            ),
        ),
    ),
)


def test_full_config() -> None:
    config = parse(FULL)
    assert config == FULL_EXPECTED
    assert config.backend("db") is config.backends[1]
    with pytest.raises(KeyError):
        config.backend("nope")
    for value in (config.edge.drain_timeout, config.listeners[0].proxy_protocol):
        assert not isinstance(value, int)


def test_full_config_sets_every_key() -> None:
    # Guards FULL against schema growth: every field of every table appears in it.
    data = tomllib.loads(FULL)
    listener, backend = data["listeners"][0], data["backends"][0]
    discovered = data["backends"][2]  # servers and discovery exclude each other
    tables: list[tuple[type[Any], dict[str, Any]]] = [
        (Config, data),
        (EdgeConfig, data["edge"]),
        (ListenerConfig, listener),
        (ProxyProtocolConfig, listener["proxy_protocol"]),
        (TlsConfig, listener["tls"]),
        (CertificateConfig, listener["tls"]["certificates"][0]),
        (ForwardedConfig, listener["forwarded"]),
        (HttpConfig, listener["http"]),
        (Http2Config, listener["http2"]),
        (BackendConfig, backend | {"discovery": discovered["discovery"]}),
        (DiscoveryConfig, discovered["discovery"]),
        (ServerConfig, backend["servers"][1]),
        (BackendTlsConfig, backend["tls"]),
        (HealthConfig, backend["health"]),
    ]
    for schema, table in tables:
        assert {f.name for f in dataclasses.fields(schema)} == set(table), schema


MINIMAL = """
[[listeners]]
name = "l"
bind = "127.0.0.1:0"
backend = "b"

[[backends]]
name = "b"
servers = ["127.0.0.1:8080"]
"""


def test_minimal_config_gets_every_default() -> None:
    config = parse(MINIMAL)
    edge = config.edge
    assert edge.workers == 1
    assert edge.drain_timeout == 30.0
    assert edge.max_connections == 10000
    assert edge.admin is None
    assert edge.log_format == "text"
    assert edge.access_log == "-"
    # "off" is a value, not a file name.
    assert parse("[edge]\naccess_log = 'off'\n" + MINIMAL).edge.access_log == "off"

    (listener,) = config.listeners
    assert listener.name == "l"
    assert listener.bind == Address(host="127.0.0.1", port=0)
    assert listener.backend == "b"
    assert listener.mode == "tcp"
    assert listener.idle_timeout == 60.0
    assert listener.client_fin_timeout == 30.0
    assert listener.max_connections == 10000
    assert listener.allow == ()  # everyone
    assert listener.deny == ()
    assert listener.denied == "close"
    assert listener.proxy_protocol is None
    assert listener.tls is None
    assert listener.forwarded == ForwardedConfig()
    assert listener.forwarded.x_forwarded_for is True
    assert listener.forwarded.x_forwarded_proto is True
    assert listener.forwarded.x_forwarded_port is True
    assert listener.forwarded.forwarded is False
    assert listener.forwarded.trusted_proxies == ()
    assert listener.forwarded.request_id == ""
    assert listener.http == HttpConfig(
        max_header_bytes=16384,
        max_headers=100,
        request_header_timeout=10.0,
        keepalive_timeout=60.0,
        max_body_size=0,
        request_body_timeout=20.0,
        request_body_min_rate=500,
        response_timeout=60.0,
        underscores_in_headers=False,
    )

    (backend,) = config.backends
    assert backend.servers == (
        ServerConfig(address=Address(host="127.0.0.1", port=8080), weight=1),
    )
    assert backend.balance == "round-robin"
    assert backend.affinity_timeout == 10800.0
    assert backend.send_proxy == "none"
    assert backend.proxy_tlvs == ("alpn", "authority", "ssl", "unique-id", "crc32c")
    assert backend.protocol == "tcp"
    assert backend.connect_timeout == 5.0
    assert backend.retries == 3
    assert backend.server_fin_timeout == 30.0
    assert backend.tls is None
    assert backend.health is None
    assert backend.discovery is None


def test_sub_table_defaults() -> None:
    config = parse(
        MINIMAL
        + """
[listeners.proxy_protocol]
trusted = ["127.0.0.1"]
[listeners.tls]
certificates = [{ cert = "c.pem", key = "k.pem" }]
[backends.tls]
[backends.health]
"""
    )
    proxy = config.listeners[0].proxy_protocol
    assert proxy == ProxyProtocolConfig(trusted=(ip_network("127.0.0.1/32"),))
    assert proxy.versions == frozenset({1, 2})
    assert proxy.untrusted == "reject"
    assert proxy.timeout == 5.0
    tls = config.listeners[0].tls
    assert tls is not None
    assert tls.policy == "intermediate"
    assert tls.alpn == ("http/1.1",)
    assert tls.client_auth == "none"
    assert tls.client_ca is None
    assert tls.handshake_timeout == 10.0
    assert tls.strict_sni is False
    assert tls.allow_expired is False
    backend_tls = config.backends[0].tls
    assert backend_tls == BackendTlsConfig(
        ca=None, verify=True, sni=None, cert=None, key=None, alpn=()
    )
    assert config.backends[0].health == HealthConfig(
        kind="tcp",
        path="/healthz",
        interval=10.0,
        timeout=5.0,
        healthy_threshold=2,
        unhealthy_threshold=6,
    )


# The example of DESIGN.md section 4, verbatim: the contract's own example loads.
DESIGN_EXAMPLE = """
[edge]
workers = 1
drain_timeout = 30.0
max_connections = 10000
admin = "127.0.0.1:9901"

[[listeners]]
name = "public"
bind = "0.0.0.0:8443"
mode = "http"
backend = "app"
allow = ["0.0.0.0/0", "::/0"]
deny = []
idle_timeout = 60.0
client_fin_timeout = 30.0
max_connections = 10000

[listeners.proxy_protocol]
versions = [1, 2]
trusted = ["10.0.0.0/8"]
untrusted = "reject"
timeout = 5.0

[listeners.tls]
certificates = [{ cert = "site.pem", key = "site.key" }]
policy = "intermediate"
alpn = ["http/1.1"]
client_auth = "none"
client_ca = "clients-ca.pem"
handshake_timeout = 10.0

[listeners.forwarded]
x_forwarded_for = true
x_forwarded_proto = true
x_forwarded_port = true
forwarded = false
trusted_proxies = []

[[backends]]
name = "app"
servers = ["127.0.0.1:8080", { address = "10.0.0.5:8080", weight = 2 }]
balance = "round-robin"
affinity_timeout = 10800.0
send_proxy = "none"
proxy_tlvs = ["alpn", "authority", "ssl", "unique-id", "crc32c"]
protocol = "tcp"
connect_timeout = 5.0
retries = 3
server_fin_timeout = 30.0

[backends.tls]
ca = "backend-ca.pem"
verify = true
sni = "app.internal"

[backends.health]
kind = "tcp"
path = "/healthz"
interval = 10.0
timeout = 5.0
healthy_threshold = 2
unhealthy_threshold = 6
"""


def test_design_example_loads() -> None:
    config = parse(DESIGN_EXAMPLE)
    assert config.listeners[0].tls is not None
    assert config.backends[0].health == HealthConfig()
    assert config.edge == EdgeConfig(admin=Address(host="127.0.0.1", port=9901))


# --- errors -----------------------------------------------------------------


def listener(**keys: str) -> str:
    """A [[listeners]] table; values are TOML literals."""
    fields = {"name": '"l"', "bind": '"0.0.0.0:8443"', "backend": '"b"'} | keys
    lines = [f"{key} = {value}" for key, value in fields.items() if value]
    return "[[listeners]]\n" + "\n".join(lines) + "\n"


def backend(**keys: str) -> str:
    """A [[backends]] table; values are TOML literals."""
    fields = {"name": '"b"', "servers": '["127.0.0.1:8080"]'} | keys
    lines = [f"{key} = {value}" for key, value in fields.items() if value]
    return "[[backends]]\n" + "\n".join(lines) + "\n"


L, B = listener(), backend()
HTTP = listener(mode='"http"')
CERTS = 'certificates = [{ cert = "c.pem", key = "k.pem" }]\n'
PP = "[listeners.proxy_protocol]\n"
PPT = PP + 'trusted = ["10.0.0.0/8"]\n'

ERRORS: list[tuple[str, str]] = [
    # unknown and missing keys, wrong table shapes
    (
        L.replace("bind", "bnd") + B,
        "listeners[0]: unknown key 'bnd' (did you mean 'bind'?)",
    ),
    (
        "listener = []\n" + L + B,
        "top level: unknown key 'listener' (did you mean 'listeners'?)",
    ),
    ("[edge]\nzzz = 1\n" + L + B, "edge: unknown key 'zzz'; known keys: 'workers', "),
    (
        L + B + "[backends.health]\nintervl = 3\n",
        "backends[0].health: unknown key 'intervl' (did you mean 'interval'?)",
    ),
    (
        L + B + "[backends.tls]\nverfy = true\n",
        "backends[0].tls: unknown key 'verfy' (did you mean 'verify'?)",
    ),
    (listener(bind="") + B, "listeners[0]: missing required key 'bind'"),
    (listener(name="") + B, "listeners[0]: missing required key 'name'"),
    (L + backend(servers=""), "backends[0]: missing required key 'servers'"),
    (B, "top level: missing required key 'listeners'"),
    (L, "top level: missing required key 'backends'"),
    ("listeners = []\n" + B, "listeners: at least one [[listeners]] table is required"),
    (
        "[listeners]\nname = 'l'\n" + B,
        "listeners: expected an array of tables ([[listeners]]), got a table",
    ),
    (
        "backends = 'b'\n" + L,
        "backends: expected an array of tables ([[backends]]), got a string ('b')",
    ),
    ("edge = 1\n" + L + B, "edge: expected a table, got an integer (1)"),
    (
        listener(tls='"yes"') + B,
        "listeners[0].tls: expected a table, got a string ('yes')",
    ),
    (
        listener(proxy_protocol="[]") + B,
        "listeners[0].proxy_protocol: expected a table, got an array",
    ),
    # edge
    ("[edge]\nworkers = 0\n" + L + B, "edge.workers: must be between 1 and 64, got 0"),
    (
        "[edge]\nworkers = 65\n" + L + B,
        "edge.workers: must be between 1 and 64, got 65",
    ),
    (
        "[edge]\nworkers = true\n" + L + B,
        "edge.workers: expected an integer, got a boolean (true)",
    ),
    (
        "[edge]\nworkers = 2.0\n" + L + B,
        "edge.workers: expected an integer, got a float (2.0)",
    ),
    (
        "[edge]\ndrain_timeout = -1\n" + L + B,
        "edge.drain_timeout: must be greater than 0 s, got -1",
    ),
    (
        "[edge]\nmax_connections = 0\n" + L + B,
        "edge.max_connections: must be at least 1, got 0",
    ),
    (
        "[edge]\nadmin = 'localhost'\n" + L + B,
        "edge.admin: expected 'host:port', got 'localhost'",
    ),
    (
        "[edge]\nadmin = '0.0.0.0:8443'\n" + L + B,
        "edge.admin: 0.0.0.0:8443 collides with 0.0.0.0:8443 of listeners[0].bind",
    ),
    # listener scalars
    (
        listener(name='""') + B,
        "listeners[0].name: expected a non-empty printable name, got ''",
    ),
    (
        listener(name="1") + B,
        "listeners[0].name: expected a string, got an integer (1)",
    ),
    (
        listener(bind='"10.0.0.1"') + B,
        "listeners[0].bind: expected 'host:port', got '10.0.0.1'",
    ),
    (
        listener(bind='":80"') + B,
        "listeners[0].bind: expected 'host:port', got ':80' (use 0.0.0.0 or [::]",
    ),
    (
        listener(bind='"::1:80"') + B,
        "listeners[0].bind: IPv6 addresses need brackets, as in '[::1]:80'",
    ),
    (
        listener(bind='"[10.0.0.1]:80"') + B,
        "listeners[0].bind: '[10.0.0.1]:80': brackets hold an IPv6 address",
    ),
    (
        listener(bind='"[::1]80"') + B,
        "listeners[0].bind: expected '[ipv6]:port', got '[::1]80'",
    ),
    (listener(bind='"[::1:80"') + B, "listeners[0].bind: missing ']' in '[::1:80'"),
    (
        listener(bind='"localhost:http"') + B,
        "listeners[0].bind: invalid port 'http' in 'localhost:http'",
    ),
    (listener(bind='"localhost:-1"') + B, "listeners[0].bind: invalid port '-1'"),
    (
        listener(bind='"0.0.0.0:70000"') + B,
        "listeners[0].bind: port 70000 out of range 0..65535",
    ),
    (
        listener(bind='"bad host:80"') + B,
        "listeners[0].bind: invalid host 'bad host' in 'bad host:80'",
    ),
    (
        listener(bind='"10.0.0.300:80"') + B,
        "listeners[0].bind: invalid host '10.0.0.300'",
    ),
    (
        listener(bind="8443") + B,
        "listeners[0].bind: expected 'host:port', got an integer (8443)",
    ),
    (
        listener(mode='"quic"') + B,
        "listeners[0].mode: unknown mode 'quic'; choose one of 'tcp', 'http', 'udp'",
    ),
    (
        listener(mode="true") + B,
        "listeners[0].mode: expected one of 'tcp', 'http', 'udp', got a boolean (true)",
    ),
    (
        listener(mode='"udp"') + B + 'send_proxy = "v1"\n',
        'backends[0].send_proxy: "v1" cannot describe a datagram (it serves the '
        'mode = "udp" listener listeners[0])',
    ),
    # client source ranges
    (
        listener(allow='["10.0.0.0/8", "office"]') + B,
        "listeners[0].allow[1]: expected an IP address or a CIDR like "
        "'10.0.0.0/8', got 'office'",
    ),
    (
        listener(allow='["2001:db8::1/32"]') + B,
        "listeners[0].allow[0]: '2001:db8::1/32' has host bits set; did you mean "
        "'2001:db8::/32'?",
    ),
    (
        listener(deny='["::ffff:192.0.2.1/120"]') + B,
        "listeners[0].deny[0]: '::ffff:192.0.2.1/120' has host bits set; did you "
        "mean '::ffff:192.0.2.0/120'?",
    ),
    (
        listener(allow='["10.0.0.0/8", "10.0.0.0/8"]') + B,
        "listeners[0].allow[1]: duplicate entry '10.0.0.0/8'",
    ),
    (
        listener(deny='["10.0.0.0/40"]') + B,
        "listeners[0].deny[0]: expected an IP address or a CIDR like '10.0.0.0/8', "
        "got '10.0.0.0/40'",
    ),
    (
        listener(deny='"10.0.0.0/8"') + B,
        "listeners[0].deny: expected an array, got a string ('10.0.0.0/8')",
    ),
    (
        listener(deny="[10]") + B,
        "listeners[0].deny[0]: expected a CIDR like '10.0.0.0/8', got an integer (10)",
    ),
    (
        listener(denied='"404"') + B,
        "listeners[0].denied: unknown denied '404'; choose one of 'close', '403'",
    ),
    (
        listener(denied="403") + B,
        "listeners[0].denied: expected one of 'close', '403', got an integer (403)",
    ),
    (
        listener(denied='"403"') + B,
        'listeners[0].denied: "403" needs mode = "http" (a tcp listener does not '
        'speak HTTP); use "close" or set mode = "http"',
    ),
    (
        listener(idle_timeout="0") + B,
        "listeners[0].idle_timeout: must be greater than 0 s, got 0",
    ),
    (
        listener(idle_timeout="-0.5") + B,
        "listeners[0].idle_timeout: must be greater than 0 s, got -0.5",
    ),
    (
        listener(idle_timeout='"60"') + B,
        "listeners[0].idle_timeout: expected a number of seconds, got a string ('60')",
    ),
    (
        listener(idle_timeout="true") + B,
        "listeners[0].idle_timeout: expected a number of seconds, got a boolean (true)",
    ),
    (
        listener(idle_timeout="inf") + B,
        "listeners[0].idle_timeout: expected a finite duration, got inf",
    ),
    (
        listener(idle_timeout="nan") + B,
        "listeners[0].idle_timeout: expected a finite duration, got nan",
    ),
    (
        listener(idle_timeout="1979-05-27") + B,
        "listeners[0].idle_timeout: expected a number of seconds, got a date",
    ),
    (
        listener(idle_timeout="[1]") + B,
        "listeners[0].idle_timeout: expected a number of seconds, got an array",
    ),
    (
        listener(client_fin_timeout="0") + B,
        "listeners[0].client_fin_timeout: must be greater than 0 s",
    ),
    (
        listener(max_connections="0") + B,
        "listeners[0].max_connections: must be at least 1, got 0",
    ),
    (
        listener(max_connections="1.5") + B,
        "listeners[0].max_connections: expected an integer, got a float (1.5)",
    ),
    (
        listener(backend='"nope"') + B,
        "listeners[0].backend: no backend named 'nope'; defined backends: 'b'",
    ),
    (
        listener(backend='"bb"') + B,
        "listeners[0].backend: no backend named 'bb' (did you mean 'b'?)",
    ),
    # cross checks
    (
        L + listener(bind='"127.0.0.1:9000"') + B,
        "listeners[1].name: duplicate listener name 'l' (also listeners[0])",
    ),
    (
        L + B + backend(),
        "backends[1].name: duplicate backend name 'b' (also backends[0])",
    ),
    (
        L + listener(name='"m"') + B,
        "listeners[1].bind: 0.0.0.0:8443 collides with 0.0.0.0:8443 of "
        "listeners[0].bind",
    ),
    (
        L + listener(name='"m"', bind='"127.0.0.1:8443"') + B,
        "listeners[1].bind: 127.0.0.1:8443 collides with 0.0.0.0:8443 of "
        "listeners[0].bind",
    ),
    (
        listener(bind='"[::1]:80"') + listener(name='"m"', bind='"[::]:80"') + B,
        "listeners[1].bind: [::]:80 collides with [::1]:80 of listeners[0].bind",
    ),
    (
        listener(bind='"Example.com:80"')
        + listener(name='"m"', bind='"example.COM:80"')
        + B,
        "listeners[1].bind: example.COM:80 collides with Example.com:80",
    ),
    # proxy_protocol
    (L + PP + B, "listeners[0].proxy_protocol: missing required key 'trusted'"),
    (
        L + PP + "trusted = []\n" + B,
        "listeners[0].proxy_protocol.trusted: empty, so no peer may send a PROXY "
        "header",
    ),
    (
        L + PP + 'trusted = ["10.0.0.1/8"]\n' + B,
        "listeners[0].proxy_protocol.trusted[0]: '10.0.0.1/8' has host bits set; did "
        "you mean '10.0.0.0/8'?",
    ),
    (
        L + PP + 'trusted = ["::/0", "lb.internal"]\n' + B,
        "listeners[0].proxy_protocol.trusted[1]: expected an IP address or a CIDR "
        "like '10.0.0.0/8', got 'lb.internal'",
    ),
    (
        L + PP + "trusted = [10]\n" + B,
        "listeners[0].proxy_protocol.trusted[0]: expected a CIDR like '10.0.0.0/8', "
        "got an integer (10)",
    ),
    (
        L + PP + 'trusted = "10.0.0.0/8"\n' + B,
        "listeners[0].proxy_protocol.trusted: expected an array, got a string "
        "('10.0.0.0/8')",
    ),
    (
        L + PPT + "versions = [3]\n" + B,
        "listeners[0].proxy_protocol.versions[0]: must be between 1 and 2, got 3",
    ),
    (
        L + PPT + "versions = []\n" + B,
        "listeners[0].proxy_protocol.versions: list 1, 2, or both",
    ),
    (
        L + PPT + "versions = [2, 2]\n" + B,
        "listeners[0].proxy_protocol.versions[1]: duplicate entry 2",
    ),
    (
        L + PPT + "versions = [true]\n" + B,
        "listeners[0].proxy_protocol.versions[0]: expected an integer, got a boolean "
        "(true)",
    ),
    (
        L + PPT + 'untrusted = "allow"\n' + B,
        "listeners[0].proxy_protocol.untrusted: unknown untrusted 'allow'; choose one "
        "of 'reject', 'direct'",
    ),
    (
        L + PPT + "timeout = 2.9\n" + B,
        "listeners[0].proxy_protocol.timeout: must be at least 3 s, got 2.9; the "
        "PROXY spec asks for at least 3 s to cover a TCP retransmit",
    ),
    (
        L + PPT + "timeout = 0\n" + B,
        "listeners[0].proxy_protocol.timeout: must be at least 3 s, got 0",
    ),
    # tls
    (
        L + "[listeners.tls]\n" + B,
        "listeners[0].tls: missing required key 'certificates'",
    ),
    (
        L + "[listeners.tls]\ncertificates = []\n" + B,
        "listeners[0].tls.certificates: empty; list at least one",
    ),
    (
        L + "[listeners.tls]\ncertificates = ['c.pem']\n" + B,
        "listeners[0].tls.certificates[0]: expected a table, got a string ('c.pem')",
    ),
    (
        L + "[listeners.tls]\ncertificates = [{ cert = 'c.pem' }]\n" + B,
        "listeners[0].tls.certificates[0]: missing required key 'key'",
    ),
    (
        L + "[listeners.tls]\ncertificates = [{ cert = '', key = 'k' }]\n" + B,
        "listeners[0].tls.certificates[0].cert: expected a file path, got ''",
    ),
    (
        L
        + "[listeners.tls]\ncertificates = [{ cert = 'c', key = 'k', chain = 'x' }]\n"
        + B,
        "listeners[0].tls.certificates[0]: unknown key 'chain'",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + 'policy = "x"\n' + B,
        "listeners[0].tls.policy: unknown policy 'x'; choose one of 'modern', "
        "'intermediate', 'ELBSecurityPolicy-TLS13-1-2-2021-06', "
        "'ELBSecurityPolicy-TLS-1-2-2017-01', 'ELBSecurityPolicy-2016-08'",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + 'client_auth = "required"\n' + B,
        "listeners[0].tls.client_auth: 'required' needs client_ca",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + 'client_auth = "optional"\n' + B,
        "listeners[0].tls.client_auth: 'optional' needs client_ca",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + 'client_auth = "maybe"\n' + B,
        "listeners[0].tls.client_auth: unknown client_auth 'maybe'; choose one of "
        "'none', 'optional', 'required'",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + 'alpn = [""]\n' + B,
        "listeners[0].tls.alpn[0]: expected an ALPN protocol name such as 'h2', got ''",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + 'alpn = ["h2", "h2"]\n' + B,
        "listeners[0].tls.alpn[1]: duplicate entry 'h2'",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + 'alpn = "h2"\n' + B,
        "listeners[0].tls.alpn: expected an array, got a string ('h2')",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + "handshake_timeout = 0\n" + B,
        "listeners[0].tls.handshake_timeout: must be greater than 0 s",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + 'strict_sni = "yes"\n' + B,
        "listeners[0].tls.strict_sni: expected true or false, got a string ('yes')",
    ),
    (
        L + "[listeners.tls]\n" + CERTS + "allow_expired = 1\n" + B,
        "listeners[0].tls.allow_expired: expected true or false, got an integer (1)",
    ),
    # forwarded
    (
        L + "[listeners.forwarded]\n" + B,
        'listeners[0].forwarded: only applies with mode = "http"',
    ),
    (
        HTTP + "[listeners.forwarded]\nx_forwarded_for = 'yes'\n" + B,
        "listeners[0].forwarded.x_forwarded_for: expected true or false, got a string "
        "('yes')",
    ),
    (
        HTTP + "[listeners.forwarded]\nforwarded = 1\n" + B,
        "listeners[0].forwarded.forwarded: expected true or false, got an integer (1)",
    ),
    (
        HTTP + "[listeners.forwarded]\ntrusted_proxies = ['10.0.0.1/8']\n" + B,
        "listeners[0].forwarded.trusted_proxies[0]: '10.0.0.1/8' has host bits set",
    ),
    (
        HTTP + "[listeners.forwarded]\nrequest_id = 'X Request'\n" + B,
        "listeners[0].forwarded.request_id: expected an HTTP header name, got "
        "'X Request'",
    ),
    (
        HTTP + "[listeners.forwarded]\nrequest_id = 'Content-Length'\n" + B,
        "listeners[0].forwarded.request_id: 'Content-Length' is managed by tlsedge",
    ),
    (
        HTTP + "[listeners.forwarded]\nrequest_id = 1\n" + B,
        "listeners[0].forwarded.request_id: expected a string, got an integer (1)",
    ),
    # http
    (
        L + "[listeners.http]\n" + B,
        'listeners[0].http: only applies with mode = "http"',
    ),
    (
        HTTP + "[listeners.http]\nmax_header_bytes = 100\n" + B,
        "listeners[0].http.max_header_bytes: must be between 1024 and 1048576, got 100",
    ),
    (
        HTTP + "[listeners.http]\nmax_headers = 0\n" + B,
        "listeners[0].http.max_headers: must be between 1 and 10000, got 0",
    ),
    (
        HTTP + "[listeners.http]\nmax_body_size = -1\n" + B,
        "listeners[0].http.max_body_size: must be at least 0, got -1",
    ),
    (
        HTTP + "[listeners.http]\nresponse_timeout = 0\n" + B,
        "listeners[0].http.response_timeout: must be greater than 0 s, got 0",
    ),
    (
        HTTP + "[listeners.http]\nrequest_body_min_rate = -1\n" + B,
        "listeners[0].http.request_body_min_rate: must be at least 0, got -1",
    ),
    (
        HTTP + "[listeners.http]\nkeepalive_timout = 5\n" + B,
        "listeners[0].http: unknown key 'keepalive_timout'",
    ),
    # backends and servers
    (
        L + backend(servers="[]"),
        "backends[0].servers: a backend needs at least one server",
    ),
    (
        L + backend(name='"a"') + backend(servers='["10.0.0.1"]'),
        "backends[1].servers[0]: expected 'host:port', got '10.0.0.1'",
    ),
    (
        L + backend(servers='["10.0.0.1:0"]'),
        "backends[0].servers[0]: port 0 out of range 1..65535 in '10.0.0.1:0'",
    ),
    (
        L + backend(servers="[8080]"),
        "backends[0].servers[0]: expected 'host:port' or { address = \"host:port\", "
        "weight = 1 }, got an integer (8080)",
    ),
    (
        L + backend(servers='"10.0.0.1:80"'),
        "backends[0].servers: expected an array, got a string ('10.0.0.1:80')",
    ),
    (
        L + backend(servers="[{ weight = 2 }]"),
        "backends[0].servers[0]: missing required key 'address'",
    ),
    (
        L + backend(servers="[{ address = 'a:1', wieght = 2 }]"),
        "backends[0].servers[0]: unknown key 'wieght' (did you mean 'weight'?)",
    ),
    (
        L + backend(servers="[{ address = 'a:1', weight = 0 }]"),
        "backends[0].servers[0].weight: must be between 1 and 256, got 0",
    ),
    (
        L + backend(servers="[{ address = 'a:1', weight = 257 }]"),
        "backends[0].servers[0].weight: must be between 1 and 256, got 257",
    ),
    (
        L + backend(servers="[{ address = 'a:1', weight = 1.5 }]"),
        "backends[0].servers[0].weight: expected an integer, got a float (1.5)",
    ),
    (
        L + backend(servers="[{ address = 'a' }]"),
        "backends[0].servers[0].address: expected 'host:port', got 'a'",
    ),
    (
        L + backend(servers="['a:1', { address = 'a:1' }]"),
        "backends[0].servers[1]: duplicate server a:1 (also backends[0].servers[0]); "
        "use weight",
    ),
    (
        L + backend(name='""'),
        "backends[0].name: expected a non-empty printable name, got ''",
    ),
    (
        L + backend(name='"b\\n"'),
        "backends[0].name: expected a non-empty printable name, got 'b\\n'",
    ),
    (
        L + backend(balance='"rr"'),
        "backends[0].balance: unknown balance 'rr'; choose one of 'round-robin', "
        "'least-connections', 'random-two', 'source-ip'",
    ),
    (
        L + backend(send_proxy='"v3"'),
        "backends[0].send_proxy: unknown send_proxy 'v3'; choose one of 'none', 'v1', "
        "'v2'",
    ),
    (
        L + backend(send_proxy="2"),
        "backends[0].send_proxy: expected one of 'none', 'v1', 'v2', got an integer "
        "(2)",
    ),
    (
        L + backend(proxy_tlvs='["netns"]'),
        "backends[0].proxy_tlvs[0]: unknown TLV 'netns'; choose one of 'alpn', "
        "'authority', 'ssl', 'unique-id', 'crc32c'",
    ),
    (
        L + backend(proxy_tlvs='["ssl", "alpn", "ssl"]'),
        "backends[0].proxy_tlvs[2]: duplicate entry 'ssl'",
    ),
    (
        L + backend(protocol='"https"'),
        "backends[0].protocol: unknown protocol 'https'; choose one of 'tcp', 'tls'",
    ),
    (
        L + backend(connect_timeout='"5s"'),
        "backends[0].connect_timeout: expected a number of seconds, got a string "
        "('5s')",
    ),
    (
        L + backend(affinity_timeout="0"),
        "backends[0].affinity_timeout: must be greater than 0 s",
    ),
    (
        L + backend(server_fin_timeout="-inf"),
        "backends[0].server_fin_timeout: expected a finite duration, got -inf",
    ),
    (L + backend(retries="-1"), "backends[0].retries: must be at least 0, got -1"),
    (
        L + backend(retries="false"),
        "backends[0].retries: expected an integer, got a boolean (false)",
    ),
    # backend tls
    (
        L + B + "[backends.tls]\ncert = 'c.pem'\n",
        "backends[0].tls: cert and key go together: set both or neither",
    ),
    (
        L + B + "[backends.tls]\nkey = 'k.pem'\n",
        "backends[0].tls: cert and key go together",
    ),
    (
        L + B + "[backends.tls]\nverify = 'no'\n",
        "backends[0].tls.verify: expected true or false, got a string ('no')",
    ),
    (
        L + B + "[backends.tls]\nsni = '10.0.0.1'\n",
        "backends[0].tls.sni: expected a DNS host name, got '10.0.0.1'",
    ),
    (
        L + B + "[backends.tls]\nsni = 'a b'\n",
        "backends[0].tls.sni: expected a DNS host name, got 'a b'",
    ),
    (
        L + B + "[backends.tls]\nca = 5\n",
        "backends[0].tls.ca: expected a string, got an integer (5)",
    ),
    (
        L + B + "[backends.tls]\nalpn = ['h2', 7]\n",
        "backends[0].tls.alpn[1]: expected a string, got an integer (7)",
    ),
    # health
    (
        L + B + "[backends.health]\ntimeout = 20\n",
        "backends[0].health.timeout: must not exceed interval (10 s), got 20",
    ),
    (
        L + B + "[backends.health]\ninterval = 2\n",
        "backends[0].health.timeout: must not exceed interval (2 s), got 5",
    ),
    (
        L + B + "[backends.health]\npath = 'healthz'\n",
        "backends[0].health.path: expected a request path starting with '/', got "
        "'healthz'",
    ),
    (
        L + B + "[backends.health]\npath = '/a b'\n",
        "backends[0].health.path: expected a request path starting with '/'",
    ),
    (
        L + B + "[backends.health]\nkind = 'udp'\n",
        "backends[0].health.kind: unknown kind 'udp'; choose one of 'tcp', 'http'",
    ),
    (
        L + B + "[backends.health]\nport = 0\n",
        "backends[0].health.port: must be between 1 and 65535, got 0",
    ),
    (
        L + B + "[backends.health]\nhealthy_threshold = 0\n",
        "backends[0].health.healthy_threshold: must be at least 1, got 0",
    ),
    (
        L + B + "[backends.health]\nunhealthy_threshold = 0\n",
        "backends[0].health.unhealthy_threshold: must be at least 1, got 0",
    ),
    (
        L + B + "[backends.health]\nhost = 'app.example.com'\n",
        'backends[0].health.host: only applies with kind = "http" (a tcp check '
        'sends no request); remove it or set kind = "http"',
    ),
    (
        L + B + "[backends.health]\nexpect = [200]\n",
        'backends[0].health.expect: only applies with kind = "http"',
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nhost = 'a b'\n",
        "backends[0].health.host: expected a host name or IP address with an "
        "optional port, such as 'app.example.com', 'app.example.com:8080', "
        "'[::1]:8080', got 'a b'",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nhost = '::1'\n",
        "backends[0].health.host: expected a host name or IP address",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nhost = 'app:0'\n",
        "backends[0].health.host: expected a host name or IP address",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nhost = 80\n",
        "backends[0].health.host: expected a string, got an integer (80)",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nexpect = []\n",
        "backends[0].health.expect: empty, so no check could pass",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nexpect = 200\n",
        "backends[0].health.expect: expected an array, got an integer (200)",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nexpect = [200, 600]\n",
        "backends[0].health.expect[1]: a status is between 100 and 599, got 600",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nexpect = ['200']\n",
        "backends[0].health.expect[0]: expected a status such as 200 or a range "
        "such as \"200-399\", got '200' (a single status is an integer: 200)",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nexpect = ['2xx']\n",
        "backends[0].health.expect[0]: expected a status such as 200 or a range",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nexpect = ['399-200']\n",
        "backends[0].health.expect[0]: expected a range of statuses between 100 "
        "and 599, low to high, got '399-200'",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nexpect = ['200-999']\n",
        "backends[0].health.expect[0]: expected a range of statuses between 100",
    ),
    (
        L + B + "[backends.health]\nkind = 'http'\nexpect = [true]\n",
        "backends[0].health.expect[0]: expected a status such as 200 or a range "
        'such as "200-399", got a boolean (true)',
    ),
]


@pytest.mark.parametrize(("text", "message"), ERRORS)
def test_error_names_the_dotted_path(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert message in str(info.value)
    # The message starts with the path: the part of the fragment before ": ".
    assert str(info.value).startswith(message.split(": ", maxsplit=1)[0] + ": ")


@pytest.mark.parametrize(
    "text",
    [
        # port 0 never collides
        L.replace("0.0.0.0:8443", "0.0.0.0:0")
        + listener(name='"m"', bind='"0.0.0.0:0"')
        + B,
        # trio sets IPV6_V6ONLY, so the two wildcards do not collide
        L + listener(name='"m"', bind='"[::]:8443"') + B,
        # different addresses of one family
        listener(bind='"127.0.0.1:80"')
        + listener(name='"m"', bind='"127.0.0.2:80"')
        + B,
        # host names are resolved later; only identical names collide
        listener(bind='"localhost:80"')
        + listener(name='"m"', bind='"127.0.0.1:80"')
        + B,
        # one backend for two listeners, and a backend nobody uses
        L + listener(name='"m"', bind='"0.0.0.0:9"') + B + backend(name='"spare"'),
    ],
)
def test_valid_variants(text: str) -> None:
    parse(text)


@pytest.mark.parametrize(
    "host", ["app.example.com", "app:8080", "10.0.0.1", "10.0.0.1:80", "[::1]:8080"]
)
def test_health_check_host_header(host: str) -> None:
    text = L + B + f"[backends.health]\nkind = 'http'\nhost = '{host}'\n"
    health = parse(text).backends[0].health
    assert health is not None
    assert health.host == host  # sent as written


def test_health_check_expected_statuses() -> None:
    text = L + B + "[backends.health]\nkind = 'http'\nexpect = [204, '200-299']\n"
    health = parse(text).backends[0].health
    assert health is not None
    assert health.expect == ((204, 204), (200, 299))
    assert HealthConfig().expect == ((200, 399),)  # 2xx and 3xx, as before


@pytest.mark.parametrize(
    ("text", "warned"),
    [
        (
            listener(mode='"http"', backend='"grpc"')
            + backend(name='"grpc"', servers='["10.0.0.5:8080"]'),
            True,
        ),
        (
            listener(mode='"http"', backend='"Orders-gRPC"')
            + backend(name='"Orders-gRPC"'),
            True,
        ),
        (HTTP + backend(servers='["10.0.0.5:50051"]'), True),
        (
            HTTP
            + backend(
                servers="",
                discovery='{ name = "_grpc._tcp.api.default.svc.", type = "SRV" }',
            ),
            True,
        ),
        (HTTP + B, False),  # an HTTP/1.1 app
        # tcp mode relays HTTP/2 as it is
        (listener(backend='"grpc"') + backend(name='"grpc"'), False),
    ],
)
def test_a_grpc_backend_behind_http_mode_is_warned_about(
    text: str, warned: bool
) -> None:
    warnings = config_warnings(parse(text))
    if not warned:
        assert warnings == []
        return
    (warning,) = warnings
    assert warning.startswith("backends[0]: ")
    assert 'behind the mode = "http" listener listeners[0]' in warning
    assert "every call would get 502" in warning
    assert 'mode = "tcp"' in warning


@pytest.mark.parametrize(
    ("health", "warned"),
    [
        ('kind = "tcp"\npath = "/ready"\n', True),
        ('path = "/ready"\n', True),  # kind's default is tcp
        ('kind = "tcp"\npath = "/healthz"\n', False),  # AWS's defaults spelled out
        ('kind = "http"\npath = "/ready"\n', False),
        ('kind = "tcp"\n', False),
    ],
)
def test_a_path_on_a_tcp_health_check_is_warned_about(
    health: str, warned: bool
) -> None:
    warnings = config_warnings(parse(L + B + "[backends.health]\n" + health))
    if not warned:
        assert warnings == []
        return
    assert warnings == [
        "backends[0].health.path: '/ready' is ignored by kind = \"tcp\" checks, "
        'which only connect; set kind = "http" to check it'
    ]


def test_keys_that_toml_cannot_produce() -> None:
    with pytest.raises(
        ConfigError, match=r"^top level: expected a table, got an array"
    ):
        config_from_mapping([], base_dir=BASE)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^top level: keys must be strings"):
        config_from_mapping({1: 2}, base_dir=BASE)  # type: ignore[dict-item]
    data = tomllib.loads(MINIMAL)
    data["listeners"] = tuple(data["listeners"])  # tuples are arrays too
    data["edge"] = {"drain_timeout": 10**400}  # too big for a float
    with pytest.raises(ConfigError, match=r"^edge.drain_timeout: expected a finite"):
        config_from_mapping(data, base_dir=BASE)
    data["edge"] = {"admin": None}
    with pytest.raises(ConfigError, match=r"^edge.admin: expected 'host:port', got a"):
        config_from_mapping(data, base_dir=BASE)


def test_long_values_are_shortened_in_messages() -> None:
    text = listener(bind='"' + "x" * 500 + '"') + B
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert len(str(info.value)) < 200
    assert "..." in str(info.value)


# --- addresses ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("0.0.0.0:8443", "0.0.0.0", 8443),
        ("127.0.0.1:0", "127.0.0.1", 0),
        ("localhost:80", "localhost", 80),
        ("[::1]:80", "::1", 80),
        ("[::]:65535", "::", 65535),
        ("[fe80::1%eth0]:443", "fe80::1%eth0", 443),
        ("app.internal.:8080", "app.internal.", 8080),
        ("my_service:8080", "my_service", 8080),
    ],
)
def test_address_round_trip(text: str, host: str, port: int) -> None:
    address = Address.parse(text)
    assert address == Address(host=host, port=port)
    assert str(address) == text
    assert Address.parse(str(address)) == address


def test_address_canonical_ip() -> None:
    assert str(Address.parse("[0:0::0:1]:80")) == "[::1]:80"
    assert Address.parse("[2001:DB8::1]:80").host == "2001:db8::1"
    # IPv4-mapped: the IPv4 address readable (RFC 5952 section 5)
    mapped = Address.parse("[::FFFF:C000:242]:80")
    assert mapped.host == "::ffff:192.0.2.66"
    assert str(mapped) == "[::ffff:192.0.2.66]:80"


@pytest.mark.parametrize(
    ("text", "min_port"),
    [
        ("10.0.0.1", 0),
        ("10.0.0.1:", 0),
        (":80", 0),
        ("::1", 0),
        ("[::1]", 0),
        ("[host]:80", 0),
        ("host:0", 1),
        ("host:65536", 0),
        ("host:+80", 0),
        ("host: 80", 0),
        ("host:٨٠", 0),  # non-ASCII digits
        ("-bad-:80", 0),
        ("a..b:80", 0),
        ("1.2.3.4.5:80", 0),
        ("", 0),
    ],
)
def test_address_parse_rejects(text: str, min_port: int) -> None:
    with pytest.raises(ValueError, match=r"."):
        Address.parse(text, min_port=min_port)


@given(st.text(max_size=40))
def test_address_parse_never_crashes(text: str) -> None:
    try:
        address = Address.parse(text)
    except ValueError:
        return
    assert Address.parse(str(address)) == address


# --- files -------------------------------------------------------------------


TLS_MINIMAL = """
[[listeners]]
name = "l"
bind = "127.0.0.1:0"
backend = "b"
[listeners.tls]
certificates = [{ cert = "certs/site.pem", key = "/keys/site.key" }]
client_auth = "required"
client_ca = "../ca.pem"
[[backends]]
name = "b"
servers = ["127.0.0.1:8080"]
[backends.tls]
ca = "backend-ca.pem"
"""


def test_relative_paths_resolve_against_the_config_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "edge.toml").write_text(TLS_MINIMAL)
    monkeypatch.chdir(tmp_path)
    config = load_config("conf/edge.toml")  # a relative path: base_dir is absolute
    tls = config.listeners[0].tls
    assert tls is not None
    assert tls.certificates[0].cert == conf_dir / "certs/site.pem"
    assert tls.certificates[0].cert.is_absolute()
    assert tls.certificates[0].key == Path("/keys/site.key")
    assert tls.client_ca == conf_dir / "../ca.pem"
    backend_tls = config.backends[0].tls
    assert backend_tls is not None
    assert backend_tls.ca == conf_dir / "backend-ca.pem"
    # files are not opened here: none of them exists
    assert not (conf_dir / "certs/site.pem").exists()


def test_load_config_accepts_pathlike(tmp_path: Path) -> None:
    file = tmp_path / "edge.toml"
    file.write_text(MINIMAL)
    assert load_config(file) == parse(MINIMAL)


def test_toml_syntax_error(tmp_path: Path) -> None:
    file = tmp_path / "bad.toml"
    file.write_text("[edge]\nworkers = = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(file)
    message = str(info.value)
    assert message.startswith(f"{file}: invalid TOML: ")
    assert "line 2" in message


def test_not_utf8(tmp_path: Path) -> None:
    file = tmp_path / "bad.toml"
    file.write_bytes(b"# \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"invalid TOML"):
        load_config(file)


@pytest.mark.parametrize("name", ["missing.toml", "."])
def test_unreadable_file(tmp_path: Path, name: str) -> None:
    file = tmp_path / name
    with pytest.raises(ConfigError) as info:
        load_config(file)
    assert str(info.value).startswith(f"{file}: cannot read: ")


# --- what a listener cannot serve: refused when the Config is built ------------


@pytest.mark.parametrize("mode", ['"sctp"', '"SCTP"'])
def test_sctp_is_refused_with_the_reason_and_the_doc(mode: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(listener(mode=mode) + B)
    message = str(info.value)
    assert message.startswith("listeners[0].mode: SCTP is not supported: ")
    assert "PROXY v2 has no SCTP transport" in message
    assert "EPROTONOSUPPORT" in message
    assert message.endswith("docs/sctp.md says what an SCTP listener would take")
    doc = Path(__file__).resolve().parents[3] / "docs/sctp.md"
    assert doc.is_file()


def test_source_ranges_of_both_families() -> None:
    config = parse(
        listener(
            mode='"http"',
            allow='["10.0.0.0/8", "2001:db8::/32", "192.0.2.7"]',
            deny='["10.1.0.0/16", "::ffff:10.2.0.0/112"]',
            denied='"403"',
        )
        + B
    )
    (lst,) = config.listeners
    assert lst.allow == (
        ip_network("10.0.0.0/8"),
        ip_network("2001:db8::/32"),
        ip_network("192.0.2.7/32"),
    )
    assert lst.deny == (ip_network("10.1.0.0/16"), ip_network("::ffff:10.2.0.0/112"))
    assert lst.denied == "403"


def test_http_mode_to_a_tcp_backend_is_accepted() -> None:
    parse(HTTP + B)


def test_http_mode_to_tls_backends_is_accepted() -> None:
    # AWS backend-protocol: https / Kubernetes appProtocol: https.
    config = parse(
        HTTP
        + backend(protocol='"tls"', send_proxy='"v2"')
        + '[backends.tls]\nsni = "api.internal"\nalpn = ["http/1.1"]\n'
    )
    assert config.listeners[0].mode == "http"
    assert config.backends[0].protocol == "tls"
    assert config.backends[0].tls is not None
    assert config.backends[0].tls.sni == "api.internal"
    parse(HTTP + backend(protocol='"tls"'))  # no [backends.tls]: the defaults


def test_http_mode_refuses_h2_in_the_alpn_of_its_tls_backend() -> None:
    # The edge speaks HTTP/1.1 to the servers: a server must not pick h2.
    with pytest.raises(ConfigError) as info:
        parse(
            HTTP
            + backend(name='"a"')
            + backend(protocol='"tls"')
            + '[backends.tls]\nalpn = ["http/1.1", "h2"]\n'
        )
    assert str(info.value) == (
        "backends[1].tls.alpn[1]: 'h2' cannot be spoken to the servers of a "
        'backend behind a mode = "http" listener (l), which speaks HTTP/1.1 to '
        "them: offer only 'http/1.1', 'http/1.0', or nothing"
    )
    # The same backend behind a tcp listener may offer h2.
    parse(L + backend(protocol='"tls"') + '[backends.tls]\nalpn = ["h2"]\n')


def test_tls_both_ways_and_tcp_are_accepted() -> None:
    parse(L + "[listeners.tls]\n" + CERTS + B)
    parse(L + backend(name='"a"') + backend(protocol='"tls"'))
    parse(MINIMAL + "[backends.tls]\n")  # unused without "tls"


@pytest.mark.parametrize("alpn", ['["h2", "http/1.1"]', '["http/1.1", "h2"]'])
def test_http_mode_accepts_h2_in_alpn(alpn: str) -> None:
    config = parse(HTTP + f"[listeners.tls]\n{CERTS}alpn = {alpn}\n" + B)
    assert config.listeners[0].h2_over_tls
    assert not config.listeners[0].h2_cleartext


def test_h2c_prior_knowledge_on_a_plain_http_listener() -> None:
    config = parse(HTTP + '[listeners.http2]\ncleartext = "prior-knowledge"\n' + B)
    assert config.listeners[0].h2_cleartext
    assert not config.listeners[0].h2_over_tls
    assert config.listeners[0].http2.max_concurrent_streams == 100


def test_h2c_on_a_tls_listener_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse(
            HTTP
            + '[listeners.http2]\ncleartext = "prior-knowledge"\n'
            + f"[listeners.tls]\n{CERTS}"
            + B
        )
    assert str(info.value) == (
        "listeners[0].http2.cleartext: 'prior-knowledge' is for plain listeners "
        "(h2c); a TLS listener offers HTTP/2 through ALPN: add 'h2' to "
        "listeners[0].tls.alpn instead"
    )


def test_http2_table_in_tcp_mode_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse(L + '[listeners.http2]\ncleartext = "prior-knowledge"\n' + B)
    assert str(info.value).startswith(
        'listeners[0].http2: only applies with mode = "http"'
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "mystery = 1",
            "listeners[0].http2: unknown key 'mystery'",
        ),
        (
            'cleartext = "upgrade"',
            "listeners[0].http2.cleartext: unknown cleartext 'upgrade'; choose "
            "one of 'off', 'prior-knowledge'",
        ),
        (
            "max_concurrent_streams = 0",
            "listeners[0].http2.max_concurrent_streams: must be between 1 and "
            "10000, got 0",
        ),
        (
            "initial_window_size = 2147483648",
            "listeners[0].http2.initial_window_size: must be between 1024 and "
            "2147483647, got 2147483648",
        ),
        (
            "flood_window = 0",
            "listeners[0].http2.flood_window: must be greater than 0 s, got 0",
        ),
    ],
)
def test_http2_table_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(HTTP + f"[listeners.http2]\n{text}\n" + B)
    assert str(info.value).startswith(message)


def test_http_mode_refuses_other_protocols_in_alpn() -> None:
    with pytest.raises(ConfigError) as info:
        parse(HTTP + f'[listeners.tls]\n{CERTS}alpn = ["http/1.1", "acme-tls/1"]\n' + B)
    assert str(info.value).startswith(
        "listeners[0].tls.alpn[1]: 'acme-tls/1' cannot be served in "
        'mode = "http" (it is not HTTP/1.x or HTTP/2)'
    )


@pytest.mark.parametrize("alpn", ['["http/1.1"]', '["http/1.1", "http/1.0"]', "[]"])
def test_http_mode_accepts_http1_alpn(alpn: str) -> None:
    config = parse(HTTP + f"[listeners.tls]\n{CERTS}alpn = {alpn}\n" + B)
    assert config.listeners[0].tls is not None


def test_tcp_mode_accepts_any_alpn() -> None:
    # A relay cannot know what its backend speaks: the operator lists it.
    config = parse(L + f'[listeners.tls]\n{CERTS}alpn = ["h2", "http/1.1"]\n' + B)
    assert config.listeners[0].tls is not None
    assert config.listeners[0].tls.alpn == ("h2", "http/1.1")


def test_port_0_with_several_workers_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse("[edge]\nworkers = 2\n" + listener(bind='"127.0.0.1:0"') + B)
    assert str(info.value).startswith(
        "listeners[0].bind: port 0 with edge.workers = 2: every worker would get "
        "a port of its own"
    )
    parse("[edge]\nworkers = 1\n" + listener(bind='"127.0.0.1:0"') + B)


def test_example_tcp_relay() -> None:
    config = load_config(EXAMPLES / "tcp-relay.toml")
    (lst,) = config.listeners
    assert lst.mode == "tcp"
    assert lst.proxy_protocol is not None
    assert lst.proxy_protocol.trusted == (ip_network("127.0.0.1/32"),)
    (bk,) = config.backends
    assert bk.send_proxy == "v2"
    assert bk.servers == (ServerConfig(address=Address(host="127.0.0.1", port=8080)),)


def test_example_edge_documents_every_section() -> None:
    config = load_config(EXAMPLES / "edge.toml")
    lst = config.listeners[0]
    assert lst.tls is not None
    assert lst.proxy_protocol is not None
    assert lst.mode == "http"
    assert lst.tls.certificates[0].cert.parent == EXAMPLES / "certs"
    assert config.edge.admin is not None
    assert any(b.health is not None for b in config.backends)
    assert any(b.tls is not None for b in config.backends)
    text = (EXAMPLES / "edge.toml").read_text()
    schemas: list[type[Any]] = [
        EdgeConfig,
        ListenerConfig,
        ProxyProtocolConfig,
        TlsConfig,
        ForwardedConfig,
        HttpConfig,
        BackendConfig,
        BackendTlsConfig,
        HealthConfig,
        DiscoveryConfig,
    ]
    for schema in schemas:
        for spec in dataclasses.fields(schema):
            pattern = rf"^(\[\w+\.{spec.name}\]|{spec.name} =)"
            assert re.search(pattern, text, re.MULTILINE), spec.name


# --- property: any input gives a Config or a ConfigError ----------------------


def _schema_keys() -> list[str]:
    schemas = (
        Config,
        EdgeConfig,
        ListenerConfig,
        ProxyProtocolConfig,
        TlsConfig,
        CertificateConfig,
        ForwardedConfig,
        HttpConfig,
        BackendConfig,
        ServerConfig,
        BackendTlsConfig,
        HealthConfig,
        DiscoveryConfig,
    )
    return sorted(
        {spec.name for schema in schemas for spec in dataclasses.fields(schema)}
    )


# Strings that get past the type checks and exercise the value checks.
interesting_strings = st.sampled_from(
    [
        "",
        "b",
        "l",
        "tcp",
        "http",
        "tls",
        "v2",
        "none",
        "required",
        "source-ip",
        "alpn",
        "127.0.0.1:8080",
        "0.0.0.0:0",
        "[::1]:80",
        "10.0.0.0/8",
        "10.0.0.1/8",
        "/healthz",
        "c.pem",
        "\x00",
    ]
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | interesting_strings
    | st.dates()
    | st.datetimes()
    | st.times()
    | st.binary(max_size=4)
)
keys = st.sampled_from(_schema_keys()) | st.text(max_size=8)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=6)
    ),
    max_leaves=25,
)


def _load_or_reject(data: Any) -> None:
    try:
        config = config_from_mapping(data, base_dir=BASE)
    except ConfigError as error:
        _check_config_error(error, data)  # defined below
        return
    assert isinstance(config, Config)


@given(values)
def test_any_document_gives_config_or_config_error(data: Any) -> None:
    _load_or_reject(data)


@given(st.dictionaries(keys, values, max_size=4))
def test_any_table_gives_config_or_config_error(data: dict[str, Any]) -> None:
    _load_or_reject(data)


@given(st.data())
def test_any_change_to_a_valid_config_gives_config_or_config_error(
    data: st.DataObject,
) -> None:
    document: Any = tomllib.loads(FULL)
    node = document
    for _ in range(data.draw(st.integers(0, 4), label="depth")):
        if isinstance(node, dict) and node:
            child = node[data.draw(st.sampled_from(sorted(node)))]
        elif isinstance(node, list) and node:
            child = node[data.draw(st.integers(0, len(node) - 1))]
        else:
            break
        if not isinstance(child, dict | list):
            break
        node = child
    new = data.draw(values, label="value")
    if isinstance(node, dict):
        node[data.draw(keys, label="key")] = new
    elif node:
        node[data.draw(st.integers(0, len(node) - 1))] = new
    _load_or_reject(document)


def test_datetime_values_are_described() -> None:
    data = tomllib.loads(MINIMAL)
    data["edge"] = {"workers": datetime.time(1, 2)}
    with pytest.raises(
        ConfigError, match=r"^edge.workers: expected an integer, got a time"
    ):
        config_from_mapping(data, base_dir=BASE)


# --- property: mutations of the real configurations ----------------------------
#
# The properties above feed random shapes and one change to FULL; these start from
# every shipped example, make up to four structural changes of any kind (delete,
# replace, add, duplicate, wrap, empty) or mangle the TOML text itself, and check
# the documented contract of the error too: it starts with the dotted path of a
# place that exists in the document ("top level" for the document itself), or
# with the file name when the file is not TOML.

# (document, base_dir) pairs: every complete configuration we ship or test with.
VALID_DOCUMENTS = {
    "FULL": FULL,
    "MINIMAL": MINIMAL,
    "edge.toml": (EXAMPLES / "edge.toml").read_text(),
    "tcp-relay.toml": (EXAMPLES / "tcp-relay.toml").read_text(),
}
# Key names are lowercase identifiers ("http2" has a digit).
_PATH_RE = re.compile(
    r"top level|[a-z_][a-z0-9_]*(?:\[\d+\])*(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])*)*"
)
_STEP_RE = re.compile(r"\.?([a-z_][a-z0-9_]*)|\[(\d+)\]")


def _located(path: str, document: Any) -> bool:
    """True when *path* ("listeners[0].tls.policy", "top level") exists in
    *document*."""
    if path == "top level":
        return True
    node = document
    for step in _STEP_RE.finditer(path):
        key, index = step.groups()
        if key is not None:
            if not isinstance(node, dict) or key not in node:
                return False
            node = node[key]
        else:
            if not isinstance(node, list | tuple) or int(index) >= len(node):
                return False
            node = node[int(index)]
    return True


def _check_config_error(error: ConfigError, document: Any) -> None:
    path, sep, reason = str(error).partition(": ")
    assert sep, f"no 'path: reason' in {error}"
    assert reason.strip(), f"no reason in {error}"
    assert _PATH_RE.fullmatch(path), f"not a dotted path: {path!r} ({error})"
    assert _located(path, document), f"{path!r} is not in the document ({error})"


def _mutate(data: st.DataObject, document: Any) -> None:
    """One structural change somewhere in *document* (in place)."""
    node = document
    while True:
        entries = (
            list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        )
        inner = [k for k, v in entries if isinstance(v, dict | list)]
        if not inner or data.draw(st.booleans(), label="stop here"):
            break
        node = node[data.draw(st.sampled_from(inner), label="descend into")]
    keys_here = list(node) if isinstance(node, dict) else list(range(len(node)))
    operation = data.draw(
        st.sampled_from(["delete", "replace", "add", "duplicate", "wrap", "empty"]),
        label="operation",
    )
    if operation == "add" or not keys_here:
        if isinstance(node, dict):
            node[data.draw(keys, label="new key")] = data.draw(values, label="value")
        else:
            node.insert(
                data.draw(st.integers(0, len(node)), label="at"),
                data.draw(values, label="value"),
            )
        return
    key = data.draw(st.sampled_from(keys_here), label="key")
    if operation == "delete":
        del node[key]
    elif operation == "replace":
        node[key] = data.draw(values, label="value")
    elif operation == "duplicate":  # the same value again, e.g. a second listener
        if isinstance(node, list):
            node.append(copy.deepcopy(node[key]))
        else:
            node[data.draw(keys, label="copy to")] = copy.deepcopy(node[key])
    elif operation == "wrap":
        node[key] = data.draw(
            st.sampled_from([[node[key]], {"x": node[key]}, {key: node[key]}]),
            label="wrapped",
        )
    else:  # empty
        node[key] = type(node[key])() if isinstance(node[key], dict | list) else ""


@given(st.data())
def test_mutated_configs_give_config_or_located_config_error(
    data: st.DataObject,
) -> None:
    name = data.draw(st.sampled_from(sorted(VALID_DOCUMENTS)), label="start from")
    document: Any = tomllib.loads(VALID_DOCUMENTS[name])
    for _ in range(data.draw(st.integers(1, 4), label="changes")):
        _mutate(data, document)
    snapshot = copy.deepcopy(document)
    try:
        config = config_from_mapping(document, base_dir=EXAMPLES)
    except ConfigError as error:
        _check_config_error(error, document)
        event("config error")
    else:
        assert isinstance(config, Config)
        event("loaded")
    assert document == snapshot  # the loader never changes its input


_TOML_SNIPPETS = st.sampled_from(
    [
        "[edge]\n",
        "[[listeners]]\n",
        "[[backends]]\n",
        "[listeners.tls]\n",
        'name = "l"\n',
        'bind = "127.0.0.1:0"\n',
        "workers = 0\n",
        "x = 1\n",
        "servers = []\n",
        "edge = 1\n",
        "[listeners]\n",
        "a.b.c = 1\n",
        "= 1\n",
        '"\n',
        "\ufeff",
    ]
)


@given(st.data())
def test_mangled_toml_files_load_or_fail_with_a_located_error(
    data: st.DataObject,
) -> None:
    name = data.draw(st.sampled_from(["edge.toml", "tcp-relay.toml"]), label="file")
    lines = VALID_DOCUMENTS[name].splitlines(keepends=True)
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        at = data.draw(st.integers(0, len(lines) - 1), label="line")
        operation = data.draw(
            st.sampled_from(["delete", "duplicate", "insert", "swap", "cut", "byte"]),
            label="operation",
        )
        if operation == "delete" and len(lines) > 1:
            del lines[at]
        elif operation == "duplicate":
            lines.insert(at, lines[at])
        elif operation == "insert":
            lines.insert(at, data.draw(_TOML_SNIPPETS | st.text(max_size=30)))
        elif operation == "swap":
            other = data.draw(st.integers(0, len(lines) - 1), label="with")
            lines[at], lines[other] = lines[other], lines[at]
        elif operation == "cut":  # the file ends in the middle of this line
            lines[at] = lines[at][: data.draw(st.integers(0, len(lines[at])))]
            del lines[at + 1 :]
        else:
            column = data.draw(st.integers(0, len(lines[at])), label="column")
            char = data.draw(st.characters(), label="char")
            lines[at] = lines[at][:column] + char + lines[at][column + 1 :]
    raw = "".join(lines).encode("utf-8", "surrogatepass")
    if data.draw(st.booleans(), label="invalid UTF-8"):
        raw += b"\xff"
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / name
        file.write_bytes(raw)
        try:
            config = load_config(file)
        except ConfigError as error:
            failure = error
        else:
            assert isinstance(config, Config)
            event("loaded")
            return
    try:
        document = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        assert str(failure).startswith(f"{file}: invalid TOML: "), failure
        event("invalid TOML")
    else:
        _check_config_error(failure, document)
        event("config error")
