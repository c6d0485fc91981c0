"""Every example configuration passes ``tlsedge check``, files and names included.

``check`` opens the certificate files as ``run`` does, so each example is
checked next to the files it names: ``tlsedge cert`` makes them (the names in
examples/edge.toml are the ones it writes), and the Kubernetes example's
Secret mount is a folder of trustme files. The Kubernetes example also serves
curl through an HTTP/1.1 app, with the ALPN list it ships.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import trio
import trustme
import yaml

from tests.peers import require
from tests.tlsedge.helpers import Backend, address_of, read_proxy, running_edge
from tlsedge._control.cli import main
from tlsedge._core.config import (
    Address,
    CertificateConfig,
    ServerConfig,
    config_from_mapping,
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
KUBERNETES_TLS = "/etc/tlsedge/tls/"  # the Secret's mount in deployment.yaml


def kubernetes_config() -> str:
    for document in yaml.safe_load_all(
        (EXAMPLES / "kubernetes/configmap.yaml").read_text()
    ):
        if document and document["kind"] == "ConfigMap":
            return str(document["data"]["tlsedge.toml"])
    raise AssertionError("no ConfigMap in configmap.yaml")


def example_in(folder: Path, name: str) -> Path:
    """*name* from examples/ in *folder*, with the files it names next to it."""
    path = folder / name
    shutil.copy(EXAMPLES / name, path)
    assert main(["cert", str(folder / "certs"), "--client", "edge"]) == 0
    return path


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_example_passes_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path = example_in(tmp_path, name)
    capsys.readouterr()
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    assert f"{path}: OK" in capsys.readouterr().out


def test_edge_example_fails_check_without_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.toml"
    shutil.copy(EXAMPLES / "edge.toml", path)
    assert main(["check", str(path)]) == 2
    assert (
        f"{path}: listeners[0].tls.certificates[0].cert: "
        f"{tmp_path}/certs/server.pem: cannot read the certificate"
    ) in capsys.readouterr().err
    assert main(["check", "--config-only", str(path)]) == 0


def test_kubernetes_example_passes_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = trustme.CA()
    leaf = ca.issue_cert("tlsedge.example.com")
    secret = tmp_path / "tls"
    secret.mkdir()
    leaf.private_key_pem.write_to_path(str(secret / "tls.key"))
    with (secret / "tls.crt").open("wb") as out:
        for blob in leaf.cert_chain_pems:
            out.write(blob.bytes())
    text = kubernetes_config()
    assert KUBERNETES_TLS in text
    path = tmp_path / "tlsedge.toml"
    path.write_text(text.replace(KUBERNETES_TLS, f"{secret}/"))
    assert main(["check", str(path)]) == 0, capsys.readouterr().err
    assert "OK (1 listeners, 1 backends)" in capsys.readouterr().out


def test_kubernetes_example_passes_config_only_check(tmp_path: Path) -> None:
    # What its README says to run on a machine without the Secret's files.
    path = tmp_path / "tlsedge.toml"
    path.write_text(kubernetes_config())
    result = subprocess.run(
        [sys.executable, "-m", "tlsedge", "check", "--config-only", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert main(["check", str(path)]) == 2  # without --config-only: no files


async def http11_app(stream: trio.SocketStream) -> None:
    """An HTTP/1.1-only application behind PROXY v2, like the README's."""
    _, data = await read_proxy(stream)
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        data += chunk
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\napp"
    )


async def test_kubernetes_example_serves_curl(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """curl offers h2 and http/1.1; the example's ALPN must pick what its app
    speaks. With "h2" offered, curl spoke HTTP/2 to the HTTP/1.1 app and failed.
    """
    curl = require("curl")
    app = await Backend(http11_app).start(nursery)
    ca = trustme.CA()
    leaf = ca.issue_cert("tlsedge.example.com")
    for name, blob in (
        ("tls.crt", leaf.cert_chain_pems[0]),
        ("tls.key", leaf.private_key_pem),
    ):
        blob.write_to_path(str(tmp_path / name))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    example = tomllib.loads(kubernetes_config())
    config = config_from_mapping(example, base_dir=tmp_path)
    # The example as it ships, on this machine: loopback instead of the pod's
    # addresses and the VPC, the app instead of DNS discovery, trustme files.
    (listener,) = config.listeners
    assert listener.tls is not None
    assert listener.proxy_protocol is not None
    (backend,) = config.backends
    config = dataclasses.replace(
        config,
        edge=dataclasses.replace(config.edge, admin=None),
        listeners=(
            dataclasses.replace(
                listener,
                bind=Address(host="127.0.0.1", port=0),
                proxy_protocol=dataclasses.replace(
                    listener.proxy_protocol,
                    trusted=(ipaddress.ip_network("127.0.0.1/32"),),
                ),
                tls=dataclasses.replace(
                    listener.tls,
                    certificates=(
                        CertificateConfig(
                            cert=tmp_path / "tls.crt", key=tmp_path / "tls.key"
                        ),
                    ),
                ),
            ),
        ),
        backends=(
            dataclasses.replace(
                backend,
                discovery=None,
                servers=(ServerConfig(address=Address.parse(app.address)),),
                health=None,
            ),
        ),
    )
    async with running_edge(config) as edge:
        host, port = address_of(edge, listener.name)
        result = await trio.run_process(
            [
                curl,
                "-sS",
                "--max-time",
                "10",
                "--haproxy-protocol",
                "--cacert",
                str(tmp_path / "ca.pem"),
                "--resolve",
                f"tlsedge.example.com:{port}:{host}",
                "-w",
                " %{http_version}",
                f"https://tlsedge.example.com:{port}/",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert result.stdout == b"app 1.1"
