"""What the edge meets at start beyond its file, and the config key it names."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from tlsedge._backends.preflight import check_environment
from tlsedge._core.config import ConfigError, load_config

# What ``tlsedge check`` opens and resolves, like ``nginx -t``: one TLS listener
# and one TLS backend, every file made by trustme in the config's folder.
TLS_CHECKED = """\
[[listeners]]
name = "in"
bind = "{bind}"
backend = "b"
[listeners.tls]
certificates = [{{ cert = "site.pem", key = "{site_key}" }}]
client_auth = "optional"
client_ca = "{client_ca}"
[[backends]]
name = "b"
servers = ["{server}"]
protocol = "tls"
[backends.tls]
ca = "{backend_ca}"
cert = "client.pem"
key = "{client_key}"
"""
TLS_GOOD = {
    "bind": "127.0.0.1:8443",
    "site_key": "site.key",
    "client_ca": "ca.pem",
    "server": "127.0.0.1:8080",
    "backend_ca": "ca.pem",
    "client_key": "client.key",
}


@pytest.fixture
def tls_files(tmp_path: Path) -> Path:
    ca = trustme.CA()
    for name, leaf in (
        ("site", ca.issue_cert("localhost")),
        ("client", ca.issue_cert("edge.example")),
        ("other", ca.issue_cert("other.example")),
    ):
        leaf.cert_chain_pems[0].write_to_path(str(tmp_path / f"{name}.pem"))
        leaf.private_key_pem.write_to_path(str(tmp_path / f"{name}.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return tmp_path


async def test_good_files_and_names_pass(tls_files: Path) -> None:
    path = tls_files / "edge.toml"
    path.write_text(TLS_CHECKED.format(**TLS_GOOD | {"server": "localhost:8080"}))
    await check_environment(load_config(path))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"site_key": "other.key"},
            "listeners[0].tls.certificates[0].key: {dir}/other.key: the private "
            "key does not match the certificate",
        ),
        (
            {"site_key": "nope.key"},
            "listeners[0].tls.certificates[0].key: {dir}/nope.key: cannot read "
            "the private key",
        ),
        (
            {"client_ca": "nope.pem"},
            "listeners[0].tls.client_ca: {dir}/nope.pem: cannot read the client "
            "CA bundle",
        ),
        (
            {"backend_ca": "site.key"},
            "backends[0].tls.ca: {dir}/site.key: invalid backend CA bundle",
        ),
        (
            {"client_key": "site.key"},
            "backends[0].tls.key: {dir}/site.key: the private key does not match",
        ),
        (
            {"server": "nonexistent.invalid:80"},
            "backends[0].servers[0]: host 'nonexistent.invalid' of backend 'b' "
            "does not resolve: ",
        ),
        (
            {"bind": "nonexistent.invalid:8443"},
            "listeners[0].bind: host 'nonexistent.invalid' does not resolve: ",
        ),
    ],
)
async def test_each_problem_names_its_config_key(
    tls_files: Path, change: dict[str, str], expected: str
) -> None:
    path = tls_files / "edge.toml"
    path.write_text(TLS_CHECKED.format(**TLS_GOOD | change))
    config = load_config(path)  # the file alone is fine
    with pytest.raises(ConfigError) as info:
        await check_environment(config)
    assert str(info.value).startswith(expected.format(dir=tls_files))


async def test_discovery_names_are_not_looked_up(tmp_path: Path) -> None:
    # The edge starts without them when DNS fails (docs/discovery.md).
    path = tmp_path / "edge.toml"
    path.write_text(
        '[[listeners]]\nname = "in"\nbind = "127.0.0.1:8443"\nbackend = "b"\n'
        '[[backends]]\nname = "b"\n'
        'discovery = { name = "nonexistent.invalid", port = 80 }\n'
    )
    await check_environment(load_config(path))
