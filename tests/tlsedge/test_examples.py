"""Every example configuration passes ``tlsedge check``, files and names included.

``check`` opens the certificate files as ``run`` does, so each example is
checked next to the files it names: ``tlsedge cert`` makes them (the names in
examples/edge.toml are the ones it writes), and the Kubernetes example's
Secret mount is a folder of trustme files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trustme
import yaml

from tlsedge._cli import main

ROOT = Path(__file__).resolve().parents[2]
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
